"""The vocabulary of a plan: the kernels' tile sizes, the task and counter kinds of each pass, the
tables' dtypes (struct mok::plan::Task / Counter of cuda/abi.cuh, from the spec in
mok_proto/abi.py) and the error a plan that cannot run raises."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from mok_proto import abi
from mok_proto.config import MoEShape

BM = abi.CONST["kBM"]  # GEMM tile rows (receive rows per row tile)
BN = abi.CONST["kBN"]  # GEMM tile columns; a gate/up tile holds 128 gate + 128 up columns -> 128 columns of h
BK = abi.CONST["kBK"]  # k depth of one GEMM pipeline stage (a k-block)
DOWN_BWD_AUX_STAGES = BN // 64  # Traits<kDownBwd>::kAuxStages (cuda/gemm_tiles.cuh): a tile's g, u, 64 columns a stage
EPILOGUE_ROWS = abi.CONST["kEpilogueRows"]  # token rows per weighted-sum / slot-sum task (memory bound: fine grained)
PASSES = ("fwd", "bwd")
PAIR_ROWS = BM * abi.CONST["kCluster"]  # rows of one 2-CTA cluster's tile pair (a GEMM fact)
# The one segment-alignment rule: every expert's receive rows are padded to a multiple of it (the
# GPU layer's schedule, sequential and fused), the ring's macrobatch_rows are a multiple of it, the
# simulator pads the fused plans' loads with it. One row tile: a tile pair may straddle two experts
# (cuda/fused.cuh: each CTA then loads its own B). A fused plan's minibatch_rows are whole tile
# pairs (PAIR_ROWS), so no pair waits for two minibatches.
SEGMENT_ROWS = BM
# A ring's turn ends a multiple of SEGMENT_ROWS after an expert's first row; weight gradients that
# accumulate over turns keep the one-pass bits only if that is a whole number of k-blocks (BF16's
# BK, FP8's scale block), and an FP8 weight-gradient scale block never straddles two experts.
assert SEGMENT_ROWS % BK == 0 and SEGMENT_ROWS % abi.CONST["kQuantBlock"] == 0 and PAIR_ROWS % SEGMENT_ROWS == 0
FUSED_STRATEGIES = {"fwd": "fused_forward", "bwd": "fused_backward"}

# The kinds come from the ABI spec (mok_proto/abi.py: enum mok::plan::TaskKind / CounterKind of
# cuda/abi.cuh); the Python name of a member is its text upper-cased: TaskKind.GATE_UP is
# kTaskGateUp. The comments on each kind are there.
TaskKind = IntEnum("TaskKind", {text.upper(): value for value, (_, text) in enumerate(abi.TASK_KIND.members)})
CounterKind = IntEnum("CounterKind", {text.upper(): value for value, (_, text) in enumerate(abi.COUNTER_KIND.members)})

# The grouped-GEMM problem (abi.GEMM_PROBLEM's text: enum mok::gemm::Problem) each GEMM task runs.
PROBLEM_OF = {
    TaskKind.SHARED_GATE_UP: "gate_up", TaskKind.GATE_UP: "gate_up",
    TaskKind.SHARED_DOWN: "down", TaskKind.DOWN: "down",
    TaskKind.SHARED_DOWN_BWD: "down_bwd", TaskKind.DOWN_BWD: "down_bwd",
    TaskKind.SHARED_GATE_UP_BWD: "gate_up_bwd", TaskKind.GATE_UP_BWD: "gate_up_bwd",
    TaskKind.DOWN_WGRAD: "down_wgrad", TaskKind.SHARED_DOWN_WGRAD: "down_wgrad",
    TaskKind.GATE_UP_WGRAD: "gate_up_wgrad", TaskKind.SHARED_GATE_UP_WGRAD: "gate_up_wgrad",
}
ROUTED_KIND_OF = {problem: kind for kind, problem in PROBLEM_OF.items() if not kind.name.startswith("SHARED")}

COMM_KINDS = frozenset({TaskKind.DISPATCH, TaskKind.COMBINE, TaskKind.REV_COMBINE, TaskKind.REV_DISPATCH})
# What a fused kernel's movers run (a communicating CTA's warps, a compute CTA's spare warps; the
# GEMM warps run the other kinds): the transfers' chunks, the backward's scale and token gradients
# (abi.MOVER_KINDS, the kernel's kMoverKinds).
MOVER_KINDS = frozenset(TaskKind(abi.TASK_KIND[name]) for name in abi.MOVER_KINDS)


@dataclass(frozen=True)
class PassKinds:
    """The task kinds of one pass, in data-flow order."""

    comm_in: TaskKind
    shared_first: TaskKind
    shared_second: TaskKind
    first: TaskKind
    second: TaskKind
    comm_out: TaskKind
    epilogue: TaskKind
    in_op: str  # operator name in the policy
    out_op: str
    wgrad: tuple = ()  # routed weight-gradient kinds (backward)
    shared_wgrad: tuple = ()


PASS_KINDS = {
    "fwd": PassKinds(TaskKind.DISPATCH, TaskKind.SHARED_GATE_UP, TaskKind.SHARED_DOWN, TaskKind.GATE_UP,
                     TaskKind.DOWN, TaskKind.COMBINE, TaskKind.WEIGHTED_SUM, "dispatch", "combine"),
    "bwd": PassKinds(TaskKind.REV_COMBINE, TaskKind.SHARED_DOWN_BWD, TaskKind.SHARED_GATE_UP_BWD,
                     TaskKind.DOWN_BWD, TaskKind.GATE_UP_BWD, TaskKind.REV_DISPATCH, TaskKind.SLOT_SUM,
                     "rev_combine", "rev_dispatch", (TaskKind.DOWN_WGRAD, TaskKind.GATE_UP_WGRAD),
                     (TaskKind.SHARED_DOWN_WGRAD, TaskKind.SHARED_GATE_UP_WGRAD)),
}


def inside_kernel(pass_: str, policy: dict) -> tuple[bool, bool]:
    """(incoming, outgoing) transfer runs inside the fused kernel: the directions that need no
    signal from a peer inside it (MoK: pull dispatch reads rows published before the launch; push
    combine is complete at the flag raised after it). The other direction runs as its own launch
    before (incoming) or after (outgoing) the kernel."""
    k = PASS_KINDS[pass_]
    return policy[k.in_op] == "pull", policy[k.out_op] == "push"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def token_tiles(shape: MoEShape) -> range:
    """The row_tile of every token tile (EPILOGUE_ROWS tokens, the last one shorter): the epilogue's
    and the fused backward's scale tasks."""
    return range(cdiv(shape.num_tokens, EPILOGUE_ROWS))


# The tables as the megakernel reads them: struct mok::plan::Task / Counter (C layout, fields
# described in mok_proto/abi.py).
TASK_DTYPE = abi.TASK.dtype
COUNTER_DTYPE = abi.COUNTER.dtype
MAX_WAITS = TASK_DTYPE["wait_counter"].shape[0]
MAX_SIGNALS = TASK_DTYPE["signal_counter"].shape[0]


class PlanError(ValueError):
    """A plan that a persistent kernel could not execute (check() says why)."""

