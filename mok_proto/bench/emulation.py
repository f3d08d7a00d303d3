"""One EP=64 rank's share of a paper shape on one GPU: 2 virtual ranks with El = E/64 experts each
(E' = 2 El), N = 2048 tokens per rank, uniform random top-K routing. Rank 0 then receives the
~N*K rows an EP=64 rank receives, for the same El experts, and computes the same FLOPs. Rank 1
stands for the peers: one full round of both ranks stages everything rank 0 reads from peers,
then rank 0's flags from rank 1 are raised to the largest epoch, and only rank 0's kernels run
(staged_layer). Also the device schedule of one rank at the real EP=64 (schedule_at_ep64).

Under a skewed routing (mok_proto.routing, not uniform) rank 0 receives what rank 0 of the real
EP=64 layout drawn under it receives, often more rows than one peer's N tokens can send (a token
sends at most min(K, El) rows to one rank): W = 1 + P virtual ranks, E' = W El (emulated_topk).
Rank 0's tokens are the real rank 0's (their choices of rank 0's experts kept, the others moved
to peers' experts); the rows the other 63 ranks send rank 0 are packed onto the P peers' tokens,
each token's other choices on peers' experts. Every peer holds the same expert weights."""

from __future__ import annotations

import dataclasses

import numpy as np

from mok_proto.bench.timing import summarize, time_stages
from mok_proto.config import MoEShape, RunConfig, ep_share, get_shape
from mok_proto.plan import SEGMENT_ROWS
from mok_proto.routing import UNIFORM, RoutingSpec
from mok_proto.routing import topk as routed_topk

EP = 64
EMULATION = "2 virtual ranks, rank 0 timed"  # the rows' `emulation` field under uniform routing
UNIFORM_CAPACITY = 1.15  # receive rows of the uniform emulation's layer, x N K


def emulated_shape(name: str) -> MoEShape:
    """The paper shape with E' = 2 E/64 experts: 2 ranks, each owning the E/64 of an EP=64 rank."""
    return ep_share(name, EP)


def emulated_topk(paper: MoEShape, routing: RoutingSpec, seed: int = 0, ep: int = EP) -> np.ndarray:
    """[W, N, K] int32 routing of W = 1 + P virtual ranks over E' = W El experts (El = E/ep) whose
    rank 0 receives, per local expert, exactly the rows rank 0 of the real `ep`-rank layout of
    `paper` (its E experts) drawn under `routing` (from default_rng(seed)) receives. P: the fewest
    peers whose N tokens carry the rows the other ep - 1 ranks send rank 0 (at most min(K, El) per
    token, at most one of an expert per token) and whose experts can take a token's K choices
    (P El >= K). Rank 0's tokens are the real rank 0's: their choices of its experts kept, the
    others uniform over the peers' experts (a token's choices stay distinct). The peers' tokens:
    those rows dealt round-robin over a random order of the P N tokens (expert by expert, first in
    each token's choices), every other choice uniform over the peers' experts."""
    n, k, e = paper.num_tokens, paper.top_k, paper.num_experts
    el = e // ep
    rng = np.random.default_rng(seed)
    layout = routed_topk(routing, ep, n, e, k, rng)
    others = layout[1:][layout[1:] < el]
    counts = np.bincount(others, minlength=el)  # [El] rows from the other ranks
    peers = max(1, -(-k // el), -(-int(counts.sum()) // (n * min(k, el))), -(-int(counts.max()) // n))
    pool = peers * n  # the peers' tokens

    def on_peers(num_rows):  # [num_rows, K] distinct experts of the peers, uniformly
        return (el + np.argsort(rng.random((num_rows, peers * el)), axis=1)[:, :k]).astype(np.int32)

    mine = layout[0].copy()
    moved = mine >= el
    mine[moved] = on_peers(n)[moved]
    carried = np.full((pool, k), -1, np.int32)
    at = np.arange(len(others))
    carried[rng.permutation(pool)[at % pool], at // pool] = np.repeat(np.arange(el, dtype=np.int32), counts)
    theirs = on_peers(pool)
    theirs[carried >= 0] = carried[carried >= 0]
    return np.concatenate([mine[None], theirs.reshape(peers, n, k)])


def emulated_inputs(name: str, routing: RoutingSpec = UNIFORM, seed: int = 0) -> tuple[MoEShape, dict]:
    """(shape, data) of paper shape `name`'s emulation under `routing`: uniform, emulated_shape and
    make_inputs (2 virtual ranks); else W virtual ranks routed by emulated_topk, E' = W El."""
    shape = emulated_shape(name)
    if routing.is_uniform:
        return shape, make_inputs(shape, seed)
    topk = emulated_topk(get_shape(name), routing, seed)
    shape = dataclasses.replace(shape, num_experts=len(topk) * (shape.num_experts // 2))
    return shape, make_inputs(shape, seed, topk, routing)


def make_inputs(shape: MoEShape, seed: int = 0, topk: np.ndarray | None = None, routing: RoutingSpec = UNIFORM):
    """Routing and weights, as float32 NumPy: x [W,N,H], topk_idx/topk_w [W,N,K], dout [W,N,H], the
    routed experts' weights of rank 0 then of every peer (2 El experts: each peer holds the second
    El), the shared expert; `routing` (the spec). topk [W,N,K] (None: uniform random top-K
    routing, distinct experts, on W = 2 ranks) over shape's E' = W El experts."""
    rng = np.random.default_rng(seed)
    n, h, i, e, k = shape.num_tokens, shape.hidden, shape.ffn, shape.num_experts, shape.top_k
    if topk is None:
        topk = np.argsort(rng.random((2 * n, e)), axis=1)[:, :k].astype(np.int32).reshape(2, n, k)
    num = len(topk)
    w = rng.random((num * n, k)).astype(np.float32)
    w /= w.sum(axis=1, keepdims=True)
    normal = lambda *s, scale=1.0: (rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
    routed = 2 * (e // num)
    weights = {"w_gate": normal(routed, h, i, scale=h ** -0.5), "w_up": normal(routed, h, i, scale=h ** -0.5),
               "w_down": normal(routed, i, h, scale=i ** -0.5), "shared_gate": normal(h, i, scale=h ** -0.5),
               "shared_up": normal(h, i, scale=h ** -0.5), "shared_down": normal(i, h, scale=i ** -0.5)}
    return dict(x=normal(num, n, h), topk_idx=topk, topk_w=w.reshape(num, n, k), dout=normal(num, n, h),
                weights=weights, routing=routing)


def local_weights(data: dict, rank: int) -> dict:
    """Rank `rank`'s weights in make_inputs' data: its El routed experts (rank 0's, or the block
    every peer holds) and the shared expert."""
    el = len(data["weights"]["w_gate"]) // 2
    block = slice(0, el) if rank == 0 else slice(el, 2 * el)
    return {key: v[block] if key.startswith("w_") else v for key, v in data["weights"].items()}


def row_fields(data: dict) -> dict:
    """What every row of this emulation records: `emulation` (its virtual ranks), `routing` (the
    spec's text), `received_rows` (rank 0's receive rows, unpadded)."""
    num = len(data["topk_idx"])
    el = len(data["weights"]["w_gate"]) // 2
    label = EMULATION if num == 2 else f"{num} virtual ranks, rank 0 timed"
    return {"emulation": label, "routing": str(data["routing"]), "received_rows": int((data["topk_idx"] < el).sum())}


def staged_layer(shape, data, policy=None, link=None, macrobatch_rows=None, precision="bf16", dispatch_dtype="bf16",
                 wgrad_precision=None):
    """(heap, layer): our layer on the W virtual ranks of `data` (make_inputs) after one full round
    of all, then driving rank 0 only, every flag it waits for from a peer raised (see the module
    doc). Receive capacity: UNIFORM_CAPACITY x N K under uniform routing, else the routing's exact
    need (layer.gpu.receive_capacity). policy: the transfers' directions (default MoK's); link: the
    emulated link its transfers pay (mok_proto.link.LinkModel with every_row: the peers stand for
    remote ranks; None: none); macrobatch_rows: the layer's ring (None: it holds every row; fewer:
    the sequential passes run in turns, the backward replaying, docs/design.md 3.1); precision,
    dispatch_dtype, wgrad_precision: the layer's RunConfig fields (fp8: the routed experts in FP8)."""
    from mok_proto.layer.gpu import GpuMoELayer, receive_capacity
    from mok_proto.layer.layout import whole_ring
    from mok_proto.symm.virtual import VirtualWorld

    num = len(data["topk_idx"])
    capacity = (int(UNIFORM_CAPACITY * shape.num_tokens * shape.top_k) if data["routing"].is_uniform
                else receive_capacity(data["topk_idx"], shape.num_experts))
    # The ring: every row unless asked (not the layer's free-memory default, which would vary with
    # what else the run holds); a ring larger than every row is one turn.
    whole = whole_ring(capacity)
    macrobatch_rows = whole if macrobatch_rows is None else min(macrobatch_rows, whole)
    heap = VirtualWorld(num)
    run = RunConfig(shape, num, timeout_s=30, link=link, precision=precision, dispatch_dtype=dispatch_dtype,
                    wgrad_precision=wgrad_precision)
    layer = GpuMoELayer(heap, run, capacity=capacity, name=shape.name, macrobatch_rows=macrobatch_rows)
    pushed_in = [op for op in ("dispatch", "rev_combine") if (policy or layer.policy)[op] == "push"]
    if layer.num_turns > 1 and pushed_in:
        # NOTE: the frozen peers push nothing into rank 0's ring after the staging round
        layer.close()
        heap.close()
        raise ValueError(f"a ring of several turns needs {' and '.join(pushed_in)} pulled in this emulation: the "
                         "staged peers push no rows into rank 0's ring once frozen")
    if policy is not None:
        layer.policy = dict(policy)
    for r in range(num):
        layer.set_weights(r, local_weights(data, r))
        layer.set_inputs(r, data["x"][r], data["topk_idx"][r], data["topk_w"][r])
        layer.set_dout(r, data["dout"][r])
    layer.enqueue_forward()  # stage the peers (and compile, upload descriptors)
    layer.enqueue_backward()
    layer.check()
    layer.launch_only([0])
    # NOTE: the peers no longer run: every flag rank 0 waits for from a peer is raised to the top
    # epoch, so its waits pass at once and it reads the staged rows.
    layer.bufs["flags"].instance(0)[:, 1:] = np.uint64(2 ** 63)
    for _ in range(2):
        layer.enqueue_forward()
        layer.enqueue_backward()
    layer.check()
    return heap, layer


def ring_rows(text: str | None, received_rows: int) -> int | None:
    """--macrobatch-rows: None (a ring that holds every row), whole rows ("4096"), or a fraction of
    rank 0's received rows ("0.25x"), rounded down to whole segments (at least one)."""
    if text is None:
        return None
    if text.endswith("x"):
        return max(SEGMENT_ROWS, int(float(text[:-1]) * received_rows) // SEGMENT_ROWS * SEGMENT_ROWS)
    return int(text)


def check_ring_option(text: str) -> None:
    """ValueError (one line) unless `text` is a --macrobatch-rows value ring_rows takes."""
    try:
        value = float(text[:-1]) if text.endswith("x") else int(text)
    except ValueError:
        value = None
    if value is None or not (0 < value <= 1 if text.endswith("x") else value >= SEGMENT_ROWS and value % SEGMENT_ROWS == 0):
        raise ValueError(f"--macrobatch-rows: {text!r} is neither a multiple of {SEGMENT_ROWS} rows nor a fraction "
                         "F x of rank 0's received rows with 0 < F <= 1 (e.g. 0.25x)")


def result_bytes(layer, name) -> bytes:
    if name == "fwd":
        return layer.output(0).get().tobytes()
    return b"".join(v.get().tobytes() for _, v in sorted(layer.grads(0).items()))


def schedule_at_ep64(name: str, iters: int, warmup: int, routing: RoutingSpec = UNIFORM):
    """The device schedule (count, scan, place) of one rank at EP=64 with the paper's shape and
    N=2048 tokens per rank, timed alone as CUDA-graph replays: rank 0 of 64 virtual ranks, the
    all-gathered routing (uniform, or drawn under `routing` with rank 0 timed) staged in its buffer
    and its peers' routing flags raised. Returns (stats, whether the placement equals
    mok_proto/schedule.py's bit for bit)."""
    import cupy

    from mok_proto import abi
    from mok_proto.kernels import comm as kc
    from mok_proto.layer.gpu_comm import GpuCommRound
    from mok_proto.schedule import build_pull_schedule
    from mok_proto.symm.virtual import VirtualWorld

    paper = get_shape(name)
    n, k, e = paper.num_tokens, paper.top_k, paper.num_experts
    shape = MoEShape(f"{name}-schedule", hidden=8, ffn=8, num_experts=e, top_k=k, num_tokens=n)  # rows unused
    rng = np.random.default_rng(1)
    if routing.is_uniform:
        topk_all = np.argsort(rng.random((EP * n, e)), axis=1)[:, :k].astype(np.int32).reshape(EP, n, k)
    else:
        topk_all = routed_topk(routing, EP, n, e, k, rng)
    want = build_pull_schedule(topk_all, e, 0)
    heap = VirtualWorld(EP)
    rnd = GpuCommRound(heap, RunConfig(shape, EP, timeout_s=30), capacity=max(int(1.25 * n * k), want.num_slots),
                       ranks=[0], name=f"{name}-schedule")
    rnd.bufs["routing"].instance(0)[...] = cupy.asarray(topk_all.reshape(EP, n * k))
    rnd.bufs["flags"].instance(0)[abi.FLAG_KIND["kFlagRouting"], :] = np.uint64(2 ** 63)

    def schedule():
        kc.begin_round(rnd.params, rnd.launch)
        kc.build_schedule(rnd.params, rnd.launch, EP, e // EP, n, k)

    schedule()
    rnd.check()
    offsets, counts, src_rank, src_slot = rnd.schedule_arrays(0)
    exact = (np.array_equal(offsets, want.expert_offsets) and np.array_equal(counts, want.tokens_per_expert)
             and np.array_equal(src_rank, want.src_rank) and np.array_equal(src_slot, want.src_slot))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        schedule()
        graph = stream.end_capture()
        samples = time_stages(lambda mark: (mark("run"), graph.launch(stream), mark(None)), iters, warmup)
    rnd.check()
    rnd.close()
    heap.close()
    return summarize(samples["run"]), exact
