"""An overlap strategy as data: SM roles, per-CTA ordered task tables and ready counters.

Shape legend: N tokens/rank, H hidden, I expert FFN, Is shared-expert FFN, E experts, K top-k,
R ranks, El = E/R local experts, BM x BN = 128 x 256 GEMM tile.

A `Plan` is what a persistent kernel executes on every rank (the same plan on all ranks): CTA b
runs the tasks of its table in order (``seq``); a task first waits until each of its (up to two)
counters reaches its target, does its work, then adds one to each of its (up to two) signal
counters. Counters live in device memory; a *remote* counter is one whose value on a rank is
raised by the tasks of every rank (a push's receiver waits for all peers' signals; a pull's
puller waits for the peers' data), so its target counts R signals per signalling task.

The receive buffer holds ``capacity_rows`` rows, expert segments padded to BM rows (the
schedule's ``align``), so every row tile belongs to one expert, found on the device from the
schedule's offsets: the plan is independent of routing. Tasks past the real row count (known on
the device only) exit at once. Rows are processed in minibatches of ``minibatch_rows``; the
buffers of x/h/y (forward) or dy/dg,du/dx (backward) are a ring of ``ring_minibatches``
minibatches: minibatch m lives in ring slot m % ring, and its slot is refilled only after the
previous occupant was released. In the backward, weight gradients are computed per *macrobatch*
(one turn of the ring: ring_minibatches minibatches), after its data gradients. A weight-gradient
task carries its ``macrobatch``; each output tile (expert, row tile, col tile) is pinned to one
CTA in every macrobatch, so that CTA stores the tile's fp32 sum in macrobatch 0 and adds the
later macrobatches in table order: the same sums in the same order on every run (deterministic),
ordered by program order on one CTA, not by counters. `check()` proves the pinning and the order.
The shared expert's weight gradients run once, after its data gradients.

The tables are the megakernel's own structs (``TASK_DTYPE``/``COUNTER_DTYPE`` are struct
mok::plan::Task/Counter of cuda/abi.cuh, from the spec in mok_proto/abi.py; so are the kinds).

Strategies are plain functions that return a plan: `sequential` (stage by stage, every SM per
stage, a barrier counter between stages), `fixed_split` (``comm_blocks`` CTAs communicate,
the rest compute; MoK's restructured overlap, for the simulator) and `fused_forward` /
`fused_backward` (what the megakernels of cuda/fused.cuh execute). `Plan.check` proves on the
CPU that a plan is executable: see its docstring.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from mok_proto import abi
from mok_proto.config import OPERATORS, MoEShape
from mok_proto.validate import check_int

BM = abi.CONST["kBM"]  # GEMM tile rows (receive rows per row tile)
BN = abi.CONST["kBN"]  # GEMM tile columns; a gate/up tile holds 128 gate + 128 up columns -> 128 columns of h
BK = abi.CONST["kBK"]  # k depth of one GEMM pipeline stage (a k-block)
DOWN_BWD_AUX_STAGES = BN // 64  # Traits<kDownBwd>::kAuxStages (cuda/gemm.cuh): a tile's g, u, 64 columns a stage
EPILOGUE_ROWS = abi.CONST["kEpilogueRows"]  # token rows per weighted-sum / slot-sum task (memory bound: fine grained)
PASSES = ("fwd", "bwd")
# How a fused plan's tile pairs go to the 2-CTA clusters (`_assign_clusters`), by default per pass.
# Measured (H200, comm 0, minibatch 2048, fused replays interleaved with the sequential pass's):
# balanced made the backward 0.0 to 2.0% faster in 14 comparisons (13 faster, 1 equal; kimi and
# deepseek, five kernel variants: results/runs/e48bf6e and eb35161), the forward -0.5 to +0.9%.
ASSIGNMENTS = ("round_robin", "balanced")
DEFAULT_ASSIGN = {"fwd": "round_robin", "bwd": "balanced"}
# The order of one minibatch's tile pairs of one kind in a fused plan's global order: "row", row
# pair by row pair (columns fastest: the standalone grouped GEMM's order), or "col", column tile by
# column tile (row pairs fastest: the pairs that run at once share B, the weights' column panels).
RASTERS = ("row", "col")
DEFAULT_RASTER = "row"
# Tile pairs of a fused plan claimed at run time (`fused_forward`'s claim): "all" (every pair: MoK's
# ticket scheduler) or "tail" (the last TAIL_PAIRS_PER_CLUSTER pairs per cluster of the global
# order). Measured at 99c90df (results/runs/99c90df: one bench_layer run on the H200, comm 0,
# minibatch 2048, each setting interleaved with the sequential pass), x sequential for no pool /
# 264 pairs (the tail of 66 clusters) / every pair: forward kimi 0.97 / 0.97 / 0.99, glm 1.00 / 1.00 /
# 1.01, qwen 1.02 / 1.03 / 1.05, deepseek 1.01 / 1.02 / 1.02; backward 1.04 / 1.05 / 1.02, 1.06 / 1.07 /
# 1.05, 1.06 / 1.11 / 1.10, 1.05 / 1.08 / 1.05; all bitwise equal to the sequential pass. With these
# defaults, two more runs (b0e48a6, 249b630; README), the default against no pool: forward -0.4 to
# +2.1%, backward +0.1 to +3.7%.
DEFAULT_CLAIM = {"fwd": "all", "bwd": "tail"}
CLAIMS = ("all", "tail")  # the claims by name; any other is a number of tile pairs
TAIL_PAIRS_PER_CLUSTER = 4


def parse_claim(text: str):
    """A claim as typed on a command line (bench_layer.py --fused, sim --claim): digits -> an int,
    a name of CLAIMS as it is; ValueError otherwise."""
    if text.isdigit():
        return int(text)
    if text in CLAIMS:
        return text
    raise ValueError(f"claim must be an int >= 0 or one of {', '.join(CLAIMS)}, got {text!r}")


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


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _token_tiles(shape: MoEShape) -> range:
    """The row_tile of every token tile (EPILOGUE_ROWS tokens, the last one shorter): the epilogue's
    and the fused backward's scale tasks."""
    return range(_cdiv(shape.num_tokens, EPILOGUE_ROWS))


def tile_grid(kind: TaskKind, shape: MoEShape) -> tuple[int, int, int]:
    """(output tile rows, output tile columns, reduction length) of one task's GEMM tile, as
    (rows, cols, k). Row-tile kinds have BM rows of the receive buffer (or of the N tokens);
    weight-gradient kinds tile the weight, k = the expert's rows (0 here: known at run time)."""
    h, i, i_s = shape.hidden, shape.ffn, shape.shared_ffn_size
    return {
        TaskKind.SHARED_GATE_UP: (BM, BN, h), TaskKind.GATE_UP: (BM, BN, h),
        TaskKind.SHARED_DOWN: (BM, BN, i_s), TaskKind.DOWN: (BM, BN, i),
        TaskKind.SHARED_DOWN_BWD: (BM, BN, h), TaskKind.DOWN_BWD: (BM, BN, h),
        TaskKind.SHARED_GATE_UP_BWD: (BM, BN, 2 * i_s), TaskKind.GATE_UP_BWD: (BM, BN, 2 * i),
        TaskKind.DOWN_WGRAD: (BM, BN, 0), TaskKind.GATE_UP_WGRAD: (BM, BN, 0),
        TaskKind.SHARED_DOWN_WGRAD: (BM, BN, 0), TaskKind.SHARED_GATE_UP_WGRAD: (BM, BN, 0),
    }[kind]


def num_col_tiles(kind: TaskKind, shape: MoEShape) -> int:
    """Output column tiles per row tile (row-tile kinds) of one task kind."""
    h, i, i_s = shape.hidden, shape.ffn, shape.shared_ffn_size
    return {
        TaskKind.SHARED_GATE_UP: _cdiv(2 * i_s, BN), TaskKind.GATE_UP: _cdiv(2 * i, BN),
        TaskKind.SHARED_DOWN: _cdiv(h, BN), TaskKind.DOWN: _cdiv(h, BN),
        TaskKind.SHARED_DOWN_BWD: _cdiv(i_s, BN), TaskKind.DOWN_BWD: _cdiv(i, BN),
        TaskKind.SHARED_GATE_UP_BWD: _cdiv(h, BN), TaskKind.GATE_UP_BWD: _cdiv(h, BN),
    }[kind]


def wgrad_grid(kind: TaskKind, shape: MoEShape) -> tuple[int, int]:
    """(row tiles, column tiles) of one expert's weight gradient: dWd [I, H], dWgu [H, 2I]."""
    h = shape.hidden
    ffn = shape.shared_ffn_size if kind in (TaskKind.SHARED_DOWN_WGRAD, TaskKind.SHARED_GATE_UP_WGRAD) else shape.ffn
    if kind in (TaskKind.DOWN_WGRAD, TaskKind.SHARED_DOWN_WGRAD):
        return _cdiv(ffn, BM), _cdiv(h, BN)
    return _cdiv(h, BM), _cdiv(2 * ffn, BN)


def expected_rows(shape: MoEShape, num_ranks: int, capacity_rows: int) -> int:
    """Receive rows a rank fills on average (the balanced assignment's estimate of where the
    real rows end; the tiles past them exit at once), at most capacity_rows. The real rows are a
    prefix of the receive buffer: expert segments back to back, each padded to a multiple of a
    cluster's row pair (PAIR_ROWS). Under even routing a rank receives N K rows (each rank's N
    tokens choose K experts among every rank's), an expert's count being Binomial(R N, K / E).
    The larger of two estimates of the padded rows:
      N K + half a pair per local expert: right when an expert's rows spread over several pairs
        (EP=64), and what the measured plans used;
      El x PAIR_ROWS x E[ceil(count / PAIR_ROWS)] (normal approximation): right when the counts
        sit within one or two pairs, where every segment pads to the same whole pairs. Half a pair
        each cost the last pairs as free and the balanced backward piled them on a few clusters:
        at EP=1 (qwen: 512 experts of ~40 rows, one pair each) 95-694 data-gradient tasks per CTA
        and 2.1x the sequential pass on the H200; at EP=8 kimi (341 rows, two pairs) and qwen (320)
        the busiest CTA's data-gradient work 1.58x and 1.72x the mean, and the simulated fused
        backward 8.53 and 3.48 ms against 6.61 and 2.57 ms now."""
    el = shape.num_experts // num_ranks
    spread = shape.num_tokens * shape.top_k + el * PAIR_ROWS // 2
    return min(capacity_rows, max(spread, _binomial_padded_rows(shape, num_ranks)))


def _binomial_padded_rows(shape: MoEShape, num_ranks: int) -> int:
    """El x PAIR_ROWS x E[ceil(X / PAIR_ROWS)] for an expert's rows X ~ Binomial(R N, K / E):
    E[ceil(X / P)] = sum over j >= 0 of P(X > j P), each term by the normal approximation (with
    continuity correction); at least one pair per expert."""
    el = shape.num_experts // num_ranks
    n, p = num_ranks * shape.num_tokens, shape.top_k / shape.num_experts
    mean, sd = n * p, math.sqrt(max(n * p * (1.0 - p), 1e-12))
    pairs, j = 0.0, 0
    while j * PAIR_ROWS <= mean + 12 * sd:
        pairs += 0.5 * math.erfc((j * PAIR_ROWS + 0.5 - mean) / (sd * math.sqrt(2.0)))
        j += 1
    return int(round(el * PAIR_ROWS * max(1.0, pairs)))


def tile_cost(kind: TaskKind, shape: MoEShape, num_ranks: int, capacity_rows: int, row_pair: int | None = None) -> int:
    """Estimated time of one GEMM tile of `kind` in a plan of R = num_ranks ranks and
    capacity_rows receive rows (the balanced assignment's cost model), in units of one
    BM x 1 x BK step of MMA work: the tile's pipeline stages x its columns (every tile has BM
    rows). Its stages: the k-blocks of K as the kernels run it (tile_grid: gate/up H, down I,
    down_bwd H, gate_up_bwd 2I), and for down_bwd the DOWN_BWD_AUX_STAGES that bring its g, u
    through the same ring (counted as k-blocks). The real rows are known only on the device (a
    prefix of the receive buffer; the tiles past them exit at once), so the estimate is
    expected_rows: a routed weight-gradient tile reduces over expected_rows / El rows (the shared
    expert's over its N tokens), and a routed row tile costs a full tile unless row_pair says it
    lies past expected_rows. The problems' different
    tile rates (their epilogues) are left out: what matters is the ratio of gate/up to down to
    weight-gradient tiles (a few % off at most).
    row_pair (routed row problems): the tile pair's index in the receive rows; a pair at or past
    expected_rows costs 1 (a tile past the real rows only signals). Without it, a full tile."""
    _, cols, k = tile_grid(kind, shape)
    routed_rows = kind in (TaskKind.GATE_UP, TaskKind.DOWN, TaskKind.DOWN_BWD, TaskKind.GATE_UP_BWD)
    if routed_rows and row_pair is not None and row_pair * PAIR_ROWS >= expected_rows(
            shape, num_ranks, capacity_rows):
        return 1
    if kind in PASS_KINDS["bwd"].wgrad:
        k = _cdiv(expected_rows(shape, num_ranks, capacity_rows), shape.num_experts // num_ranks)
    elif kind in PASS_KINDS["bwd"].shared_wgrad:
        k = shape.num_tokens
    aux = DOWN_BWD_AUX_STAGES if PROBLEM_OF[kind] == "down_bwd" else 0
    return (_cdiv(k, BK) + aux) * cols


# The tables as the megakernel reads them: struct mok::plan::Task / Counter (C layout, fields
# described in mok_proto/abi.py).
TASK_DTYPE = abi.TASK.dtype
COUNTER_DTYPE = abi.COUNTER.dtype
MAX_WAITS = TASK_DTYPE["wait_counter"].shape[0]
MAX_SIGNALS = TASK_DTYPE["signal_counter"].shape[0]


class PlanError(ValueError):
    """A plan that a persistent kernel could not execute (check() says why)."""


@dataclass(frozen=True, eq=False)
class Plan:
    """One pass of one MoE layer on every rank, as per-CTA task tables (see the module doc)."""

    pass_: str  # "fwd" | "bwd"
    shape: MoEShape
    num_ranks: int  # R
    policy: dict  # operator -> "push" | "pull"
    num_sms: int  # CTAs of the persistent kernel (one per SM, all co-resident)
    comm_blocks: int  # CTAs 0..comm_blocks-1 communicate (sequential: all CTAs do everything)
    minibatch_rows: int  # multiple of BM
    ring_minibatches: int
    capacity_rows: int  # multiple of minibatch_rows
    strategy: str
    tasks: np.ndarray  # [num_tasks] TASK_DTYPE, sorted by (block, seq)
    counters: np.ndarray  # [num_counters] COUNTER_DTYPE
    assign: str = "round_robin"  # how compute tasks went to CTAs (fused plans: ASSIGNMENTS; others round robin)
    raster: str = "row"  # the order of a minibatch's tile pairs (fused plans: RASTERS; others row)
    spread_from: int | None = None  # fused plans: outgoing transfers of minibatches >= this one on every CTA
    token_grads: bool = False  # fused backward: the token gradients (SLOT_SUM tasks) run inside the kernel
    scale: bool = False  # fused backward: dy_slots = w * dout (SCALE tasks) runs inside the kernel
    claim_pairs: int = 0  # fused plans: the last claim_pairs tile pairs of the global order, claimed at run time

    @property
    def pool_block(self) -> int:
        """The `block` of the claimed tile pairs' tasks (fused plans with claim_pairs > 0): past every
        CTA (num_sms). They are in no CTA's table: the kernel's clusters claim them in order (seq
        2k and 2k + 1: the two halves of pair k) once their producers issued their own tables' GEMM loads."""
        return self.num_sms

    @property
    def claim_counter(self) -> int:
        """The CLAIMED counter's id (the next pool pair to claim; the kernel's ticket), -1 without a pool."""
        ids = np.flatnonzero(self.counters["kind"] == int(CounterKind.CLAIMED))
        return int(ids[0]) if len(ids) else -1

    def pool_table(self) -> np.ndarray:
        """The claimed tile pairs' tasks (a view of `tasks`, in claim order), empty without a pool."""
        return self.tasks[np.searchsorted(self.tasks["block"], self.pool_block):]

    @property
    def kinds(self) -> PassKinds:
        return PASS_KINDS[self.pass_]

    @property
    def first_remote_counter(self) -> int:
        """Counters first_remote_counter .. are the remote ones (`_Builder.build` numbers them last;
        check() proves it): the fused kernel tells a remote counter by its id."""
        return int(len(self.counters) - np.count_nonzero(self.counters["remote"]))

    @property
    def num_minibatches(self) -> int:
        return self.capacity_rows // self.minibatch_rows

    @property
    def tiles_per_minibatch(self) -> int:
        return self.minibatch_rows // BM

    @property
    def num_macrobatches(self) -> int:
        return _cdiv(self.num_minibatches, self.ring_minibatches)

    @property
    def num_chunks(self) -> int:
        """Chunks of a minibatch for communication tasks: one per communicating CTA (a fused plan
        without communicating CTAs: one per CTA); see chunks_of for the spread ones."""
        return self.comm_blocks or self.num_sms

    def chunks_of(self, minibatch: int, outgoing: bool) -> int:
        """Chunks of one minibatch's incoming or outgoing transfer (a comm task's col_tile): num_chunks,
        or every CTA's (num_sms) for the outgoing transfer of a minibatch >= spread_from."""
        spread = outgoing and self.spread_from is not None and minibatch >= self.spread_from
        return self.num_sms if spread else self.num_chunks

    def streams(self) -> list[np.ndarray]:
        """Task indices of each in-order stream, in execution order. A CTA is one stream, except
        in a fused plan: there a CTA's mover tasks (MOVER_KINDS: its spare warps, or a
        communicating CTA) are one stream, and the GEMM tasks of the two CTAs of a cluster are ONE
        stream of tile pairs (even CTA's task, then its partner's: neither half of a pair can finish
        before both halves' waits are met, as they share the B operand and the stage barriers).
        The claimed tile pairs (`pool_table`: block pool_block, in claim order) are the last stream."""
        t = self.tasks
        if not len(t):
            return []
        comm = np.isin(t["kind"], [int(k) for k in MOVER_KINDS])
        if self.strategy not in FUSED_STRATEGIES.values():
            key, pos = t["block"].astype(np.int64), np.arange(len(t))
        else:
            cluster = np.where(comm, t["block"], self.num_sms + t["block"] // 2).astype(np.int64)
            key = 2 * cluster + comm
            rank = np.zeros(len(t), np.int64)  # position of a GEMM task among its CTA's GEMM tasks
            for blk in np.unique(t["block"]):
                sel = np.flatnonzero((t["block"] == blk) & ~comm)
                rank[sel] = np.arange(len(sel))
            pos = np.where(comm, np.arange(len(t)), 2 * rank + t["block"] % 2)
        order = np.lexsort((pos, key))
        bounds = np.flatnonzero(np.diff(key[order])) + 1
        return np.split(order, bounds)

    def is_comm_block(self, block) -> np.ndarray:
        return np.asarray(block) < self.comm_blocks

    def describe(self) -> str:
        return (f"{self.strategy} {self.pass_}: {self.shape.name} R={self.num_ranks} SMs={self.num_sms} "
                f"comm={self.comm_blocks} minibatch={self.minibatch_rows} ring={self.ring_minibatches} "
                f"capacity={self.capacity_rows} assign={self.assign} raster={self.raster} "
                f"spread_from={self.spread_from} token_grads={self.token_grads} scale={self.scale} "
                f"claim_pairs={self.claim_pairs} tasks={len(self.tasks)} counters={len(self.counters)}")

    def block_tables(self) -> list[np.ndarray]:
        """Per-CTA ordered task tables (views of `tasks`)."""
        bounds = np.searchsorted(self.tasks["block"], np.arange(self.num_sms + 1))
        return [self.tasks[bounds[b]:bounds[b + 1]] for b in range(self.num_sms)]

    @functools.cached_property
    def execution_order(self) -> np.ndarray:
        """[num_tasks] task indices in the order of an in-order execution (every CTA advances
        while its head task's waits are met; remote signals count R: all ranks run the plan).
        Raises PlanError naming the stuck CTAs when the plan deadlocks."""
        return _execution_order(self)

    def check(self) -> None:
        """Prove on the CPU that the plan can run: raise PlanError otherwise.

        1. Structure: blocks, seq, kinds, counter ids in range (a fused plan's pool: `claim_pairs`
           tile pairs at block num_sms, with its one CLAIMED counter no task touches); every wait target equals its
           counter's target, and every counter's target equals the signals it will get
           (R per signalling task for a remote counter); the remote counters have the last ids
           (first_remote_counter: the fused kernel tells them by their id).
        2. Coverage: every task the pass needs (each GEMM tile, each chunk of each minibatch,
           each epilogue tile, each weight-gradient tile per macrobatch) exists exactly once.
        3. Weight-gradient order: each routed weight-gradient output tile runs on one CTA, its
           macrobatches in increasing table order (a store, then adds in a fixed order).
        4. No deadlock: an in-order execution per stream (`streams`: a CTA, or in a fused plan a
           CTA's movers (MOVER_KINDS) and a cluster's tile pairs; all co-resident) finishes, the
           pool's pairs taken in claim order only once every cluster's own tile pairs ran (at run
           time a cluster claims once its producer issued its table's loads: see _execution_order).
        5. Order: every counter a task waits on is raised only by tasks earlier in that global
           topological order.
        6. Ring: the task that refills the slot of minibatch m happens after every task that
           uses the rows of minibatch m - ring (transitively through counters and CTA order).
        7. Pairs (fused plans): every GEMM task is one half of a 2-CTA cluster's tile pair.
        8. Data flow (fused plans): every task runs after the tasks that write what it reads
           (the first GEMM after its minibatch's incoming chunks, the second after its row
           tile's first-GEMM tiles, the outgoing chunks after their minibatch's second-GEMM
           tiles, the shared second after its row tile's shared first; backward: the weight
           gradients after every first-GEMM tile, the shared gate/up weight gradient after every
           shared first tile, the token gradients after every outgoing chunk and every shared
           second tile, the incoming chunks after every scale tile), transitively through counters
           and stream order (none among the pool's pairs: they run at once on several clusters).
        9. Cross-rank (fused backward): a task that reads rows every rank's tasks write (a
           reverse-combine chunk pulls every rank's dy_slots, written by its scale tiles; a
           token-gradient task reads the slot rows every rank's reverse-dispatch pushed) waits
           for a remote counter that every one of those writers signals (8 sees this rank's
           writers only; inside the kernel a remote counter is what waits for the other ranks').

        The proof is kept: a second call costs nothing (like `execution_order`, it assumes the
        tables are not changed in place; `with_tasks` makes a new plan).
        """
        if self.__dict__.get("_checked"):
            return
        _check_structure(self)
        _check_coverage(self)
        _check_pairs(self)
        _check_wgrad_order(self)
        _check_cross_rank(self)
        order = self.execution_order
        _check_topological(self, order)
        needs = _ring_needs(self) + _dataflow_needs(self)  # (check, reader, tasks that must precede it)
        if needs:
            tracked = np.zeros(len(self.tasks), bool)
            for _, _, need in needs:
                tracked[need] = True
            index = np.flatnonzero(tracked)
            ancestors = _ancestors(self, order, tracked)
            _check_needs(self, needs, ancestors, index)
        self.__dict__["_checked"] = True  # frozen dataclass: kept in the instance dict, as cached_property does


# ---------------------------------------------------------------------------------------------
# Building plans
# ---------------------------------------------------------------------------------------------
class _Builder:
    """Collects counters and tasks; tasks are added to a CTA's table in call order."""

    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks
        self.counters: dict[tuple, list] = {}  # (kind, index) -> [id, remote, signals]
        self.by_id: list[list] = []
        self.tasks: list[tuple] = []
        self.seq: dict[int, int] = {}

    def counter(self, kind: CounterKind, index: int, remote: bool = False) -> int:
        key = (int(kind), int(index))
        if key not in self.counters:
            self.counters[key] = [len(self.counters), bool(remote), 0]
            self.by_id.append(self.counters[key])
        return self.counters[key][0]

    def add(self, block: int, kind: TaskKind, waits=(), signals=(), **fields):
        """fields: minibatch, macrobatch, row_tile, col_tile, expert (default -1)."""
        if len(waits) > MAX_WAITS or len(signals) > MAX_SIGNALS:
            raise PlanError(f"a task has more than {MAX_WAITS} waits or {MAX_SIGNALS} signals")
        seq = self.seq.get(block, 0)
        self.seq[block] = seq + 1
        for c in signals:
            entry = self.by_id[c]
            entry[2] += self.num_ranks if entry[1] else 1
        self.tasks.append(dict(block=block, seq=seq, kind=int(kind), **fields,
                               wait_counter=(list(waits) + [-1] * MAX_WAITS)[:MAX_WAITS],
                               signal_counter=(list(signals) + [-1] * MAX_SIGNALS)[:MAX_SIGNALS]))

    def build(self, **fields) -> Plan:
        # Remote counters get the last ids (Plan.first_remote_counter): the fused kernel tells one by its
        # id, without loading its Counter (a load in every task's wait and signal cost the fused
        # forward ~1% on the H200, results/runs/491ec86).
        order = sorted(range(len(self.by_id)), key=lambda cid: (self.by_id[cid][1], cid))  # locals, then remotes
        new_id = np.empty(len(order) + 1, np.int64)
        new_id[order] = np.arange(len(order))
        new_id[-1] = -1  # "no counter" stays -1
        counters = np.zeros(len(self.counters), COUNTER_DTYPE)
        for (kind, index), (cid, remote, signals) in self.counters.items():
            i = new_id[cid]
            counters["kind"][i], counters["index"][i] = kind, index
            counters["remote"][i], counters["target"][i] = remote, signals
        tasks = np.zeros(len(self.tasks), TASK_DTYPE)
        for name in TASK_DTYPE.names:
            if name != "wait_target":
                tasks[name] = [t.get(name, -1) for t in self.tasks]
        for name in ("wait_counter", "signal_counter"):
            tasks[name] = new_id[tasks[name]]
        wc = tasks["wait_counter"]
        tasks["wait_target"] = np.where(wc >= 0, counters["target"][np.maximum(wc, 0)], 0)
        tasks = tasks[np.lexsort((tasks["seq"], tasks["block"]))]
        return Plan(tasks=tasks, counters=counters, **fields)


def _remote_counters(pass_: str, policy: dict) -> set:
    """Counter kinds whose value depends on every rank's tasks, under this policy."""
    k = PASS_KINDS[pass_]
    push_in, pull_out = policy[k.in_op] == "push", policy[k.out_op] == "pull"
    remote = set()
    if push_in:  # senders push rows: the receiver waits for every peer; senders need its free slot
        remote |= {CounterKind.ARRIVED, CounterKind.RELEASED}
    if pull_out:  # the token owner pulls: it waits for the peers' results, which wait for its reads
        remote |= {CounterKind.SECOND_DONE, CounterKind.RELEASED}
    else:  # pushed results: the token owner waits for every peer's signal
        remote |= {CounterKind.SLOTS_ARRIVED}
    return remote


def _check_common(shape, num_ranks, policy, num_sms, minibatch_rows, ring_minibatches, capacity_rows, pass_):
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
    if set(policy) != set(OPERATORS) or any(v not in ("push", "pull") for v in policy.values()):
        raise ValueError(f"policy must map each of {OPERATORS} to push or pull, got {policy!r}")
    if num_ranks < 1 or shape.num_experts % num_ranks:
        raise ValueError(f"num_ranks={num_ranks} must divide E={shape.num_experts}")
    if minibatch_rows < BM or minibatch_rows % BM:
        raise ValueError(f"minibatch_rows must be a positive multiple of BM={BM}, got {minibatch_rows}")
    if capacity_rows < minibatch_rows or capacity_rows % minibatch_rows:
        raise ValueError(f"capacity_rows ({capacity_rows}) must be a positive multiple of "
                         f"minibatch_rows ({minibatch_rows})")
    if not 1 <= ring_minibatches:
        raise ValueError(f"ring_minibatches must be >= 1, got {ring_minibatches}")
    if num_sms < 2:
        raise ValueError(f"num_sms must be >= 2, got {num_sms}")


def default_capacity(shape: MoEShape, num_ranks: int, minibatch_rows: int = BM, slack: float = 1.25) -> int:
    """Receive rows a plan is sized for: `slack` x the mean N*K rows plus El*BM padding, and at
    least a row pair per local expert (each expert's segment is padded to one), rounded up to
    whole minibatches (the true worst case, all R*N*K rows, would make the grid huge)."""
    el = shape.num_experts // num_ranks
    rows = max(int(slack * shape.num_tokens * shape.top_k) + el * BM, el * PAIR_ROWS)
    return _cdiv(rows, minibatch_rows) * minibatch_rows


def fixed_split(shape: MoEShape, num_ranks: int, comm_blocks: int, minibatch_rows: int,
                ring_minibatches: int | None = None, *, pass_: str = "fwd", policy: dict,
                num_sms: int, capacity_rows: int | None = None) -> Plan:
    """MoK's restructured overlap: CTAs 0..comm_blocks-1 run every dispatch, then combines and
    later dispatches interleaved (ring permitting); the other CTAs take compute tasks in one
    global order, round robin: shared expert first (it fills the wait for the first rows), then
    per minibatch the first GEMM's tiles and the second GEMM's tiles, in the backward the weight
    gradients at the end of each macrobatch (each output tile pinned to one CTA; shared weight
    gradients last); the epilogue sum
    (weighted sum / slot sum) on every CTA at the end."""
    capacity_rows = capacity_rows or default_capacity(shape, num_ranks, minibatch_rows)
    ring = ring_minibatches or capacity_rows // minibatch_rows
    _check_common(shape, num_ranks, policy, num_sms, minibatch_rows, ring, capacity_rows, pass_)
    if not 1 <= comm_blocks < num_sms:
        raise ValueError(f"comm_blocks must be in [1, num_sms={num_sms}), got {comm_blocks}")
    k = PASS_KINDS[pass_]
    remote = _remote_counters(pass_, policy)
    b = _Builder(num_ranks)
    num_mb = capacity_rows // minibatch_rows
    tpm = minibatch_rows // BM
    num_macro = _cdiv(num_mb, ring)
    el = shape.num_experts // num_ranks
    shared_tiles = _cdiv(shape.num_tokens, BM) if shape.num_shared else 0
    wgrad = bool(k.wgrad)

    def ctr(kind, index=0):
        return b.counter(kind, index, kind in remote)

    # Counters first, so that targets are known when tasks reference them (ids in a fixed order).
    for m in range(num_mb):
        ctr(CounterKind.ARRIVED, m), ctr(CounterKind.SECOND_DONE, m), ctr(CounterKind.RELEASED, m)
    for rt in range(num_mb * tpm):
        ctr(CounterKind.FIRST_DONE, rt)
    for rt in range(shared_tiles):
        ctr(CounterKind.SHARED_FIRST_DONE, rt)
    ctr(CounterKind.SHARED_DONE), ctr(CounterKind.SLOTS_ARRIVED)
    for j in range(num_macro if wgrad else 0):
        ctr(CounterKind.DATA_GRAD_DONE, j), ctr(CounterKind.WGRAD_DONE, j)

    # Compute tasks in one global order; tasks are assigned round robin to compute CTAs.
    compute: list[dict] = []
    n1, n2 = num_col_tiles(k.shared_first, shape), num_col_tiles(k.shared_second, shape)
    for rt in range(shared_tiles):
        compute += [dict(kind=k.shared_first, row_tile=rt, col_tile=c,
                         signals=[ctr(CounterKind.SHARED_FIRST_DONE, rt)]) for c in range(n1)]
    for rt in range(shared_tiles):
        compute += [dict(kind=k.shared_second, row_tile=rt, col_tile=c,
                         waits=[ctr(CounterKind.SHARED_FIRST_DONE, rt)], signals=[ctr(CounterKind.SHARED_DONE)])
                    for c in range(n2)]
    f1, f2 = num_col_tiles(k.first, shape), num_col_tiles(k.second, shape)
    for j in range(num_macro):
        mbs = range(j * ring, min((j + 1) * ring, num_mb))
        for m in mbs:
            for rt in range(m * tpm, (m + 1) * tpm):
                sig = [ctr(CounterKind.FIRST_DONE, rt)] + ([ctr(CounterKind.DATA_GRAD_DONE, j)] if wgrad else [])
                compute += [dict(kind=k.first, minibatch=m, row_tile=rt, col_tile=c,
                                 waits=[ctr(CounterKind.ARRIVED, m)], signals=sig) for c in range(f1)]
            for rt in range(m * tpm, (m + 1) * tpm):
                compute += [dict(kind=k.second, minibatch=m, row_tile=rt, col_tile=c,
                                 waits=[ctr(CounterKind.FIRST_DONE, rt)],
                                 signals=[ctr(CounterKind.SECOND_DONE, m)]) for c in range(f2)]
        # Weight-gradient output tile `pin` (the same numbering in every macrobatch) runs on
        # compute CTA pin % num_compute in every macrobatch: one CTA stores (macrobatch 0), then
        # adds in macrobatch order, in program order (check() proves it).
        grids = {kind: wgrad_grid(kind, shape) for kind in k.wgrad}  # (row tiles, col tiles)
        tiles = [(kind, e, r, c) for kind, (rows, cols) in grids.items() for e in range(el)
                 for r in range(rows) for c in range(cols)]
        compute += [dict(kind=kind, macrobatch=j, row_tile=r, col_tile=c, expert=e, pin=pin,
                         waits=[ctr(CounterKind.DATA_GRAD_DONE, j)], signals=[ctr(CounterKind.WGRAD_DONE, j)])
                    for pin, (kind, e, r, c) in enumerate(tiles)]
    if shared_tiles:
        for kind in k.shared_wgrad:
            rows, cols = wgrad_grid(kind, shape)
            compute += [dict(kind=kind, row_tile=r, col_tile=c, waits=[ctr(CounterKind.SHARED_DONE)])
                        for r in range(rows) for c in range(cols)]

    # Communication CTAs: chunk c of every minibatch, in MoK's order.
    def comm_in(c, m):
        waits = []
        if m >= ring:
            waits.append(ctr(CounterKind.RELEASED, m - ring))
            if wgrad:
                waits.append(ctr(CounterKind.WGRAD_DONE, (m - ring) // ring))
        b.add(c, k.comm_in, waits, [ctr(CounterKind.ARRIVED, m)], minibatch=m, row_tile=c, col_tile=comm_blocks)

    def comm_out(c, m):
        b.add(c, k.comm_out, [ctr(CounterKind.SECOND_DONE, m)],
              [ctr(CounterKind.RELEASED, m), ctr(CounterKind.SLOTS_ARRIVED)], minibatch=m, row_tile=c,
              col_tile=comm_blocks)

    # Tables in CTA order (targets are filled in by build(), once every signal is known).
    for c in range(comm_blocks):
        for m in range(min(ring, num_mb)):
            comm_in(c, m)
        for m in range(num_mb):
            comm_out(c, m)
            if m + ring < num_mb:
                comm_in(c, m + ring)
    # Compute tasks round robin over the compute CTAs, except pinned weight-gradient tiles.
    num_compute = num_sms - comm_blocks
    turn = 0
    for t in compute:
        pin = t.pop("pin", None)
        if pin is None:
            pin, turn = turn, turn + 1
        b.add(comm_blocks + pin % num_compute, t.pop("kind"), t.pop("waits", ()), t.pop("signals", ()), **t)
    for block, kind, rt, waits in _epilogue_tasks(k, shape, num_sms, ctr):
        b.add(block, kind, waits, (), row_tile=rt)
    return b.build(pass_=pass_, shape=shape, num_ranks=num_ranks, policy=dict(policy), num_sms=num_sms,
                   comm_blocks=comm_blocks, minibatch_rows=minibatch_rows, ring_minibatches=ring,
                   capacity_rows=capacity_rows, strategy="fixed_split")


PAIR_ROWS = BM * abi.CONST["kCluster"]  # rows of one 2-CTA cluster's tile pair (the fused kernel's align)


def inside_kernel(pass_: str, policy: dict) -> tuple[bool, bool]:
    """(incoming, outgoing) transfer runs inside the fused kernel: the directions that need no
    signal from a peer inside it (MoK: pull dispatch reads rows published before the launch; push
    combine is complete at the flag raised after it). The other direction runs as its own launch
    before (incoming) or after (outgoing) the kernel."""
    k = PASS_KINDS[pass_]
    return policy[k.in_op] == "pull", policy[k.out_op] == "push"


def fused_forward(shape: MoEShape, num_ranks: int, comm_blocks: int, minibatch_rows: int,
                  ring_minibatches: int | None = None, *, policy: dict, num_sms: int,
                  capacity_rows: int | None = None, lookahead: int | None = None, assign: str | None = None,
                  raster: str | None = None, spread_from: int | None = None, claim=None) -> Plan:
    """The forward megakernel's plan (cuda/fused.cuh): CTAs 0 .. comm_blocks - 1 pull the
    dispatched rows of minibatch after minibatch (chunk b of each: CTA b), then push the combine
    of each minibatch once its down tiles are done, a ring slot's next dispatch right after the
    combine that releases it; the other CTAs, in 2-CTA clusters, take GEMM tile pairs in one
    global order: the shared expert's gate/up then down tiles, then per minibatch routed
    gate/up (after its rows arrived), then down (after its row tile's gate/up tiles). assign
    (ASSIGNMENTS, default DEFAULT_ASSIGN["fwd"]): which cluster takes each pair, round robin or
    load-balanced (`_assign_clusters`); raster (RASTERS, default DEFAULT_RASTER): the order of a
    minibatch's pairs of one kind (and of the shared expert's), row pair by row pair or column
    tile by column tile; the backward's weight-gradient pairs keep their order (expert, row pair,
    column tile) either way.
    spread_from (None: no minibatch): the combine of every minibatch >= spread_from is split over
    all num_sms CTAs (chunk c on CTA c: the communicating CTAs with every warp, the compute CTAs
    with their spare warps), not just the communicating ones: the last combines run when the
    GEMM tiles are (nearly) done, so the whole GPU can move them.
    comm_blocks = 0: no CTA is set aside; chunk c of every minibatch goes to CTA c of all
    num_sms, whose spare warps move it while its GEMM tasks run (two independent in-order
    streams per CTA: `Plan.streams`).
    lookahead (default 1, or 0 with a ring of one minibatch): the gate/up tiles of minibatch
    m + lookahead come before the down tiles of minibatch m in the global order (0: strictly
    per minibatch), so a cluster whose next down
    tile still waits for other clusters' gate/up tiles has gate/up work queued before it instead
    (measured, kimi: the minibatches' gate/up and down phases no longer alternate in lockstep).
    At most ring - 1 (a later minibatch's rows may need this one's slot).

    A tile pair is one task on each CTA of a cluster, at the same position of both tables:
    row_tile 2p on the even CTA, 2p + 1 on the odd one (row pair p: rows PAIR_ROWS p ..).
    Every counter is local (no peer signals inside the kernel). The weighted sum is not in the
    plan: it runs after the kernel (MoK's epilogue kernel). With dispatch push / combine pull
    (see inside_kernel) those transfers run outside and the ring cannot turn (ring = every
    minibatch).
    claim (None: DEFAULT_CLAIM[pass]): the last `claim` tile pairs of the global order go to no
    cluster: they are the pool (`Plan.pool_table`), which the clusters claim at run time, in
    order, each once its producer issued its own table's GEMM loads (MoK's ticket scheduler): the cluster
    that finishes first takes the next pair, whatever the routing made each pair cost. "all":
    every pair (MoK's scheduler over the whole kernel); "tail": TAIL_PAIRS_PER_CLUSTER per
    cluster; 0: none (every pair in a cluster's table). check() proves the plan deadlock free
    with the pool claimed after every cluster's table (`_execution_order`)."""
    return _fused("fwd", shape, num_ranks, comm_blocks, minibatch_rows, ring_minibatches, policy, num_sms,
                  capacity_rows, lookahead, assign, raster, spread_from, False, False, claim)


def fused_backward(shape: MoEShape, num_ranks: int, comm_blocks: int, minibatch_rows: int, *, policy: dict,
                   num_sms: int, capacity_rows: int | None = None, lookahead: int | None = None,
                   assign: str | None = None, raster: str | None = None, spread_from: int | None = None,
                   token_grads: bool | None = None, scale: bool | None = None, claim=None) -> Plan:
    """The backward megakernel's plan (cuda/fused.cuh, fused_backward), the forward's structure
    with the backward's kinds: chunk tasks pull the reverse-combine (w * dout rows, into the
    receive rows) and push the reverse-dispatch (input-gradient rows into the owners' slots);
    the tile pairs run the shared expert's data and weight gradients first, then per minibatch
    down_bwd (after its rows arrived; SwiGLU backward fused) and gate_up_bwd (after its row
    tile's down_bwd tiles), then every routed weight-gradient tile (deferred: after every
    down_bwd tile, so they overlap the last reverse-dispatches), each (expert, row pair, column
    tile) one pair task that stores its fp32 sum over the expert's rows in order: the same sums,
    in the same order, as the sequential launches. One macrobatch: the ring holds every
    minibatch (a smaller ring would need the forward's activations again). assign, raster,
    spread_from (the reverse-dispatch): as fused_forward's.
    token_grads (default: whenever the reverse-dispatch is pushed inside the kernel): the token
    gradients run inside it too, as SLOT_SUM tasks of EPILOGUE_ROWS tokens (dx = the shared
    expert's dx + the K slots' sum, and d topk_weights of their slots), round robin over every
    CTA after its transfers: the movers run them beside the deferred weight-gradient tiles. Each
    waits for SLOTS_ARRIVED, a remote counter raised by every reverse-dispatch chunk of every
    rank (the kernel keeps it as the peers' kFlagCombine flags), and for SHARED_SECOND_DONE (the
    shared expert's dx). False: the slot sum and d topk_weights run after the kernel.
    scale (default: whenever the reverse-combine is pulled inside the kernel): dy_slots = w * dout
    runs inside it too, as SCALE tasks of EPILOGUE_ROWS tokens, first in every CTA's table (the
    movers write this rank's rows while the shared expert's tiles run), each raising PUBLISHED, a
    remote counter (the kernel keeps it as the peers' kFlagRouting flags) that every
    reverse-combine chunk waits for. False: the scale kernel and the publish (a flag, a wait for
    every peer's) run before the kernel.
    claim: the last `claim` tile pairs (the tail of the deferred weight gradients) are claimed at
    run time, as fused_forward's."""
    return _fused("bwd", shape, num_ranks, comm_blocks, minibatch_rows, None, policy, num_sms, capacity_rows,
                  lookahead, assign, raster, spread_from, token_grads, scale, claim)


FUSED_STRATEGIES = {"fwd": "fused_forward", "bwd": "fused_backward"}


def _fused(pass_, shape, num_ranks, comm_blocks, minibatch_rows, ring_minibatches, policy, num_sms, capacity_rows,
           lookahead, assign, raster, spread_from, token_grads, scale, claim) -> Plan:
    assign = DEFAULT_ASSIGN[pass_] if assign is None else assign
    if assign not in ASSIGNMENTS:
        raise ValueError(f"assign must be one of {', '.join(ASSIGNMENTS)}, got {assign!r}")
    raster = DEFAULT_RASTER if raster is None else raster
    if raster not in RASTERS:
        raise ValueError(f"raster must be one of {', '.join(RASTERS)}, got {raster!r}")

    def grid(row_pairs, cols):  # (row pair, column tile) of a minibatch's pairs of one kind, in order
        if raster == "row":
            return [(p, col) for p in row_pairs for col in range(cols)]
        return [(p, col) for col in range(cols) for p in row_pairs]

    capacity_rows = capacity_rows or default_capacity(shape, num_ranks, minibatch_rows)
    num_mb = capacity_rows // minibatch_rows if minibatch_rows > 0 else 0
    ring = min(ring_minibatches or num_mb, max(num_mb, 1))  # a ring of every minibatch never turns
    _check_common(shape, num_ranks, policy, num_sms, minibatch_rows, ring, capacity_rows, pass_)
    comm_in, comm_out = inside_kernel(pass_, policy)
    k = PASS_KINDS[pass_]
    if comm_blocks and not (comm_in or comm_out):
        raise ValueError(f"policy {policy} moves no rows inside the kernel: comm_blocks must be 0")
    if minibatch_rows % PAIR_ROWS:
        raise ValueError(f"minibatch_rows must be a multiple of {PAIR_ROWS} (a cluster's row pair), got {minibatch_rows}")
    if num_sms % 2 or comm_blocks % 2 or not 0 <= comm_blocks < num_sms:
        raise ValueError(f"num_sms ({num_sms}) and comm_blocks ({comm_blocks}) must be even (2-CTA clusters), "
                         f"0 <= comm_blocks < num_sms")
    if ring < num_mb and not (comm_in and comm_out):
        raise ValueError(f"a ring of {ring} < {num_mb} minibatches needs {k.in_op} pull and {k.out_op} push (both "
                         f"inside the kernel), got {policy}")
    spread_ok = spread_from is None or comm_blocks and comm_out and 0 <= check_int(spread_from, "spread_from") < num_mb
    if not spread_ok:
        raise ValueError(f"spread_from ({spread_from}) needs communicating CTAs, the {k.out_op} inside the kernel "
                         f"(push) and a minibatch in [0, {num_mb})")
    if token_grads is None:
        token_grads = pass_ == "bwd" and comm_out
    if token_grads and not (pass_ == "bwd" and comm_out):
        raise ValueError(f"token_grads runs the backward's slot sum inside the kernel: it needs the backward with "
                         f"{k.out_op} push (inside the kernel), got the {pass_} with {policy}")
    if scale is None:
        scale = pass_ == "bwd" and comm_in
    if scale and not (pass_ == "bwd" and comm_in):
        raise ValueError(f"scale runs the backward's dy_slots = w * dout inside the kernel: it needs the backward "
                         f"with {k.in_op} pull (inside the kernel), got the {pass_} with {policy}")
    b = _Builder(num_ranks)
    tpm = minibatch_rows // BM
    shared_pairs = _cdiv(shape.num_tokens, PAIR_ROWS) if shape.num_shared else 0
    n_first, n_second = num_col_tiles(k.first, shape), num_col_tiles(k.second, shape)
    arrived = [b.counter(CounterKind.ARRIVED, m) for m in range(num_mb)] if comm_in else None
    first_done = [b.counter(CounterKind.FIRST_DONE, rt) for rt in range(num_mb * tpm)]
    shared_first = [b.counter(CounterKind.SHARED_FIRST_DONE, rt) for rt in range(2 * shared_pairs)]
    second_done = [b.counter(CounterKind.SECOND_DONE, m) for m in range(num_mb)] if comm_out else None
    released = [b.counter(CounterKind.RELEASED, m) for m in range(num_mb)] if ring < num_mb else None
    wgrad = bool(k.wgrad)
    shared_done = [b.counter(CounterKind.SHARED_DONE, 0)] if wgrad and shared_pairs else []
    data_grad_done = [b.counter(CounterKind.DATA_GRAD_DONE, 0)] if wgrad else []
    slots_arrived = [b.counter(CounterKind.SLOTS_ARRIVED, 0, remote=True)] if token_grads else []
    shared_second_done = [b.counter(CounterKind.SHARED_SECOND_DONE, 0)] if token_grads and shared_pairs else []
    published = [b.counter(CounterKind.PUBLISHED, 0, remote=True)] if scale else []
    if scale:  # first in every CTA's table: its movers write this rank's dy_slots before any pull
        for r in _token_tiles(shape):
            b.add(r % num_sms, TaskKind.SCALE, [], published, row_tile=r)

    chunks = comm_blocks or num_sms
    spread = range(num_mb if spread_from is None else spread_from, num_mb)
    def comm_out_task(c, m):
        b.add(c, k.comm_out, [second_done[m]], ([released[m]] if released else []) + slots_arrived, minibatch=m,
              row_tile=c, col_tile=num_sms if m in spread else chunks)

    for c in range(chunks):  # chunk c of every minibatch (of num_chunks), on CTA c
        def comm_in_task(m, c=c):
            waits = ([released[m - ring]] if m >= ring else []) + published
            b.add(c, k.comm_in, waits, [arrived[m]], minibatch=m, row_tile=c, col_tile=chunks)
        if comm_in:
            for m in range(min(ring, num_mb)):
                comm_in_task(m)
        for m in range(num_mb):
            if comm_out:
                comm_out_task(c, m)
            if comm_in and m + ring < num_mb:
                comm_in_task(m + ring)
    for c in range(chunks, num_sms):  # the spread minibatches' other chunks: the compute CTAs' spare warps
        for m in spread:
            comm_out_task(c, m)

    # Tile pairs in one global order: (kind, row pair, col tile, waits(rt), signals(rt), task fields)
    pairs = []
    pairs += [(k.shared_first, p, col, lambda rt: [], lambda rt: [shared_first[rt]] + shared_done, {})
              for p, col in grid(range(shared_pairs), num_col_tiles(k.shared_first, shape))]
    pairs += [(k.shared_second, p, col, lambda rt: [shared_first[rt]], lambda rt: shared_second_done, {})
              for p, col in grid(range(shared_pairs), num_col_tiles(k.shared_second, shape))]
    for kind in (k.shared_wgrad if shared_pairs else ()):  # shared weight gradients: its data gradients' rows
        rows, cols = wgrad_grid(kind, shape)
        waits = shared_done if kind == TaskKind.SHARED_GATE_UP_WGRAD else []
        pairs += [(kind, p, col, lambda rt, w=waits: w, lambda rt: [], {}) for p in range(_cdiv(rows, 2))
                  for col in range(cols)]
    if lookahead is None:
        lookahead = min(1, max(ring - 1, 0))
    if not 0 <= lookahead <= max(ring - 1, 0):
        raise ValueError(f"lookahead must be in [0, ring - 1 = {ring - 1}] (minibatch m + lookahead may need m's "
                         f"ring slot), got {lookahead}")
    for step in range(num_mb + lookahead):
        m = step  # the first GEMM of minibatch step, then the second of minibatch step - lookahead
        if m < num_mb:
            pairs += [(k.first, p, col, lambda rt, m=m: [arrived[m]] if comm_in else [],
                       lambda rt: [first_done[rt]] + data_grad_done, {"minibatch": m})
                      for p, col in grid(range(m * tpm // 2, (m + 1) * tpm // 2), n_first)]
        m = step - lookahead
        if m >= 0:
            pairs += [(k.second, p, col, lambda rt: [first_done[rt]],
                       lambda rt, m=m: [second_done[m]] if comm_out else [], {"minibatch": m})
                      for p, col in grid(range(m * tpm // 2, (m + 1) * tpm // 2), n_second)]
    for kind in k.wgrad:  # deferred: after every data-gradient tile of every minibatch
        rows, cols = wgrad_grid(kind, shape)
        pairs += [(kind, p, col, lambda rt: data_grad_done, lambda rt: [], {"expert": e, "macrobatch": 0})
                  for e in range(shape.num_experts // num_ranks) for p in range(_cdiv(rows, 2)) for col in range(cols)]
    # Each pair goes to one cluster, appended to both its CTAs' tables: every table is a
    # subsequence of the global order (what keeps the plan deadlock free: every counter a pair
    # waits on is raised by pairs earlier in it), both halves of a pair at the same position.
    # The last `claim` pairs go to the pool instead (block num_sms, claimed at run time).
    claim = DEFAULT_CLAIM[pass_] if claim is None else claim
    if isinstance(claim, str) and claim in CLAIMS:
        claim = len(pairs) if claim == "all" else min(len(pairs), TAIL_PAIRS_PER_CLUSTER * (num_sms - comm_blocks) // 2)
    claim = check_int(claim, "claim (an int, 'all' or 'tail')")
    if not 0 <= claim <= len(pairs):
        raise ValueError(f"claim must be in [0, {len(pairs)}] (the plan's tile pairs), got {claim}")
    if claim:
        b.counter(CounterKind.CLAIMED, 0)
    static = len(pairs) - claim
    clusters = _assign_clusters(assign, pairs[:static], (num_sms - comm_blocks) // 2,
                                lambda kind, p: tile_cost(kind, shape, num_ranks, capacity_rows, p))
    clusters += [None] * claim
    for cluster, (kind, p, col, waits, signals, fields) in zip(clusters, pairs):
        for cta in (0, 1):
            rt = 2 * p + cta
            blk = num_sms if cluster is None else comm_blocks + 2 * cluster + cta
            b.add(blk, kind, waits(rt), signals(rt), row_tile=rt, col_tile=col, **fields)
    if token_grads:  # last in every CTA's table: its movers run them after their transfers
        for r in _token_tiles(shape):
            b.add(r % num_sms, k.epilogue, slots_arrived + shared_second_done, [], row_tile=r)
    return b.build(pass_=pass_, shape=shape, num_ranks=num_ranks, policy=dict(policy), num_sms=num_sms,
                   comm_blocks=comm_blocks, minibatch_rows=minibatch_rows, ring_minibatches=ring,
                   capacity_rows=capacity_rows, strategy=FUSED_STRATEGIES[pass_], assign=assign, raster=raster,
                   spread_from=spread_from, token_grads=bool(token_grads), scale=bool(scale), claim_pairs=claim)


def _assign_clusters(assign: str, pairs: list, clusters: int, cost) -> list[int]:
    """The cluster (0 .. clusters - 1) of every tile pair of `_fused`'s global order `pairs`.

    round_robin: pair j on cluster j % clusters (equal pair counts, whatever their work).
    balanced: a greedy list schedule over the same order, on estimated times (`cost(kind, row
    pair)`, the pair's tile_cost): a pair can start once the pairs that raise the counters it waits on have
    finished (per counter, the latest estimated finish of the pairs assigned so far that signal
    it: they all come earlier in the order); the counters only communication tasks raise
    (ARRIVED: the rows of a minibatch) count as ready at 0, as the transfers have no estimate in
    these units. Each pair goes to the cluster that can start it earliest (max of its free time
    and the pair's ready time), and among those that start it at the same time, the one that
    became free last (the least idle gap: clusters free earlier stay free for later pairs that
    are ready earlier), then the lowest index. That cluster's free time becomes the pair's
    estimated finish. Deterministic (integer costs, no randomness). The estimate takes the
    rows up to expected_rows as real and the tile pairs past them as free (tile_cost); costing
    those as full tiles balanced free tiles against real ones, and the simulator then predicted
    the comm-0 forwards of glm and kimi 1.5-1.9% slower than round robin."""
    if assign == "round_robin":
        return [turn % clusters for turn in range(len(pairs))]
    finish_of: dict[int, int] = {}  # counter -> latest estimated finish of the pairs signalling it so far
    by_free = sorted((0, -cluster) for cluster in range(clusters))  # (free time, -cluster), ascending
    out = []
    for kind, p, _, waits, signals, _ in pairs:
        tiles = (2 * p, 2 * p + 1)
        ready = max((finish_of.get(c, 0) for rt in tiles for c in waits(rt)), default=0)
        # the latest free time <= max(ready, earliest free time); among equal ones the lowest cluster
        j = bisect.bisect_right(by_free, (max(ready, by_free[0][0]), 0)) - 1
        free, neg_cluster = by_free.pop(j)
        finish = max(free, ready) + cost(kind, p)
        bisect.insort(by_free, (finish, neg_cluster))
        for c in {c for rt in tiles for c in signals(rt)}:
            finish_of[c] = max(finish_of.get(c, 0), finish)
        out.append(-neg_cluster)
    return out


def _epilogue_tasks(k: PassKinds, shape: MoEShape, num_sms: int, ctr) -> list:
    """Weighted sum (fwd) / slot sum (bwd) per EPILOGUE_ROWS tokens, round robin over every CTA."""
    waits = [ctr(CounterKind.SLOTS_ARRIVED)] + ([ctr(CounterKind.SHARED_DONE)] if shape.num_shared else [])
    return [(rt % num_sms, k.epilogue, rt, waits) for rt in _token_tiles(shape)]


def sequential(shape: MoEShape, num_ranks: int, *, pass_: str = "fwd", policy: dict, num_sms: int,
               capacity_rows: int | None = None) -> Plan:
    """Stage by stage, every CTA in every stage, a barrier counter between stages (what separate
    kernel launches do): comm in, shared first, shared second, first GEMM, second GEMM, comm
    out, [weight gradients, shared weight gradients], epilogue. One minibatch (the whole
    capacity), ring of one. A stage's barrier is remote when its data crosses ranks."""
    capacity_rows = capacity_rows or default_capacity(shape, num_ranks)
    _check_common(shape, num_ranks, policy, num_sms, capacity_rows, 1, capacity_rows, pass_)
    k = PASS_KINDS[pass_]
    remote = _remote_counters(pass_, policy)
    el = shape.num_experts // num_ranks
    shared_tiles = _cdiv(shape.num_tokens, BM) if shape.num_shared else 0
    row_tiles = capacity_rows // BM
    # stage: (work items as dicts, is the barrier after it remote)
    stages = [([dict(kind=k.comm_in, minibatch=0, row_tile=c, col_tile=num_sms) for c in range(num_sms)],
               CounterKind.ARRIVED in remote)]
    for kind in (k.shared_first, k.shared_second):
        stages.append(([dict(kind=kind, row_tile=r, col_tile=c) for r in range(shared_tiles)
                        for c in range(num_col_tiles(kind, shape))], False))
    stages.append(([dict(kind=k.first, minibatch=0, row_tile=r, col_tile=c) for r in range(row_tiles)
                    for c in range(num_col_tiles(k.first, shape))], False))
    stages.append(([dict(kind=k.second, minibatch=0, row_tile=r, col_tile=c) for r in range(row_tiles)
                    for c in range(num_col_tiles(k.second, shape))], CounterKind.SECOND_DONE in remote))
    stages.append(([dict(kind=k.comm_out, minibatch=0, row_tile=c, col_tile=num_sms) for c in range(num_sms)],
                   CounterKind.SLOTS_ARRIVED in remote))
    for kind in k.wgrad:
        rows, cols = wgrad_grid(kind, shape)
        stages.append(([dict(kind=kind, macrobatch=0, row_tile=r, col_tile=c, expert=e) for e in range(el)
                        for r in range(rows) for c in range(cols)], False))
    for kind in (k.shared_wgrad if shared_tiles else ()):
        rows, cols = wgrad_grid(kind, shape)
        stages.append(([dict(kind=kind, row_tile=r, col_tile=c) for r in range(rows) for c in range(cols)], False))
    stages.append(([dict(kind=k.epilogue, row_tile=r) for r in _token_tiles(shape)], False))
    stages = [(items, rem) for items, rem in stages if items]

    b = _Builder(num_ranks)
    for s, (_, rem) in enumerate(stages):
        b.counter(CounterKind.STAGE_DONE, s, rem)
    for s, (items, _) in enumerate(stages):
        waits = [b.counter(CounterKind.STAGE_DONE, s - 1)] if s else []
        for i, item in enumerate(items):
            b.add(i % num_sms, item.pop("kind"), waits, [b.counter(CounterKind.STAGE_DONE, s)], **item)
    return b.build(pass_=pass_, shape=shape, num_ranks=num_ranks, policy=dict(policy), num_sms=num_sms,
                   comm_blocks=num_sms, minibatch_rows=capacity_rows, ring_minibatches=1,
                   capacity_rows=capacity_rows, strategy="sequential")


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------
def _check_structure(plan: Plan) -> None:
    t, c = plan.tasks, plan.counters
    if t.dtype != TASK_DTYPE or c.dtype != COUNTER_DTYPE:
        raise PlanError("tasks/counters must use TASK_DTYPE/COUNTER_DTYPE")
    if len(t) and (t["block"].min() < 0 or t["block"].max() > plan.num_sms):
        raise PlanError(f"task blocks must lie in [0, num_sms={plan.num_sms}) (or be the pool's, num_sms)")
    if np.any(np.diff(t["block"]) < 0):
        raise PlanError("tasks must be sorted by block")
    for b, table in enumerate(plan.block_tables() + [plan.pool_table()]):
        if not np.array_equal(table["seq"], np.arange(len(table))):
            raise PlanError(f"block {b}: seq must be 0, 1, ... in table order")
    _check_pool(plan)
    valid = set(int(x) for x in TaskKind)
    if not set(np.unique(t["kind"]).tolist()) <= valid:
        raise PlanError("unknown task kind")
    for field in ("wait_counter", "signal_counter"):
        ids = t[field]
        if np.any((ids < -1) | (ids >= len(c))):
            raise PlanError(f"{field} out of range [-1, {len(c)})")
    used = t["wait_counter"] >= 0
    if np.any(t["wait_target"][used] != c["target"][t["wait_counter"][used]]):
        bad = np.argwhere(used & (t["wait_target"] != c["target"][np.maximum(t["wait_counter"], 0)]))[0][0]
        raise PlanError(f"task {_name(plan, bad)} waits for a target other than its counter's")
    if np.any(c["remote"][:plan.first_remote_counter]):
        raise PlanError(f"the remote counters must have the last ids (from {plan.first_remote_counter}): the fused "
                        "kernel tells a remote counter by its id")
    sig = t["signal_counter"]
    weight = np.where(c["remote"], plan.num_ranks, 1)
    got = np.zeros(len(c), np.int64)
    np.add.at(got, sig[sig >= 0], weight[sig[sig >= 0]])
    if np.any(got != c["target"]):
        i = int(np.argmax(got != c["target"]))
        raise PlanError(f"counter {_counter_name(plan, i)}: target {c['target'][i]} but {got[i]} signals")


def _check_pool(plan: Plan) -> None:
    """The claimed tile pairs (check(), 1): claim_pairs pairs of GEMM tasks at block pool_block
    (a fused plan only), claimed through one local CLAIMED counter that no task waits on or
    signals (the kernel's ticket: the kernel adds to it, not the tasks)."""
    pool, claim = plan.pool_table(), plan.claim_pairs
    if not isinstance(claim, (int, np.integer)) or claim < 0:
        raise PlanError(f"claim_pairs must be an int >= 0, got {claim!r}")
    if claim and plan.strategy not in FUSED_STRATEGIES.values():
        raise PlanError(f"only fused plans claim tile pairs at run time, got {plan.strategy} with claim_pairs={claim}")
    if len(pool) != 2 * claim:
        raise PlanError(f"pool: {len(pool)} tasks at block {plan.pool_block}, expected 2 x claim_pairs = {2 * claim}")
    if np.isin(pool["kind"], [int(k) for k in MOVER_KINDS]).any():
        raise PlanError("pool: only GEMM tile pairs are claimed at run time (a mover task has its CTA)")
    c = plan.counters
    claimed = np.flatnonzero(c["kind"] == int(CounterKind.CLAIMED))
    if len(claimed) != (1 if claim else 0):
        raise PlanError(f"pool: {len(claimed)} CLAIMED counters, expected {1 if claim else 0} (claim_pairs={claim})")
    if len(claimed):
        i = int(claimed[0])
        used = np.isin(plan.tasks["wait_counter"], [i]).any() or np.isin(plan.tasks["signal_counter"], [i]).any()
        if used or c["remote"][i] or c["target"][i] != 0:
            raise PlanError("pool: the CLAIMED counter is the kernel's ticket: local, target 0, no task waits on or "
                            "signals it")


KEY_FIELDS = ("kind", "minibatch", "macrobatch", "row_tile", "col_tile", "expert")  # what a task computes


def _expected_keys(plan: Plan) -> np.ndarray:
    """[num_tasks, len(KEY_FIELDS)] the KEY_FIELDS of every task the pass needs."""
    k, shape = plan.kinds, plan.shape
    el = shape.num_experts // plan.num_ranks
    shared_tiles = _cdiv(shape.num_tokens, BM) if shape.num_shared else 0
    tpm = plan.tiles_per_minibatch

    def key(kind, minibatch=-1, macrobatch=-1, row_tile=-1, col_tile=-1, expert=-1):
        return (int(kind), minibatch, macrobatch, row_tile, col_tile, expert)

    keys = []
    if plan.strategy in FUSED_STRATEGIES.values():
        return _expected_fused_keys(plan, key)
    for m in range(plan.num_minibatches):
        for kind in (k.comm_in, k.comm_out):
            keys += [key(kind, m, row_tile=c, col_tile=plan.num_chunks) for c in range(plan.num_chunks)]
        for kind in (k.first, k.second):
            keys += [key(kind, m, row_tile=rt, col_tile=c) for rt in range(m * tpm, (m + 1) * tpm)
                     for c in range(num_col_tiles(kind, shape))]
    for kind in (k.shared_first, k.shared_second):
        keys += [key(kind, row_tile=r, col_tile=c) for r in range(shared_tiles)
                 for c in range(num_col_tiles(kind, shape))]
    for kind in k.wgrad:
        rows, cols = wgrad_grid(kind, shape)
        keys += [key(kind, macrobatch=j, row_tile=r, col_tile=c, expert=e) for j in range(plan.num_macrobatches)
                 for e in range(el) for r in range(rows) for c in range(cols)]
    for kind in (k.shared_wgrad if shared_tiles else ()):
        rows, cols = wgrad_grid(kind, shape)
        keys += [key(kind, row_tile=r, col_tile=c) for r in range(rows) for c in range(cols)]
    keys += [key(k.epilogue, row_tile=r) for r in _token_tiles(shape)]
    return np.array(keys, np.int64).reshape(-1, len(KEY_FIELDS))


def _expected_fused_keys(plan: Plan, key) -> np.ndarray:
    """A fused pass: the transfers inside the kernel (a chunk per chunk), the tile pairs (shared
    expert: both tiles of every token row pair; weight gradients: both tiles of every row pair
    of every expert's weights), the epilogue tiles if the plan runs them (token_grads; else a launch
    after it), the scale tiles if it runs them (scale; else a launch before it)."""
    k, shape = plan.kinds, plan.shape
    comm_in, comm_out = inside_kernel(plan.pass_, plan.policy)
    tpm = plan.tiles_per_minibatch
    shared_tiles = 2 * _cdiv(shape.num_tokens, PAIR_ROWS) if shape.num_shared else 0
    keys = []
    for m in range(plan.num_minibatches):
        for kind, inside in ((k.comm_in, comm_in), (k.comm_out, comm_out)):
            chunks = plan.chunks_of(m, kind == k.comm_out)
            keys += [key(kind, m, row_tile=c, col_tile=chunks) for c in range(chunks)] if inside else []
        for kind in (k.first, k.second):
            keys += [key(kind, m, row_tile=rt, col_tile=c) for rt in range(m * tpm, (m + 1) * tpm)
                     for c in range(num_col_tiles(kind, shape))]
    for kind in (k.shared_first, k.shared_second):
        keys += [key(kind, row_tile=r, col_tile=c) for r in range(shared_tiles) for c in range(num_col_tiles(kind, shape))]
    # weight gradients (backward): every tile of every expert's weights, row tiles in pairs
    for kinds, experts, macro in ((k.wgrad, range(shape.num_experts // plan.num_ranks), 0),
                                  (k.shared_wgrad if shared_tiles else (), (-1,), -1)):
        for kind in kinds:
            rows, cols = wgrad_grid(kind, shape)
            keys += [key(kind, macrobatch=macro, row_tile=r, col_tile=c, expert=e) for e in experts
                     for r in range(2 * _cdiv(rows, 2)) for c in range(cols)]
    if plan.token_grads:
        keys += [key(k.epilogue, row_tile=r) for r in _token_tiles(shape)]
    if plan.scale:
        keys += [key(TaskKind.SCALE, row_tile=r) for r in _token_tiles(shape)]
    return np.array(keys, np.int64).reshape(-1, len(KEY_FIELDS))


def _check_pairs(plan: Plan) -> None:
    """A fused plan's GEMM tasks come in cluster pairs: the GEMM tasks of CTAs 2j and 2j + 1
    (past the communicating CTAs), in table order, are one tile pair at each position: same
    kind, minibatch and column tile, row tiles 2p and 2p + 1 (the kernel runs them as one 2-CTA
    cluster tile sharing B). Their communication tasks (comm_blocks == 0) may differ."""
    if plan.strategy not in FUSED_STRATEGIES.values():
        return
    tables = plan.block_tables()
    comm_kinds = [int(x) for x in MOVER_KINDS]
    for blk in range(plan.comm_blocks):
        if not np.isin(tables[blk]["kind"], comm_kinds).all():
            raise PlanError(f"pairs: communicating CTA {blk} has a GEMM task")
    for blk in range(plan.comm_blocks, plan.num_sms, 2):
        even, odd = (table[~np.isin(table["kind"], comm_kinds)] for table in (tables[blk], tables[blk + 1]))
        if len(even) != len(odd):
            raise PlanError(f"pairs: CTAs {blk} and {blk + 1} (one cluster) have {len(even)} and {len(odd)} tasks")
        same = _one_pair(even, odd)
        if not same.all():
            i = int(np.argmin(same))
            raise PlanError(f"pairs: CTAs {blk}, {blk + 1}, GEMM task {i}: seq {even['seq'][i]} and {odd['seq'][i]} "
                            f"are not one tile pair")
    pool = plan.pool_table()
    same = _one_pair(pool[0::2], pool[1::2])
    if not same.all():
        i = int(np.argmin(same))
        raise PlanError(f"pairs: pool tasks seq {2 * i} and {2 * i + 1} are not one tile pair")


def _one_pair(even: np.ndarray, odd: np.ndarray) -> np.ndarray:
    """Per position: the two tasks are one tile pair (the same tile but for row tiles 2p, 2p + 1)."""
    return (even["kind"] == odd["kind"]) & (even["minibatch"] == odd["minibatch"]) & (
        even["col_tile"] == odd["col_tile"]) & (even["expert"] == odd["expert"]) & (
        even["macrobatch"] == odd["macrobatch"]) & (even["row_tile"] % 2 == 0) & (odd["row_tile"] == even["row_tile"] + 1)


def _check_coverage(plan: Plan) -> None:
    t = plan.tasks
    got = np.stack([t[name] for name in KEY_FIELDS], axis=1).astype(np.int64)
    want = _expected_keys(plan)
    got_u, got_n = np.unique(got, axis=0, return_counts=True)
    want_u, want_n = np.unique(want, axis=0, return_counts=True)
    if got_u.shape == want_u.shape and np.array_equal(got_u, want_u) and np.array_equal(got_n, want_n):
        return
    got_d = {tuple(r): n for r, n in zip(got_u.tolist(), got_n.tolist())}
    want_d = {tuple(r): n for r, n in zip(want_u.tolist(), want_n.tolist())}
    for key in sorted(set(got_d) | set(want_d)):
        if got_d.get(key, 0) != want_d.get(key, 0):
            fields = " ".join(f"{name}={v}" for name, v in zip(KEY_FIELDS[1:], key[1:]))
            raise PlanError(f"coverage: task {TaskKind(key[0]).name} {fields} appears {got_d.get(key, 0)} times, "
                            f"expected {want_d.get(key, 0)}")


def _check_wgrad_order(plan: Plan) -> None:
    """Every routed weight-gradient output tile (kind, expert, row tile, col tile) runs on one CTA,
    its macrobatches in increasing order in that CTA's table: the CTA stores macrobatch 0 and adds
    the others in program order, so the fp32 sums are the same on every run. (Coverage already
    holds: each macrobatch of each tile exists once.)"""
    t = plan.tasks
    sel = np.flatnonzero(np.isin(t["kind"], [int(x) for x in plan.kinds.wgrad]))
    if not len(sel):
        return
    w = t[sel].copy()
    pooled = w["block"] == plan.pool_block  # its CTA is known at run time only: a CTA of its own here
    w["block"][pooled] = -1 - np.flatnonzero(pooled)
    by_tile = np.lexsort((w["macrobatch"], w["col_tile"], w["row_tile"], w["expert"], w["kind"]))
    w = w[by_tile]
    tile = np.stack([w["kind"], w["expert"], w["row_tile"], w["col_tile"]], axis=1)
    same_tile = np.all(tile[1:] == tile[:-1], axis=1)  # pairs (macrobatch j, j + 1) of one tile
    split = same_tile & (w["block"][1:] != w["block"][:-1])
    late = same_tile & ~split & (w["seq"][1:] <= w["seq"][:-1])
    for bad, what in ((split, "runs on CTAs {a} and {b}"), (late, "runs before macrobatch {j} on CTA {a}")):
        if bad.any():
            i = int(np.argmax(bad))
            kind, e, r, c = tile[i].tolist()
            raise PlanError(f"weight-gradient order: {TaskKind(kind).name} tile expert={e} row_tile={r} col_tile={c}: "
                            f"macrobatch {w['macrobatch'][i + 1]} "
                            + what.format(a=w["block"][i], b=w["block"][i + 1], j=w["macrobatch"][i]))


def _check_cross_rank(plan: Plan) -> None:
    """check(), 9: each reader of rows written by every rank waits for a remote counter that all
    their writers signal."""
    if plan.strategy not in FUSED_STRATEGIES.values():
        return
    t, c, k = plan.tasks, plan.counters, plan.kinds
    pairs = ([(k.comm_in, TaskKind.SCALE)] if plan.scale else []) + (
        [(k.epilogue, k.comm_out)] if plan.token_grads else [])
    for reader, writer in pairs:
        signals = t["signal_counter"][t["kind"] == int(writer)]
        every = set(range(len(c))) if len(signals) else set()
        for row in signals.tolist():
            every &= {x for x in row if x >= 0}
        remote = {x for x in every if c["remote"][x]}
        for i in np.flatnonzero(t["kind"] == int(reader)).tolist():
            if not remote & set(t["wait_counter"][i].tolist()):
                raise PlanError(f"cross-rank: {_name(plan, i)} reads rows every rank's {TaskKind(int(writer)).name} "
                                f"tasks write, but waits for no remote counter they all signal")


def _execution_order(plan: Plan) -> np.ndarray:
    t, c = plan.tasks, plan.counters
    weight = np.where(c["remote"], plan.num_ranks, 1).tolist()
    target = c["target"].tolist()
    wait = t["wait_counter"].tolist()
    sig = t["signal_counter"].tolist()
    streams = [x.tolist() for x in plan.streams()]
    ptr = [0] * len(streams)
    value = [0] * len(c)
    order = []
    # The pool (the last stream) is modelled as claimed only after every cluster's own GEMM tasks
    # are done, in claim order: a static task that needs a pool pair could leave no cluster free to
    # claim it, and this refuses it. (At run time a cluster's producer claims once it issued its
    # table's loads, and pool pairs run concurrently, each waiting only for earlier ones: if this
    # order finishes, so does that one.)
    movers = [int(k) for k in MOVER_KINDS]
    pool = len(streams) - 1 if plan.claim_pairs else -1
    static_gemm = [blk for blk, stream in enumerate(streams) if blk != pool and t["kind"][stream[0]] not in movers]
    progress = True
    while progress:
        progress = False
        for blk, stream in enumerate(streams):
            if blk == pool and any(ptr[g] < len(streams[g]) for g in static_gemm):
                continue
            j, end = ptr[blk], len(stream)
            while j < end and all(w < 0 or value[w] >= target[w] for w in wait[stream[j]]):
                i = stream[j]
                for s in sig[i]:
                    if s >= 0:
                        value[s] += weight[s]
                order.append(i)
                j += 1
                progress = True
            ptr[blk] = j
    stuck = [blk for blk, stream in enumerate(streams) if ptr[blk] < len(stream)]
    if stuck:
        lines = []
        for blk in stuck[:4]:
            i = streams[blk][ptr[blk]]
            w = [x for x in wait[i] if x >= 0 and value[x] < target[x]]
            lines.append(f"block {plan.tasks['block'][i]} at {_name(plan, i)} waits for "
                         + ", ".join(f"{_counter_name(plan, x)} ({value[x]}/{target[x]})" for x in w))
        raise PlanError(f"deadlock: {len(stuck)} CTAs cannot progress; " + "; ".join(lines))
    return np.array(order, np.int64)


def _check_topological(plan: Plan, order: np.ndarray) -> None:
    t = plan.tasks
    pos = np.empty(len(t), np.int64)
    pos[order] = np.arange(len(order))
    last_signal = np.full(len(plan.counters), -1, np.int64)
    for j in range(MAX_SIGNALS):
        s = t["signal_counter"][:, j]
        np.maximum.at(last_signal, s[s >= 0], pos[s >= 0])
    for j in range(MAX_WAITS):
        w = t["wait_counter"][:, j]
        bad = (w >= 0) & (last_signal[np.maximum(w, 0)] >= pos)
        if bad.any():
            i = int(np.argmax(bad))
            raise PlanError(f"order: {_name(plan, i)} waits on {_counter_name(plan, int(w[i]))}, "
                            f"raised by a task at or after it")


def _ancestors(plan: Plan, order: np.ndarray, tracked: np.ndarray | None = None) -> list:
    """Happens-before: per task, the bitset (a Python int) of the tasks that precede it through
    counters (every signaller of a counter it waits on) and stream order (none within the pool:
    its pairs run at once on whichever clusters claim them), itself included.
    tracked (a [num_tasks] mask): only those tasks are recorded, bit k standing for the k-th
    tracked task (np.flatnonzero(tracked)[k]); a task whose set does not grow shares its
    predecessor's int, so the sets of the many tasks after the last tracked one cost nothing."""
    t = plan.tasks
    bit = np.full(len(t), -1, np.int64)
    sel = np.arange(len(t)) if tracked is None else np.flatnonzero(tracked)
    bit[sel] = np.arange(len(sel))
    signalers: dict[int, int] = {}
    anc = [0] * len(t)
    prev_in_stream = np.full(len(t), -1, np.int64)
    for stream in plan.streams():
        prev_in_stream[stream[1:]] = stream[:-1]
    # claimed pairs run on whichever cluster claims them, concurrently: nothing precedes one by order
    prev_in_stream[t["block"] == plan.pool_block] = -1
    wait, sig = t["wait_counter"].tolist(), t["signal_counter"].tolist()
    prev, bit = prev_in_stream.tolist(), bit.tolist()
    for i in order.tolist():
        base = anc[prev[i]] if prev[i] >= 0 else 0
        extra = 1 << bit[i] if bit[i] >= 0 else 0
        for w in wait[i]:
            if w >= 0:
                extra |= signalers.get(w, 0)
        a = base | extra if extra & ~base else base
        anc[i] = a
        for s in sig[i]:
            if s >= 0:
                got = signalers.get(s, 0)
                signalers[s] = got | a if a & ~got else got
    return anc


def _ring_needs(plan: Plan) -> list:
    """(refill, the tasks that use the rows of the minibatch whose ring slot it refills): see
    check(), 6. Weight-gradient tiles of macrobatch j read the rows of all its minibatches."""
    ring, k = plan.ring_minibatches, plan.kinds
    if plan.num_minibatches <= ring:
        return []
    t = plan.tasks
    kind, mb = t["kind"], t["minibatch"]
    user = np.isin(kind, [int(x) for x in (k.first, k.second, k.comm_out)]) & (mb >= 0)
    users_of = [[np.flatnonzero(user & (mb == m))] for m in range(plan.num_minibatches)]
    wgrad = np.flatnonzero(np.isin(kind, [int(x) for x in k.wgrad]))
    macro = t["macrobatch"][wgrad]
    for j in np.unique(macro).tolist():
        for m in range(j * ring, min((j + 1) * ring, plan.num_minibatches)):
            users_of[m].append(wgrad[macro == j])
    need = [np.concatenate(u) for u in users_of]
    return [("ring", int(i), need[int(mb[i]) - ring])
            for i in np.flatnonzero((kind == int(k.comm_in)) & (mb >= ring))]


def _dataflow_needs(plan: Plan) -> list:
    """Fused plans: (reader, every writer of the rows it reads): see check(), 8."""
    if plan.strategy not in FUSED_STRATEGIES.values():
        return []
    t, k = plan.tasks, plan.kinds
    kind, mb, rt = t["kind"], t["minibatch"], t["row_tile"]
    writers = {}  # (reader kind, key) -> the writers it needs
    for m in np.unique(mb[mb >= 0]).tolist():
        writers[(int(k.first), "mb", m)] = np.flatnonzero((kind == int(k.comm_in)) & (mb == m))
        writers[(int(k.comm_out), "mb", m)] = np.flatnonzero((kind == int(k.second)) & (mb == m))
    for r in np.unique(rt[kind == int(k.second)]).tolist():
        writers[(int(k.second), "rt", r)] = np.flatnonzero((kind == int(k.first)) & (rt == r))
    for r in np.unique(rt[kind == int(k.shared_second)]).tolist():
        writers[(int(k.shared_second), "rt", r)] = np.flatnonzero((kind == int(k.shared_first)) & (rt == r))
    # weight gradients read the rows of every minibatch's first GEMM (dg, du; the arrived dy rows)
    # and the shared gate/up weight gradient the shared first GEMM's (sdg, sdu)
    for w in k.wgrad:
        writers[(int(w), "all", -1)] = np.flatnonzero(kind == int(k.first))
    if k.shared_wgrad:
        writers[(int(k.shared_wgrad[1]), "all", -1)] = np.flatnonzero(kind == int(k.shared_first))
    # the token gradients read every slot row (every rank's outgoing chunks: by symmetry, this
    # rank's) and the shared expert's dx (its second GEMM's tiles)
    writers[(int(k.epilogue), "all", -1)] = np.flatnonzero((kind == int(k.comm_out)) | (kind == int(k.shared_second)))
    # the backward's pulls read every rank's dy_slots (by symmetry: this rank's scale tiles), where
    # the kernel writes them
    if plan.scale:
        writers[(int(k.comm_in), "all", -1)] = np.flatnonzero(kind == int(TaskKind.SCALE))
    by_rt = {int(k.second), int(k.shared_second)}
    needs = []
    for i, (kd, m, r) in enumerate(zip(kind.tolist(), mb.tolist(), rt.tolist())):
        if kd in by_rt:
            key = (kd, "rt", r)
        elif (kd, "all", -1) in writers:
            key = (kd, "all", -1)
        else:
            key = (kd, "mb", m)
        need = writers.get(key)
        if need is not None and len(need):
            needs.append(("data flow", i, need))
    return needs


def _check_needs(plan: Plan, needs: list, anc: list, index: np.ndarray) -> None:
    """Every (check, reader, tasks) of `needs` has all those tasks among the reader's ancestors
    (`anc` over the tracked tasks `index`, as _ancestors gives them)."""
    bit = np.full(len(plan.tasks), -1, np.int64)
    bit[index] = np.arange(len(index))
    masks: dict[int, int] = {}  # id of a need array -> its bitset (readers share their writers' arrays)
    for what, i, need in needs:
        m = masks.get(id(need))
        if m is None:
            m = masks[id(need)] = sum(1 << b for b in bit[need].tolist())
        if anc[i] & m != m:
            missing = m & ~anc[i]
            j = int(index[(missing & -missing).bit_length() - 1])
            if what == "ring":
                raise PlanError(f"ring: {_name(plan, i)} refills the slot of minibatch "
                                f"{int(plan.tasks['minibatch'][i]) - plan.ring_minibatches} before every task using "
                                f"its rows finished ({_name(plan, j)})")
            raise PlanError(f"data flow: {_name(plan, i)} may run before {_name(plan, j)}, which writes rows it reads")


def _name(plan: Plan, i: int) -> str:
    r = plan.tasks[i]
    macro = f" macrobatch={r['macrobatch']} expert={r['expert']}" if r["macrobatch"] >= 0 else ""
    return (f"{TaskKind(int(r['kind'])).name}(block={r['block']} seq={r['seq']} minibatch={r['minibatch']}{macro} "
            f"row_tile={r['row_tile']} col_tile={r['col_tile']})")


def _counter_name(plan: Plan, i: int) -> str:
    c = plan.counters[i]
    return f"{CounterKind(int(c['kind'])).name}[{c['index']}]"


def with_tasks(plan: Plan, tasks: np.ndarray, counters: np.ndarray | None = None) -> Plan:
    """The same plan with another task table (and counter table) (for experiments and tests of
    check())."""
    return dataclasses.replace(plan, tasks=tasks, counters=plan.counters if counters is None else counters)
