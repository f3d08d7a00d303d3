"""Wrappers of cuda/comm.cuh: one function per kernel. Each checks what it can, computes the
grid, and launches on the current CuPy stream. Kernels never read anything back to the host.

Grids are (blocks_per_rank, W): blockIdx.y is the launch-rank (W virtual ranks in one launch,
or W = 1 with NVSHMEM, one process per rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mok_proto import abi
from mok_proto.kernels.build import CudaModule

THREADS = abi.CONST["kCommThreads"]
SCHEDULE_THREADS = abi.CONST["kScheduleThreads"]
SCHEDULE_SEGMENT = abi.CONST["kScheduleSegment"]

VECS = (16, 2)  # bytes per row access: 16 when rows are 16-byte multiples, else 2 (even rows)
MOVES = ("dispatch_pull", "dispatch_push", "combine_push", "combine_pull")  # the row movements (move_rows)
MODULE = CudaModule("comm.cuh", (
    "mok::begin_round", "mok::wait_peers", "mok::raise_flag", "mok::allgather_routing",
    "mok::schedule_count_segments", "mok::schedule_scan", "mok::schedule_place_segments",
    "mok::expert_scale", "mok::weighted_sum", "mok::turn_segments",
) + tuple(f"mok::{kernel}<{vec}>" for kernel in MOVES for vec in VECS))
LINK_MODULE = MODULE.variant("MOK_LINK")  # the same kernels paying an emulated link (mok_proto/link.py)


def pack_params(fields: dict):
    """{CommParams field: value} -> the device struct (the kernels' `const CommParams*`)."""
    import cupy

    return cupy.asarray(abi.COMM_PARAMS.pack(fields))


@dataclass(frozen=True)
class Launch:
    """Launch geometry shared by a round's kernels."""

    num_launch_ranks: int  # W (grid.y)
    blocks_per_rank: int  # grid.x of the copy kernels
    vec: int  # bytes per row access: 16 (row_bytes % 16 == 0) or 2
    link: bool = False  # the kernels built with MOK_LINK (the round's CommParams hold a link)

    @property
    def module(self):
        return LINK_MODULE if self.link else MODULE

    def __post_init__(self):
        if self.num_launch_ranks < 1 or self.blocks_per_rank < 1 or self.vec not in VECS:
            raise ValueError(f"bad launch geometry {self}")

    @staticmethod
    def default_blocks_per_rank(rows: int, num_sms: int, num_launch_ranks: int) -> int:
        """The copy kernels' grid.x when the caller sets none: about 4 blocks per SM in all, at
        most one block per 8 rows (rows: the larger of the slot and receive buffers)."""
        return max(1, min(4 * num_sms // num_launch_ranks, -(-rows // 8)))

    @staticmethod
    def vec_for(row_bytes: int) -> int:
        if row_bytes % 2:
            raise ValueError(f"rows must have an even number of bytes, got {row_bytes}")
        return 16 if row_bytes % 16 == 0 else 2


def _go(launch: Launch, name, grid, block, args, shared_mem=0):
    kernel = launch.module.function(name)
    if shared_mem > 48 * 1024:
        kernel.max_dynamic_shared_size_bytes = shared_mem
    kernel(grid, block, args, shared_mem=shared_mem)


def begin_round(params, launch: Launch):
    _go(launch, "mok::begin_round", (1, launch.num_launch_ranks), (32,), (params,))


def wait_peers(params, launch: Launch, kind: str, op: str):
    """The receiver side of a push: one block per launch-rank waits for flag `kind` (a FlagKind
    member, e.g. "kFlagDispatch") from all peers; `op` (an Op member, e.g. "kOpDispatchPush")
    names the wait in an error report."""
    _go(launch, "mok::wait_peers", (1, launch.num_launch_ranks), (128,),
        (params, np.int32(abi.FLAG_KIND[kind]), np.int32(abi.OP[op])))


def raise_flag(params, launch: Launch, kind: str):
    """Flag `kind` (a FlagKind member) = this round's epoch on every peer, from each launch-rank
    (after the launches that wrote what the flag announces)."""
    _go(launch, "mok::raise_flag", (1, launch.num_launch_ranks), (128,), (params, np.int32(abi.FLAG_KIND[kind])))


def allgather_routing(params, launch: Launch):
    _over_rows("mok::allgather_routing", params, launch)


def schedule_words(num_local_experts: int, capacity: int) -> int:
    """int32 words of a rank's schedule (CommParams.sched): offsets [El+1], counts [El], src_rank [C],
    src_slot [C]."""
    return 2 * num_local_experts + 1 + 2 * capacity


def schedule_scratch_words(num_ranks: int, num_tokens: int, top_k: int, num_local_experts: int) -> int:
    """int32 words of a rank's schedule scratch (CommParams.sched_scratch, see ScheduleScratch)."""
    segments = num_ranks * -(-num_tokens * top_k // SCHEDULE_SEGMENT)
    return segments * num_local_experts + num_ranks * num_local_experts + 1


def build_schedule(params, launch: Launch, num_ranks: int, num_local_experts: int, num_tokens: int, top_k: int):
    """The MoK placement on every launch-rank: count, scan, place (three launches), then kFlagMap."""
    segments = num_ranks * -(-num_tokens * top_k // SCHEDULE_SEGMENT)
    el, w = num_local_experts, launch.num_launch_ranks
    smem = 4 * (el * num_ranks + el + 1 + (THREADS // 32) * el)  # schedule_place_segments: M, offsets, cursors
    if smem > 227 * 1024:
        raise ValueError(f"build_schedule: E = {el * num_ranks} experts need {smem} bytes of shared memory")
    _go(launch, "mok::schedule_count_segments", (segments, w), (THREADS,), (params,), shared_mem=4 * el)
    _go(launch, "mok::schedule_scan", (1, w), (SCHEDULE_THREADS,), (params,), shared_mem=4 * (el * num_ranks + el))
    _go(launch, "mok::schedule_place_segments", (segments, w), (THREADS,), (params,), shared_mem=smem)


def turn_segments(params, launch: Launch):
    """Every turn's expert segments in the ring (CommParams.turn_sched), after the schedule."""
    _go(launch, "mok::turn_segments", (1, launch.num_launch_ranks), (256,), (params,))


def _over_rows(name: str, params, launch: Launch):
    """A row kernel over the launch ranks: grid (blocks per rank, W), kCommThreads per block."""
    _go(launch, name, (launch.blocks_per_rank, launch.num_launch_ranks), (THREADS,), (params,))


def move_rows(kernel: str, params, launch: Launch):
    """One of the row movements (MOVES), with the launch's access width: dispatch_pull / push
    (token-side rows -> receive rows; the backward's reverse-combine), combine_push / pull
    (receive rows -> slot buffers; the backward's reverse-dispatch)."""
    if kernel not in MOVES:
        raise ValueError(f"kernel must be one of {', '.join(MOVES)}, got {kernel!r}")
    _over_rows(f"mok::{kernel}<{launch.vec}>", params, launch)


def expert_scale(params, launch: Launch):
    _over_rows("mok::expert_scale", params, launch)


def weighted_sum(params, launch: Launch):
    _over_rows("mok::weighted_sum", params, launch)
