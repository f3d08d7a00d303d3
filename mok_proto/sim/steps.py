"""The simulator's steps (model.simulate): what starts together (one task, or a fused plan's tile
pair), the in-order streams tasks run on, and the orders the steps are visited in: any order that
respects every dependency (`StepGraph.order`), or the order of their start times (`by_start`),
which a model with shared state needs (the emulated link's clocks, sim/linked.py).
"""

from __future__ import annotations

import heapq

import numpy as np

from mok_proto.plan import MOVER_KINDS, Plan, PlanError

MOVER_KIND_IDS = sorted(int(k) for k in MOVER_KINDS)


def streams(plan: Plan, fused: bool) -> np.ndarray:
    """[num_tasks] the in-order stream of every task: 2 x its CTA, + 1 for the mover tasks
    (plan.MOVER_KINDS: transfers, scale, token gradients) of a compute CTA of a fused plan (the
    spare warps of a compute CTA run them beside its GEMM tasks, in table order)."""
    t = plan.tasks
    spare = fused & (t["block"] >= plan.comm_blocks) & np.isin(t["kind"], MOVER_KIND_IDS)
    return 2 * t["block"].astype(np.int64) + spare  # the pool (block num_sms): stream 2 num_sms


class StepGraph:
    """A plan's steps and their dependencies. steps: each a tuple of tasks that start together (one
    task; in a fused plan a tile pair: the k-th GEMM task of CTAs 2j and 2j + 1 past the
    communicating ones); a step is ready once the previous step of its streams ran and every
    counter it waits on had all its signals. The claimed pairs (Plan.pool_table) are one unit of
    pair steps whose first follows the last step of every cluster (a pair goes to a cluster once
    that cluster's table is done: model.simulate). order: the step indices in an order that
    respects every dependency (Kahn's algorithm).
    Raises PlanError on a deadlock or on a fused plan whose cluster CTAs disagree on a tile pair."""

    def __init__(self, plan: Plan, stream: np.ndarray, fused: bool):
        t = plan.tasks
        by_stream: dict[int, list] = {}
        for i in np.lexsort((t["seq"], stream)).tolist():
            by_stream.setdefault(int(stream[i]), []).append(i)
        units = []  # sequences of steps run in order
        paired = set()
        if fused:
            for cta in range(plan.comm_blocks, plan.num_sms, 2):
                even, odd = by_stream.get(2 * cta, []), by_stream.get(2 * cta + 2, [])
                a, b = t[even], t[odd]
                same = len(a) == len(b) and np.array_equal(a["kind"], b["kind"]) and np.array_equal(
                    a["minibatch"], b["minibatch"]) and np.array_equal(a["col_tile"], b["col_tile"]) and np.array_equal(
                    a["row_tile"] + 1, b["row_tile"])
                if not same:
                    raise PlanError(f"cluster CTAs {cta} and {cta + 1}: their GEMM tasks are not one tile pair per "
                                    "position")
                units.append(list(zip(even, odd)))
                paired |= {2 * cta, 2 * cta + 2}
        pool = by_stream.get(2 * plan.pool_block, []) if fused else []
        clusters = len(units)  # units[:clusters]: the clusters' tables; then the pool's unit
        if pool:
            units.append(list(zip(pool[0::2], pool[1::2])))
            paired.add(2 * plan.pool_block)
        units += [[(i,) for i in tasks] for s, tasks in by_stream.items() if s not in paired]
        self.steps = steps = [st for unit in units for st in unit]
        first = np.cumsum([0] + [len(u) for u in units])[:-1]
        self.follows = np.ones(len(steps), bool)
        self.follows[first] = False  # a step after another one of its unit
        wait, self.signals = t["wait_counter"].tolist(), t["signal_counter"].tolist()
        self.pending = np.bincount(t["signal_counter"][t["signal_counter"] >= 0], minlength=len(plan.counters)).tolist()
        self.waiters: list[list] = [[] for _ in self.pending]
        self.deps = self.follows.astype(np.int64).tolist()
        self.gate: dict[int, int] = {}  # last step of a cluster's table -> the pool's first step
        if pool:
            for u in range(clusters):
                if units[u]:
                    self.gate[int(first[u]) + len(units[u]) - 1] = int(first[clusters])
                    self.deps[int(first[clusters])] += 1
        for j, st in enumerate(steps):
            for c in {w for i in st for w in wait[i] if w >= 0 and self.pending[w]}:
                self.waiters[c].append(j)
                self.deps[j] += 1
        pending, deps = list(self.pending), list(self.deps)
        ready = [j for j, d in enumerate(deps) if not d]
        self.order = []
        while ready:
            j = ready.pop()
            self.order.append(j)
            ready += self._release(j, pending, deps)
        if len(self.order) < len(steps):
            stuck = sorted(set(range(len(steps))) - set(self.order))[:3]
            raise PlanError("deadlock: steps cannot start: " + "; ".join(
                f"tasks {list(steps[j])} on CTAs {sorted(set(t['block'][list(steps[j])].tolist()))}" for j in stuck))

    def _release(self, j: int, pending: list, deps: list) -> list:
        """The steps that become ready once step j ran (pending, deps: the visit's counts, updated)."""
        out = []
        for c in (s for i in self.steps[j] for s in self.signals[i] if s >= 0):
            pending[c] -= 1
            if not pending[c]:
                for w in self.waiters[c]:
                    deps[w] -= 1
                    if not deps[w]:
                        out.append(w)
        if j + 1 < len(self.steps) and self.follows[j + 1]:
            deps[j + 1] -= 1
            if not deps[j + 1]:
                out.append(j + 1)
        if j in self.gate:
            deps[self.gate[j]] -= 1
            if not deps[self.gate[j]]:
                out.append(self.gate[j])
        return out

    def by_start(self, start_of):
        """Yield (j, *start_of(j)) for every step in the order of its start on rank 0 (ties: table
        order), where start_of(j) -> (start [R], ...) is asked when step j becomes ready (every
        step it depends on was yielded, and the caller ran it before asking for the next)."""
        pending, deps = list(self.pending), list(self.deps)
        heap: list = []

        def push(ready):
            for j in ready:
                s, *rest = start_of(j)
                s = np.array(s)  # (not a view of the caller's state)
                heapq.heappush(heap, (float(s[0]), j, (s, *rest)))

        push(j for j, d in enumerate(deps) if not d)
        while heap:
            _, j, got = heapq.heappop(heap)
            yield (j, *got)
            push(self._release(j, pending, deps))
