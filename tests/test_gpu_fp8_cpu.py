"""The GPU layer's FP8 routed experts on the CPU (layer/gpu_fp8.py; no GPU, nothing launches):
which tensor each routed GEMM reads, traced through the quantizers and the ring's reused codes
against docs/design.md 5.7's table; the FP8 dispatch's params and the order of its launches; the
hooks in the passes; the refusals; poisoning; the layout and memory. The wrappers' own argument
checks run on NumPy stand-ins (the no_launch fixture: tests/conftest.py)."""

from types import SimpleNamespace

import numpy as np
import pytest

from mok_proto import abi, memory
from mok_proto.config import MOK_POLICY, MoEShape, RunConfig, get_shape
from mok_proto.kernels import fp8 as kq
from mok_proto.kernels import gemm
from mok_proto.kernels import gemm_fp8 as kg
from mok_proto.layer import gpu, gpu_base, gpu_fp8, gpu_ring, layout

from conftest import SiteRecord

SHAPE = MoEShape("fp8gpu", hidden=512, ffn=256, num_experts=4, top_k=2, num_tokens=16)
R, RING = 2, 512
EL = SHAPE.num_experts // R
H, I = SHAPE.hidden, SHAPE.ffn
SLOTS = {"fwd": ("kSlotFirst", "kSlotSecond"),
         "bwd": ("kSlotFirst", "kSlotSecond", "kSlotDownWgrad", "kSlotGateUpWgrad")}
# What each routed GEMM reads (design.md 5.7): q = 1 x 128 rows, qT = 128 x 1 over an expert's rows
# (transposed), deq = dequantized; wq_*: the weights' codes in the orientation named.
READS = {
    kg.gate_up: [("q", "x"), "wq_gate_t", "wq_up_t"],
    kg.down: [("q", "h"), "wq_down_t"],
    kg.down_bwd: [("q", "dy"), "wq_down", "g", "u"],
    kg.gate_up_bwd: [("q", "dg"), ("q", "du"), "wq_gate", "wq_up"],
    kg.down_wgrad: [("qT", "h"), ("qT", "dy")],
    kg.gate_up_wgrad: [("qT", ("deq", ("q", "x"))), ("qT", "dg"), ("qT", "du")],
    # wgrad_precision bf16: the BF16 layer's GEMMs on the bf16 rows (x: recv, or fp8 dispatch's
    # dequantized codes rounded to bf16)
    gemm.down_wgrad: ["h", "dy"],
    gemm.gate_up_wgrad: ["x_bf16", "dg", "du"],
}
WRITES = {kg.gate_up: {5: "h", 6: ("q", "h"), "g": "g", "u": "u"}, kg.down: {4: "y"},
          kg.down_bwd: {6: "dg", 7: "du", "dgq": ("q", "dg"), "duq": ("q", "du")}, kg.gate_up_bwd: {6: "dx"},
          kg.down_wgrad: {4: "dWd"}, kg.gate_up_wgrad: {5: "dWg", 6: "dWu"},
          gemm.down_wgrad: {4: "dWd"}, gemm.gate_up_wgrad: {5: "dWg", 6: "dWu"}}


def _address(a) -> int:
    return a.__array_interface__["data"][0]


def _stand_in(dispatch="bf16", wgrad=None):
    """What Fp8Experts reads of a layer, its buffers NumPy arrays of the layer's FP8 layout."""
    bufs = {name: np.zeros(shp, dt)
            for name, (shp, dt) in layout.layer_row_layout(SHAPE, EL, RING, "fp8", dispatch, wgrad).items()}
    rows = (np.zeros(EL, np.int32), np.zeros(EL, np.int32))
    run = RunConfig(SHAPE, R, precision="fp8", dispatch_dtype=dispatch, wgrad_precision=wgrad)
    layer = SimpleNamespace(run=run, shape=SHAPE,
                            ring_rows=RING, error=SiteRecord("layer"), ranks=[0], _b=lambda key, r: bufs[key],
                            _rows=lambda r, turn=0: rows)
    return layer, bufs, rows


class Trace:
    """Runs a pass's steps on the stand-in and follows what each buffer holds."""

    def __init__(self, bufs, rows, x_bf16="x"):
        self.x_bf16 = x_bf16  # what a bf16 weight gradient's x rows hold
        self.names = {_address(a): name for name, a in bufs.items()}
        self.rows = rows
        self.holds = {name: name.removesuffix("_s") for name in layout.FP8_WEIGHTS}  # a weight's codes and scales
        self.gemms = []

    def name(self, a):
        return self.names[_address(a)]

    def pair(self, a):
        codes, scales = a
        assert self.name(scales) == self.name(codes) + "_s", (self.name(codes), self.name(scales))
        assert self.holds[self.name(codes)] == self.holds[self.name(scales)]
        return self.holds[self.name(codes)]

    def read(self, a):
        return self.pair(a) if isinstance(a, tuple) else self.holds[self.name(a)]

    def write(self, a, what):
        for one in a if isinstance(a, tuple) else (a,):
            self.holds[self.name(one)] = what

    def run(self, steps):
        for fn, args, kwargs in steps:
            fn(*args, **kwargs)  # the wrapper's own checks (shapes, dtypes, contiguity)
            assert sum(a is self.rows[0] for a in args) == sum(a is self.rows[1] for a in args) == 1
            if fn in (kq.quantize_segment_rows, kq.quantize_segment_columns):
                x, _, _, codes, scales = args
                src = self.read(x)
                if kwargs.get("x_scales") is not None:  # e4m3 input: its codes and scales, dequantized
                    src = ("deq", self.pair((x, kwargs["x_scales"])))
                self.write((codes, scales), ("q" if fn is kq.quantize_segment_rows else "qT", src))
                continue
            if fn is kq.dequantize_segment_rows:
                codes, scales, _, _, out = args
                self.write(out, ("bf16", ("deq", self.pair((codes, scales)))))
                continue
            reads = [self.read(a) for a in args[:len(READS[fn])]]
            assert reads == [self.x_bf16 if r == "x_bf16" else r for r in READS[fn]], (fn.__name__, reads)
            for where, what in WRITES[fn].items():
                if isinstance(where, int) or where in kwargs:  # dgq, duq: only where down_bwd writes them
                    self.write(args[where] if isinstance(where, int) else kwargs[where], what)
            self.gemms.append((fn, kwargs.get("accumulate")))


@pytest.mark.parametrize("wgrad", [None, "bf16"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dispatch", ["bf16", "fp8"])
def test_every_routed_gemm_reads_the_quantization_the_design_names(dispatch, fused, wgrad, no_launch):
    """A forward and a backward turn, the backward's codes reusing the ring's (h^T in hq, dy^T then
    x^T in dyq, dg^T, du^T in dgq, duq): every GEMM reads design.md 5.7's operands, each written by
    an earlier launch and not yet overwritten; a later turn's weight gradients accumulate. dgq, duq
    come from the row quantizer (sequential) or down_bwd's epilogue (fused). wgrad_precision bf16:
    the BF16 weight gradients read the bf16 rows (x: recv, holding fp8 dispatch's deq(xq))."""
    layer, bufs, rows = _stand_in(dispatch, wgrad)
    experts = gpu_fp8.Fp8Experts(layer)
    trace = Trace(bufs, rows, "x" if dispatch == "bf16" else ("bf16", ("deq", ("q", "x"))))
    for turn, accumulate in ((0, False), (1, True)):  # a ring's second turn replays the forward's gate/up
        if dispatch == "bf16":
            trace.write(bufs["recv"], "x")  # the dispatch's bf16 rows
        else:
            trace.write((bufs["xq"], bufs["xq_s"]), ("q", "x"))  # codes and scales, as the token owner made them
        for slot in SLOTS["fwd"][:1 if turn else 2]:
            trace.run(experts.steps("fwd", slot, 0, turn))
        trace.write(bufs["recv_dy"], "dy")  # the reverse-combine's rows
        for slot in SLOTS["bwd"]:
            steps = experts.steps("bwd", slot, 0, turn, accumulate, fused=fused)
            assert fused or all("dgq" not in kwargs for _, _, kwargs in steps), "sequential: dgq by the quantizer"
            # every launch that waits reports into the layer's record (the row quantizers have no wait)
            assert all(kwargs.get("error") is layer.error for fn, _, kwargs in steps
                       if fn not in (kq.quantize_segment_rows, kq.dequantize_segment_rows))
            trace.run(steps)
    wgrads = (kg.down_wgrad, kg.gate_up_wgrad) if wgrad is None else (gemm.down_wgrad, gemm.gate_up_wgrad)
    if wgrad == "bf16":  # x's bf16 rows live in recv (no peer reads it in the backward), whatever the dispatch
        assert experts.steps("bwd", "kSlotGateUpWgrad", 0)[-1][1][0] is bufs["recv"]
    want = [kg.gate_up, kg.down, kg.down_bwd, kg.gate_up_bwd, *wgrads, kg.gate_up, kg.down_bwd, kg.gate_up_bwd, *wgrads]
    assert [fn for fn, _ in trace.gemms] == want
    assert [acc for fn, acc in trace.gemms if fn in wgrads] == [False, False, True, True]
    with pytest.raises(ValueError, match="no routed FP8 GEMM"):
        experts.steps("fwd", "kSlotDownWgrad", 0)


def test_down_bwd_quantizes_both_or_neither(no_launch):
    layer, bufs, (offsets, counts) = _stand_in()
    pair = lambda name: (bufs[name], bufs[name + "_s"])  # noqa: E731
    args = (pair("dyq"), pair("wq_down"), bufs["g"], bufs["u"], offsets, counts, bufs["dg"], bufs["du"])
    kg.down_bwd(*args)
    kg.down_bwd(*args, dgq=pair("dgq"), duq=pair("duq"))
    for one in ({"dgq": pair("dgq")}, {"duq": pair("duq")}):
        with pytest.raises(ValueError, match="dgq, duq: give both"):
            kg.down_bwd(*args, **one)
    with pytest.raises(ValueError, match="duq codes"):  # checked as an operand: [rows, I] e4m3
        kg.down_bwd(*args, dgq=pair("dgq"), duq=(bufs["dgq"][:-1], bufs["dgq_s"][:-1]))


def test_fp8_dispatch_moves_codes_then_scales_and_waits_for_each(monkeypatch):
    calls = []
    record = lambda name: lambda *a: calls.append((name, *a))  # noqa: E731
    monkeypatch.setattr(gpu_fp8, "kc", SimpleNamespace(pack_params=lambda fields: fields, move_rows=record("move"),
                                                       wait_peers=record("wait"), begin_round=record("begin")))
    table = {name: f"&{name}" for name in ("x", "xq", "xq_s", "xq_tok", "xq_tok_s")}
    layer = SimpleNamespace(run=RunConfig(SHAPE, R, precision="fp8", dispatch_dtype="fp8"), shape=SHAPE, num_turns=3,
                            tables=lambda: table,
                            comm_fields=lambda ranks, row_bytes, t: {"turn": t, "rows": row_bytes},
                            launch_for=lambda ranks, row_bytes, bpr: f"launch{row_bytes}")
    experts = gpu_fp8.Fp8Experts(layer)
    experts.launch_only([0, 1], None)
    assert len(experts.turn_params) == 3 and experts.launches == {"codes": f"launch{H}", "scales": f"launch{H // 32}"}
    for t, p in enumerate(experts.turn_params):
        assert (p["codes"]["x"], p["codes"]["recv"], p["codes"]["rows"], p["codes"]["turn"]) == ("&xq_tok", "&xq", H, t)
        assert (p["scales"]["x"], p["scales"]["recv"], p["scales"]["rows"]) == ("&xq_tok_s", "&xq_s", H // 32)
        assert p["codes"]["slot_rows"] == p["scales"]["slot_rows"] == 0
    codes, scales = experts.turn_params[2]["codes"], experts.turn_params[2]["scales"]
    experts.dispatch("pull", 2, wait_map=True)
    assert calls == [("move", "dispatch_pull", codes, f"launch{H}"),
                     ("move", "dispatch_pull", scales, f"launch{H // 32}")]
    calls.clear()
    experts.dispatch("push", 2, wait_map=True)
    assert [c[:2] for c in calls] == [("wait", codes), ("move", "dispatch_push"), ("wait", codes), ("begin", scales),
                                      ("move", "dispatch_push"), ("wait", scales)]
    assert [c[-2:] for c in calls if c[0] == "wait"] == [("kFlagMap", "kOpDispatchPush"),
                                                         ("kFlagDispatch", "kOpDispatchPush"),
                                                         ("kFlagDispatch", "kOpDispatchPush")]
    calls.clear()
    experts.dispatch("push", 1, wait_map=False)  # a ring's turn, or its replay: the map was waited for
    assert [c[0] for c in calls] == ["move", "wait", "begin", "move", "wait"]


def test_the_passes_call_the_fp8_hooks(monkeypatch):
    """enqueue_forward (one turn): x quantized for the dispatch before the routing flag publishes
    it, the dispatch by Fp8Experts; the ring's turns and replays dispatch through it too."""
    calls = []
    record = lambda name: lambda *a, **k: calls.append(name)  # noqa: E731
    stub = SimpleNamespace(**{n: record(n) for n in ("begin_round", "allgather_routing", "build_schedule",
                                                     "move_rows", "wait_peers", "raise_flag", "turn_segments",
                                                     "weighted_sum", "scale_to_slots", "slot_sum", "topk_weight_grad")})
    for module in (gpu, gpu_base, gpu_ring):
        monkeypatch.setattr(module, "kc", stub)
    monkeypatch.setattr(gpu, "kt", stub)
    monkeypatch.setattr(gpu_ring, "kt", stub)
    fp8 = SimpleNamespace(dispatch_fp8=True, quantize_tokens=lambda: calls.append("quantize_tokens"),
                          dispatch=lambda direction, turn, wait_map: calls.append(
                              ("dispatch", direction, turn, wait_map)))
    layer = SimpleNamespace(_policy=lambda: dict(MOK_POLICY), params_fwd=None, params_bwd=None, launch=None,
                            run=RunConfig(SHAPE, R),
                            num_local=EL, shape=SHAPE, num_turns=1, fused=None, fp8=fp8, params_tok=None,
                            _launch_gemms=lambda pass_, slots, turn=0, accumulate=False: calls.append(slots[0]))
    gpu.GpuMoELayer.enqueue_forward(layer)
    assert calls.index("quantize_tokens") < calls.index("allgather_routing")
    assert [c for c in calls if c[0] == "dispatch"] == [("dispatch", "pull", 0, True)]
    assert "move_rows" not in calls[:calls.index(("dispatch", "pull", 0, True))]  # no bf16 dispatch
    calls.clear()
    layer.num_turns, layer.turn_params, layer.trace = 3, {"fwd": [0, 1, 2], "bwd": [0, 1, 2]}, False
    gpu_ring.forward_turns(layer, dict(MOK_POLICY), lambda stage: None)
    assert [c for c in calls if c[0] == "dispatch"] == [("dispatch", "pull", t, False) for t in (2, 1, 0)]
    calls.clear()
    gpu_ring.backward_turns(layer, {**MOK_POLICY, "dispatch": "push"}, lambda stage: None)
    assert [c for c in calls if c[0] == "dispatch"] == [("dispatch", "push", t, False) for t in (1, 2)]


@pytest.mark.parametrize("dispatch", ["bf16", "fp8"])
def test_fused_words_pack_each_turns_rows(dispatch, monkeypatch):
    """Fp8Experts.fused_words(ranks, turn, pass_): the routed slots' Fp8GemmParams on turn `turn`'s
    segments (its row offsets and counts), the other slots zero; QuantParams recv -> xq, xq_s (bf16
    dispatch); the backward's: down_bwd quantizing dg, du into dgq, duq, and recv_dy -> dyq, dyq_s."""
    monkeypatch.setattr(gemm, "tensor_map", lambda *args, **kwargs: 0)
    monkeypatch.setattr(gemm, "launch_grouped", lambda module, namespace, struct, problem, site, error, pack_only,
                        fields: struct.pack({**dict.fromkeys(struct.names, 0), **fields, "error": 0}))
    layer, bufs, _ = _stand_in(dispatch)
    turns = [(np.zeros(EL, np.int32), np.zeros(EL, np.int32)) for _ in range(3)]
    layer._rows = lambda r, turn=0: turns[turn]
    experts = gpu_fp8.Fp8Experts(layer)
    slots = [name for name, _ in abi.GEMM_SLOT.members]
    for t in (2, 0, 1):
        gemms, quants = experts.fused_words(layer.ranks, t)
        got = gemms.view(abi.FP8_GEMM_PARAMS.dtype)
        for slot, params in zip(slots, got):
            routed = slot in ("kSlotFirst", "kSlotSecond")
            assert (params["row_offsets"], params["row_counts"]) == (
                (_address(turns[t][0]), _address(turns[t][1])) if routed else (0, 0)), (t, slot)
        q = quants.view(abi.QUANT_PARAMS.dtype)[0]
        if dispatch == "bf16":
            assert (q["x"], q["codes"], q["scales"]) == (_address(bufs["recv"]), _address(bufs["xq"]),
                                                        _address(bufs["xq_s"]))
        else:  # (the layout has no recv: fp8 dispatch moves codes and scales)
            assert "recv" not in bufs and not any(q[name] for name in abi.QUANT_PARAMS.names)
        gemms, quants = experts.fused_words(layer.ranks, t, "bwd")
        got = dict(zip(slots, gemms.view(abi.FP8_GEMM_PARAMS.dtype)))
        first, second = got["kSlotFirst"], got["kSlotSecond"]
        assert (first["row_offsets"], second["row_counts"]) == (_address(turns[t][0]), _address(turns[t][1]))
        assert [first[k] for k in ("out1", "out2", "out_codes", "out_scales", "out_codes2", "out_scales2")] == [
            _address(bufs[k]) for k in ("dg", "du", "dgq", "dgq_s", "duq", "duq_s")]
        assert second["out1"] == _address(bufs["dx_rows"]) and second["out_codes"] == 0
        q = quants.view(abi.QUANT_PARAMS.dtype)[0]
        assert (q["x"], q["codes"], q["scales"], q["cols"]) == (_address(bufs["recv_dy"]), _address(bufs["dyq"]),
                                                                _address(bufs["dyq_s"]), H)


def test_the_fused_fp8_pass_holds_every_turns_words(monkeypatch):
    """GpuMoELayer._fused_pass of an FP8 layer on a ring of 3 turns: fp8_words[t] is
    fused_words(ranks, t) with the GEMMs' longer timeout, shared with the turns' pass without the
    shared expert (fused.rest)."""
    from mok_proto import plan as P
    from mok_proto.kernels import fused

    tile = get_shape("tile")
    monkeypatch.setattr(fused, "FusedPass", lambda plan, w, link=False, fp8=False, wgrads_inside=False: SimpleNamespace(
        plan=plan, fp8=fp8, wgrads_inside=wgrads_inside))
    blank = np.zeros(abi.FP8_GEMM_PARAMS.nbytes // 8 * len(abi.GEMM_SLOT), np.uint64)
    experts = SimpleNamespace(fused_words=lambda ranks, t, pass_: (blank.copy(), f"quants of turn {t}"))
    experts.bf16_words = lambda *a: gpu_fp8.Fp8Experts.bf16_words(experts, *a)
    pack = (lambda *a, error=None, pack_only=False, accumulate=False: abi.GEMM_PARAMS.pack(
        {**dict.fromkeys(abi.GEMM_PARAMS.names, 0), "num_groups": 3}), ())

    def bf16_gemm(pass_, slot, r, t=0):  # an FP8 layer's routed slots come from Fp8Experts.bf16_words
        assert slot.startswith("kSlotShared"), slot
        return pack

    layer = SimpleNamespace(run=RunConfig(tile, 2, precision="fp8", timeout_s=30), shape=tile, capacity=1024,
                            num_turns=3, ring_rows=512, ranks=[0, 1], error=SimpleNamespace(ptr=4096),
                            has_shared=True, fp8=experts, _gemm=bf16_gemm)
    layer._plan_rows = lambda: gpu.GpuMoELayer._plan_rows(layer)
    experts.layer = layer
    plan = P.fused_forward(tile, 2, P.FusedKnobs(0, 256), policy=MOK_POLICY, num_sms=8, capacity_rows=512)
    made, words = gpu.GpuMoELayer._fused_pass(layer, plan, "fwd")
    assert made.fp8 and made.rest.fp8 and made.rest.fp8_words is made.fp8_words
    for turn in words:  # the routed slots' BF16 records: the error record and the timeout only
        got = turn.view(abi.GEMM_PARAMS.dtype)
        slots = [name for name, _ in abi.GEMM_SLOT.members] * 2
        routed = np.isin(slots, ["kSlotFirst", "kSlotSecond"])
        assert (got["error"][routed] == 4096).all() and (got["num_groups"][routed] == 0).all()
        shared = np.char.startswith(slots, "kSlotShared")
        assert (got["num_groups"][shared] == 3).all() and (got["timeout_ns"] > 0).all()
    assert [q for _, q in made.fp8_words] == [f"quants of turn {t}" for t in range(3)]
    timeouts = {int(v) for g, _ in made.fp8_words for v in g.view(abi.FP8_GEMM_PARAMS.dtype)["timeout_ns"]}
    assert timeouts == {fused.gemm_timeout_ns(30 * 10**9)}
    # the backward (its routed weight gradients after the kernel): every routed slot's record too
    plan = P.fused_backward(tile, 2, P.FusedKnobs(0, 256, scale=False, token_grads=False, routed_wgrads=False),
                            policy=MOK_POLICY, num_sms=8, capacity_rows=512)
    made, words = gpu.GpuMoELayer._fused_pass(layer, plan, "bwd")
    for turn in words:
        got = turn.view(abi.GEMM_PARAMS.dtype)
        routed = ~np.char.startswith([name for name, _ in abi.GEMM_SLOT.members] * 2, "kSlotShared")
        assert (got["error"][routed] == 4096).all() and (got["num_groups"][routed] == 0).all()
        assert (got["num_groups"][~routed] == 3).all()
    # bf16 weight gradients inside the FP8 kernel: their slots hold the BF16 GEMMs of gpu_fp8's steps,
    # accumulating after the first turn; the other routed slots stay blank
    def wgrad_pack(slot, r, t, accumulate=False, pack_only=False):
        assert pack_only
        return abi.GEMM_PARAMS.pack({**dict.fromkeys(abi.GEMM_PARAMS.names, 0), "num_groups": 7 + t,
                                     "accumulate": int(accumulate), "error": 4096})

    def steps(pass_, slot, r, t=0, accumulate=False):  # (as Fp8Experts.steps: the weight gradients are the backward's)
        assert pass_ == "bwd" and slot in gpu_ring.ROUTED_WGRAD, (pass_, slot)
        return [("a dequantizer", (), {}), (wgrad_pack, (slot, r, t), {"accumulate": accumulate})]

    experts.steps = steps
    layer.run = RunConfig(tile, 2, precision="fp8", timeout_s=30, wgrad_precision="bf16")
    fwd = P.fused_forward(tile, 2, P.FusedKnobs(0, 256), policy=MOK_POLICY, num_sms=8, capacity_rows=512)
    for turn in gpu.GpuMoELayer._fused_pass(layer, fwd, "fwd")[1]:  # the forward: every routed slot blank
        got = turn.view(abi.GEMM_PARAMS.dtype)
        routed = ~np.char.startswith([name for name, _ in abi.GEMM_SLOT.members] * 2, "kSlotShared")
        assert (got["num_groups"][routed] == 0).all() and (got["error"][routed] == 4096).all()
    plan = P.fused_backward(tile, 2, P.FusedKnobs(0, 256, scale=False, token_grads=False), policy=MOK_POLICY,
                            num_sms=8, capacity_rows=512)
    made, words = gpu.GpuMoELayer._fused_pass(layer, plan, "bwd")
    assert plan.routed_wgrads and made.fp8 and made.wgrads_inside
    names = [name for name, _ in abi.GEMM_SLOT.members] * 2
    wgrad_slots = np.isin(names, gpu_ring.ROUTED_WGRAD)
    data_slots = ~wgrad_slots & ~np.char.startswith(names, "kSlotShared")
    for t, turn in enumerate(words):
        got = turn.view(abi.GEMM_PARAMS.dtype)
        assert (got["num_groups"][wgrad_slots] == 7 + t).all() and (got["accumulate"][wgrad_slots] == (t > 0)).all()
        assert (got["num_groups"][data_slots] == 0).all() and (got["timeout_ns"] > 0).all()


def test_the_fused_fp8_forward_runs_every_turn_of_a_ring_with_that_turns_words(monkeypatch):
    """A ring of 3 turns (last first): each launch gets its turn's Fp8GemmParams words; the movers
    quantize (QuantParams words) when the dispatch runs inside the kernel, else the turn's sequential
    quantizer runs before the launch (its steps but the GEMM) and the kernel gets no QuantParams."""
    calls = []
    stub = SimpleNamespace(**{n: (lambda name: lambda *a, **k: calls.append(name))(n)
                              for n in ("move_rows", "wait_peers", "raise_flag", "turn_segments", "weighted_sum",
                                        "begin_round")})
    monkeypatch.setattr(gpu_ring, "kc", stub)
    monkeypatch.setattr(gpu_ring, "kt", stub)
    experts = gpu_fp8.Fp8Experts.__new__(gpu_fp8.Fp8Experts)
    experts.layer, experts.dispatch_fp8 = SimpleNamespace(ranks=[0, 1]), False
    experts.steps = lambda pass_, slot, r, turn=0, accumulate=False: [
        (lambda *a: calls.append(("quantize", *a)), (pass_, slot, r, turn), {}), (None, (), {})]
    launches = []

    def launch_of(part):
        return lambda p, words, error, timeout_ns, trace=False, **fp8: (launches.append((part, p, words, fp8)),
                                                                        calls.append(("launch", part)))

    words = [(f"gemms{t}", f"quants{t}") for t in range(3)]
    fused = SimpleNamespace(plan=SimpleNamespace(ring_minibatches=1, num_minibatches=1), fp8_words=words,
                            launch=launch_of("first"), rest=SimpleNamespace(launch=launch_of("rest")))
    layer = SimpleNamespace(launch=None, turn_params={"fwd": ["p0", "p1", "p2"]}, params_fwd=None, params_tok=None,
                            num_turns=3, fused=fused, fp8=experts, _fused_words=["w0", "w1", "w2"], error=None,
                            run=RunConfig(SHAPE, R, precision="fp8"), trace=False)
    monkeypatch.setattr(gpu_ring, "_dispatch_into_ring", lambda layer, t, direction: calls.append(("dispatch", t)))
    gpu_ring.forward_turns(layer, dict(MOK_POLICY), lambda stage: None, inside=(True, True))
    assert launches == [("rest", "p2", "w2", {"fp8_gemm_params": "gemms2", "quant_params": "quants2"}),
                        ("rest", "p1", "w1", {"fp8_gemm_params": "gemms1", "quant_params": "quants1"}),
                        ("first", "p0", "w0", {"fp8_gemm_params": "gemms0", "quant_params": "quants0"})]
    assert not [c for c in calls if c[0] in ("quantize", "dispatch")]  # the movers pull and quantize
    launches.clear()
    calls.clear()
    gpu_ring.forward_turns(layer, {**MOK_POLICY, "dispatch": "push"}, lambda stage: None, inside=(False, True))
    assert [(part, fp8) for part, _, _, fp8 in launches] == [
        (part, {"fp8_gemm_params": f"gemms{t}", "quant_params": None}) for part, t in (("rest", 2), ("rest", 1),
                                                                                       ("first", 0))]
    turns = [c for c in calls if c[0] in ("quantize", "dispatch", "launch")]
    assert turns == [c for t, part in ((2, "rest"), (1, "rest"), (0, "first"))
                     for c in [("dispatch", t), *[("quantize", "fwd", "kSlotFirst", r, t) for r in (0, 1)], ("launch", part)]]


def test_the_fused_fp8_forward_with_fp8_dispatch_moves_the_token_owners_codes_and_scales(monkeypatch):
    """fp8 dispatch: pulled inside, the kernel gets the turn's codes and scales CommParams and no
    QuantParams (nothing to quantize); pushed before it, Fp8Experts.dispatch moves them (not the bf16
    push) and the kernel gets neither."""
    experts = gpu_fp8.Fp8Experts.__new__(gpu_fp8.Fp8Experts)
    experts.dispatch_fp8 = True
    experts.turn_params = [{"codes": "c0", "scales": "s0"}, {"codes": "c1", "scales": "s1"}]
    experts.steps = lambda *a, **k: pytest.fail("no quantizer runs: the token owners quantized their rows")
    calls = []
    experts.dispatch = lambda direction, turn, wait_map: calls.append(("fp8 dispatch", direction, turn, wait_map))
    fused = SimpleNamespace(fp8_words=[("g0", "q0"), ("g1", "q1")])
    assert experts.fused_args(fused, 1, comm_in=True) == {"fp8_gemm_params": "g1", "quant_params": None,
                                                          "dispatch_params": ("c1", "s1")}
    assert experts.fused_args(fused, 0, comm_in=False) == {"fp8_gemm_params": "g0", "quant_params": None,
                                                           "dispatch_params": None}
    monkeypatch.setattr(gpu, "to_experts_before_fused", lambda *a, **k: calls.append("bf16 dispatch"))
    for name in ("to_tokens_after_fused", "kt"):
        monkeypatch.setattr(gpu, name, SimpleNamespace(weighted_sum=lambda *a: None) if name == "kt" else
                            (lambda *a, **k: None))
    fused.plan = SimpleNamespace(pass_="fwd", policy={**MOK_POLICY, "dispatch": "push"}, ring_minibatches=1,
                                 num_minibatches=1)
    fused.launch = lambda *a, **fp8: calls.append(("launch", fp8))
    layer = SimpleNamespace(fused=fused, params_fwd=None, launch=None, fp8=experts, _fused_words=["w0"], error=None,
                            run=RunConfig(SHAPE, R, precision="fp8", dispatch_dtype="fp8"), trace=False, params_tok=None)
    gpu.GpuMoELayer._enqueue_fused_forward(layer, {**MOK_POLICY, "dispatch": "push"}, lambda stage: None)
    assert calls == [("fp8 dispatch", "push", 0, True),
                     ("launch", {"trace": False, "fp8_gemm_params": "g0", "quant_params": None, "dispatch_params": None})]
    calls.clear()
    fused.plan.policy = dict(MOK_POLICY)  # pull: inside the kernel
    gpu.GpuMoELayer._enqueue_fused_forward(layer, dict(MOK_POLICY), lambda stage: None)
    assert calls == ["bf16 dispatch",  # (to_experts_before_fused: a pull inside publishes nothing after the schedule)
                     ("launch", {"trace": False, "fp8_gemm_params": "g0", "quant_params": None,
                                 "dispatch_params": ("c0", "s0")})]


def test_the_fused_fp8_backward_quantizes_dy_then_runs_the_routed_weight_gradients_after_it(monkeypatch):
    """_enqueue_fused_backward of an FP8 layer: the reverse-combine pulled inside, the kernel gets the
    backward's words and QuantParams (its movers quantize dy); pushed before it, the sequential dy
    quantizer runs first and the kernel gets none; after the kernel the routed weight gradients
    (their quantizers and GEMMs: _launch_gemms), after the reverse-dispatch's flag and wait and
    before the token gradients where the plan leaves those outside."""
    calls = []
    experts = gpu_fp8.Fp8Experts.__new__(gpu_fp8.Fp8Experts)
    experts.layer, experts.dispatch_fp8 = SimpleNamespace(ranks=[0, 1]), True  # (fp8 dispatch: the forward's only)
    experts.steps = lambda pass_, slot, r, turn=0, accumulate=False: [
        (lambda *a: calls.append(("quantize", *a)), (pass_, slot, r, turn), {}), (None, (), {})]
    for name in ("to_experts_before_fused", "to_tokens_after_fused"):
        monkeypatch.setattr(gpu, name, lambda *a, name=name, **k: calls.append(name))
    monkeypatch.setattr(gpu, "kt", SimpleNamespace(**{n: (lambda n: lambda *a: calls.append(n))(n) for n in (
        "scale_to_slots", "slot_sum", "topk_weight_grad")}))
    fused = SimpleNamespace(fp8_words=[("g0", "q0")], launch=lambda *a, **k: calls.append(("launch", k)))
    layer = SimpleNamespace(fused_bwd=fused, params_bwd=None, params_tok="tok", launch=None, fp8=experts,
                            _fused_bwd_words=["w0"], error=None, run=RunConfig(SHAPE, R, precision="fp8"),
                            trace=False, _launch_gemms=lambda pass_, slots: calls.append((pass_, *slots)))
    wgrads = ("bwd", "kSlotDownWgrad", "kSlotGateUpWgrad")
    for policy, inside in ((dict(MOK_POLICY), True), ({**MOK_POLICY, "rev_combine": "push"}, False)):
        for token_grads in (True, False):
            fused.plan = SimpleNamespace(pass_="bwd", policy=policy, scale=inside, token_grads=token_grads,
                                         routed_wgrads=False)
            calls.clear()
            gpu.GpuMoELayer._enqueue_fused_backward(layer, policy, lambda stage: None)
            launch = ("launch", {"trace": False, "token_params": "tok", "fp8_gemm_params": "g0",
                                 "quant_params": "q0" if inside else None})
            before = [] if inside else ["scale_to_slots", "to_experts_before_fused"] + [
                ("quantize", "bwd", "kSlotFirst", r, 0) for r in (0, 1)]
            after = [wgrads] if token_grads else [  # as the sequential pass: the reverse-dispatch first
                "to_tokens_after_fused", wgrads, "slot_sum", "topk_weight_grad"]
            assert calls == before + [launch] + after, (policy, token_grads)
    # bf16 weight gradients inside the kernel: their x rows' steps (fp8 dispatch: the dequantizer) before it
    fused.plan = SimpleNamespace(pass_="bwd", policy=dict(MOK_POLICY), scale=True, token_grads=True,
                                 routed_wgrads=True)
    calls.clear()
    gpu.GpuMoELayer._enqueue_fused_backward(layer, dict(MOK_POLICY), lambda stage: None)
    assert calls == [("quantize", "bwd", "kSlotGateUpWgrad", r, 0) for r in (0, 1)] + [
        ("launch", {"trace": False, "token_params": "tok", "fp8_gemm_params": "g0", "quant_params": "q0"})]


def test_the_fused_fp8_backward_dequantizes_each_turns_x_rows_before_its_kernel(monkeypatch):
    """fused_args of the backward with bf16 weight gradients inside: every turn's steps before its
    GEMM (the dequantizer, with fp8 dispatch) for every launch rank, the turn's words returned."""
    calls = []
    experts = gpu_fp8.Fp8Experts.__new__(gpu_fp8.Fp8Experts)
    experts.layer, experts.dispatch_fp8 = SimpleNamespace(ranks=[0, 1]), True
    experts.steps = lambda pass_, slot, r, turn=0, accumulate=False: [
        (lambda *a: calls.append(a), (slot, r, turn), {}), (None, (), {})]
    fused = SimpleNamespace(fp8_words=[(f"g{t}", f"q{t}") for t in range(3)],
                            plan=SimpleNamespace(pass_="bwd", routed_wgrads=True))
    for turn in range(3):
        calls.clear()
        got = experts.fused_args(fused, turn, comm_in=True, pass_="bwd")
        assert calls == [("kSlotGateUpWgrad", r, turn) for r in (0, 1)]
        assert got == {"fp8_gemm_params": f"g{turn}", "quant_params": f"q{turn}"}
    fused.plan.routed_wgrads = False  # FP8 weight gradients: after the kernel, nothing before it
    calls.clear()
    experts.fused_args(fused, 1, comm_in=True, pass_="bwd")
    assert calls == []


def test_the_row_layout_and_the_default_ring_count_the_bf16_weight_gradients_x_rows():
    kimi = get_shape("kimi-k2.7")
    kinds = dict(precision="fp8", dispatch_dtype="fp8")
    for wgrad, has_recv in ((None, False), ("bf16", True)):
        run = RunConfig(SHAPE, R, wgrad_precision=wgrad, **kinds)
        layer = SimpleNamespace(shape=SHAPE, num_local=EL, run=run)
        assert ("recv" in gpu.GpuMoELayer.row_layout(layer, RING)) == has_recv, wgrad
    fp8_wgrad, bf16_wgrad = (memory.default_macrobatch_rows(kimi, 64, wgrad_precision=w, **kinds) for w in ("fp8", "bf16"))
    assert bf16_wgrad < fp8_wgrad  # 2H more bytes a ring row
    for ring in (bf16_wgrad, bf16_wgrad + 128):  # the default: the largest whole-segment ring that fits
        fits = memory.layer_memory(kimi, 64, macrobatch_rows=ring, wgrad_precision="bf16", **kinds).total_bytes <= \
            memory.DEFAULT_FRACTION * memory.H100_FREE_BYTES
        assert fits == (ring == bf16_wgrad), ring


def test_refusals():
    fp8_run = RunConfig(SHAPE, 1, precision="fp8")
    with pytest.raises(ValueError, match="GpuRound has bf16 passes only"):
        gpu_base.GpuRound(SimpleNamespace(num_ranks=1), fp8_run, None, 256, "layer")
    from mok_proto.layer.gpu_comm import GpuCommRound

    with pytest.raises(ValueError, match="GpuCommRound has bf16 passes only"):
        GpuCommRound(SimpleNamespace(num_ranks=1), fp8_run)
    with pytest.raises(ValueError, match="shared expert is bf16"):
        gpu.GpuMoELayer(SimpleNamespace(num_ranks=1), RunConfig(SHAPE, 1, precision="fp8", shared_precision="fp8"))
    fp8_layer = SimpleNamespace(run=fp8_run, fp8=object(), num_turns=1)
    from mok_proto import plan as P

    inside = P.fused_backward(get_shape("tile"), 2, P.FusedKnobs(0, 256), policy=MOK_POLICY, num_sms=8,
                              capacity_rows=512)
    with pytest.raises(ValueError, match="routed weight gradients after the kernel"):
        gpu.GpuMoELayer._fused_pass(fp8_layer, inside, "bwd")
    assert gpu.GpuMoELayer._fused_pass(fp8_layer, None, "fwd") == (None, None)  # sequential
    from mok_proto.kernels import fused

    with pytest.raises(ValueError, match="routed_wgrads=False"):  # (before it touches the GPU)
        fused.FusedPass(inside, 1, fp8=True)
    try:  # given BF16 weight-gradient GEMMs it takes the plan (and goes on to the GPU, absent here)
        fused.FusedPass(inside, 1, fp8=True, wgrads_inside=True)
    except ValueError as e:
        pytest.fail(f"FusedPass refused BF16 weight gradients inside: {e}")
    except Exception:  # noqa: BLE001 - no GPU: CuPy's import or its first device call
        pass
    # bf16 weight gradients: the FP8 kernel runs them inside (BF16 tiles), so the plan's default puts them there
    bf16_wgrads = RunConfig(get_shape("tile"), 2, precision="fp8", wgrad_precision="bf16")
    fp8_dispatch = RunConfig(get_shape("tile"), 2, precision="fp8", wgrad_precision="bf16", dispatch_dtype="fp8")
    for run in (bf16_wgrads, fp8_dispatch):
        gpu_fp8.check_fused(inside, run)
    for run, inside_kernel in ((fp8_run, False), (bf16_wgrads, True), (fp8_dispatch, True)):
        layer = SimpleNamespace(run=run, fp8=object(), num_turns=1, policy=MOK_POLICY, _plan_rows=lambda: 512,
                                ranks=[0])
        plan = gpu.GpuMoELayer.fused_backward_plan(layer, P.FusedKnobs(0, 256), num_sms=8)
        assert plan.routed_wgrads == plan.token_grads == inside_kernel, run


def test_poison_fills_every_row_buffer_but_the_weights_codes():
    bufs = {name: np.zeros(shp, dt) for name, (shp, dt) in
            layout.layer_layout(RunConfig(SHAPE, R, precision="fp8"), 1024, RING).items()}
    layer = SimpleNamespace(ranks=[0], bufs={k: SimpleNamespace(instance=lambda r, a=a: a) for k, a in bufs.items()})
    gpu.GpuMoELayer.poison(layer)
    for name in layout.FP8_WEIGHTS + ("x", "w_gate", "dout", "topk_w"):
        assert not bufs[name].any(), name  # inputs: set once, never poisoned
    for name in layout.FP8_RING_BUFFERS:
        a = bufs[name]
        assert (a == 0xFF).all() if a.dtype == np.uint8 else np.isnan(a).all(), name  # e4m3 NaN codes, NaN scales
    assert (bufs["h"] == 0x7FC0).all() and (bufs["sched"] == -1).all()


# ---------------------------------------------------------------------------------------------
# Layout and memory
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wgrad", [None, "bf16"])
@pytest.mark.parametrize("dispatch", ["bf16", "fp8"])
def test_fp8_memory_is_the_layout_and_its_formula(dispatch, wgrad):
    """... and bf16 weight gradients keep recv (their x rows) with fp8 dispatch too."""
    kinds = dict(precision="fp8", dispatch_dtype=dispatch, wgrad_precision=wgrad)
    for shape in (SHAPE, get_shape("tile"), get_shape("kimi-k2.7")):
        for ranks in (1, 2):
            worst = memory.worst_capacity(shape, ranks)
            half = worst // 2 + 1
            for capacity, ring in ((worst, 256), (half, layout.whole_ring(half)), (worst - 3, worst - 3)):
                mem = memory.layer_memory(shape, ranks, capacity, ring, **kinds)
                run = RunConfig(shape, ranks, **kinds)
                assert [b.name for b in mem.buffers if b.symmetric] == list(layout.layer_layout(run, capacity, ring))
                assert mem.formula_bytes() == mem.by_role(), (shape.name, ranks, capacity, ring)
                assert memory.kinds_of(run) == kinds
    cap = memory.worst_capacity(SHAPE, R)  # (a ring of 256 rows: two segments of it)
    mem = memory.layer_memory(SHAPE, R, cap, 256, **kinds)
    names = {b.name for b in mem.buffers}
    assert set(layout.FP8_BUFFER_ROLE) <= names and ("recv" in names) == (dispatch == "bf16" or wgrad == "bf16")
    assert ("xq_tok" in names) == (dispatch == "fp8") and memory.layer_memory(SHAPE, R, cap, 256).by_role()[
        "ring"] < mem.by_role()["ring"]
    role = {b.name: b.role for b in mem.buffers}
    assert {n for n in names if role[n] == "weights"} == set(layout.WEIGHTS[:3]) | set(layout.FP8_WEIGHTS) | {
        n for n in layout.WEIGHTS[3:] if n in names}
    # a ring row: the bf16 layer's 4H + 5I bf16 values (3H + 5I with fp8 dispatch) and 2H + 3I codes, a scale per 128
    one, two = (memory.layer_memory(SHAPE, R, cap, m, **kinds) for m in (128, 256))
    bf16_values = 4 * H + 5 * I - (H if "recv" not in names else 0)
    assert two.by_role()["ring"] - one.by_role()["ring"] == 128 * (2 * bf16_values + (2 * H + 3 * I) * 33 // 32)
    assert mem.symmetric_bytes == gpu.symmetric_bytes(RunConfig(SHAPE, R, **kinds), cap, 256)
    assert "precision fp8" in mem.formula() and "33 M (2H + 3I) / 32" in mem.formula()


def test_fp8_default_ring_counts_the_codes_and_refuses_odd_shapes(capsys):
    kimi = get_shape("kimi-k2.7")
    plain, fp8 = (memory.default_macrobatch_rows(kimi, 64, precision=p) for p in ("bf16", "fp8"))
    assert fp8 < plain and memory.layer_memory(kimi, 64, precision="fp8").total_bytes <= \
        memory.DEFAULT_FRACTION * memory.H100_FREE_BYTES
    with pytest.raises(ValueError, match="multiple of 128"):
        memory.layer_memory(get_shape("tiny"), 2, precision="fp8")
    with pytest.raises(ValueError, match="only with precision fp8"):
        memory.layer_memory(kimi, 64, dispatch_dtype="fp8")
    assert memory.main(["--shape", "glm-5.2", "--ep", "8", "--precision", "fp8", "--dispatch-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "xq_tok" in out and "precision fp8, dispatch fp8" in out
    with pytest.raises(SystemExit) as e:
        memory.main(["--precision", "fp16"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "precision must be one of" in err


# ---------------------------------------------------------------------------------------------
# The GPU check program's own checks (tests/mpi_programs/check_gpu_fp8_layer.py), on the CPU
# ---------------------------------------------------------------------------------------------
def _check_program(monkeypatch):
    """check_gpu_fp8_layer as a module (its sibling imports resolved as when it runs)."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).parent / "mpi_programs"
    for name in ("gpu_program", "check_gpu_layer", "check_gpu_fp8_layer"):
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
    return module


def _mirror_layer(x_order: str = "deq"):
    """What a GPU layer of one rank holds after its backward, computed by the float32 mirror
    (reference_fp8's per-expert functions) in the device's receive layout; x_order "pow2": the
    weight gradients' x^T from another quantization of x than xq (a wrong quantization point)."""
    from mok_proto import fp8, reference_fp8
    from mok_proto.problem import make_problem
    from mok_proto.reference import from_bf16, to_bf16
    from mok_proto.plan import SEGMENT_ROWS
    from mok_proto.schedule import build_pull_schedule

    shape = MoEShape("mirror", hidden=256, ffn=256, num_experts=4, top_k=2, num_tokens=200, num_shared=0)
    prob = make_problem(shape, 1, seed=3, routing="one-expert")  # expert 0: 200 rows, two 128-row blocks
    sched = build_pull_schedule(prob.topk_idx, 4, 0, align=SEGMENT_ROWS)  # the device's receive layout
    el, rows, k = 4, sched.num_slots, shape.top_k
    x = reference_fp8.round_bf16(prob.x[0])
    w = {key: reference_fp8.round_bf16(prob.weights[key]) for key in ("w_gate", "w_up", "w_down")}
    wq = reference_fp8.quantize_weights(w, ("w_gate", "w_up", "w_down"))
    dy_all = reference_fp8.round_bf16(np.random.default_rng(4).standard_normal((rows, shape.hidden)))
    b = {"sched": np.concatenate([sched.expert_offsets[:-1], [rows], sched.tokens_per_expert, sched.src_rank,
                                  sched.src_slot]).astype(np.int32)}
    for name, cols in (("xq", 256), ("hq", 256)):
        b[name], b[name + "_s"] = np.zeros((rows, cols), np.uint8), np.zeros((rows, cols // 128), np.float32)
    for name in ("g", "u", "h", "y", "dg", "du", "dx_rows", "recv_dy"):
        b[name] = np.zeros((rows, 256), np.float32)
    grads = {key: np.zeros_like(w[key]) for key in w}
    for l in range(el):
        lo, n = int(sched.expert_offsets[l]), int(sched.tokens_per_expert[l])
        if not n:
            continue
        rs = slice(lo, lo + n)
        b["xq"][rs], b["xq_s"][rs] = fp8.quantize_rows(x[sched.src_slot[rs] // k])
        ew = reference_fp8.expert_weights(wq, l)
        b["y"][rs], (b["g"][rs], b["u"][rs], b["h"][rs]) = reference_fp8.expert_forward((b["xq"][rs], b["xq_s"][rs]), ew)
        b["hq"][rs], b["hq_s"][rs] = fp8.quantize_rows(b["h"][rs])
        b["recv_dy"][rs] = dy_all[rs]
        b["dx_rows"][rs], b["dg"][rs], b["du"][rs] = reference_fp8.expert_backward(dy_all[rs], b["g"][rs], b["u"][rs], ew)
        xq = (b["xq"][rs], b["xq_s"][rs]) if x_order == "deq" else fp8.quantize_rows(x[sched.src_slot[rs] // k], pow2=True)
        reference_fp8.add_weight_grads({key: grads[key][l] for key in grads}, xq, b["h"][rs], dy_all[rs], b["dg"][rs],
                                       b["du"][rs])
    for key in w:
        b[key] = to_bf16(w[key])
        b["d" + key] = grads[key]
        codes, scales = wq[key]
        name = "wq_" + key[2:]
        b[name], b[name + "_s"] = codes, scales
        b[name + "_t"], b[name + "_t_s"] = codes.swapaxes(1, 2).copy(), scales.swapaxes(1, 2).copy()
    for name in ("g", "u", "h", "y", "dg", "du", "dx_rows", "recv_dy"):
        b[name] = to_bf16(b[name])
    layer = SimpleNamespace(num_local=el, capacity=rows, shape=shape,
                            _b=lambda key, r: SimpleNamespace(get=lambda: b[key].copy()))
    return layer, from_bf16(to_bf16(prob.x)), b


def test_the_gpu_programs_stage_checks_pass_the_mirror_and_catch_a_wrong_point(monkeypatch):
    """The GPU program's per-GEMM bounds hold for the float32 mirror in the device's layout (an
    expert of 200 rows: two scale blocks); a weight gradient from the wrong x^T, a non-bitwise hq
    and a y off by a bf16 step's worth of error beyond the bound fail them."""
    program = _check_program(monkeypatch)
    layer, x_bf16, b = _mirror_layer()
    program.check_forward_stages(layer, 0, x_bf16)
    program.check_backward_stages(layer, 0)
    wrong, _, _ = _mirror_layer(x_order="pow2")  # x^T requantized from other codes of x
    with pytest.raises(AssertionError, match="dw_gate"):
        program.check_backward_stages(wrong, 0)
    b["hq"][0, 0] ^= 1
    with pytest.raises(AssertionError, match="hq != q"):
        program.check_forward_stages(layer, 0, x_bf16)
    b["hq"][0, 0] ^= 1
    b["y"][0, :] ^= 0x40  # bf16 bits: a large change of every value in one row
    with pytest.raises(AssertionError, match="expert 0 y"):
        program.check_forward_stages(layer, 0, x_bf16)


def test_the_gpu_programs_bf16_weight_gradient_check_passes_the_mirror_and_catches_the_wrong_x(monkeypatch):
    """check_bf16_wgrads holds for the mirror's bf16 weight gradients (x from recv: bf16 rows, or with
    fp8 dispatch bf16(deq(xq))), and fails on weight gradients of other x rows and, with fp8
    dispatch, on a recv that is not bf16(deq(xq))."""
    from mok_proto import fp8, reference_fp8
    from mok_proto.reference import from_bf16, to_bf16

    program = _check_program(monkeypatch)
    layer, _, b = _mirror_layer()
    el, sched = layer.num_local, b["sched"]
    offsets, counts = sched[:el], sched[el + 1:2 * el + 1]
    rows_bf16 = np.zeros((layer.capacity, 256), np.float32)  # x as a bf16 dispatch lands it
    deq = np.zeros_like(rows_bf16)  # x as fp8 dispatch's dequantized codes
    for l in range(el):
        rs = slice(int(offsets[l]), int(offsets[l] + counts[l]))
        xq = (b["xq"][rs], b["xq_s"][rs])
        rows_bf16[rs] = reference_fp8.round_bf16(fp8.dequantize_rows(*xq) * np.float32(1.0 + 2.0 ** -6))
        deq[rs] = reference_fp8.wgrad_rows(None, xq, "fp8")

    def grads_of(x):
        grads = {key: np.zeros_like(b["d" + key]) for key in ("w_gate", "w_up", "w_down")}
        for l in range(el):
            rs = slice(int(offsets[l]), int(offsets[l] + counts[l]))
            reference_fp8.add_weight_grads_bf16({key: grads[key][l] for key in grads}, x[rs],
                                                *(from_bf16(b[n][rs]) for n in ("h", "recv_dy", "dg", "du")))
        return {"d" + key: v for key, v in grads.items()}

    for dispatch, x, other in (("bf16", rows_bf16, deq), ("fp8", deq, rows_bf16)):
        layer.run = SimpleNamespace(dispatch_dtype=dispatch)
        b.update({"recv": to_bf16(x), **grads_of(x)})
        program.check_bf16_wgrads(layer, 0)
        b.update(grads_of(other))
        with pytest.raises(AssertionError, match="dw_gate"):  # weight gradients of other x rows
            program.check_bf16_wgrads(layer, 0)
    b.update({"recv": to_bf16(rows_bf16), **grads_of(rows_bf16)})  # fp8 dispatch, x not its dequantized codes
    with pytest.raises(AssertionError, match="recv is not"):
        program.check_bf16_wgrads(layer, 0)


def test_the_gpu_programs_accuracy_check_passes_the_mirror_and_refuses_bf16(monkeypatch):
    from mok_proto.problem import make_problem

    program = _check_program(monkeypatch)
    shape = MoEShape("acc", hidden=256, ffn=256, num_experts=8, top_k=2, num_tokens=64)
    prob = make_problem(shape, 2, seed=1)
    ref, mirror = prob.reference_results(bf16=True), program.mirror_results(prob)

    def by_rank(results):  # each rank's share: its tokens, its experts, the shared gradient on rank 0
        n, el = shape.num_tokens, shape.num_experts // 2
        return {r: {key: (v[r * el:(r + 1) * el] if key.startswith("w_") else
                          (v if r == 0 else np.zeros_like(v)) if key.startswith("shared_") else v[r * n:(r + 1) * n])
                    for key, v in results.items()} for r in range(2)}

    worst = program.check_accuracy(None, by_rank(mirror), ref, mirror, shape, 2)
    assert program.MIN_FP8_ERR < worst <= 0.08
    bf16 = {key: v.astype(np.float32) for key, v in ref.items()}  # a layer without FP8 quantization
    with pytest.raises(AssertionError, match="no FP8 quantization"):
        program.check_accuracy(None, by_rank(bf16), ref, bf16, shape, 2)
