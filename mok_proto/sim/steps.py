"""The simulator's steps (model.simulate): what starts together (one task, or a fused plan's tile
pair), the in-order streams tasks run on, and the orders the steps are visited in: level by level
(`StepGraph.times`: a step's level is the longest chain of steps it depends on, so the steps of a
level depend only on earlier levels and run as one vector operation), or in the order of their
start times (`by_start`), which a model with shared state needs (the emulated link's clocks,
sim/linked.py).
"""

from __future__ import annotations

import functools
import heapq

import numpy as np

from mok_proto.plan import MOVER_KINDS, Plan, PlanError

MOVER_KIND_IDS = sorted(int(k) for k in MOVER_KINDS)
_NONE = np.zeros(0, np.int64)


def streams(plan: Plan, fused: bool) -> np.ndarray:
    """[num_tasks] the in-order stream of every task: 2 x its CTA, + 1 for the mover tasks
    (plan.MOVER_KINDS: transfers, scale, token gradients) of a compute CTA of a fused plan (the
    spare warps of a compute CTA run them beside its GEMM tasks, in table order)."""
    t = plan.tasks
    spare = fused & (t["block"] >= plan.comm_blocks) & np.isin(t["kind"], MOVER_KIND_IDS)
    return 2 * t["block"].astype(np.int64) + spare  # the pool (block num_sms): stream 2 num_sms


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of arange(s, s + n) over the pairs (s, n) of starts and lengths."""
    total = int(lengths.sum())
    if not total:
        return _NONE
    return np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(total)


def _csr(keys: np.ndarray, values: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(ptr [size + 1], values grouped by key in a stable order): values of key k are
    values[ptr[k]:ptr[k + 1]]."""
    ptr = np.zeros(size + 1, np.int64)
    np.cumsum(np.bincount(keys, minlength=size), out=ptr[1:])
    return ptr, values[np.argsort(keys, kind="stable")]


class StepGraph:
    """A plan's steps and their dependencies. Steps: each one task, or in a fused plan a tile pair
    (the k-th GEMM task of CTAs 2j and 2j + 1 past the communicating ones; first, second: the
    tasks of each step, the same task twice for a lone one); a step is ready once the previous step
    of its streams ran and every counter it waits on had all its signals. The claimed pairs
    (Plan.pool_table) are one unit of pair steps whose first follows the last step of every
    cluster (a pair goes to a cluster once that cluster's table is done: model.simulate).
    level: every step's level (0: depends on nothing).
    Raises PlanError on a deadlock or on a fused plan whose cluster CTAs disagree on a tile pair."""

    def __init__(self, plan: Plan, stream: np.ndarray, fused: bool):
        t = plan.tasks
        self.num_tasks = len(t)
        order = np.lexsort((t["seq"], stream))
        cuts = np.flatnonzero(np.diff(stream[order])) + 1
        by_stream = {int(stream[part[0]]): part for part in np.split(order, cuts) if len(part)}
        firsts, seconds = [], []  # per unit (steps run in order): its steps' first and second tasks
        paired = set()
        if fused:
            for cta in range(plan.comm_blocks, plan.num_sms, 2):
                even, odd = by_stream.get(2 * cta, _NONE), by_stream.get(2 * cta + 2, _NONE)
                a, b = t[even], t[odd]
                same = len(a) == len(b) and np.array_equal(a["kind"], b["kind"]) and np.array_equal(
                    a["minibatch"], b["minibatch"]) and np.array_equal(a["col_tile"], b["col_tile"]) and np.array_equal(
                    a["row_tile"] + 1, b["row_tile"])
                if not same:
                    raise PlanError(f"cluster CTAs {cta} and {cta + 1}: their GEMM tasks are not one tile pair per "
                                    "position")
                firsts.append(even)
                seconds.append(odd)
                paired |= {2 * cta, 2 * cta + 2}
        clusters = len(firsts)  # units[:clusters]: the clusters' tables; then the pool's unit
        pool = by_stream.get(2 * plan.pool_block, _NONE) if fused else _NONE
        if len(pool):
            pairs = len(pool) // 2
            firsts.append(pool[0:2 * pairs:2])
            seconds.append(pool[1:2 * pairs:2])
            paired.add(2 * plan.pool_block)
        for s, tasks in by_stream.items():
            if s not in paired:
                firsts.append(tasks)
                seconds.append(tasks)
        lengths = np.array([len(u) for u in firsts], np.int64)
        unit_start = np.cumsum(lengths) - lengths
        self.first = np.concatenate([*firsts, _NONE]).astype(np.int64)
        self.second = np.concatenate([*seconds, _NONE]).astype(np.int64)
        num = len(self.first)
        self.follows = np.ones(num, bool)
        self.follows[unit_start[lengths > 0]] = False  # a step after another one of its unit
        self.pred = np.where(self.follows, np.arange(num) - 1, num)  # num: none (the kernel's start)
        self.pool = np.arange(unit_start[clusters], unit_start[clusters] + lengths[clusters]) if len(pool) else _NONE
        # the pool's first step follows the last step of every cluster's table
        self.gate_from = [int(unit_start[u] + lengths[u] - 1) for u in range(clusters) if len(pool) and lengths[u]]
        self.gate_to = int(unit_start[clusters]) if len(pool) else -1
        # the last step of each cluster's table (num: an empty table), where its pairs of the pool follow
        self.cluster_last = np.array([unit_start[u] + lengths[u] - 1 if lengths[u] else num for u in range(clusters)],
                                     np.int64)
        self.even_ctas = np.arange(plan.comm_blocks, plan.num_sms, 2)
        self._dependencies(plan)

    @functools.cached_property
    def steps(self) -> list[tuple]:
        """Each step's tasks: (task,) or a tile pair's (first, second)."""
        return [(f,) if f == s else (f, s) for f, s in zip(self.first.tolist(), self.second.tolist())]

    def _dependencies(self, plan: Plan) -> None:
        """The counters each step waits on and signals, and every step's level and the level of every
        counter's last signal (Kahn's algorithm); raises PlanError on a deadlock."""
        t, num, first, second = plan.tasks, len(self.first), self.first, self.second
        num_c = len(plan.counters)
        pair = (first != second)[:, None]
        waits = np.concatenate([t["wait_counter"][first], np.where(pair, t["wait_counter"][second], -1)], axis=1)
        signals = np.concatenate([t["signal_counter"][first], np.where(pair, t["signal_counter"][second], -1)], axis=1)
        self.signal_of = signals  # [steps, signals of its tasks] (-1: none)
        step_of = np.repeat(np.arange(num), waits.shape[1])
        flat = waits.ravel()
        key = np.unique(step_of[flat >= 0] * max(num_c, 1) + flat[flat >= 0])  # (step, counter) once each
        self.wait_step, self.wait_counter = key // max(num_c, 1), key % max(num_c, 1)
        sig = t["signal_counter"]
        self.pending = np.bincount(sig[sig >= 0], minlength=num_c)  # signals a counter gets
        dep = self.pending[self.wait_counter] > 0  # a counter nothing signals is no dependency
        self.deps = self.follows.astype(np.int64) + np.bincount(self.wait_step[dep], minlength=num)
        if self.gate_from:
            self.deps[self.gate_to] += len(self.gate_from)
        self.waiter_ptr, self.waiters = _csr(self.wait_counter[dep], self.wait_step[dep], num_c)
        level, done_at = self._levels(signals)
        if np.any(level < 0):
            stuck = np.flatnonzero(level < 0)[:3].tolist()
            raise PlanError("deadlock: steps cannot start: " + "; ".join(
                f"tasks {list(self.steps[j])} on CTAs {sorted(set(t['block'][list(self.steps[j])].tolist()))}"
                for j in stuck))
        self.level, self.counter_level = level, done_at

    def _levels(self, signals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(every step's level, -1 where it never becomes ready; the level of every counter's last
        signal, -1 for none): Kahn's algorithm, a step at a time (a step's level: one past the
        latest of the steps it depends on, known once the last of them ran)."""
        num, num_c = len(self.first), len(self.pending)
        sig = [[c for c in row if c >= 0] for row in signals.tolist()]
        ptr, waiters, follows = self.waiter_ptr.tolist(), self.waiters.tolist(), self.follows.tolist()
        pending, deps = self.pending.tolist(), self.deps.tolist()
        gate = dict.fromkeys(self.gate_from, self.gate_to)
        level, done_at, ran = [0] * num, [-1] * num_c, [False] * num
        stack = [j for j, d in enumerate(deps) if not d]

        while stack:  # releasing step w at level lv: level[w] >= lv, deps[w] - 1
            j = stack.pop()
            ran[j], lv = True, level[j]
            for c in sig[j]:
                if done_at[c] < lv:
                    done_at[c] = lv
                pending[c] -= 1
                if not pending[c]:
                    wl = done_at[c] + 1
                    for w in waiters[ptr[c]:ptr[c + 1]]:
                        if level[w] < wl:
                            level[w] = wl
                        deps[w] -= 1
                        if not deps[w]:
                            stack.append(w)
            w = j + 1
            if w < num and follows[w]:
                if level[w] <= lv:
                    level[w] = lv + 1
                deps[w] -= 1
                if not deps[w]:
                    stack.append(w)
            if j in gate:
                w = gate[j]
                if level[w] <= lv:
                    level[w] = lv + 1
                deps[w] -= 1
                if not deps[w]:
                    stack.append(w)
        done_at = [lv if not left else -1 for lv, left in zip(done_at, pending)]
        return np.where(ran, level, -1), np.array(done_at, np.int64)

    @functools.cached_property
    def levels(self) -> list[tuple]:
        """Per level, what `times` computes: (steps outside the pool, their previous steps, those of
        them that wait (None: all), the segments of their waits, the counters waited on; the
        pool's step or -1; the counters the level completes that a step waits on, their signalling
        steps and segments) (None where a level has none)."""
        num = len(self.first)
        num_levels = int(self.level.max()) + 1 if num else 0
        in_pool = np.zeros(num, bool)
        in_pool[self.pool] = True
        pool_at = np.full(num_levels, -1, np.int64)
        pool_at[self.level[self.pool]] = self.pool
        steps = np.flatnonzero(~in_pool)
        steps = steps[np.argsort(self.level[steps], kind="stable")]
        step_ptr = np.searchsorted(self.level[steps], np.arange(num_levels + 1))
        counts = np.bincount(self.wait_step, minlength=num)  # wait_step is sorted
        wait_ptr = np.cumsum(counts) - counts
        waits_of = counts[steps]
        wait_of_ptr = np.concatenate([[0], np.cumsum(waits_of)])
        waited = self.wait_counter[_ranges(wait_ptr[steps], waits_of)]
        # counters a step waits on that steps signal, by the level their last signal runs at
        counters = np.unique(self.wait_counter)
        counters = counters[self.counter_level[counters] >= 0]
        counters = counters[np.argsort(self.counter_level[counters], kind="stable")]
        counter_ptr = np.searchsorted(self.counter_level[counters], np.arange(num_levels + 1))
        sig = self.signal_of.ravel()
        sig_step = np.repeat(np.arange(num), self.signal_of.shape[1])[sig >= 0]
        sig_ptr, signallers = _csr(sig[sig >= 0], sig_step, len(self.pending))
        sig_counts = sig_ptr[counters + 1] - sig_ptr[counters]
        sig_of_ptr = np.concatenate([[0], np.cumsum(sig_counts)])
        signalled = signallers[_ranges(sig_ptr[counters], sig_counts)]
        out = []
        for lv in range(num_levels):
            a, b = step_ptr[lv], step_ptr[lv + 1]
            idx = pred = has = seg = waited_lv = None
            if b > a:
                idx = steps[a:b]
                pred = self.pred[idx]
                wa, wb = wait_of_ptr[a], wait_of_ptr[b]
                if wb > wa:
                    has = np.flatnonzero(waits_of[a:b])
                    seg = wait_of_ptr[a:b][has] - wa
                    has = None if len(has) == b - a else has
                    waited_lv = waited[wa:wb]
            ca, cb = counter_ptr[lv], counter_ptr[lv + 1]
            complete = signal = signal_seg = None
            if cb > ca:
                complete = counters[ca:cb]
                signal = signalled[sig_of_ptr[ca]:sig_of_ptr[cb]]
                signal_seg = sig_of_ptr[ca:cb] - sig_of_ptr[ca]
            out.append((idx, pred, has, seg, waited_lv, int(pool_at[lv]), complete, signal, signal_seg))
        return out

    @functools.cached_property
    def pool_waits(self) -> dict:
        """{pool step: the counters it waits on}."""
        ptr = np.searchsorted(self.wait_step, np.arange(len(self.first) + 1))
        return {j: self.wait_counter[ptr[j]:ptr[j + 1]] for j in self.pool.tolist()}

    def times(self, dur: np.ndarray, kernel_start: np.ndarray, delay: np.ndarray,
              remote: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
        """(start, end [num_tasks, R] of every task, {pool step: [R] the index in even_ctas of the
        cluster each rank's claimed pair ran on}): a step starts once its streams are free (the
        previous step of its unit ended; the first at kernel_start [R]) and every counter it waits
        on is complete, and ends after its duration (the longer of a pair's two tasks, dur
        [num_tasks, R]); a counter is complete at its last signal plus its delay [counters] (remote
        [counters]: at the slowest rank's). A claimed pair runs on the cluster free first, per rank."""
        num, r = len(self.first), len(kernel_start)
        step_dur = np.maximum(dur[self.first], dur[self.second])
        start = np.empty((num, r))
        end = np.empty((num + 1, r))
        end[num] = kernel_start
        ready = np.zeros((len(delay), r)) + delay[:, None]
        ranks = np.arange(r)
        free = None  # [clusters, R] when each cluster is free for a claimed pair
        cluster = {}  # pool step -> [R] the cluster each rank's pair went to
        for idx, pred, has, seg, waited, pooled, complete, signal, signal_seg in self.levels:
            if idx is not None:
                s = end[pred]
                if waited is not None:
                    waits = np.maximum.reduceat(ready[waited], seg, axis=0)
                    if has is None:
                        np.maximum(s, waits, out=s)
                    else:
                        s[has] = np.maximum(s[has], waits)
                start[idx] = s
                end[idx] = s + step_dur[idx]
            if pooled >= 0:
                if free is None:
                    free = end[self.cluster_last]
                k = np.argmin(free, axis=0)
                s = free[k, ranks]
                waits = self.pool_waits[pooled]
                if len(waits):
                    s = np.maximum(s, ready[waits].max(axis=0))
                e = s + step_dur[pooled]
                start[pooled], end[pooled] = s, e
                free[k, ranks] = e
                cluster[pooled] = k
            if complete is not None:
                last = np.maximum(np.maximum.reduceat(end[signal], signal_seg, axis=0), 0.0)
                far = remote[complete]
                if far.any():
                    last[far] = last[far].max(axis=1, keepdims=True)
                ready[complete] = last + delay[complete, None]
        task_start, task_end = np.empty((self.num_tasks, r)), np.empty((self.num_tasks, r))
        for tasks in (self.second, self.first):
            task_start[tasks], task_end[tasks] = start, end[:num]
        return task_start, task_end, cluster

    @functools.cached_property
    def chained(self) -> bool:
        """Whether the steps are so many levels (a long claimed pool: one level per pair) that one
        rank's steps are visited faster one at a time (`one_rank_times`) than a level at a time."""
        return len(self.first) > 0 and 10 * (int(self.level.max()) + 1) > len(self.first)

    @functools.cached_property
    def _lists(self) -> tuple:
        """(waits, signals, previous step, whether in the pool) per step, and a topological order,
        as Python lists (`one_rank_times`)."""
        num = len(self.first)
        ptr = np.searchsorted(self.wait_step, np.arange(num + 1)).tolist()
        waited = self.wait_counter.tolist()
        in_pool = np.zeros(num, bool)
        in_pool[self.pool] = True
        return ([waited[ptr[j]:ptr[j + 1]] for j in range(num)], [[c for c in row if c >= 0] for row in
                self.signal_of.tolist()], self.pred.tolist(), in_pool.tolist(),
                np.argsort(self.level, kind="stable").tolist())

    def one_rank_times(self, dur: np.ndarray, kernel_start: float, delay: np.ndarray, duration=None,
                       moves=None) -> tuple[np.ndarray, np.ndarray, dict]:
        """`times` for one rank (dur [num_tasks], kernel_start: a float), a step at a time with
        Python floats: the same operations on the same values. Under a link, duration(task, start)
        -> the duration of a step whose `moves` [steps] is set (its first task's, as it starts),
        and the steps are visited in the order of their start (`by_start`) as the link's clocks
        need. Returns (start, end [num_tasks], {pool step: the cluster index its pair ran on})."""
        num = len(self.first)
        waits, signals, pred, pooled, order = self._lists
        step_dur = np.maximum(dur[self.first], dur[self.second]).tolist()
        first = self.first.tolist()
        delay = delay.tolist()
        last, ready = [0.0] * len(delay), [None] * len(delay)
        start, end = [0.0] * num, [0.0] * num + [float(kernel_start)]
        free: list = []  # (free time, cluster index) of every cluster once the pool starts (a heap)
        cluster = {}

        def start_of(j):
            k = None
            if pooled[j]:  # the cluster free first (the lowest index among equals)
                if not cluster and not free:
                    free.extend((end[c], k) for k, c in enumerate(self.cluster_last.tolist()))
                    heapq.heapify(free)
                s, k = heapq.heappop(free)
            else:
                s = end[pred[j]]
            for c in waits[j]:
                r = ready[c]
                if r is None:  # every signaller ran already
                    r = ready[c] = last[c] + delay[c]
                if r > s:
                    s = r
            return s, k

        visit = ((j, *start_of(j)) for j in order) if duration is None else self.by_start(start_of)
        for j, s, k in visit:
            e = s + (duration(first[j], s) if duration is not None and moves[j] else step_dur[j])
            start[j], end[j] = s, e
            for c in signals[j]:
                if e > last[c]:
                    last[c] = e
            if k is not None:
                heapq.heappush(free, (e, k))
                cluster[j] = k
        task_start, task_end = np.empty(self.num_tasks), np.empty(self.num_tasks)
        for tasks in (self.second, self.first):
            task_start[tasks], task_end[tasks] = start, end[:num]
        return task_start, task_end, cluster

    @functools.cached_property
    def _release_lists(self) -> tuple:
        """(waiters' ptr, waiters, follows (+ a last False), gate, pending, deps) as Python lists (`by_start`)."""
        return (self.waiter_ptr.tolist(), self.waiters.tolist(), [*self.follows.tolist(), False],
                dict.fromkeys(self.gate_from, self.gate_to), self.pending.tolist(), self.deps.tolist())

    def by_start(self, start_of):
        """Yield (j, *start_of(j)) for every step in the order of its start on rank 0 (ties: table
        order), where start_of(j) -> (start [R] or one rank's float, ...) is asked when step j
        becomes ready (every step it depends on was yielded, and the caller ran it before asking
        for the next)."""
        ptr, waiters, follows, gate, pending, deps = self._release_lists
        pending, deps, signals = list(pending), list(deps), self._lists[1]
        heap: list = []

        def ready(j):
            s, *rest = start_of(j)
            if isinstance(s, float):  # one rank's (one_rank_times)
                heapq.heappush(heap, (s, j, (s, *rest)))
            else:
                s = np.array(s)  # (not a view of the caller's state)
                heapq.heappush(heap, (float(s[0]), j, (s, *rest)))

        for j, d in enumerate(deps):
            if not d:
                ready(j)
        while heap:
            _, j, got = heapq.heappop(heap)
            yield (j, *got)
            for c in signals[j]:  # the steps that become ready once step j ran
                pending[c] -= 1
                if not pending[c]:
                    for w in waiters[ptr[c]:ptr[c + 1]]:
                        deps[w] -= 1
                        if not deps[w]:
                            ready(w)
            if follows[j + 1]:
                deps[j + 1] -= 1
                if not deps[j + 1]:
                    ready(j + 1)
            if j in gate:
                deps[gate[j]] -= 1
                if not deps[gate[j]]:
                    ready(gate[j])
