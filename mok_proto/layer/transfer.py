"""The four row movements of the layer, each as a one-sided push or pull over symmetric memory.

Legend: N tokens/rank, H hidden, K top-k, R ranks, C receive capacity (rows), M ring rows.
Two shapes of movement, read off one PullSchedule (mok_proto.schedule):

  to_experts   token side -> expert side receive rows      forward dispatch, backward reverse-combine
  to_tokens    expert side -> token side slot buffer [N*K]   forward combine,  backward reverse-dispatch

Directions, and who must wait for whom (MoK insight 1):
  to_experts pull : the expert owner loads its rows; waits only for its own loads.
  to_experts push : token owners store rows + raise a flag; the expert owner waits for all R flags.
  to_tokens  push : expert owners store rows + raise a flag; the token owner waits for all R flags.
  to_tokens  pull : expert owners raise "results ready" flags; the token owner waits for each, then loads.
A to_experts pull reads a round INPUT (x or dy) that the round-start flags already published, so
it needs no flag of its own; a to_tokens pull reads rows produced inside the round, so it does.

The ring: every movement covers one Turn, a window [lo, hi) of receive rows that lives in the
expert owner's ring rows [0, hi - lo). With more than one turn a pass (Turn.free set), the owner's
ring is reused, so two more flags order it: the owner raises RING_FREE when its ring may take
the turn's rows (a push into it waits for that), and a token owner that pulled rows out of the
ring raises PULLED (the owner waits for every rank's before it frees the ring again).

NOTE (buffer reuse across rounds): every round starts with a flag from every rank (routing
all-gather in forward, "dy ready" in backward), raised only after that rank finished its previous
round, and every round ends with each rank having heard from all R peers. So once a rank is past
a round's start flags, no peer still reads or writes any buffer of the previous round.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mok_proto import fp8

# Flag kinds: row of the [kinds, R] signal table.
ROUND_START, TO_EXPERTS, TO_TOKENS, RING_FREE, PULLED = 0, 1, 2, 3, 4
NUM_FLAG_KINDS = 5


class Turn(NamedTuple):
    """One movement's receive-row window and the flag value (stamp) it raises and waits for;
    free: the RING_FREE value a push into the owner's ring waits for (None: one turn a pass, no
    ring reuse, and no PULLED flags)."""

    lo: int
    hi: int
    stamp: int
    free: int | None = None


def to_experts(mode, sched, src, dst, signals, turn: Turn, timeout_s, op, token_rows):
    """Receive row i in [turn.lo, turn.hi) of the owner -> its ring row i - turn.lo in dst, from
    the row of src on rank src_rank[i]: src_slot[i] // K if token_rows (src is x [N,H]) else
    src_slot[i] (src is a slot buffer [N*K,H])."""
    rank, num_ranks, top_k = sched.rank, sched.num_ranks, sched.top_k
    lo, hi = turn.lo, min(turn.hi, sched.num_slots)
    if mode == "pull":
        for peer in _peers_from(rank, num_ranks):
            recv_rows = lo + np.flatnonzero(sched.src_rank[lo:hi] == peer)
            rows = sched.src_slot[recv_rows] // top_k if token_rows else sched.src_slot[recv_rows]
            dst.local[recv_rows - lo] = src.get_rows(peer, rows)
        return
    for peer in _peers_from(rank, num_ranks):
        my_slots = np.flatnonzero((sched.dst_rank == peer) & (sched.recv_row >= turn.lo) & (sched.recv_row < turn.hi))
        rows = my_slots // top_k if token_rows else my_slots
        if turn.free is not None:  # the owner's ring holds its previous turn until it says otherwise
            signals.wait(RING_FREE, peer, turn.free, timeout_s, f"{op} (ring of rank {peer})")
        dst.put_rows(peer, sched.recv_row[my_slots] - turn.lo, src.local[rows])
        signals.signal(peer, TO_EXPERTS, turn.stamp)
    for peer in range(num_ranks):
        signals.wait(TO_EXPERTS, peer, turn.stamp, timeout_s, op)


def to_tokens(mode, sched, src, dst, signals, turn: Turn, timeout_s, op):
    """Slot s of dst (token side, [N*K,H]) <- receive row recv_row[s] of the owner dst_rank[s],
    for the slots whose row is in [turn.lo, turn.hi): its ring row recv_row[s] - turn.lo of src."""
    rank, num_ranks = sched.rank, sched.num_ranks
    if mode == "push":
        lo, hi = turn.lo, min(turn.hi, sched.num_slots)
        for peer in _peers_from(rank, num_ranks):
            recv_rows = lo + np.flatnonzero(sched.src_rank[lo:hi] == peer)
            dst.put_rows(peer, sched.src_slot[recv_rows], src.local[recv_rows - lo])
            signals.signal(peer, TO_TOKENS, turn.stamp)
        for peer in range(num_ranks):
            signals.wait(TO_TOKENS, peer, turn.stamp, timeout_s, op)
        return
    src.publish()  # NOTE: my results must be visible before any peer is told they are ready
    for peer in _peers_from(rank, num_ranks):
        signals.signal(peer, TO_TOKENS, turn.stamp)
    for peer in _peers_from(rank, num_ranks):
        signals.wait(TO_TOKENS, peer, turn.stamp, timeout_s, op)
        my_slots = np.flatnonzero((sched.dst_rank == peer) & (sched.recv_row >= turn.lo) & (sched.recv_row < turn.hi))
        dst.local[my_slots] = src.get_rows(peer, sched.recv_row[my_slots] - turn.lo)
        if turn.free is not None:
            signals.signal(peer, PULLED, turn.stamp)


def free_ring(signals, rank, num_ranks, stamp, pulled_stamp, timeout_s, op):
    """The owner's side of a turn boundary: wait until every rank pulled the previous turn's rows
    out of my ring (pulled_stamp: that turn's to_tokens stamp; None: nothing was pulled), then
    tell every rank my ring may take the turn of `stamp`."""
    if pulled_stamp is not None:
        for peer in range(num_ranks):
            signals.wait(PULLED, peer, pulled_stamp, timeout_s, f"{op} (ring reuse)")
    for peer in _peers_from(rank, num_ranks):
        signals.signal(peer, RING_FREE, stamp)


def round_start(signals, rank, num_ranks, epoch, timeout_s, op, before_wait=None):
    """Raise my round-start flag on every rank, run `before_wait` (overlap), wait for all R."""
    for peer in _peers_from(rank, num_ranks):
        signals.signal(peer, ROUND_START, epoch)
    result = before_wait() if before_wait is not None else None
    for peer in range(num_ranks):
        signals.wait(ROUND_START, peer, epoch, timeout_s, op)
    return result


def fp8_row_bytes(hidden: int) -> int:
    """Bytes of one FP8 dispatch row: H e4m3 codes, then H/128 fp32 scales (bf16: 2H)."""
    return hidden + 4 * (hidden // fp8.BLOCK)


def pack_fp8_rows(codes, scales) -> np.ndarray:
    """codes [n,H] uint8, scales [n,H/128] float32 (fp8.quantize_rows) -> rows [n, fp8_row_bytes(H)]
    uint8: what an FP8 dispatch moves, one row per token, quantized once by its owner."""
    n, num_blocks = scales.shape
    return np.concatenate([codes, np.ascontiguousarray(scales, np.float32).view(np.uint8).reshape(n, 4 * num_blocks)],
                          axis=1)


def unpack_fp8_rows(rows, hidden: int):
    """rows [n, fp8_row_bytes(H)] uint8 -> (codes [n,H] uint8, scales [n,H/128] float32)."""
    return np.ascontiguousarray(rows[:, :hidden]), np.ascontiguousarray(rows[:, hidden:]).view(np.float32)


def _peers_from(rank, num_ranks):
    """Peers in the order rank+1, rank+2, ..., rank: staggered so ranks do not all hit rank 0."""
    return [(rank + d) % num_ranks for d in range(1, num_ranks + 1)]
