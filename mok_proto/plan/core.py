"""The plan type (a pass as per-CTA task tables and counters: see the package doc) and the
builder the strategies fill it with."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from mok_proto.config import MoEShape
from mok_proto.plan.check import execution_order, prove
from mok_proto.plan.kinds import (BM, COUNTER_DTYPE, FUSED_STRATEGIES, MAX_SIGNALS, MAX_WAITS, MOVER_KINDS, PASS_KINDS,
                                  TASK_DTYPE, CounterKind, PassKinds, PlanError, TaskKind, cdiv)


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
    routed_wgrads: bool = True  # fused backward: the routed weight-gradient tiles run inside the kernel
    claim_pairs: int = 0  # fused plans: the last claim_pairs tile pairs of the global order, claimed at run time
    knobs: object = None  # fused plans: the FusedKnobs they were built with (resolved for the pass)

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
        """Counters first_remote_counter .. are the remote ones (`Builder.build` numbers them last;
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
        return cdiv(self.num_minibatches, self.ring_minibatches)

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
                f"routed_wgrads={self.routed_wgrads} claim_pairs={self.claim_pairs} tasks={len(self.tasks)} "
                f"counters={len(self.counters)}")

    def block_tables(self) -> list[np.ndarray]:
        """Per-CTA ordered task tables (views of `tasks`)."""
        bounds = np.searchsorted(self.tasks["block"], np.arange(self.num_sms + 1))
        return [self.tasks[bounds[b]:bounds[b + 1]] for b in range(self.num_sms)]

    @functools.cached_property
    def execution_order(self) -> np.ndarray:
        """[num_tasks] task indices in the order of an in-order execution (every CTA advances
        while its head task's waits are met; remote signals count R: all ranks run the plan).
        Raises PlanError naming the stuck CTAs when the plan deadlocks."""
        return execution_order(self)

    def check(self) -> None:
        """Prove on the CPU that the plan can run: raise PlanError otherwise (what it proves:
        mok_proto.plan.check.prove). The proof is kept: a second call costs nothing (like
        `execution_order`, it assumes the tables are not changed in place; `with_tasks` makes a new plan)."""
        if self.__dict__.get("_checked"):
            return
        prove(self)
        self.__dict__["_checked"] = True  # frozen dataclass: kept in the instance dict, as cached_property does


class Builder:
    """Collects counters and tasks; tasks are added to a CTA's table in call order."""

    FIELDS = ("minibatch", "macrobatch", "row_tile", "col_tile", "expert")  # add's fields, in TASK_DTYPE order

    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks
        self.counters: dict[tuple, list] = {}  # (kind, index) -> [id, remote]
        self.by_id: list[list] = []
        self.tasks: list[tuple] = []  # (block, kind, *FIELDS, waits..., signals...) per task, in call order
        self.parts: list[np.ndarray] = []  # the rows of the tasks before `tasks`, in call order (add_rows)

    def counter(self, kind: CounterKind, index: int, remote: bool = False) -> int:
        key = (int(kind), int(index))
        if key not in self.counters:
            self.counters[key] = [len(self.counters), bool(remote)]
            self.by_id.append(self.counters[key])
        return self.counters[key][0]

    def add(self, block: int, kind: TaskKind, waits=(), signals=(), minibatch=-1, macrobatch=-1, row_tile=-1,
            col_tile=-1, expert=-1):
        if len(waits) > MAX_WAITS or len(signals) > MAX_SIGNALS:
            raise PlanError(f"a task has more than {MAX_WAITS} waits or {MAX_SIGNALS} signals")
        self.tasks.append((block, int(kind), minibatch, macrobatch, row_tile, col_tile, expert,
                           *waits, *_NONE[:MAX_WAITS - len(waits)], *signals, *_NONE[:MAX_SIGNALS - len(signals)]))

    def add_rows(self, rows: np.ndarray) -> None:
        """Add tasks as int64 rows in the layout of `tasks`' tuples (-1: no wait or signal), in row order."""
        if self.tasks:
            self.parts.append(np.array(self.tasks, np.int64).reshape(len(self.tasks), ROW_WIDTH))
            self.tasks = []
        self.parts.append(np.asarray(rows, np.int64).reshape(-1, ROW_WIDTH))

    def build(self, **fields) -> Plan:
        # Remote counters get the last ids (Plan.first_remote_counter): the fused kernel tells one by its
        # id, without loading its Counter in every task's wait and signal.
        order = sorted(range(len(self.by_id)), key=lambda cid: (self.by_id[cid][1], cid))  # locals, then remotes
        new_id = np.empty(len(order) + 1, np.int64)
        new_id[order] = np.arange(len(order))
        new_id[-1] = -1  # "no counter" stays -1
        counters = np.zeros(len(self.counters), COUNTER_DTYPE)
        keys = np.array(list(self.counters), np.int64).reshape(-1, 2)
        ids = new_id[np.array([cid for cid, _ in self.counters.values()], np.int64)]
        counters["kind"][ids], counters["index"][ids] = keys[:, 0], keys[:, 1]
        counters["remote"][ids] = [remote for _, remote in self.counters.values()]
        rows = np.concatenate(self.parts + [np.array(self.tasks, np.int64).reshape(len(self.tasks), ROW_WIDTH)])
        tasks = np.zeros(len(rows), TASK_DTYPE)
        for j, name in enumerate(("block", "kind") + self.FIELDS):
            tasks[name] = rows[:, j]
        tasks["wait_counter"] = new_id[rows[:, WAITS_AT:WAITS_AT + MAX_WAITS]]
        tasks["signal_counter"] = new_id[rows[:, WAITS_AT + MAX_WAITS:]]
        by_block = np.argsort(rows[:, 0], kind="stable")  # a CTA's tasks in call order: seq 0, 1, ...
        first = np.searchsorted(rows[by_block, 0], rows[by_block, 0])
        tasks["seq"][by_block] = np.arange(len(rows)) - first
        # a counter's target: the signals it gets, R per signalling task for a remote one
        sig = tasks["signal_counter"][tasks["signal_counter"] >= 0]
        counters["target"] = np.bincount(sig, minlength=len(counters)) * np.where(counters["remote"], self.num_ranks, 1)
        wc = tasks["wait_counter"]
        tasks["wait_target"] = np.where(wc >= 0, counters["target"][np.maximum(wc, 0)], 0)
        tasks = tasks[np.lexsort((tasks["seq"], tasks["block"]))]
        return Plan(tasks=tasks, counters=counters, **fields)


_NONE = (-1,) * max(MAX_WAITS, MAX_SIGNALS)  # the unused wait and signal slots of a task
WAITS_AT = 2 + len(Builder.FIELDS)  # a Builder row: block, kind, FIELDS, then the waits, then the signals
ROW_WIDTH = WAITS_AT + MAX_WAITS + MAX_SIGNALS


def with_tasks(plan: Plan, tasks: np.ndarray, counters: np.ndarray | None = None) -> Plan:
    """The same plan with another task table (and counter table) (for experiments and tests of
    check())."""
    return dataclasses.replace(plan, tasks=tasks, counters=plan.counters if counters is None else counters)
