"""The GPU layer's one list of GEMM operands (`GpuMoELayer._gemm`, shared by the sequential
launches and the fused kernels' packed params), checked on the CPU with stand-in buffers."""

import pytest

from mok_proto import abi
from mok_proto.kernels import gemm
from mok_proto.layer.gpu import GpuMoELayer

SLOTS = [name for name, _ in abi.GEMM_SLOT.members]


class StandIn:
    """What _gemm reads of a layer: buffers by name (a missing one raises, as the layer's do)."""

    ranks = [0]
    _whole = ("whole_offsets", "whole_counts")

    def __init__(self, has_shared):
        self.has_shared = has_shared

    def _b(self, key, rank):
        if not self.has_shared and (key.startswith("shared_") or key in ("sg", "su", "sh", "sdg", "sdu", "base",
                                                                           "dx_base") or key.startswith("dshared")):
            raise KeyError(key)
        return key

    def _rows(self, rank, turn=0):
        return f"offsets{turn or ''}", f"counts{turn or ''}"


@pytest.mark.parametrize("has_shared", [True, False])
def test_every_slot_of_each_pass(has_shared):
    layer = StandIn(has_shared)
    got = {(p, s): GpuMoELayer._gemm(layer, p, s, 0) for p in ("fwd", "bwd") for s in SLOTS}
    present = {key for key, call in got.items() if call is not None}
    fwd = {"kSlotFirst", "kSlotSecond"} | ({"kSlotSharedFirst", "kSlotSharedSecond"} if has_shared else set())
    bwd = set(SLOTS) if has_shared else {s for s in SLOTS if not s.startswith("kSlotShared")}
    assert present == {("fwd", s) for s in fwd} | {("bwd", s) for s in bwd}
    # the routed GEMMs read the receive-row segments, the shared ones the whole token range
    for (pass_, slot), call in got.items():
        if call is not None:
            args = call[1]
            segments = ("whole_offsets", "whole_counts") if slot.startswith("kSlotShared") else ("offsets", "counts")
            assert tuple(a for a in args if "offsets" in a or "counts" in a) == segments, (pass_, slot, args)


def test_backward_slots_run_the_backward_problems():
    layer = StandIn(True)
    want = {"kSlotSharedFirst": gemm.down_bwd, "kSlotSharedSecond": gemm.gate_up_bwd, "kSlotFirst": gemm.down_bwd,
            "kSlotSecond": gemm.gate_up_bwd, "kSlotSharedDownWgrad": gemm.down_wgrad,
            "kSlotSharedGateUpWgrad": gemm.gate_up_wgrad, "kSlotDownWgrad": gemm.down_wgrad,
            "kSlotGateUpWgrad": gemm.gate_up_wgrad}
    assert {s: GpuMoELayer._gemm(layer, "bwd", s, 0)[0] for s in SLOTS} == want
    # the routed weight gradients read the forward's receive rows and the backward's dy / dg, du
    assert GpuMoELayer._gemm(layer, "bwd", "kSlotGateUpWgrad", 0)[1][:3] == ("recv", "dg", "du")
    assert GpuMoELayer._gemm(layer, "bwd", "kSlotDownWgrad", 0)[1][:2] == ("h", "recv_dy")


def test_a_turn_of_the_ring_runs_on_its_own_segments():
    """Turn t's routed GEMMs read turn t's segments (layer._rows(rank, t)); the shared expert's the
    whole token range, whatever the turn."""
    layer = StandIn(True)
    for pass_ in ("fwd", "bwd"):
        for slot in SLOTS:
            call = GpuMoELayer._gemm(layer, pass_, slot, 0, 2)
            if call is None:
                continue
            want = ("whole_offsets", "whole_counts") if slot.startswith("kSlotShared") else ("offsets2", "counts2")
            assert tuple(a for a in call[1] if "offsets" in a or "counts" in a) == want, (pass_, slot)


def test_fused_plans_of_a_ring_cover_one_turn():
    """With a ring of several turns a fused plan covers one turn's rows, and the backward's, run
    once a turn, leaves dy_slots and the token gradients to launches outside it."""
    from types import SimpleNamespace

    from mok_proto import plan as P
    from mok_proto.config import MOK_POLICY, RunConfig, get_shape

    run = RunConfig(get_shape("tile"), 2)
    layer = SimpleNamespace(run=run, capacity=1536, policy=dict(MOK_POLICY), ranks=[0], num_turns=3, ring_rows=512,
                            fp8=None)
    layer._plan_rows = lambda: GpuMoELayer._plan_rows(layer)
    fwd = GpuMoELayer.fused_forward_plan(layer, P.FusedKnobs(0, 256), num_sms=8)
    bwd = GpuMoELayer.fused_backward_plan(layer, P.FusedKnobs(0, 256), num_sms=8)
    assert fwd.capacity_rows == bwd.capacity_rows == 512 and (bwd.scale, bwd.token_grads) == (False, False)
    one = SimpleNamespace(**{**vars(layer), "num_turns": 1, "ring_rows": 1536})
    one._plan_rows = lambda: GpuMoELayer._plan_rows(one)
    whole = GpuMoELayer.fused_backward_plan(one, P.FusedKnobs(0, 256), num_sms=8)
    assert whole.capacity_rows == 1536 and (whole.scale, whole.token_grads) == (True, True)  # MoK's defaults
    assert whole.routed_wgrads and bwd.routed_wgrads
    # an FP8 layer's: the routed weight gradients and the token gradients after the kernel, unless the
    # knobs say otherwise
    fp8 = SimpleNamespace(**{**vars(one), "fp8": object(), "run": RunConfig(get_shape("tile"), 2, precision="fp8")})
    made = GpuMoELayer.fused_backward_plan(fp8, P.FusedKnobs(0, 256), num_sms=8)
    assert (made.routed_wgrads, made.token_grads, made.scale) == (False, False, True)
    made = GpuMoELayer.fused_backward_plan(fp8, P.FusedKnobs(0, 256, routed_wgrads=True, token_grads=True), num_sms=8)
    assert made.routed_wgrads and made.token_grads


def test_a_fused_plan_refuses_a_changed_policy():
    from mok_proto import plan as P
    from mok_proto.config import MOK_POLICY, get_shape
    from mok_proto.layer.gpu import _directions

    tile = get_shape("tile")
    fwd = P.fused_forward(tile, 2, P.FusedKnobs(0, 256), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    bwd = P.fused_backward(tile, 2, P.FusedKnobs(0, 256), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    assert _directions(fwd, MOK_POLICY) == (True, True) and _directions(bwd, MOK_POLICY) == (True, True)
    # the backward's directions do not concern the forward's plan, and the other way round
    assert _directions(fwd, {**MOK_POLICY, "rev_combine": "push"}) == (True, True)
    with pytest.raises(ValueError, match="set_forward_plan"):
        _directions(fwd, {**MOK_POLICY, "dispatch": "push"})
    with pytest.raises(ValueError, match="set_backward_plan"):
        _directions(bwd, {**MOK_POLICY, "rev_dispatch": "pull"})


def test_fused_plans_take_the_knobs():
    # fused_plan and the layer's plan builders build the plan of the knobs they are given (`assign`,
    # `raster`, `spread_from`), the default knobs (FusedKnobs()) when given none
    from types import SimpleNamespace

    from mok_proto import plan as P
    from mok_proto.config import MOK_POLICY, RunConfig, get_shape
    from mok_proto.layer.gpu import fused_plan

    run = RunConfig(get_shape("tile"), 2)
    layer = SimpleNamespace(run=run, capacity=1024, policy=dict(MOK_POLICY), ranks=[0], num_turns=1, ring_rows=1024,
                            fp8=None)
    layer._plan_rows = lambda: GpuMoELayer._plan_rows(layer)
    for pass_, method in (("fwd", GpuMoELayer.fused_forward_plan), ("bwd", GpuMoELayer.fused_backward_plan)):
        default = fused_plan(pass_, run, 1024, MOK_POLICY, P.FusedKnobs(), 8)
        assert (default.comm_blocks, default.minibatch_rows) == (0, 1024)
        assert method(layer, num_sms=8).tasks.tobytes() == default.tasks.tobytes()
        assert fused_plan(pass_, run, 1024, MOK_POLICY, P.FusedKnobs(0, 256), 8).assign == P.FusedKnobs().resolved(
            pass_, MOK_POLICY).assign
        for assign in P.ASSIGNMENTS:
            knobs = P.FusedKnobs(0, 256, assign=assign)
            made, built = fused_plan(pass_, run, 1024, MOK_POLICY, knobs, 8), method(layer, knobs, num_sms=8)
            assert made.assign == built.assign == assign and (made.pass_, built.pass_) == (pass_, pass_)
            assert made.tasks.tobytes() == built.tasks.tobytes()
        with pytest.raises(ValueError, match="assign must be one of"):
            method(layer, P.FusedKnobs(0, 256, assign="nope"), num_sms=8)
        assert fused_plan(pass_, run, 1024, MOK_POLICY, P.FusedKnobs(0, 256), 8).raster == "row"
        for raster in P.RASTERS:  # and `raster` likewise
            knobs = P.FusedKnobs(0, 256, raster=raster)
            made, built = fused_plan(pass_, run, 1024, MOK_POLICY, knobs, 8), method(layer, knobs, num_sms=8)
            assert made.raster == built.raster == raster and made.tasks.tobytes() == built.tasks.tobytes()
        knobs = P.FusedKnobs(2, 256, spread_from=1)  # and `spread_from`
        made, built = fused_plan(pass_, run, 1024, MOK_POLICY, knobs, 8), method(layer, knobs, num_sms=8)
        assert made.spread_from == built.spread_from == 1 and made.tasks.tobytes() == built.tasks.tobytes()


def test_turns_after_the_first_run_the_plan_without_the_shared_expert(monkeypatch):
    """without_shared keeps the knobs (a claim of more pairs than the routed ones claims them all);
    forward_turns / backward_turns launch the full plan in turn 0 only (the forward's last turn,
    the backward's first) and replay the gate/up of every later turn; the sequential weight
    gradients accumulate after turn 0."""
    from types import SimpleNamespace

    from mok_proto import plan as P
    from mok_proto.config import MOK_POLICY, get_shape
    from mok_proto.layer import gpu_ring
    from mok_proto.layer.gpu import without_shared

    tile = get_shape("tile")
    full = P.fused_forward(tile, 2, P.FusedKnobs(0, 256, claim=9), policy=MOK_POLICY, num_sms=8, capacity_rows=512)
    rest = without_shared(full)
    assert full.claim_pairs == 9 and 0 < rest.claim_pairs < 9 and rest.shape.num_shared == 0
    assert rest.knobs.minibatch_rows == full.knobs.minibatch_rows and rest.capacity_rows == full.capacity_rows

    calls = []
    record = lambda name: lambda *a, **k: calls.append((name, k.get("turn"), k.get("accumulate")))  # noqa: E731
    stub_kc = SimpleNamespace(**{n: record(n) for n in ("turn_segments", "begin_round", "raise_flag", "wait_peers",
                                                        "move_rows")})
    stub_kt = SimpleNamespace(**{n: record(n) for n in ("weighted_sum", "scale_to_slots", "slot_sum",
                                                        "topk_weight_grad")})

    def fused_pass(name):
        return SimpleNamespace(plan=SimpleNamespace(ring_minibatches=2, num_minibatches=2, routed_wgrads=True),
                               launch=lambda p, words, *a, **k: calls.append((name, words, None)))

    fwd, bwd = fused_pass("fwd full"), fused_pass("bwd full")
    fwd.rest, bwd.rest = fused_pass("fwd rest"), fused_pass("bwd rest")
    layer = SimpleNamespace(num_turns=3, turn_params={"fwd": [0, 1, 2], "bwd": [0, 1, 2]}, params_fwd=0,
                            params_bwd=0, params_tok=None, launch=None, error=None, trace=False,
                            run=SimpleNamespace(timeout_s=1), fused=fwd, fused_bwd=bwd, fp8=None,
                            _fused_words=["w0", "w1", "w2"], _fused_bwd_words=["b0", "b1", "b2"],
                            _launch_gemms=lambda pass_, slots, turn=0, accumulate=False:
                            calls.append((f"{pass_} {','.join(slots)}", turn, accumulate)))
    monkeypatch.setattr(gpu_ring, "kc", stub_kc)
    monkeypatch.setattr(gpu_ring, "kt", stub_kt)
    gpu_ring.forward_turns(layer, MOK_POLICY, lambda stage: None, (True, True))
    assert [c[:2] for c in calls if "fwd " in c[0]] == [("fwd rest", "w2"), ("fwd rest", "w1"), ("fwd full", "w0")]
    calls.clear()
    gpu_ring.backward_turns(layer, MOK_POLICY, lambda stage: None, (True, True))
    assert [c[:2] for c in calls if "bwd " in c[0]] == [("bwd full", "b0"), ("bwd rest", "b1"), ("bwd rest", "b2")]
    assert [c[1] for c in calls if c[0] == "fwd kSlotFirst"] == [1, 2]  # the replays' gate/up
    calls.clear()  # a backward that may not follow its forward (a graph of it alone) replays turn 0 too
    gpu_ring.backward_turns(layer, MOK_POLICY, lambda stage: None, (True, True), replay_first=True)
    assert [c[1] for c in calls if c[0] == "fwd kSlotFirst"] == [0, 1, 2]
    assert [c[:2] for c in calls if "bwd " in c[0]] == [("bwd full", "b0"), ("bwd rest", "b1"), ("bwd rest", "b2")]
    calls.clear()  # a plan without the routed weight gradients (FP8): they run after each turn's kernel
    bwd.plan.routed_wgrads = False
    gpu_ring.backward_turns(layer, MOK_POLICY, lambda stage: None, (True, True))
    assert [c[:3] for c in calls if "bwd " in c[0]] == [
        c for t, part in ((0, "full"), (1, "rest"), (2, "rest"))
        for c in [(f"bwd {part}", f"b{t}", None), ("bwd kSlotDownWgrad,kSlotGateUpWgrad", t, t > 0)]]
    calls.clear()
    layer.fused = layer.fused_bwd = None  # sequential: the weight gradients accumulate after turn 0
    gpu_ring.backward_turns(layer, MOK_POLICY, lambda stage: None)
    wgrads = [(turn, acc) for name, turn, acc in calls if name == "bwd kSlotDownWgrad,kSlotGateUpWgrad"]
    assert wgrads == [(0, False), (1, True), (2, True)]
    assert [c[0] for c in calls][-2:] == ["slot_sum", "topk_weight_grad"]


@pytest.mark.parametrize("turns", [1, 3])
def test_a_graph_of_the_backward_alone_replays_every_turn(turns):
    """capture(forward=False) of a ring of several turns: the backward replays turn 0 as well (its
    replays need not follow a forward, after which the ring holds turn 0); with the forward in the
    graph, or one turn, it does not."""
    from types import SimpleNamespace

    got = []
    layer = SimpleNamespace(num_turns=turns, fused=None, fused_bwd=None, _captured={},
                            capture_graph=lambda enqueue: enqueue(),
                            enqueue_forward=lambda: got.append("fwd"),
                            enqueue_backward=lambda replay_first=False: got.append(("bwd", replay_first)))
    GpuMoELayer.capture(layer, forward=False)
    GpuMoELayer.capture(layer)
    assert got == [("bwd", turns > 1), "fwd", ("bwd", False)]


def test_capture_waits_for_the_eager_work_first(monkeypatch):
    """Replays run on non-blocking streams: capture_graph synchronizes the device before it captures,
    so no replay can overlap an eager pass still running (they would share the epoch and the rows)."""
    import sys
    from types import SimpleNamespace

    from mok_proto.layer.gpu_base import GpuRound

    calls = []

    class Stream:
        def __init__(self, non_blocking=False):
            calls.append(("stream", non_blocking))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def begin_capture(self):
            calls.append("begin_capture")

        def end_capture(self):
            calls.append("end_capture")
            return "graph"

    device = SimpleNamespace(synchronize=lambda: calls.append("synchronize"))
    fake = SimpleNamespace(cuda=SimpleNamespace(Stream=Stream, Device=lambda: device))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert GpuRound.capture_graph(lambda: calls.append("enqueue")) == "graph"
    assert calls == ["synchronize", ("stream", True), "begin_capture", "enqueue", "end_capture"]


def test_a_fused_launch_uploads_its_params_once_and_never_inside_a_capture(monkeypatch):
    """FusedPass.launch: the first launch of a distinct argument set uploads its params; inside a
    graph capture (which cannot copy host data) a launch never seen before is refused in one line,
    and a seen one launches with the params it uploaded."""
    import sys
    from types import SimpleNamespace

    import numpy as np

    from mok_proto.kernels import fused

    uploads, launches, capturing = [], [], [False]

    class Device:
        def __init__(self, host):
            self.data = SimpleNamespace(ptr=4096 * (len(uploads) + 1))
            uploads.append(host)

        def fill(self, value):
            pass

    stream = SimpleNamespace(is_capturing=lambda: capturing[0])
    fake = SimpleNamespace(asarray=Device, cuda=SimpleNamespace(get_current_stream=lambda: stream))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(fused, "_kernel", lambda kernel, link: lambda grid, block, args, shared_mem: launches.append(
        args[0]))
    monkeypatch.setattr(fused, "smem_bytes", lambda kernel, link: 0)
    table = lambda: SimpleNamespace(data=SimpleNamespace(ptr=64), fill=lambda v: None, shape=(1, 3))  # noqa: E731
    plan = SimpleNamespace(token_grads=False, scale=False, comm_blocks=0, tasks=[0] * 5, first_remote_counter=3,
                           claim_counter=-1, minibatch_rows=256, ring_minibatches=1, num_sms=8)
    p = fused.FusedPass.__new__(fused.FusedPass)
    p.plan, p.kernel, p.link, p.num_launch_ranks, p._params = plan, "fwd", False, 1, {}
    p.tasks = p.task_begin = p.counters = p.counter_info = p.records = table()
    comm, error, words = SimpleNamespace(data=SimpleNamespace(ptr=128)), SimpleNamespace(ptr=256), np.zeros(4, np.uint64)
    capturing[0] = True
    with pytest.raises(RuntimeError, match="never uploaded: run the pass once before capturing"):
        p.launch(comm, words, error, 10**9)
    assert not uploads and not launches
    capturing[0] = False
    p.launch(comm, words, error, 10**9)  # eager: the GEMM words, then the FusedParams
    assert len(uploads) == 2 and len(launches) == 1
    capturing[0] = True
    p.launch(comm, words, error, 10**9)  # captured: the same device params, no upload
    assert len(uploads) == 2 and launches == [launches[0], launches[0]]
    with pytest.raises(RuntimeError, match="never uploaded"):
        p.launch(comm, words, error, 2 * 10**9)  # another timeout: other params
