"""One EP=64 rank's share of a paper shape on one GPU: 2 virtual ranks with El = E/64 experts each
(E' = 2 El), N = 2048 tokens per rank, uniform random top-K routing. Rank 0 then receives the
~N*K rows an EP=64 rank receives, for the same El experts, and computes the same FLOPs. Rank 1
stands for the peers: one full round of both ranks stages everything rank 0 reads from peers,
then rank 0's flags from rank 1 are raised to the largest epoch, and only rank 0's kernels run
(staged_layer). Also the device schedule of one rank at the real EP=64 (schedule_at_ep64)."""

from __future__ import annotations

import numpy as np

from mok_proto.bench.timing import summarize, time_stages
from mok_proto.config import MoEShape, RunConfig, ep_share, get_shape

EP = 64
EMULATION = "2 virtual ranks, rank 0 timed"  # the rows' `emulation` field


def emulated_shape(name: str) -> MoEShape:
    """The paper shape with E' = 2 E/64 experts: 2 ranks, each owning the E/64 of an EP=64 rank."""
    return ep_share(name, EP)


def make_inputs(shape: MoEShape, seed: int = 0):
    """Uniform random top-K routing (distinct experts) and weights, as float32 NumPy: x [2,N,H],
    topk_idx/topk_w [2,N,K], dout [2,N,H], weights of both ranks, the shared expert."""
    rng = np.random.default_rng(seed)
    n, h, i, e, k = shape.num_tokens, shape.hidden, shape.ffn, shape.num_experts, shape.top_k
    topk = np.argsort(rng.random((2 * n, e)), axis=1)[:, :k].astype(np.int32)
    w = rng.random((2 * n, k)).astype(np.float32)
    w /= w.sum(axis=1, keepdims=True)
    normal = lambda *s, scale=1.0: (rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
    weights = {"w_gate": normal(e, h, i, scale=h ** -0.5), "w_up": normal(e, h, i, scale=h ** -0.5),
               "w_down": normal(e, i, h, scale=i ** -0.5), "shared_gate": normal(h, i, scale=h ** -0.5),
               "shared_up": normal(h, i, scale=h ** -0.5), "shared_down": normal(i, h, scale=i ** -0.5)}
    return dict(x=normal(2, n, h), topk_idx=topk.reshape(2, n, k), topk_w=w.reshape(2, n, k), dout=normal(2, n, h),
                weights=weights)


def staged_layer(shape, data, policy=None, link=None):
    """(heap, layer): our layer on 2 virtual ranks after one full round of both, then driving
    rank 0 only, every flag it waits for from rank 1 raised (see the module doc). policy: the
    transfers' directions (default MoK's); link: the emulated link its transfers pay
    (mok_proto.link.LinkModel with every_row: rank 1 stands for remote peers; None: none)."""
    from mok_proto.layer.gpu import GpuMoELayer
    from mok_proto.symm.virtual import VirtualWorld

    el = shape.num_experts // 2
    heap = VirtualWorld(2)
    layer = GpuMoELayer(heap, RunConfig(shape, 2, timeout_s=30, link=link),
                        capacity=int(1.15 * shape.num_tokens * shape.top_k), name=shape.name)
    if policy is not None:
        layer.policy = dict(policy)
    for r in range(2):
        local = {key: v[r * el:(r + 1) * el] for key, v in data["weights"].items() if key.startswith("w_")}
        local.update({key: v for key, v in data["weights"].items() if key.startswith("shared_")})
        layer.set_weights(r, local)
        layer.set_inputs(r, data["x"][r], data["topk_idx"][r], data["topk_w"][r])
        layer.set_dout(r, data["dout"][r])
    layer.enqueue_forward()  # stage the peer (and compile, upload descriptors)
    layer.enqueue_backward()
    layer.check()
    layer.launch_only([0])
    # NOTE: rank 1 no longer runs: every flag rank 0 waits for from rank 1 is raised to the top
    # epoch, so its waits pass at once and it reads the staged rows.
    layer.bufs["flags"].instance(0)[:, 1] = np.uint64(2 ** 63)
    for _ in range(2):
        layer.enqueue_forward()
        layer.enqueue_backward()
    layer.check()
    return heap, layer


def result_bytes(layer, name) -> bytes:
    if name == "fwd":
        return layer.output(0).get().tobytes()
    return b"".join(v.get().tobytes() for _, v in sorted(layer.grads(0).items()))


def schedule_at_ep64(name: str, iters: int, warmup: int):
    """The device schedule (count, scan, place) of one rank at EP=64 with the paper's shape and
    N=2048 tokens per rank, timed alone as CUDA-graph replays: rank 0 of 64 virtual ranks, the
    all-gathered routing staged in its buffer and its peers' routing flags raised. Returns (stats,
    whether the placement equals mok_proto/schedule.py's bit for bit)."""
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
    topk_all = np.argsort(rng.random((EP * n, e)), axis=1)[:, :k].astype(np.int32).reshape(EP, n, k)
    heap = VirtualWorld(EP)
    rnd = GpuCommRound(heap, RunConfig(shape, EP, timeout_s=30), capacity=int(1.25 * n * k), ranks=[0],
                       name=f"{name}-schedule")
    rnd.bufs["routing"].instance(0)[...] = cupy.asarray(topk_all.reshape(EP, n * k))
    rnd.bufs["flags"].instance(0)[abi.FLAG_KIND["kFlagRouting"], :] = np.uint64(2 ** 63)

    def schedule():
        kc.begin_round(rnd.params, rnd.launch)
        kc.build_schedule(rnd.params, rnd.launch, EP, e // EP, n, k)

    schedule()
    rnd.check()
    want = build_pull_schedule(topk_all, e, 0)
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
