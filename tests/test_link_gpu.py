"""The emulated link on the GPU (virtual ranks): the round and the layer (sequential and fused)
bitwise equal to the plain ones, no fused chunk done before its budget, and the link's measured
rate within 5% of its setting on a long transfer."""

import numpy as np
import pytest

from mok_proto.config import DIRECTIONS, MoEShape, RunConfig, get_shape
from mok_proto.link import LinkModel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cupy():
    return pytest.importorskip("cupy", reason="cupy is not importable; GPU tests need an NVIDIA GPU and cupy-cuda13x")


def _round_outputs(link, num_ranks, shape, policy):
    from mok_proto.layer.gpu_comm import GpuCommRound
    from mok_proto.problem import make_routed_tokens
    from mok_proto.symm.virtual import VirtualWorld

    data = make_routed_tokens(shape, num_ranks, seed=3)
    with VirtualWorld(num_ranks) as heap:
        rnd = GpuCommRound(heap, RunConfig(shape, num_ranks, timeout_s=20, link=link), name="link")
        for rank in rnd.ranks:
            rnd.set_inputs(rank, data.x[rank], data.topk_idx[rank], data.topk_weights[rank], data.scale)
        rnd.policy.update(policy)
        rnd.poison()
        rnd.enqueue()
        rnd.check()
        outs = [rnd.output(rank).get() for rank in rnd.ranks]
        rnd.close()
    return outs


@pytest.mark.parametrize("dispatch", DIRECTIONS)
@pytest.mark.parametrize("combine", DIRECTIONS)
def test_round_with_a_link_is_bitwise_the_plain_round(cupy, dispatch, combine):
    shape = MoEShape("link", hidden=1024, ffn=8, num_experts=16, top_k=4, num_tokens=300)
    policy = dict(dispatch=dispatch, combine=combine)
    plain = _round_outputs(None, 4, shape, policy)
    for link in (LinkModel(50, latency_us=2.0), LinkModel(50, latency_us=2.0, every_row=True)):
        assert all(np.array_equal(a, b) for a, b in zip(plain, _round_outputs(link, 4, shape, policy)))


def _layer_results(link, fused: bool, trace: bool = False):
    """Forward + backward of the tile shape on 2 virtual ranks: (digest bytes per rank, timeline or None)."""
    from mok_proto.layer.gpu import GpuMoELayer
    from mok_proto.problem import make_problem
    from mok_proto.symm.virtual import VirtualWorld

    shape = get_shape("tile")
    prob = make_problem(shape, 2, seed=5)
    with VirtualWorld(2) as heap:
        layer = GpuMoELayer(heap, RunConfig(shape, 2, timeout_s=20, link=link), name="link")
        for r in layer.ranks:
            layer.set_weights(r, prob.local_weights(r))
            layer.set_inputs(r, prob.x[r], prob.topk_idx[r], prob.topk_weights[r])
            layer.set_dout(r, prob.dout[r])
        if fused:
            layer.set_forward_plan(layer.fused_forward_plan())
            layer.set_backward_plan(layer.fused_backward_plan())
        layer.trace = trace
        layer.enqueue_forward()
        layer.enqueue_backward()
        layer.check()
        blobs = [layer.output(r).get().tobytes() + b"".join(v.get().tobytes() for _, v in sorted(layer.grads(r).items()))
                 for r in layer.ranks]
        timeline = (layer.forward_timeline(0), layer.fused.plan) if trace else None
        layer.close()
    return blobs, timeline


def test_layer_with_a_link_is_bitwise_the_plain_layer(cupy):
    plain, _ = _layer_results(None, fused=False)
    link = LinkModel(100, latency_us=2.0)
    assert _layer_results(link, fused=False)[0] == plain
    assert _layer_results(link, fused=True)[0] == plain
    assert _layer_results(LinkModel(100, every_row=True), fused=True)[0] == plain


def test_no_fused_chunk_ends_before_its_budget(cupy):
    from mok_proto.plan import SEGMENT_ROWS, TaskKind
    from mok_proto.problem import make_problem
    from mok_proto.schedule import build_pull_schedule

    link = LinkModel(0.25, latency_us=1.0, every_row=True)  # slow, every row pays: budgets far above copy times
    _, (rows, plan) = _layer_results(link, fused=True, trace=True)
    prob = make_problem(plan.shape, 2, seed=5)
    # rank 0's receive rows as the layer places them: each expert's segment padded to SEGMENT_ROWS
    src_rank = build_pull_schedule(prob.topk_idx, plan.shape.num_experts, 0, align=SEGMENT_ROWS).src_rank
    row_bytes = 2 * plan.shape.hidden
    chunks = rows[rows["kind"] == int(TaskKind.DISPATCH)]
    assert len(chunks)
    granularity_ns = 2000  # %globaltimer's update period, at most
    for task in chunks:  # chunk c of minibatch m: receive rows m MB + c, + C, ... of the minibatch
        m, c, stride = int(task["minibatch"]), int(task["row_tile"]), int(task["col_tile"])
        idx = np.arange(m * plan.minibatch_rows + c, min((m + 1) * plan.minibatch_rows, len(src_rank)), stride)
        budget = link.transfer_ns(int((src_rank[idx] >= 0).sum()) * row_bytes)
        assert task["end_ns"] - task["start_ns"] >= budget - granularity_ns, (task, budget)
    # one budget for every chunk: from the first chunk's start to the last's end, at most the link's rate
    span = chunks["end_ns"].max() - chunks["start_ns"].min()
    assert span >= link.transfer_ns(int((src_rank >= 0).sum()) * row_bytes) - granularity_ns


@pytest.mark.gpu_alone
def test_long_transfer_runs_at_the_link_rate(cupy):
    from mok_proto.bench import summarize, time_stages
    from mok_proto.layer.gpu_comm import GpuCommRound
    from mok_proto.problem import make_routed_tokens
    from mok_proto.symm.virtual import VirtualWorld

    shape = MoEShape("long", hidden=4096, ffn=8, num_experts=16, top_k=8, num_tokens=4096)
    link = LinkModel(100, latency_us=0.0, every_row=True)
    data = make_routed_tokens(shape, 2, seed=0)
    with VirtualWorld(2) as heap:
        rnd = GpuCommRound(heap, RunConfig(shape, 2, timeout_s=30, link=link), name="long")
        for rank in rnd.ranks:
            rnd.set_inputs(rank, data.x[rank], data.topk_idx[rank], data.topk_weights[rank], data.scale)
        rnd.policy.update(dispatch="push", combine="push")
        samples = time_stages(rnd.enqueue, 5, 2)
        rnd.check()
        # each rank pushes its N*K slot rows (every row pays): the slower rank's bytes decide
        placed = [int((rnd.bufs["recv_row"].instance(r).get() >= 0).sum()) for r in rnd.ranks]
        rnd.close()
    ms = summarize(samples["dispatch"])["median_ms"]
    gbps = max(placed) * 4 * shape.hidden / (ms * 1e-3) / 1e9
    assert abs(gbps / link.gbps - 1) <= 0.05, (gbps, ms, placed)
