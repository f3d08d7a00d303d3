"""Discrete-event model of one MoE layer pass on R GPUs of a scale-up domain, executing a Plan.

Shape legend: N tokens/rank, H hidden, I expert FFN, E experts, K top-k, R ranks, El = E/R.

Every rank runs the same plan on its own receive rows (expert imbalance comes from the routing).
Tasks run on in-order *streams*: a CTA's table (`_streams`; in a fused plan without
communicating CTAs, comm_blocks == 0, a CTA's communication tasks are a second stream, run by
spare warps beside its GEMM tasks). A *step* is what starts together: one task, or in a fused
plan one tile pair of a 2-CTA cluster (both CTAs start it together and share B). Steps are
visited once, in a topological order (sim/steps.py), each a vector over the R ranks: a step starts
when its streams are free and its counters are complete, and ends after its duration. A local
counter completes at its last signal; a remote counter (raised by every rank) at the slowest
rank's last signal plus the receiver's signal wait (a fence and one signal per peer). Every CTA
starts after one kernel launch; a sequential plan pays one more launch at each stage boundary
(its STAGE_DONE counters); a fused plan (fused_forward or fused_backward) pays what runs around
its kernel (`_fused_before_ns`, `_fused_pass_end_ns`: the counters' memset, a transfer in the other
direction, the outgoing transfer's flag and wait, the weighted sum; a backward whose plan keeps
them outside its kernel (plan.scale, plan.token_grads off) also the scale kernel and the publish
of dy_slots before, the slot sum and topk_weight_grad after). Durations:

* GEMM tile: 2*BM*BN*k / (the problem's tile rate per SM under sustained load, GpuParams.tile_ns);
  tiles past the rank's padded rows take no time; a weight-gradient tile's k is its expert's rows
  (per macrobatch; a fused backward has one), the shared expert's N tokens. A fused plan's tiles
  at GpuParams.fused_gemm of that rate (one factor for the copies and the counter waits beside
  them; 1.0 unless the set fits it: sim.validate NOT MODELED, the acquire-spin rule, params.WAIT_SPINS).
* communication chunk (1/comm_blocks of a minibatch's rows): remote bytes at the link's rate
  (push or pull efficiency) shared by the communicating CTAs, capped per SM (a pull keeps one
  window in flight per round trip), local bytes at a row-movement kernel's copy rate
  (GpuParams.row_copy_ns); a pull pays a round trip.
* fused chunk c of minibatch m (cuda/fused.cuh: receive rows m MB + c, + C, ..., on CTA c; the
  backward's reverse-combine is modeled as the forward's dispatch, its reverse-dispatch as the combine):
  the fixed cost of a task plus its rows at one CTA's in-kernel copy rate (GpuParams.fused_task_ns,
  fused_chunk_copy_ns: a communicating CTA's warps at comm_cta_gbs per byte, or, for the
  retired bulk ring, comm_mover "bulk", bulk_row_ns per row; spare warps beside GEMM tiles at
  spare_cta_gbs per byte), or slower where the CTAs' share of the link or of HBM is; the incoming
  transfer (PassKinds.comm_in) moves every row below the padded end (a padding row stores the zero
  row), the outgoing one only the real rows.
* epilogue tile: reads K slot rows (+ the shared row), writes one row: HBM traffic at the rate of
  the token sums (GpuParams.token_kernel_ns, "gather_sum"); a fused backward's (plan.token_grads:
  the slot sum and d topk_weights inside the kernel) also reads the token's dout and K slot rows
  at topk_weight_grad's rate (TOPK_WEIGHT_GRAD), and nothing runs after that kernel. Its scale tiles
  (plan.scale) are their share of scale_to_slots (SCALE_TO_SLOTS). Each is the GPU's rate shared by
  every CTA, unless the movers' own rates are fitted (GpuParams.token_read_gbs / token_write_gbs, h200:
  on one measured backward): then a fused plan's SCALE and SLOT_SUM tasks are their bytes
  (token_task_bytes) at those rates.

With an emulated link (simulate's `link`: bench_layer's emulation on one GPU, sim/linked.py) a
transfer task is its copy in HBM or, where longer, its paying bytes on its rank's link clock of its
direction (one budget shared by every mover, reserved as each starts) or a pull's round trips; a
flag pays a round trip. The clocks make the steps' order matter: they are visited in the order of
their start on rank 0 (StepGraph.by_start; every rank of the emulation moves rank 0's rows).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from mok_proto import trace
from mok_proto.config import MoEShape
from mok_proto.link import LinkModel
from mok_proto.plan import (BM, EPILOGUE_ROWS, FUSED_STRATEGIES, PROBLEM_OF, SEGMENT_ROWS, CounterKind, Plan,
                            TaskKind, inside_kernel, tile_grid)
from mok_proto.routing import RoutingSpec, uniform_topk
from mok_proto.routing import topk as routed_topk
from mok_proto.sim import linked
from mok_proto.sim.params import GpuParams
from mok_proto.sim.steps import MOVER_KIND_IDS, StepGraph, streams

ELEM_BYTES = 2  # BF16 rows and weights in the layer

OPERATOR_OF = {TaskKind.DISPATCH: "dispatch", TaskKind.COMBINE: "combine",
               TaskKind.REV_COMBINE: "rev_combine", TaskKind.REV_DISPATCH: "rev_dispatch"}
ROUTED_ROW_KINDS = (TaskKind.GATE_UP, TaskKind.DOWN, TaskKind.DOWN_BWD, TaskKind.GATE_UP_BWD)
FUSED = frozenset(FUSED_STRATEGIES.values())  # fused_forward, fused_backward (cuda/fused.cuh)


def is_fused(plan: Plan) -> bool:
    """A plan of the megakernel (plan.fused_forward / plan.fused_backward)."""
    return plan.strategy in FUSED


def plan_align(plan: Plan) -> int:
    """Rows an expert segment is padded to for this plan: a fused plan's segment rule (its knobs'
    segment_rows: the GPU layer's SEGMENT_ROWS unless a what-if or a results row says otherwise),
    else one row tile (BM: the sequential model's, docs/design.md 3.2)."""
    return (plan.knobs.segment_rows or SEGMENT_ROWS) if is_fused(plan) else BM


@dataclass(frozen=True)
class Load:
    """Receive rows of every rank, from an actual routing (the schedule's placement)."""

    tokens_per_expert: np.ndarray  # [R, El] real rows of each local expert
    expert_offsets: np.ndarray  # [R, El + 1] padded to the schedule's align (plan_align: BM or SEGMENT_ROWS)
    local_fraction: np.ndarray  # [R] share of received rows that come from the rank itself

    @property
    def num_ranks(self) -> int:
        return self.tokens_per_expert.shape[0]


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
        topk = uniform_topk(rng, num_ranks * n, e, k)
    return topk.reshape(num_ranks, n, k)


def load_from_topk(topk: np.ndarray, num_experts: int, align: int = BM) -> Load:
    """The receive rows of every rank for a routing topk [R, N, K], placed as the pull schedule
    places them (`schedule.build_pull_schedule(topk, E, rank, align=align)`): rank r owns experts
    r*El .. (r+1)*El - 1, segments padded to `align` rows (`plan_align`)."""
    num_ranks, n, k = topk.shape
    el = num_experts // num_ranks
    src = np.repeat(np.arange(num_ranks), n * k)  # source rank of each (token, choice)
    pairs = np.bincount(topk.reshape(-1) * num_ranks + src, minlength=num_experts * num_ranks)
    pairs = pairs.reshape(num_ranks, el, num_ranks)  # [owner, local expert, source rank]
    per_expert = pairs.sum(axis=2)  # [R, El]
    offsets = np.zeros((num_ranks, el + 1), np.int64)
    np.cumsum(-(-per_expert // align) * align, axis=1, out=offsets[:, 1:])
    own = pairs[np.arange(num_ranks), :, np.arange(num_ranks)].sum(axis=1)  # [R] rows from the owner itself
    return Load(per_expert, offsets, own / np.maximum(per_expert.sum(axis=1), 1))


@functools.lru_cache(maxsize=32)
def routed_load(shape: MoEShape, num_ranks: int, seed: int = 0, skew: float = 0.0, align: int = BM) -> Load:
    """The load of a random routing (`route`), placed as the pull schedule does."""
    return load_from_topk(_route_once(shape, num_ranks, seed, skew), shape.num_experts, align)


@functools.lru_cache(maxsize=16)
def _route_once(shape: MoEShape, num_ranks: int, seed: int, skew: float) -> np.ndarray:
    """`route`, drawn once for every padding of its loads (read only)."""
    return route(shape, num_ranks, seed, skew)


def spec_load(shape: MoEShape, num_ranks: int, routing: RoutingSpec, seed: int = 0, align: int = BM) -> Load:
    """The load of a routing spec over the real layout (mok_proto.routing, rank 0 timed; uniform:
    `routed_load`'s, the same draws), placed as the pull schedule does."""
    if routing.is_uniform:
        return routed_load(shape, num_ranks, seed, align=align)
    return load_from_topk(_spec_topk(shape, num_ranks, routing, seed), shape.num_experts, align)


@functools.lru_cache(maxsize=8)
def _spec_topk(shape: MoEShape, num_ranks: int, routing: RoutingSpec, seed: int) -> np.ndarray:
    """The routing of `spec_load`, drawn once for every padding of its loads (read only)."""
    return routed_topk(routing, num_ranks, shape.num_tokens, shape.num_experts, shape.top_k,
                       np.random.default_rng(seed))


@dataclass(frozen=True)
class SimResult:
    plan: Plan
    gpu: GpuParams
    start_ns: np.ndarray  # [num_tasks, R]
    end_ns: np.ndarray  # [num_tasks, R]
    load: Load
    pass_end_ns: np.ndarray  # [R] end of the pass: the last task, or what runs after a fused kernel
    block: np.ndarray | None = None  # [num_tasks, R] the CTA that ran each task (a claimed pair's: simulated)

    @property
    def rank_ns(self) -> np.ndarray:
        """[R] time each rank finishes the pass."""
        return self.pass_end_ns

    @property
    def time_ns(self) -> float:
        """The pass's time: the slowest rank (a fused plan: with the launches around its kernel,
        the weighted sum / the backward's scale, slot sum and topk_weight_grad included)."""
        return float(self.rank_ns.max())

    @property
    def kernel_ns(self) -> float:
        """The plan's tasks as an in-kernel trace measures them: first task start to last task end,
        the slowest rank (a fused plan: its kernel only, no weighted sum)."""
        return float((self.end_ns.max(axis=0) - self.start_ns.min(axis=0)).max())

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
        """Timeline records (trace.TRACE_DTYPE) of one rank (default: the slowest), one per plan
        task in table order; role comm for a mover task (outside sequential plans)."""
        rank = self.slowest_rank if rank is None else rank
        t = self.plan.tasks
        rec = trace.empty(len(t))
        rec["rank"] = rank
        for name in ("block", "kind", "minibatch", "row_tile", "col_tile"):
            rec[name] = t[name]
        if self.block is not None:
            rec["block"] = self.block[:, rank]
        rec["claimed"] = t["block"] == self.plan.pool_block
        rec["role"] = np.where(np.isin(t["kind"], MOVER_KIND_IDS) & (self.plan.strategy != "sequential"), 0, 1)
        rec["expert"] = np.where(t["expert"] >= 0, t["expert"], _row_tile_expert(self.load, self.plan, rank))
        rec["start_ns"], rec["end_ns"] = self.start_ns[:, rank], self.end_ns[:, rank]
        return rec


def _row_tile_expert(load: Load, plan: Plan, rank: int) -> np.ndarray:
    t = plan.tasks
    routed = np.isin(t["kind"], [int(k) for k in ROUTED_ROW_KINDS])
    expert = np.searchsorted(load.expert_offsets[rank], t["row_tile"] * BM, side="right") - 1
    return np.where(routed & (expert < load.tokens_per_expert.shape[1]), expert, -1)


def _transfer_ns(gpu: GpuParams, direction: str, ctas, remote, local):
    """One CTA's share of a row transfer that `ctas` CTAs (a number, or one per row of remote)
    run at once: remote bytes at its share of the link (capped by what one SM keeps in flight),
    local bytes at its share of a row-movement kernel's copy rate."""
    link = gpu.link_gbs * gpu.link_efficiency[direction] / ctas
    link = np.minimum(link, gpu.pull_sm_gbs() if direction == "pull" else gpu.sm_push_gbs)
    return np.maximum(remote / link, gpu.row_copy_ns(local) * ctas)


def _durations(plan: Plan, gpu: GpuParams, load: Load, movers: linked.LinkedMovers | None = None) -> np.ndarray:
    """[num_tasks, R] duration of every task on every rank, in ns; with `movers` (a link), the
    transfer tasks' pricing under the link goes there too."""
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
    if is_fused(plan) and gpu.fused_gemm != 1.0:
        dur[np.isin(kind, [int(k) for k in PROBLEM_OF])] /= gpu.fused_gemm
    # Communication chunks.
    row_bytes = shape.hidden * ELEM_BYTES
    real_in_mb = _real_rows_per_minibatch(plan, load)  # [num_mb, R]
    for k, op in OPERATOR_OF.items():
        sel = np.flatnonzero(kind == int(k))
        if not len(sel):
            continue
        if is_fused(plan):
            dur[sel] = _fused_chunk_ns(plan, gpu, load, k, sel, movers)
            continue
        direction = plan.policy[op]
        rows = real_in_mb[t["minibatch"][sel]] / plan.num_chunks  # [n, R]
        remote = rows * (1.0 - load.local_fraction)[None, :] * row_bytes
        local = rows * load.local_fraction[None, :] * row_bytes
        moved = _transfer_ns(gpu, direction, plan.comm_blocks, remote, local)
        dur[sel] = moved + (gpu.rtt_ns if direction == "pull" else 0.0) * (rows > 0)
        if movers is not None:  # a standalone kernel's share: all its warps reserve from the stage's start
            pull, link = direction == "pull", movers.link
            movers.add(sel, pull, rows * row_bytes * linked.paying_fraction(link, load.local_fraction)[None, :],
                       _transfer_ns(gpu, direction, plan.comm_blocks, 0.0, rows * row_bytes),
                       _standalone_round_trips(plan, gpu, load, link, k == plan.kinds.comm_in) if pull else 0.0,
                       signal=0.0 if pull else link.latency_ns)
    # Token tiles: the epilogue (weighted sum / slot sum) and a fused backward's scale.
    for k in (TaskKind.WEIGHTED_SUM, TaskKind.SLOT_SUM, TaskKind.SCALE):
        sel = np.flatnonzero(kind == int(k))
        dur[sel] = _token_task_ns(plan, gpu, k, t["row_tile"][sel])[:, None]
    return dur


def _token_task_ns(plan: Plan, gpu: GpuParams, kind: TaskKind, row_tiles) -> np.ndarray:
    """Token tiles of `kind` (WEIGHTED_SUM, SLOT_SUM, SCALE). A fused backward's scale and token
    gradients run on its movers: at their fitted rates (GpuParams.fused_token_task_ns), or where
    those are not set their share of the standalone kernels, every CTA at once (scale_to_slots;
    the slot sum plus topk_weight_grad). An epilogue tile outside a fused kernel (a fused forward
    runs its weighted sum after the kernel): reads K slot rows (+ the shared row), writes one."""
    shape, fused = plan.shape, is_fused(plan)
    if fused and kind in (TaskKind.SCALE, TaskKind.SLOT_SUM):
        movers = gpu.fused_token_task_ns(*token_task_bytes(shape, kind, row_tiles))
        if movers is not None:
            return movers
    if kind == TaskKind.SCALE:
        return _token_tile_ns(shape, gpu, SCALE_TO_SLOTS, row_tiles, plan.num_sms)
    ns = _epilogue_task_ns(shape, gpu, row_tiles, plan.num_sms)
    if kind == TaskKind.SLOT_SUM and fused:
        ns = ns + _token_tile_ns(shape, gpu, TOPK_WEIGHT_GRAD, row_tiles, plan.num_sms)
    return ns


def _tile_tokens(shape: MoEShape, row_tiles) -> np.ndarray:
    """Tokens of epilogue-sized token tiles (EPILOGUE_ROWS each, the last one shorter)."""
    return np.minimum(EPILOGUE_ROWS, shape.num_tokens - np.asarray(row_tiles) * EPILOGUE_ROWS)


def _token_tile_ns(shape: MoEShape, gpu: GpuParams, kernel: tuple, row_tiles, num_sms: int) -> np.ndarray:
    """Token tiles' share of a token kernel (such as SCALE_TO_SLOTS), num_sms of them at once."""
    return token_kernel_ns(shape, gpu, kernel) * _tile_tokens(shape, row_tiles) / shape.num_tokens * num_sms


def token_task_bytes(shape: MoEShape, kind: TaskKind, row_tiles) -> tuple[np.ndarray, np.ndarray]:
    """(bytes read, bytes written) of fused-kernel token-side tasks of `kind` (rows of H bf16; the
    fp32 router weights and d topk_weights, K per token, are left out: under 0.2% of the bytes):
    SCALE reads each token's dout row and writes its K dy_slots rows; SLOT_SUM (the token
    gradients) reads its K dx_slots rows (+ the shared expert's dx row) and writes dx, then reads
    the dout row and the K y_slots rows for d topk_weights."""
    rows = _tile_tokens(shape, row_tiles).astype(np.float64) * shape.hidden * ELEM_BYTES
    k = shape.top_k
    if kind == TaskKind.SCALE:
        return rows, rows * k
    if kind == TaskKind.SLOT_SUM:
        return rows * (2 * k + 1 + shape.num_shared), rows
    raise ValueError(f"token_task_bytes: {kind.name} is not a token-side task of a fused kernel")


def _epilogue_task_ns(shape: MoEShape, gpu: GpuParams, row_tiles: np.ndarray, num_sms: int) -> np.ndarray:
    """Epilogue tiles of EPILOGUE_ROWS tokens, num_sms of them at once: each reads K slot rows (+ the
    shared row) and writes one row per token; every byte once from HBM at the token sums' rate
    (gpu.token_kernel_ns), the GPU's rate shared by num_sms CTAs."""
    row_bytes = shape.hidden * ELEM_BYTES
    rows = _tile_tokens(shape, row_tiles)
    reads = rows * (shape.top_k + shape.num_shared) * row_bytes
    return gpu.token_kernel_ns("gather_sum", reads, rows * row_bytes) * num_sms


def epilogue_kernel_ns(shape: MoEShape, gpu: GpuParams, num_sms: int) -> float:
    """The weighted sum (or slot sum) as one launch's work: its tiles round robin over num_sms CTAs
    (as in a plan's epilogue stage), the busiest CTA's time; no launch cost."""
    tiles = np.arange(-(-shape.num_tokens // EPILOGUE_ROWS))
    return float(np.bincount(tiles % num_sms, _epilogue_task_ns(shape, gpu, tiles, num_sms)).max())


# Token kernels outside every plan (cuda/token.cuh): (traffic, rows read, rows written), rows in
# units of N H elements ("K": N K rows), at GpuParams.token_kernel_ns's rate for that traffic
# (None: the recorded kernel's, GpuParams.scale_traffic).
SCALE_TO_SLOTS = (None, 1, "K")  # backward, first: reads dout, writes its K scaled slot rows
TOPK_WEIGHT_GRAD = ("stream", "K+1", 0)  # backward, last: reads dout and the K slot rows


def token_bytes(shape: MoEShape, rows) -> float:
    """Bytes of `rows` (0, 1, "K", "K+1") x N token rows of H elements."""
    factor = {0: 0, 1: 1, "K": shape.top_k, "K+1": shape.top_k + 1}[rows]
    return factor * shape.num_tokens * shape.hidden * ELEM_BYTES


def token_kernel_ns(shape: MoEShape, gpu: GpuParams, kernel: tuple) -> float:
    """The work of a token kernel (traffic, reads, writes) such as SCALE_TO_SLOTS; no launch."""
    traffic, reads, writes = kernel
    return gpu.token_kernel_ns(traffic or gpu.scale_traffic, token_bytes(shape, reads), token_bytes(shape, writes))


def _real_rows_per_minibatch(plan: Plan, load: Load) -> np.ndarray:
    """[num_minibatches, R] real (not padding) received rows inside each minibatch's row range."""
    edges = np.arange(plan.num_minibatches + 1) * plan.minibatch_rows  # [M+1]
    off = load.expert_offsets  # [R, El+1]
    seg_start = off[:, :-1]  # [R, El]
    # real rows below each edge: sum over experts of clip(edge - start, 0, count)
    below = np.clip(edges[:, None, None] - seg_start[None], 0, load.tokens_per_expert[None]).sum(axis=2)  # [M+1, R]
    return np.diff(below, axis=0).astype(np.float64)


def fused_chunk_rows(plan: Plan, load: Load, outgoing: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(real, used) rows [M, C, R] that chunk c of minibatch m's incoming (outgoing: outgoing)
    transfer moves on each rank in the fused kernel, of its C_m = plan.chunks_of(m, outgoing)
    chunks (C = the largest; chunks c >= C_m move nothing): receive rows m MB + c, + C_m, ...
    below the padded end (used) and, of those, the rows inside an expert's real rows (real)."""
    per_mb = np.array([plan.chunks_of(m, outgoing) for m in range(plan.num_minibatches)])
    chunks = per_mb[:, None, None, None]  # [M, 1, 1, 1]
    c = np.arange(per_mb.max())[None, :, None, None]  # [1, C, 1, 1]
    lo = (np.arange(plan.num_minibatches) * plan.minibatch_rows)[:, None, None, None]  # [M, 1, 1, 1]
    hi = lo + plan.minibatch_rows

    def count(a, b):  # rows i in [a, b) with i % C_m == c (none for c >= C_m)
        return np.maximum((np.maximum(a, b) - c - 1) // chunks - (a - c - 1) // chunks, 0) * (c < chunks)

    start = load.expert_offsets[None, None, :, :-1]  # [1, 1, R, El]
    end = start + load.tokens_per_expert[None, None]
    real = count(np.maximum(lo, start), np.minimum(hi, end)).sum(axis=3)  # [M, C, R]
    used = count(lo, np.minimum(hi, load.expert_offsets[None, None, :, -1:]))[..., 0]
    return real, used


def _fused_chunk_ns(plan: Plan, gpu: GpuParams, load: Load, kind: TaskKind, sel: np.ndarray,
                    linked_movers: linked.LinkedMovers | None = None) -> np.ndarray:
    """[n, R] durations of the fused plan's communication tasks `sel` of one kind (module doc);
    with `linked_movers`, their pricing under the link too."""
    row_bytes = plan.shape.hidden * ELEM_BYTES
    gpu.fused_chunk_copy_ns(plan.comm_blocks, 0, row_bytes)  # raises without a copy rate for this plan
    t = plan.tasks
    outgoing = kind == plan.kinds.comm_out
    real, used = fused_chunk_rows(plan, load, outgoing)
    # the incoming transfer (dispatch; backward: reverse-combine) fills every receive row below the
    # padded end (zero rows for padding), the outgoing one (combine; reverse-dispatch) the real ones
    rows = (real if outgoing else used)[t["minibatch"][sel], t["row_tile"][sel]]  # [n, R]
    moved = rows * row_bytes
    local = moved * load.local_fraction[None, :]
    direction = plan.policy[OPERATOR_OF[kind]]
    link = _transfer_ns(gpu, direction, t["col_tile"][sel, None], moved - local, local)  # col_tile: its chunks
    rtt = gpu.rtt_ns * ((direction == "pull") & (moved > local))
    # the mover: a communicating CTA's warps, or a compute CTA's spare warps (comm_blocks 0, or a
    # transfer spread over every CTA: plan.spread_from)
    on_comm = np.broadcast_to(t["block"][sel, None] < plan.comm_blocks, rows.shape)
    copy, fixed = np.zeros(rows.shape), np.zeros(rows.shape)
    for comm, movers in ((True, plan.comm_blocks), (False, 0)):
        mine = on_comm == comm
        if mine.any():
            copy[mine] = gpu.fused_chunk_copy_ns(movers, rows[mine], row_bytes)
            fixed[mine] = gpu.fused_task_ns(movers)
    if linked_movers is not None:  # the real rows pay (a padding row has no peer), spread over the task's warps
        pull, emulated = direction == "pull", linked_movers.link
        pays = real[t["minibatch"][sel], t["row_tile"][sel]] * linked.paying_fraction(emulated, load.local_fraction)
        (warps, batch), (spare_warps, spare_batch) = linked.COMM_CTA_MOVERS, linked.SPARE_MOVERS
        trips = linked.round_trips_ns(emulated, np.ceil(pays / np.where(on_comm, warps, spare_warps)), row_bytes,
                                      np.where(on_comm, batch, spare_batch))
        floor = fixed + np.maximum(copy, _transfer_ns(gpu, direction, t["col_tile"][sel, None], 0.0, moved))
        linked_movers.add(sel, pull, pays * row_bytes, floor, trips if pull else 0.0, fixed)
    return fixed + np.maximum(copy, link) + rtt


def _outside_transfer_ns(plan: Plan, gpu: GpuParams, load: Load, direction: str, rows: np.ndarray,
                         link: LinkModel | None = None) -> np.ndarray:
    """[R] a transfer of `rows` [R] rows run as its own launch on every SM (a fused forward's
    dispatch push or combine pull): its launch, the bytes, a pull's round trip. Under a link
    (sim/linked.py) no other mover of the rank runs: the whole link; a push's flag pays a round trip."""
    moved = rows * (plan.shape.hidden * ELEM_BYTES)
    local = moved * load.local_fraction
    if link is not None:  # (the transfer pulled after a kernel is the outgoing one: of the N K slots)
        pull = direction == "pull"
        pays = moved * linked.paying_fraction(link, load.local_fraction)
        trips = _standalone_round_trips(plan, gpu, load, link, incoming=False) if pull else 0.0
        return gpu.launch_ns + linked.standalone_ns(link, pays, gpu.row_copy_ns(moved), trips,
                                                    0.0 if pull else link.latency_ns)
    ns = _transfer_ns(gpu, direction, plan.num_sms, (moved - local) / plan.num_sms, local / plan.num_sms)
    return gpu.launch_ns + ns + (gpu.rtt_ns if direction == "pull" else 0.0)


def _standalone_round_trips(plan: Plan, gpu: GpuParams, load: Load, link: LinkModel, incoming: bool) -> np.ndarray:
    """[R] a standalone pull kernel's least time under the link: its busiest warp's paying rows, of
    the receive rows (incoming: dispatch, reverse-combine) or of the N K slots (outgoing)."""
    shape = plan.shape
    nk = shape.num_tokens * shape.top_k
    warps = linked.standalone_warps(max(nk, plan.capacity_rows), gpu.num_sms)
    if incoming:
        rows = linked.busiest_warp_rows(load.expert_offsets[:, :-1], load.tokens_per_expert, warps)
    else:
        rows = np.full(load.num_ranks, -(-nk // warps))
    rows = np.ceil(rows * linked.paying_fraction(link, load.local_fraction))
    return linked.round_trips_ns(link, rows, shape.hidden * ELEM_BYTES, linked.STANDALONE_BATCH)


def _flag_wait_ns(gpu: GpuParams, t: np.ndarray, signal_ns: float = 0.0) -> np.ndarray:
    """[R] after t [R]: raise a flag (a kernel, and signal_ns: a link's round trip), then wait for
    every peer's (a kernel: the slowest rank's flag plus the receiver's signal wait)."""
    flag = t + gpu.launch_ns + signal_ns
    return np.maximum(flag + gpu.launch_ns, flag.max() + gpu.signal_wait_ns(len(t)))


def _fused_before_ns(plan: Plan, gpu: GpuParams, load: Load, link: LinkModel | None = None) -> np.ndarray:
    """[R] what a fused pass runs before its kernel. A backward first runs begin_round and, unless
    its kernel runs the scale (plan.scale), scale_to_slots (dy_slots = w * dout: SCALE_TO_SLOTS).
    Then the counters' memset (a kernel
    boundary) and the incoming transfer's part outside: pushed outside (dispatch / reverse-combine
    push), the push and the wait for every peer's rows; pulled inside, the backward publishes its
    dy_slots first (a flag, the wait for every peer's; the forward's pull follows the schedule,
    whose routing flags published its rows: nothing). A backward whose kernel runs the scale
    (plan.scale) does neither: its SCALE tasks write dy_slots and raise the flag inside."""
    before = np.zeros(load.num_ranks)
    if plan.pass_ == "bwd":  # begin_round, and the scale unless the kernel runs it (plan.scale)
        before += gpu.launch_ns
        if not plan.scale:
            before += gpu.launch_ns + token_kernel_ns(plan.shape, gpu, SCALE_TO_SLOTS)
    before += gpu.launch_ns
    if not inside_kernel(plan.pass_, plan.policy)[0]:
        pushed = before + _outside_transfer_ns(plan, gpu, load, "push", load.tokens_per_expert.sum(axis=1), link)
        before = np.maximum(pushed + gpu.launch_ns, pushed.max() + gpu.signal_wait_ns(plan.num_ranks))
    elif plan.pass_ == "bwd" and not plan.scale:
        before = _flag_wait_ns(gpu, before, _signal_ns(link))
    return before


def _fused_pass_end_ns(plan: Plan, gpu: GpuParams, load: Load, kernel_end: np.ndarray,
                       link: LinkModel | None = None) -> np.ndarray:
    """[R] a fused pass's end after its kernel ends (kernel_end [R]): raise the flag of the
    outgoing transfer (combine; reverse-dispatch), wait for every peer's (push inside: their rows
    are in my slots; pull: their results are ready, then pull my N K slot rows), then the epilogue
    kernel (cuda/token.cuh, its own launch: the weighted sum; backward: the slot sum, then
    topk_weight_grad, TOPK_WEIGHT_GRAD). A backward with token_grads ran all of that inside the
    kernel: it ends with it."""
    if plan.token_grads:
        return kernel_end
    done = _flag_wait_ns(gpu, kernel_end, _signal_ns(link))
    if not inside_kernel(plan.pass_, plan.policy)[1]:
        slots = np.full(load.num_ranks, plan.shape.num_tokens * plan.shape.top_k)
        done = done + _outside_transfer_ns(plan, gpu, load, "pull", slots, link)
    done = done + gpu.launch_ns + epilogue_kernel_ns(plan.shape, gpu, plan.num_sms)
    if plan.pass_ == "bwd":
        done = done + gpu.launch_ns + token_kernel_ns(plan.shape, gpu, TOPK_WEIGHT_GRAD)
    return done


def _signal_ns(link: LinkModel | None) -> float:
    """What a flag costs its signaller beyond a launch: a link's round trip (none without one)."""
    return 0.0 if link is None else float(link.latency_ns)


def _counter_delays(plan: Plan, gpu: GpuParams) -> np.ndarray:
    """[num_counters] extra ns from a counter's last signal to its waiters seeing it."""
    c = plan.counters
    delay = np.where(c["remote"], gpu.signal_wait_ns(plan.num_ranks), 0.0)
    return delay + np.where(c["kind"] == int(CounterKind.STAGE_DONE), gpu.launch_ns, 0.0)


def simulate(plan: Plan, gpu: GpuParams, load: Load | None = None, seed: int = 0,
             link: LinkModel | None = None) -> SimResult:
    """Simulate one pass of `plan` on every rank; load defaults to uniform random routing, placed
    with the plan's padding (`plan_align`). link: the emulated link (mok_proto.link.LinkModel) the
    plan's transfers pay, every row in this GPU's memory (bench_layer's emulation: sim/linked.py;
    a sequential or fused plan, whose kernels this project runs).
    Raises plan.PlanError for a plan the megakernel could not run (e.g. a counter target below
    its signals would let waiters start early and give a too short time); the proof is kept
    per plan object, so a second simulation of the same plan does not check again."""
    plan.check()
    if plan.num_sms > gpu.num_sms:
        raise ValueError(f"plan has {plan.num_sms} CTAs but {gpu.name} has {gpu.num_sms} SMs")
    fused = is_fused(plan)
    if link is not None and not (fused or plan.strategy == "sequential"):
        raise ValueError(f"the emulated link is priced as this project's kernels move rows: a sequential or fused "
                         f"plan, got {plan.strategy}")
    align = plan_align(plan)
    load = load or routed_load(plan.shape, plan.num_ranks, seed, align=align)
    if load.expert_offsets[:, -1].max() > plan.capacity_rows:
        raise ValueError(f"a rank receives {load.expert_offsets[:, -1].max()} padded rows, more than the "
                         f"plan's capacity_rows={plan.capacity_rows}")
    if np.any(load.expert_offsets % align):
        raise ValueError(f"the load's expert segments must be padded to {align} rows for a {plan.strategy} plan")
    t = plan.tasks
    r = load.num_ranks
    movers = None if link is None else linked.LinkedMovers(link, len(t), r)
    dur = _durations(plan, gpu, load, movers)
    delay = _counter_delays(plan, gpu)
    if link is not None and fused:  # a remote counter's flags: its last signaller's round trip first (its own
        # CTA goes on after it too: not modelled; a fused plan's remote counters have waiters in the kernel)
        delay = delay + np.where(plan.counters["remote"], _signal_ns(link), 0.0)
    # Every CTA starts after one kernel launch: the persistent kernel's (fixed_split, fused) or the
    # first stage's (sequential); each later sequential stage pays one more launch through its
    # STAGE_DONE counter (_counter_delays). So both strategies pay the launches they would issue.
    kernel_start = (_fused_before_ns(plan, gpu, load, link) if fused else np.zeros(r)) + gpu.launch_ns
    stream = streams(plan, fused)
    if "_sim_steps" not in plan.__dict__:  # a plan's steps depend on it alone: kept with it, as its proof is
        plan.__dict__["_sim_steps"] = StepGraph(plan, stream, fused)
    graph = plan.__dict__["_sim_steps"]
    block = np.repeat(t["block"][:, None], r, axis=1).astype(np.int32)
    # Ranks that run alike (bench_layer's emulation: every rank moves rank 0's rows) are simulated
    # as rank 0 alone: every rank's times are its times.
    alike = r == 1 or _alike(dur, kernel_start, movers)
    if movers is None and not (alike and graph.chained):  # any order that respects the dependencies
        # gives the same times: level by level
        start, end, cluster = graph.times(dur[:, :1] if alike else dur, kernel_start[:1] if alike else kernel_start,
                                          delay, plan.counters["remote"])
    elif alike:
        start, end, cluster = graph.one_rank_times(dur[:, 0], kernel_start[0], delay, movers and movers.one_rank(),
                                                   movers and movers.moves[graph.first].tolist())
        start, end = start[:, None], end[:, None]
    else:
        start, end = _linked_times(plan, graph, stream, dur, kernel_start, delay, movers, block)
        cluster = {}
    for j, k in cluster.items():  # a claimed pair's CTAs: the cluster it ran on, per rank
        block[graph.first[j]], block[graph.second[j]] = graph.even_ctas[k], graph.even_ctas[k] + 1
    if start.shape[1] < r:
        start, end = np.repeat(start, r, axis=1), np.repeat(end, r, axis=1)
    kernel_end = end.max(axis=0) if len(t) else kernel_start
    pass_end = _fused_pass_end_ns(plan, gpu, load, kernel_end, link) if fused else kernel_end
    return SimResult(plan, gpu, start, end, load, pass_end, block)


def _alike(dur: np.ndarray, kernel_start: np.ndarray, movers: linked.LinkedMovers | None) -> bool:
    """Whether every rank runs the plan alike: the same durations, kernel start and transfers."""
    same = lambda a: bool((a == a[:, :1]).all())  # noqa: E731
    return bool((kernel_start == kernel_start[0]).all()) and same(dur) and (
        movers is None or all(same(a) for a in (movers.pays, movers.floor, movers.round_trips, movers.fixed)))


def _linked_times(plan: Plan, graph: StepGraph, stream: np.ndarray, dur: np.ndarray, kernel_start: np.ndarray,
                  delay: np.ndarray, movers: linked.LinkedMovers, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) [num_tasks, R] of every task under a link (`simulate`): the steps visited in the
    order of their start on rank 0 (StepGraph.by_start), as the link's clocks are reserved in the
    order the movers start; block [num_tasks, R]: a claimed pair's CTAs set per rank."""
    t = plan.tasks
    r = len(kernel_start)
    num_c = len(plan.counters)
    remote = plan.counters["remote"].tolist()
    last = np.zeros((num_c, r))
    ready: list = [None] * num_c
    free = np.repeat(kernel_start[None, :], 2 * plan.num_sms, axis=0)  # [streams, R]
    start, end = np.empty((len(t), r)), np.empty((len(t), r))
    waits = [[w for w in ws if w >= 0] for ws in t["wait_counter"].tolist()]
    sigs = [[s for s in ss if s >= 0] for ss in t["signal_counter"].tolist()]
    steps = graph.steps
    stream = stream.tolist()
    # A claimed pair (the pool, stream 2 num_sms) runs on the cluster free first, per rank: the
    # kernel's clusters claim the next pair as each finishes (cuda/fused.cuh), the pool in order.
    even_ctas = graph.even_ctas
    # per step (one task or a tile pair): its duration, the longer task's, and whether it is claimed
    first, second = graph.first, graph.second
    step_dur = np.maximum(dur[first], dur[second])
    pooled_steps = np.zeros(len(steps), bool)
    pooled_steps[graph.pool] = True
    pooled_steps = pooled_steps.tolist()
    linked_steps = movers.moves[first].tolist()
    maximum = np.maximum

    def start_of(j):
        """(start [R], the cluster [R] of a claimed pair or None) of step j, every step it depends on run."""
        step, cta = steps[j], None
        if pooled_steps[j]:
            cta = even_ctas[np.argmin(free[2 * even_ctas], axis=0)]  # [R] the cluster each rank's pair goes to
            s = free[2 * cta, np.arange(r)]
        else:  # (s may be a view of the stream's row: it is stored below before that row changes)
            s = free[stream[step[0]]]
            for i in step[1:]:
                s = maximum(s, free[stream[i]])
        for i in step:
            for w in waits[i]:
                if ready[w] is None:  # every signaller ran already (topological order)
                    ready[w] = (np.full(r, last[w].max()) if remote[w] else last[w]) + delay[w]
                s = maximum(s, ready[w])
        return s, cta

    for j, s, cta in graph.by_start(start_of):
        step = steps[j]
        e = s + (movers.duration(step[0], s) if linked_steps[j] else step_dur[j])
        for half, i in enumerate(step):  # a tile pair: both CTAs in lockstep
            start[i], end[i] = s, e
            if cta is not None:
                block[i] = cta + half
                free[2 * (cta + half), np.arange(r)] = e
            else:
                free[stream[i]] = e
            for c in sigs[i]:
                row = last[c]
                maximum(row, e, out=row)
    return start, end
