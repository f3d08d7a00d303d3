"""MoK pull schedule: where every routed (token, choice) row lands on its expert owner.

Shape legend: N tokens/rank, H hidden, E experts, K top-k, R ranks, El = E/R
(local experts per rank). Rank r owns global experts [r*El, (r+1)*El); local
expert l of rank r is global expert r*El + l. A *source slot* of a rank is
s = t*K + j (token t, top-k choice j), so every rank has N*K source slots.
The routing of all ranks is all-gathered as ``topk_idx_all`` [R, N, K].

Placement on an expert-owning rank (no sort of tokens is needed by the kernels):

* M[l, r] = number of (source rank r, source slot) pairs routed to local
  expert l; T[l] = sum_r M[l, r].
* Expert l's rows start at ``expert_offsets[l]``; segments are padded up to a
  multiple of ``align``: offsets[l+1] = offsets[l] + ceil(T[l]/align)*align.
* The o-th pair (o = 0, 1, ..., in increasing source slot) of source rank r
  for expert l goes to receive row
      offsets[l] + sum_r' min(M[l, r'], o) + |{r' < r : M[l, r'] > o}|,
  i.e. inside an expert, pairs are ordered by (o, r): source ranks are
  interleaved round robin (all links stay busy) and rows stay contiguous and
  expert-ordered. Padding rows hold -1 in ``src_rank`` and ``src_slot``.

Worked example: R=2, N=3, K=2, E=4 (El=2), align=2::

    topk_idx_all[0] = [[0, 1], [2, 0], [1, 3]]   # rank 0, slots s = 0..5
    topk_idx_all[1] = [[0, 2], [0, 1], [3, 0]]   # rank 1

    rank 0 owns experts 0, 1:
      expert 0: rank 0 slots (0, 3), rank 1 slots (0, 2, 5); M = [2, 3], T = 5
        order (o, r): (0,0) (0,1) (1,0) (1,1) (2,1) + 1 pad -> rows 0..5
      expert 1: rank 0 slots (1, 4), rank 1 slot (3,);      M = [2, 1], T = 3
        order: (0,0) (0,1) (1,0) + 1 pad                   -> rows 6..9
      expert_offsets = [0, 6, 10]
      src_rank = [0, 1, 0, 1, 1, -1,  0, 1, 0, -1]
      src_slot = [0, 0, 3, 2, 5, -1,  1, 3, 4, -1]
    rank 1 owns experts 2, 3:
      expert_offsets = [0, 2, 4]; src_rank = [0, 1, 0, 1]; src_slot = [2, 1, 5, 4]

    inverse maps (where each of a rank's own source slots goes):
      rank 0: dst_rank = [0, 0, 1, 0, 0, 1], recv_row = [0, 6, 0, 2, 8, 2]
      rank 1: dst_rank = [0, 1, 0, 0, 1, 0], recv_row = [1, 1, 3, 7, 3, 4]

The placement on every owner is a pure function of ``topk_idx_all``; it is
computed for all ranks at once in one vectorized pass over the R*N*K pairs
(a stable grouping by (expert, source rank) gives o, then one sort by
(expert, o, source rank) gives the row inside the expert).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

from mok_proto.validate import InputError, check_int, check_routing

__all__ = [
    "PullSchedule",
    "build_pull_schedule",
    "build_all_schedules",
    "max_receive_slots",
    "expert_slot_order",
]

_INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True)
class PullSchedule:
    """Receive-side layout of one expert-owning rank, plus its own send map."""

    rank: int
    num_ranks: int  # R
    num_local_experts: int  # El
    top_k: int  # K
    align: int
    expert_offsets: np.ndarray  # [El + 1] int64, rows of expert l: offsets[l]:offsets[l+1]
    tokens_per_expert: np.ndarray  # [El] int64, T[l] (real rows, without padding)
    src_rank: np.ndarray  # [num_slots] int32, source rank of each row, -1 on padding
    src_slot: np.ndarray  # [num_slots] int32, t*K + j on the source rank, -1 on padding
    dst_rank: np.ndarray  # [N*K] int32, owner rank of each of this rank's source slots
    recv_row: np.ndarray  # [N*K] int32, receive row on that owner

    @property
    def num_slots(self) -> int:
        """Rows of the receive buffer, padding included (expert_offsets[-1])."""
        return int(self.expert_offsets[-1])

    @property
    def src_token(self) -> np.ndarray:
        """[num_slots] int32: source token t = src_slot // K, -1 on padding."""
        k = max(self.top_k, 1)
        return np.where(self.src_slot >= 0, self.src_slot // k, -1).astype(np.int32)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PullSchedule):
            return NotImplemented
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if not (np.array_equal(a, b) and np.asarray(a).dtype == np.asarray(b).dtype):
                    return False
            elif a != b:
                return False
        return True


@dataclass(frozen=True)
class _Placement:
    """Placement of all R*N*K pairs on all owners (concatenated receive buffers)."""

    num_ranks: int  # R
    num_local_experts: int  # El
    top_k: int  # K
    align: int
    expert_offsets: np.ndarray  # [E + 1] int64, padded offsets in the concatenated buffer
    tokens_per_expert: np.ndarray  # [E] int64
    rank_offsets: np.ndarray  # [R + 1] int64, rank r's buffer: rank_offsets[r]:rank_offsets[r+1]
    src_rank: np.ndarray  # [total] int32
    src_slot: np.ndarray  # [total] int32
    dst_rank: np.ndarray  # [R, N*K] int32
    recv_row: np.ndarray  # [R, N*K] int32 (local to the owner's buffer)


def _check_routing(topk_idx_all, num_experts) -> tuple[np.ndarray, int]:
    """Validate and convert the all-gathered routing; returns (topk [R, N, K] int64, E)."""
    if (
        not isinstance(topk_idx_all, (np.ndarray, Mapping))
        and callable(getattr(topk_idx_all, "get", None))
    ):
        topk_idx_all = topk_idx_all.get()  # CuPy (or similar device array) -> host
    topk = np.asarray(topk_idx_all)
    if topk.ndim != 3:
        raise InputError(
            f"topk_idx_all must be 3-D [R, N, K] (ranks, tokens, top-k), got shape {topk.shape}"
        )
    num_ranks = topk.shape[0]
    if num_ranks < 1:
        raise InputError(f"topk_idx_all must have at least one rank (R >= 1), got shape {topk.shape}")
    num_experts = check_int(num_experts, "num_experts", minimum=1)
    if num_experts % num_ranks:
        raise InputError(
            f"num_experts ({num_experts}) must be divisible by the number of ranks "
            f"R = topk_idx_all.shape[0] ({num_ranks})"
        )
    # Any ids in [0, E) (a token may repeat an expert: the placement is defined for every pair).
    check_routing(topk, num_experts, "topk_idx_all", distinct=False)
    num_tokens, top_k = topk.shape[1], topk.shape[2]
    if num_ranks * num_tokens * top_k > _INT32_MAX:
        raise InputError(
            f"topk_idx_all has {num_ranks * num_tokens * top_k} pairs, more than int32 slots allow"
        )
    return topk.astype(np.int64, copy=False), num_experts


def _check_align(align) -> int:
    return check_int(align, "align", minimum=1)


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(x.shape[0] + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def _place(topk: np.ndarray, num_experts: int, align: int) -> _Placement:
    """Place every pair of every rank on its owner, in one vectorized pass."""
    num_ranks, num_tokens, top_k = topk.shape
    num_local = num_experts // num_ranks
    num_src = num_tokens * top_k  # source slots per rank
    num_pairs = num_ranks * num_src

    expert = topk.reshape(num_pairs)  # [P] global expert of pair p = r*N*K + s
    pair_rank = np.repeat(np.arange(num_ranks, dtype=np.int64), num_src)  # [P]
    pair_slot = np.tile(np.arange(num_src, dtype=np.int64), num_ranks)  # [P]

    # o: index of a pair among the pairs of its (expert, source rank), in slot order.
    # Pairs are already in (r, s) order, so a stable grouping by (e, r) keeps s increasing.
    group = expert * num_ranks + pair_rank  # [P] (e, r) group id
    num_groups = num_experts * num_ranks
    group_sizes = np.bincount(group, minlength=num_groups)  # [E*R] = M[e, r]
    group_offsets = _exclusive_cumsum(group_sizes)  # [E*R + 1]
    if num_groups <= np.iinfo(np.uint16).max + 1:
        group_order = np.argsort(group.astype(np.uint16), kind="stable")  # radix sort
    else:
        group_order = np.argsort(group, kind="stable")
    arange_pairs = np.arange(num_pairs, dtype=np.int64)
    o = np.empty(num_pairs, dtype=np.int64)  # [P]
    o[group_order] = arange_pairs - np.repeat(group_offsets[:-1], group_sizes)

    # Row inside the expert: rank of the pair in (o, r) order among the expert's pairs.
    num_o = int(group_sizes.max()) if num_pairs else 1
    order_key = (expert * num_o + o) * num_ranks + pair_rank  # [P], unique per pair
    row_order = np.argsort(order_key)
    tokens_per_expert = np.bincount(expert, minlength=num_experts).astype(np.int64)  # [E]
    row = np.empty(num_pairs, dtype=np.int64)  # [P]
    row[row_order] = arange_pairs - np.repeat(_exclusive_cumsum(tokens_per_expert)[:-1], tokens_per_expert)

    # Padded segments, concatenated over owners in global expert order.
    padded = -(-tokens_per_expert // align) * align  # [E]
    expert_offsets = _exclusive_cumsum(padded)  # [E + 1]
    rank_offsets = expert_offsets[:: num_local].copy()  # [R + 1]
    glob_slot = expert_offsets[expert] + row  # [P] row in the concatenated buffer
    owner = expert // num_local  # [P]

    total = int(expert_offsets[-1])
    src_rank = np.full(total, -1, dtype=np.int32)
    src_slot = np.full(total, -1, dtype=np.int32)
    src_rank[glob_slot] = pair_rank
    src_slot[glob_slot] = pair_slot
    dst_rank = owner.astype(np.int32).reshape(num_ranks, num_src)  # [R, N*K]
    recv_row = (glob_slot - rank_offsets[owner]).astype(np.int32).reshape(num_ranks, num_src)

    return _Placement(
        num_ranks=num_ranks,
        num_local_experts=num_local,
        top_k=top_k,
        align=align,
        expert_offsets=expert_offsets,
        tokens_per_expert=tokens_per_expert,
        rank_offsets=rank_offsets,
        src_rank=src_rank,
        src_slot=src_slot,
        dst_rank=dst_rank,
        recv_row=recv_row,
    )


def _schedule_of(place: _Placement, rank: int) -> PullSchedule:
    """Slice rank `rank`'s schedule out of the all-ranks placement."""
    el = place.num_local_experts
    base, end = int(place.rank_offsets[rank]), int(place.rank_offsets[rank + 1])
    return PullSchedule(
        rank=rank,
        num_ranks=place.num_ranks,
        num_local_experts=el,
        top_k=place.top_k,
        align=place.align,
        expert_offsets=place.expert_offsets[rank * el : (rank + 1) * el + 1] - base,
        tokens_per_expert=place.tokens_per_expert[rank * el : (rank + 1) * el].copy(),
        src_rank=place.src_rank[base:end].copy(),
        src_slot=place.src_slot[base:end].copy(),
        dst_rank=place.dst_rank[rank].copy(),
        recv_row=place.recv_row[rank].copy(),
    )


def build_pull_schedule(topk_idx_all, num_experts: int, rank: int, align: int = 1) -> PullSchedule:
    """Pull schedule of expert-owning rank `rank` from the all-gathered routing [R, N, K]."""
    topk, num_experts = _check_routing(topk_idx_all, num_experts)
    align = _check_align(align)
    num_ranks = topk.shape[0]
    rank = check_int(rank, "rank")
    if not 0 <= rank < num_ranks:
        raise InputError(f"rank must be in [0, R={num_ranks}), got {rank}")
    return _schedule_of(_place(topk, num_experts, align), rank)


def build_all_schedules(topk_idx_all, num_experts: int, align: int = 1) -> list[PullSchedule]:
    """Pull schedules of all R ranks, sharing one placement computation."""
    topk, num_experts = _check_routing(topk_idx_all, num_experts)
    align = _check_align(align)
    place = _place(topk, num_experts, align)
    return [_schedule_of(place, r) for r in range(topk.shape[0])]


def max_receive_slots(
    num_tokens: int, top_k: int, num_ranks: int, num_local_experts: int, align: int = 1
) -> int:
    """Worst-case receive rows: all R*N*K pairs land here, plus El*(align-1) padding."""
    num_tokens = check_int(num_tokens, "num_tokens", minimum=0)
    top_k = check_int(top_k, "top_k", minimum=0)
    num_ranks = check_int(num_ranks, "num_ranks", minimum=0)
    num_local_experts = check_int(num_local_experts, "num_local_experts", minimum=0)
    align = _check_align(align)
    return num_ranks * num_tokens * top_k + num_local_experts * (align - 1)


def expert_slot_order(topk_idx_all, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(order [R*N*K], offsets [E+1]) int64: every expert's pairs in the order its owner's receive
    buffer holds them, as global slots r*N*K + s (the flat [R*N] tokens' slots), expert e's at
    order[offsets[e]:offsets[e+1]]. The row order of the experts' weight-gradient sums (with FP8,
    which rows share a 128-row scale block): reference_fp8.forward(slot_order=...) takes it."""
    topk, num_experts = _check_routing(topk_idx_all, num_experts)
    place = _place(topk, num_experts, 1)
    num_src = topk.shape[1] * topk.shape[2]
    order = place.src_rank.astype(np.int64) * num_src + place.src_slot
    return order, place.expert_offsets.copy()
