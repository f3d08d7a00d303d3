"""Discrete-event model of one MoE layer pass on R GPUs of a scale-up domain, executing a Plan.

Shape legend: N tokens/rank, H hidden, I expert FFN, E experts, K top-k, R ranks, El = E/R.

Every rank runs the same plan on its own receive rows (expert imbalance comes from the routing).
Tasks are visited once, in the plan's execution order (a topological order), each step a
vector over the R ranks: a task starts when its CTA is free and its counters are complete, and
ends after its duration. A local counter completes at its last signal; a remote counter (raised
by every rank) at the slowest rank's last signal plus the receiver's signal wait (a fence and
one signal per peer). Every CTA starts after one kernel launch; a sequential plan pays one more
launch at each stage boundary (its STAGE_DONE counters). Durations:

* GEMM tile: 2*BM*BN*k / (the problem's tile rate per SM under sustained load, GpuParams.tile_ns);
  tiles past the rank's padded rows take no time; a weight-gradient tile's k is its expert's rows.
* communication chunk (1/comm_blocks of a minibatch's rows): remote bytes at the link's rate
  (push or pull efficiency) shared by the communicating CTAs, capped per SM (a pull keeps one
  window in flight per round trip), local bytes at a row-movement kernel's copy rate
  (GpuParams.row_copy_ns); a pull pays a round trip.
* epilogue tile: reads K slot rows (+ the shared row), writes one row: HBM traffic at the rate of
  the token sums (GpuParams.token_kernel_ns, "gather_sum").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from mok_proto import trace
from mok_proto.config import MoEShape
from mok_proto.plan import BM, EPILOGUE_ROWS, PROBLEM_OF, CounterKind, Plan, TaskKind, tile_grid
from mok_proto.sim.params import GpuParams

ELEM_BYTES = 2  # BF16 rows and weights in the layer

OPERATOR_OF = {TaskKind.DISPATCH: "dispatch", TaskKind.COMBINE: "combine",
               TaskKind.REV_COMBINE: "rev_combine", TaskKind.REV_DISPATCH: "rev_dispatch"}
ROUTED_ROW_KINDS = (TaskKind.GATE_UP, TaskKind.DOWN, TaskKind.DOWN_BWD, TaskKind.GATE_UP_BWD)


@dataclass(frozen=True)
class Load:
    """Receive rows of every rank, from an actual routing (the schedule's placement)."""

    tokens_per_expert: np.ndarray  # [R, El] real rows of each local expert
    expert_offsets: np.ndarray  # [R, El + 1] padded to BM (the schedule's align)
    local_fraction: np.ndarray  # [R] share of received rows that come from the rank itself

    @property
    def num_ranks(self) -> int:
        return self.tokens_per_expert.shape[0]


def _topk_uniform(rng, num_rows: int, num_experts: int, top_k: int) -> np.ndarray:
    """[num_rows, K] distinct experts per row, uniformly at random (redraw rows with repeats)."""
    idx = rng.integers(0, num_experts, (num_rows, top_k))
    while True:
        s = np.sort(idx, axis=1)
        bad = np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1))
        if not len(bad):
            return idx
        idx[bad] = rng.integers(0, num_experts, (len(bad), top_k))


def route(shape: MoEShape, num_ranks: int, seed: int = 0, skew: float = 0.0) -> np.ndarray:
    """[R, N, K] every rank's top-k experts. skew = 0: uniform random top-k; skew > 0: expert e
    drawn with weight (e+1)^-skew (a popular-expert imbalance), experts in a random order over ranks."""
    rng = np.random.default_rng(seed)
    e, k, n = shape.num_experts, shape.top_k, shape.num_tokens
    if skew:
        weights = rng.permutation(np.arange(1, e + 1, dtype=np.float64) ** -skew)
        gumbel = np.log(weights)[None, :] - np.log(-np.log(rng.random((num_ranks * n, e))))
        topk = np.argpartition(-gumbel, k - 1, axis=1)[:, :k]
    else:
        topk = _topk_uniform(rng, num_ranks * n, e, k)
    return topk.reshape(num_ranks, n, k)


def load_from_topk(topk: np.ndarray, num_experts: int) -> Load:
    """The receive rows of every rank for a routing topk [R, N, K], placed as the pull schedule
    places them (`schedule.build_pull_schedule(topk, E, rank, align=BM)`): rank r owns experts
    r*El .. (r+1)*El - 1, segments padded to BM."""
    num_ranks, n, k = topk.shape
    el = num_experts // num_ranks
    src = np.repeat(np.arange(num_ranks), n * k)  # source rank of each (token, choice)
    pairs = np.bincount(topk.reshape(-1) * num_ranks + src, minlength=num_experts * num_ranks)
    pairs = pairs.reshape(num_ranks, el, num_ranks)  # [owner, local expert, source rank]
    per_expert = pairs.sum(axis=2)  # [R, El]
    offsets = np.zeros((num_ranks, el + 1), np.int64)
    np.cumsum(-(-per_expert // BM) * BM, axis=1, out=offsets[:, 1:])
    own = pairs[np.arange(num_ranks), :, np.arange(num_ranks)].sum(axis=1)  # [R] rows from the owner itself
    return Load(per_expert, offsets, own / np.maximum(per_expert.sum(axis=1), 1))


@functools.lru_cache(maxsize=32)
def routed_load(shape: MoEShape, num_ranks: int, seed: int = 0, skew: float = 0.0) -> Load:
    """The load of a random routing (`route`), placed as the pull schedule does."""
    return load_from_topk(route(shape, num_ranks, seed, skew), shape.num_experts)


@dataclass(frozen=True)
class SimResult:
    plan: Plan
    gpu: GpuParams
    start_ns: np.ndarray  # [num_tasks, R]
    end_ns: np.ndarray  # [num_tasks, R]
    load: Load

    @property
    def rank_ns(self) -> np.ndarray:
        """[R] time each rank finishes the pass."""
        return self.end_ns.max(axis=0)

    @property
    def time_ns(self) -> float:
        """The pass's time: the slowest rank."""
        return float(self.rank_ns.max())

    @property
    def slowest_rank(self) -> int:
        return int(np.argmax(self.rank_ns))

    def kind_span_ns(self, kinds, rank: int | None = None) -> float:
        """From the first start to the last end of the tasks of these kinds (on one rank, or the
        longest over ranks)."""
        sel = np.isin(self.plan.tasks["kind"], [int(k) for k in kinds]) & (self.end_ns > self.start_ns).any(axis=1)
        if not sel.any():
            return 0.0
        span = self.end_ns[sel].max(axis=0) - self.start_ns[sel].min(axis=0)
        return float(span[rank] if rank is not None else span.max())

    def records(self, rank: int | None = None) -> np.ndarray:
        """Timeline records (trace.TRACE_DTYPE) of one rank (default: the slowest)."""
        rank = self.slowest_rank if rank is None else rank
        t = self.plan.tasks
        rec = trace.empty(len(t))
        rec["rank"] = rank
        for name in ("block", "kind", "minibatch", "row_tile", "col_tile"):
            rec[name] = t[name]
        rec["role"] = np.where(self.plan.is_comm_block(t["block"]) & (self.plan.strategy != "sequential"), 0, 1)
        rec["expert"] = np.where(t["expert"] >= 0, t["expert"], _row_tile_expert(self.load, self.plan, rank))
        rec["start_ns"], rec["end_ns"] = self.start_ns[:, rank], self.end_ns[:, rank]
        return rec


def _row_tile_expert(load: Load, plan: Plan, rank: int) -> np.ndarray:
    t = plan.tasks
    routed = np.isin(t["kind"], [int(k) for k in ROUTED_ROW_KINDS])
    expert = np.searchsorted(load.expert_offsets[rank], t["row_tile"] * BM, side="right") - 1
    return np.where(routed & (expert < load.tokens_per_expert.shape[1]), expert, -1)


def _durations(plan: Plan, gpu: GpuParams, load: Load) -> np.ndarray:
    """[num_tasks, R] duration of every task on every rank, in ns."""
    t, shape, r = plan.tasks, plan.shape, load.num_ranks
    kind = t["kind"].astype(np.int64)
    dur = np.zeros((len(t), r))
    padded = load.expert_offsets[:, -1]  # [R]
    # GEMM tiles of row-tile kinds: full tile time while the tile lies inside the padded rows.
    for k in PROBLEM_OF:
        sel = np.flatnonzero(kind == int(k))
        if not len(sel):
            continue
        _, _, red = tile_grid(k, shape)
        tile_ns = gpu.tile_ns(PROBLEM_OF[k], red)
        if k in ROUTED_ROW_KINDS:
            dur[sel] = tile_ns * (t["row_tile"][sel, None] * BM < padded[None, :])
        elif k in (TaskKind.DOWN_WGRAD, TaskKind.GATE_UP_WGRAD):
            rows = load.tokens_per_expert[:, t["expert"][sel]].T  # [n, R] (one macrobatch: all rows)
            dur[sel] = gpu.tile_ns(PROBLEM_OF[k], rows / plan.num_macrobatches)
        elif k in (TaskKind.SHARED_DOWN_WGRAD, TaskKind.SHARED_GATE_UP_WGRAD):
            dur[sel] = gpu.tile_ns(PROBLEM_OF[k], shape.num_tokens)
        else:  # shared expert row tiles
            dur[sel] = tile_ns
    # Communication chunks.
    row_bytes = shape.hidden * ELEM_BYTES
    real_in_mb = _real_rows_per_minibatch(plan, load)  # [num_mb, R]
    for k, op in OPERATOR_OF.items():
        sel = np.flatnonzero(kind == int(k))
        if not len(sel):
            continue
        direction = plan.policy[op]
        ctas = plan.comm_blocks
        link = gpu.link_gbs * gpu.link_efficiency[direction] / ctas
        link = min(link, gpu.pull_sm_gbs() if direction == "pull" else gpu.sm_push_gbs)
        rows = real_in_mb[t["minibatch"][sel]] / plan.num_chunks  # [n, R]
        remote = rows * (1.0 - load.local_fraction)[None, :] * row_bytes
        local = rows * load.local_fraction[None, :] * row_bytes
        moved = np.maximum(remote / link, gpu.row_copy_ns(local) * ctas)
        dur[sel] = moved + (gpu.rtt_ns if direction == "pull" else 0.0) * (rows > 0)
    # Epilogue tiles: read K slot rows (+ the shared row), write one row, per token; every byte
    # once from HBM at the token sums' rate (gpu.token_kernel_ns).
    for k in (TaskKind.WEIGHTED_SUM, TaskKind.SLOT_SUM):
        sel = np.flatnonzero(kind == int(k))
        rows = np.minimum(EPILOGUE_ROWS, shape.num_tokens - t["row_tile"][sel] * EPILOGUE_ROWS)[:, None]
        reads = rows * (shape.top_k + shape.num_shared) * row_bytes
        dur[sel] = gpu.token_kernel_ns("gather_sum", reads, rows * row_bytes) * plan.num_sms
    return dur


def _real_rows_per_minibatch(plan: Plan, load: Load) -> np.ndarray:
    """[num_minibatches, R] real (not padding) received rows inside each minibatch's row range."""
    edges = np.arange(plan.num_minibatches + 1) * plan.minibatch_rows  # [M+1]
    off = load.expert_offsets  # [R, El+1]
    seg_start = off[:, :-1]  # [R, El]
    # real rows below each edge: sum over experts of clip(edge - start, 0, count)
    below = np.clip(edges[:, None, None] - seg_start[None], 0, load.tokens_per_expert[None]).sum(axis=2)  # [M+1, R]
    return np.diff(below, axis=0).astype(np.float64)


def _counter_delays(plan: Plan, gpu: GpuParams) -> np.ndarray:
    """[num_counters] extra ns from a counter's last signal to its waiters seeing it."""
    c = plan.counters
    delay = np.where(c["remote"], gpu.signal_wait_ns(plan.num_ranks), 0.0)
    return delay + np.where(c["kind"] == int(CounterKind.STAGE_DONE), gpu.launch_ns, 0.0)


def simulate(plan: Plan, gpu: GpuParams, load: Load | None = None, seed: int = 0) -> SimResult:
    """Simulate one pass of `plan` on every rank; load defaults to uniform random routing.
    Raises plan.PlanError for a plan the megakernel could not run (e.g. a counter target below
    its signals would let waiters start early and give a too short time); the proof is kept
    per plan object, so a second simulation of the same plan does not check again."""
    plan.check()
    if plan.num_sms > gpu.num_sms:
        raise ValueError(f"plan has {plan.num_sms} CTAs but {gpu.name} has {gpu.num_sms} SMs")
    load = load or routed_load(plan.shape, plan.num_ranks, seed)
    if load.expert_offsets[:, -1].max() > plan.capacity_rows:
        raise ValueError(f"a rank receives {load.expert_offsets[:, -1].max()} padded rows, more than the "
                         f"plan's capacity_rows={plan.capacity_rows}")
    dur = _durations(plan, gpu, load)
    t = plan.tasks
    r = load.num_ranks
    num_c = len(plan.counters)
    remote = plan.counters["remote"].tolist()
    delay = _counter_delays(plan, gpu)
    last = np.zeros((num_c, r))
    ready: list = [None] * num_c
    # Every CTA starts after one kernel launch: the persistent kernel's (fixed_split) or the
    # first stage's (sequential); each later sequential stage pays one more launch through its
    # STAGE_DONE counter (_counter_delays). So both strategies pay the launches they would issue.
    cta = np.full((plan.num_sms, r), gpu.launch_ns)
    start = np.empty((len(t), r))
    block = t["block"].tolist()
    waits = [[w for w in ws if w >= 0] for ws in t["wait_counter"].tolist()]
    sigs = [[s for s in ss if s >= 0] for ss in t["signal_counter"].tolist()]
    for i in plan.execution_order.tolist():
        s = cta[block[i]]
        for w in waits[i]:
            if ready[w] is None:  # every signaller ran already (topological order)
                ready[w] = (np.full(r, last[w].max()) if remote[w] else last[w]) + delay[w]
            s = np.maximum(s, ready[w])
        start[i] = s
        e = s + dur[i]
        cta[block[i]] = e
        for c in sigs[i]:
            np.maximum(last[c], e, out=last[c])
    return SimResult(plan, gpu, start, start + dur, load)

