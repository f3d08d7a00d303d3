"""CPU checks of bench_layer.py's library (mok_proto.bench: overlap, settings, layer, power): its pure
helpers, and its timing on stand-ins for the GPU (the GPU parts run on the device)."""

import pytest

from mok_proto.bench import layer as bench_layer
from mok_proto.bench import overlap, power
from mok_proto.bench import settings as bench_settings
from mok_proto.config import MOK_POLICY, get_shape
from mok_proto.plan import SEGMENT_ROWS, FusedKnobs


def test_overlap_ceiling_counts_gemm_and_outside_stages():
    # the backward: everything but the two transfers (1.0 + 0.5) and the gaps (0.5) stays
    bwd = {"scale": 0.5, "shared": 1.0, "rev_combine": 1.0, "experts": 4.0, "rev_dispatch": 0.5, "wgrad": 2.0,
           "token_grads": 0.5, "total": 10.0}
    assert overlap.overlap_ceiling(bwd, "bwd") == pytest.approx(10.0 / 8.0)
    # a plan that runs the token gradients (and the scale) inside the kernel may hide them as well
    assert overlap.overlap_ceiling(bwd, "bwd", ("token_grads",)) == pytest.approx(10.0 / 7.5)
    assert overlap.overlap_ceiling(bwd, "bwd", ("scale", "token_grads")) == pytest.approx(10.0 / 7.0)
    assert overlap.stages_inside({"scale": True, "token_grads": True}) == ("scale", "token_grads")
    assert overlap.stages_inside({"scale": False, "token_grads": True}) == ("token_grads",)
    assert overlap.stages_inside({"comm_blocks": 0}) == ()  # a forward row: nothing
    assert bench_settings.TOKEN_GRADS == {"default": None, "inside": True, "after": False}
    assert bench_settings.SCALE == {"default": None, "inside": True, "before": False}
    fwd = {"schedule": 0.1, "shared": 0.3, "dispatch": 0.1, "experts": 2.2, "combine": 0.1, "weighted_sum": 0.1,
           "total": 3.0}
    assert overlap.overlap_ceiling(fwd, "fwd") == pytest.approx(3.0 / 2.7)
    with pytest.raises(KeyError):  # a stage the layer no longer marks: the bench fails loudly, not silently
        overlap.overlap_ceiling({k: v for k, v in fwd.items() if k != "weighted_sum"}, "fwd")
    # through a ring of turns each turn is one stage (transfers and GEMMs): no ceiling from them
    ring = {"schedule": 0.1, "shared": 0.3, "turns": 2.5, "weighted_sum": 0.1, "total": 3.0}
    assert overlap.overlap_ceiling(ring, "fwd") is None
    assert overlap.overlap_ceiling({"shared": 1.0, "replay.1": 1.0, "turn.0": 3.0, "turn.1": 3.0,
                                    "token_grads": 0.5, "total": 9.0}, "bwd") is None


def test_direction_policies():
    from mok_proto.config import MOK_POLICY

    assert bench_settings.direction_policies("mok") == [MOK_POLICY]
    every = bench_settings.direction_policies("all")
    assert every[0] == MOK_POLICY and len(every) == 4 and len({tuple(p.values()) for p in every}) == 4
    # the backward mirrors the forward: reverse-combine goes the dispatch's way, reverse-dispatch the combine's
    assert all(p["rev_combine"] == p["dispatch"] and p["rev_dispatch"] == p["combine"] for p in every)
    named = bench_settings.direction_policies("push:pull:push:pull,pull:push:pull:push,push:pull:push:pull")
    assert named == [MOK_POLICY, {"dispatch": "push", "combine": "pull", "rev_combine": "push", "rev_dispatch": "pull"}]
    for bad in ("push:pull", "push:pull:push:sideways"):
        with pytest.raises(ValueError, match="--directions"):
            bench_settings.direction_policies(bad)


def test_fused_settings_keep_comm_ctas_only_where_a_transfer_runs_inside():
    k0, k8, k0_1024 = FusedKnobs(0, 2048), FusedKnobs(8, 2048), FusedKnobs(0, 1024)
    settings = (k0, k8)
    assert bench_settings.fused_settings_for(MOK_POLICY, settings) == {"fwd": settings, "bwd": settings}
    outside = {"dispatch": "push", "combine": "pull", "rev_combine": "push", "rev_dispatch": "pull"}
    assert bench_settings.fused_settings_for(outside, settings) == {"fwd": (k0,), "bwd": (k0,)}
    # MoK's best had communicating CTAs: the policy still gets a fused run, with every CTA computing
    assert bench_settings.fused_settings_for(outside, (k8,)) == {"fwd": (k0,), "bwd": (k0,)}
    half = {"dispatch": "pull", "combine": "pull", "rev_combine": "push", "rev_dispatch": "pull"}
    assert bench_settings.fused_settings_for(half, (k8, k0_1024)) == {"fwd": (k8, k0_1024), "bwd": (k0, k0_1024)}


def test_directions_rows_report_and_record(monkeypatch, capsys):
    """directions_rows on a stand-in for the GPU run: one line per pass, the sequential and fused
    rows recorded with the policy and the emulation's routing, and a fused result unequal to its
    sequential layer's fails."""
    from mok_proto.bench.emulation import make_inputs
    from mok_proto.config import get_shape

    data = make_inputs(get_shape("tiny"))
    policy = {"dispatch": "push", "combine": "pull", "rev_combine": "push", "rev_dispatch": "pull"}
    seen, recorded = [], []

    def fake_ours(shape, data, iters, warmup, settings, trace_to, pol):
        seen.append((settings, trace_to, pol))
        row = {"comm_blocks": 0, "minibatch_tokens": 2048, "median_ms": 2.0, "sequential_median_ms": 2.1,
               "speedup_vs_sequential": 1.05,
               "equal_to_sequential": True, "bitwise_repeat": True}
        return ({p: {"median_ms": 2.1} for p in ("fwd", "bwd")}, {p: {"total": 2.2} for p in ("fwd", "bwd")},
                {"fwd": True, "bwd": True}, None, {"fwd": [row], "bwd": [dict(row, equal_to_sequential=False)]})

    monkeypatch.setattr(bench_layer, "ours", fake_ours)
    monkeypatch.setattr(bench_layer, "append_result", lambda name, row: recorded.append((name, row)))
    knobs = [FusedKnobs(comm, 2048, assign="balanced", raster="col") for comm in (0, 8)]
    failed = bench_layer.directions_rows("kimi-k2.7", None, data, policy, knobs, 3, 1)
    assert seen == [({"fwd": (knobs[0],), "bwd": (knobs[0],)}, None, policy)]
    assert failed == ["kimi-k2.7 bwd directions push:pull:push:pull"]
    assert [(n, r["pass"], r["schedule"]) for n, r in recorded] == [
        ("bench_layer_directions", "fwd", "sequential"), ("bench_layer_directions", "fwd", "fused"),
        ("bench_layer_directions", "bwd", "sequential"), ("bench_layer_directions", "bwd", "fused")]
    assert all(r["policy"] == policy and r["routing"] == "uniform" for _, r in recorded)
    assert all(r["emulation"] == "2 virtual ranks, rank 0 timed" for _, r in recorded)
    out = capsys.readouterr().out
    assert ("directions push:pull:push:pull fwd: sequential 2.100 ms; fused comm=0 minibatch=2048 2.000 ms against "
            "2.100 interleaved (x 1.05") in out


def test_rotating_interleaves_and_rotates_the_runs():
    # every run once per iteration, as a stage named after it, the first one moving along each
    # iteration; paired_ratio: the median of the per-iteration ratios
    from mok_proto.bench import paired_ratio, rotating

    calls = []
    enqueue = rotating({name: (lambda name=name: calls.append(("run", name))) for name in ("a", "b", "c")})
    for _ in range(4):
        enqueue(lambda stage: calls.append(("mark", stage)))
    firsts = [calls[i + 1][1] for i in range(0, len(calls), 7)]
    assert firsts == ["a", "b", "c", "a"]
    assert calls[:7] == [("mark", "a"), ("run", "a"), ("mark", "b"), ("run", "b"), ("mark", "c"), ("run", "c"),
                         ("mark", None)]
    assert calls[7:14] == [("mark", "b"), ("run", "b"), ("mark", "c"), ("run", "c"), ("mark", "a"), ("run", "a"),
                           ("mark", None)]
    assert paired_ratio([2.0, 3.0, 10.0], [1.0, 2.0, 2.0]) == 2.0  # (2, 1.5, 5): not 5 / 2 or 3 / 2
    for bad in (([1.0], [1.0, 2.0]), ([], [])):
        with pytest.raises(ValueError, match="paired samples"):
            paired_ratio(*bad)


def test_fused_times_each_setting_against_the_sequential_pass(monkeypatch):
    """bench_layer.fused on stand-ins for the layer, its graphs and the event timing: each setting
    interleaved with the sequential graph, x sequential the median of the per-iteration ratios,
    the best setting the largest ratio (not the smallest median: the two settings ran under other
    clocks), its results read after a replay of its own graph."""
    import contextlib
    from types import SimpleNamespace

    # ms of (stage, setting) per iteration: setting 2 ran under slower clocks (both graphs slower)
    # but gains more over the sequential pass than setting 0
    ms = {("fused", 0): [2.0, 2.0, 2.2], ("sequential", 0): [2.1, 2.1, 2.2],
          ("fused", 2): [2.1, 2.1, 2.3], ("sequential", 2): [2.4, 2.4, 2.5]}

    class Layer:
        trace, last, fused = False, None, None

        def fused_forward_plan(self, knobs):
            return SimpleNamespace(comm=knobs.comm_blocks, num_sms=8, claim_pairs=0, policy=dict(MOK_POLICY))

        def set_forward_plan(self, plan):
            self.fused = None if plan is None else SimpleNamespace(plan=plan)

        def set_backward_plan(self, plan):
            assert plan is None

        def enqueue_forward(self):
            pass

        enqueue_backward = check = enqueue_forward

        def capture(self, forward=True, backward=True):
            return Graph(self, "fused", self.fused.plan.comm)

    class Graph:
        def __init__(self, layer, name, comm):
            self.layer, self.name, self.comm = layer, name, comm

        def launch(self, stream):
            self.layer.last = (self.name, self.comm)

    def fake_time_stages(enqueue, iters, warmup):
        samples = {}
        for i in range(iters):
            marks = []
            enqueue(lambda stage: marks.append((stage, layer.last)))
            for stage, _ in marks[:-1]:
                comm = layer.fused.plan.comm
                samples.setdefault(stage, []).append(ms[(stage, comm)][i])
        return samples

    layer = Layer()
    sequential_graph = Graph(layer, "sequential", None)
    monkeypatch.setattr(bench_layer, "time_stages", fake_time_stages)
    monkeypatch.setattr(bench_layer, "result_bytes",
                        lambda lay, pass_: b"fused bits" if lay.last[0] == "fused" else b"sequential bits")
    class Stream(contextlib.nullcontext):
        def synchronize(self):
            pass

    settings = [FusedKnobs(comm, 256, raster="col") for comm in (0, 2)]
    rows = bench_layer.fused(layer, settings, b"fused bits", sequential_graph, 3, 1, Stream(), None, "fwd")
    by_comm = {r["comm_blocks"]: r for r in rows}
    assert by_comm[0]["speedup_vs_sequential"] == pytest.approx(2.1 / 2.0)  # median of 1.05, 1.05, 1.0
    assert by_comm[2]["speedup_vs_sequential"] == pytest.approx(2.4 / 2.1)
    assert by_comm[0]["median_ms"] == 2.0 and by_comm[2]["sequential_median_ms"] == 2.4
    assert all(r["equal_to_sequential"] and r["bitwise_repeat"] and r["raster"] == "col" for r in rows)
    # the knobs as the rows record them (FusedKnobs.describe): the forward's, claim as given
    assert {k: by_comm[2][k] for k in ("comm_blocks", "minibatch_tokens", "assign", "claim", "claim_pairs")} == {
        "comm_blocks": 2, "minibatch_tokens": 256, "assign": "round_robin", "claim": None, "claim_pairs": 0}
    assert "token_grads" not in by_comm[2] and "scale" not in by_comm[2]
    assert "retimed_median_ms" in by_comm[2] and "retimed_median_ms" not in by_comm[0]  # the larger ratio
    assert bench_layer.best_row(rows) is by_comm[2]


def test_fused_rows_record_the_backward_knobs_the_plan_ran():
    # an FP8 layer's plan runs its token gradients and routed weight gradients after the kernel
    # though the knobs leave them to the default (None): the row says what ran
    from mok_proto import plan as P

    knobs = FusedKnobs(0, 256)
    ran = P.fused_backward(get_shape("tile"), 2, FusedKnobs(0, 256, token_grads=False, routed_wgrads=False),
                           policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    row = bench_layer.knobs_as_run(knobs, ran, "bwd").describe("bwd", MOK_POLICY)
    assert (row["token_grads"], row["scale"], row["routed_wgrads"]) == (False, True, False)
    assert knobs.describe("bwd", MOK_POLICY)["token_grads"]  # (what the knobs alone would have said)
    bf16 = P.fused_backward(get_shape("tile"), 2, knobs, policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    assert bench_layer.knobs_as_run(knobs, bf16, "bwd").describe("bwd", MOK_POLICY) == knobs.describe("bwd", MOK_POLICY)
    assert bench_layer.knobs_as_run(knobs, None, "fwd") is knobs


# nvidia-smi samples of power_probe.py (mok_proto.bench.power)
SMI_LINES = ["timestamp, clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active",  # a header
             "2026/12/01 20:45:10.000, 1980, 300.00, 0x0000000000000000",
             "2026/12/01 20:45:10.200, 1500, 690.00, 0x0000000000000004",
             "2026/12/01 20:45:10.400, 1400, 700.00, 0x0000000000000004",
             "2026/12/01 20:45:10.600, 1700, 650.00, 0x0000000000000000",
             "2026/12/01 20:45:10.8"]  # cut off by the kill


def test_smi_samples_parse_and_skip_what_does_not():
    from mok_proto.bench import smi_samples

    s = smi_samples(SMI_LINES)
    assert len(s) == 4 and list(s["sm_mhz"]) == [1980, 1500, 1400, 1700] and list(s["reasons"]) == [0, 4, 4, 0]
    assert s["t"][1] - s["t"][0] == pytest.approx(0.2) and s["power_w"][2] == 700.0


def test_phase_power_means_the_settled_samples_only():
    from mok_proto.bench import phase_power, smi_samples

    s = smi_samples(SMI_LINES)
    t0 = s["t"][0]
    got = phase_power(s, t0, t0 + 0.45, settle_s=0.1)  # the samples at +0.2 and +0.4
    assert got == {"sm_mhz": 1450.0, "power_w": 695.0, "power_capped": 1.0, "samples": 2}
    assert phase_power(s, t0, t0 + 0.65, settle_s=0.1)["power_capped"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="no nvidia-smi sample"):
        phase_power(s, t0 + 0.41, t0 + 0.5, settle_s=0.0)


def test_smi_command_samples_one_gpu():
    from mok_proto.bench import SMI_QUERY, smi_command

    loop, once = smi_command("00000000:19:00.0"), smi_command(3, None)
    assert loop[:3] == ["nvidia-smi", "-i", "00000000:19:00.0"] and loop[-2:] == ["-lms", "20"]
    assert once[:3] == ["nvidia-smi", "-i", "3"] and "-lms" not in once and f"--query-gpu={SMI_QUERY}" in once


def test_fused_settings_take_a_claim():
    assert bench_settings.parse_settings("0:2048,8:1024:264,0:2048:all,0:512:tail") == (
        FusedKnobs(0, 2048), FusedKnobs(8, 1024, claim=264), FusedKnobs(0, 2048, claim="all"),
        FusedKnobs(0, 512, claim="tail"))
    for bad in ("0", "0:2048:some", "a:2048", "0:2048:1:2", "0:100"):
        with pytest.raises(ValueError, match="--fused"):
            bench_settings.parse_settings(bad)
    policy = {"dispatch": "push", "combine": "pull", "rev_combine": "pull", "rev_dispatch": "push"}
    got = bench_settings.fused_settings_for(policy, (FusedKnobs(8, 2048, claim=264), FusedKnobs(0, 2048, claim=264)))
    assert got["fwd"] == (FusedKnobs(0, 2048, claim=264),)
    assert got["bwd"] == (FusedKnobs(8, 2048, claim=264), FusedKnobs(0, 2048, claim=264))


def test_power_probe_compares_the_phases_of_one_shape_and_pass():
    compare = power.compare
    row = lambda shape, pass_, schedule, ms, mhz, w: dict(  # noqa: E731
        shape=shape, pass_=pass_, schedule=schedule, median_ms=ms, sm_mhz=mhz, power_w=w, energy_mj=ms * w,
        power_capped=1.0)
    phases = [row("a", "fwd", "sequential", 2.0, 1500, 700), row("a", "fwd", "fused", 2.2, 1200, 690),
              row("a", "fwd", "sequential", 2.2, 1500, 700), row("a", "fwd", "fused", 1.8, 1200, 710),
              row("a", "bwd", "sequential", 9.0, 1000, 100), row("b", "fwd", "fused", 9.0, 1000, 100)]
    seq, fus, ratio = compare(phases, "a", "fwd")  # other passes and shapes are not averaged in
    assert seq["median_ms"] == pytest.approx(2.1) and fus["median_ms"] == pytest.approx(2.0)
    assert seq["sm_mhz"] == 1500 and fus["power_w"] == pytest.approx(700)
    assert ratio["x_seq"] == pytest.approx(2.1 / 2.0) and ratio["clock"] == pytest.approx(0.8)
    assert ratio["energy"] == pytest.approx((2.2 * 690 + 1.8 * 710) / 2 / ((2.0 * 700 + 2.2 * 700) / 2))
    assert ratio["x_cycles"] == pytest.approx(2.1 * 1500 / (2.0 * 1200))  # at equal clocks: 1.3125


# --- bench_layer.py's rows and verdicts (mok_proto.bench.layer_rows), on made-up measurements -------
def _fused_row(comm, ms, seq_ms, equal=True, best=None, claim=None):
    """A fused row as bench_layer.fused makes it; best=(fused ms, sequential ms) of its timing again."""
    row = {"comm_blocks": comm, "minibatch_tokens": 2048, "num_sms": 132, "assign": "round_robin", "raster": "row",
           "claim": claim, "claim_pairs": 264, "median_ms": ms, "p20_ms": ms, "p80_ms": ms, "iters": 5,
           "sequential_median_ms": seq_ms, "speedup_vs_sequential": seq_ms / ms, "equal_to_sequential": equal,
           "bitwise_repeat": True}
    if best:
        row.update(retimed_median_ms=best[0], retimed_sequential_median_ms=best[1],
                   retimed_speedup_vs_sequential=best[1] / best[0], trace_on_median_ms=best[0])
    return row


def _measured(fused_fwd, fused_bwd, seq_ms=(2.0, 5.0), results=None):
    import numpy as np

    from mok_proto.bench.layer import Measured

    stats = {p: {"median_ms": m, "p20_ms": m, "p80_ms": m, "iters": 5} for p, m in zip(("fwd", "bwd"), seq_ms)}
    stages = {"fwd": {"schedule": 0.1, "shared": 0.3, "dispatch": 0.1, "experts": 1.2, "combine": 0.1,
                      "weighted_sum": 0.1, "total": 2.2},
              "bwd": {"scale": 0.2, "shared": 1.0, "rev_combine": 0.4, "experts": 2.0, "rev_dispatch": 0.4,
                      "wgrad": 1.0, "token_grads": 0.2, "total": 5.4}}
    results = results or {k: np.full(4, i, np.float32) for i, k in enumerate(("out", "w_down", "w_gate", "w_up"))}
    return Measured(stats, stages, {"fwd": True, "bwd": True}, results, {"fwd": fused_fwd, "bwd": fused_bwd})


def _torch(out_ms=(2.5, 8.0)):
    import numpy as np

    ref = {k: np.full(4, i, np.float32) for i, k in enumerate(("out", "w_down", "w_gate", "w_up"))}
    ref["out"] = ref["out"] + 1.0  # out 0 against 1: a relative error of 1 would fail; keep it small below
    stats = {"fwd": {"median_ms": out_ms[0], "iters": 5}, "bwd": {"median_ms": out_ms[1], "iters": 5,
                                                               "variant_2n_bwd_ms": 6.0}}
    return stats, ref


def test_rows_keep_their_fields_and_bars_judge_the_best_setting():
    """The rows without the link are today's (same fields, `link_gbps` null added), the fused
    verdicts use the best setting's timing again, and --bar values replace the defaults."""
    import numpy as np

    from mok_proto.bench.cli import parse_bars
    from mok_proto.bench.emulation import emulated_shape
    from mok_proto.bench.layer_rows import BARS, shape_report

    shape = emulated_shape("kimi-k2.7")
    fwd = [_fused_row(0, 1.7, 2.0, best=(1.75, 2.0)), _fused_row(8, 1.9, 2.0)]
    bwd = [_fused_row(0, 4.0, 5.0, best=(4.2, 5.0))]
    measured = _measured(fwd, bwd)
    base, ref = _torch()
    ref["out"] = measured.results["out"] * np.float32(1.01)  # a 1% error: within TORCH_REL_ERR
    report = shape_report("kimi-k2.7", shape, measured, (base, ref), ({"median_ms": 0.03}, True), BARS)
    names = [(f, r["schedule"], r["pass"]) for f, r in report.rows]
    assert names == [("bench_layer", "torch", "fwd"), ("bench_layer", "sequential", "fwd"),
                     ("bench_layer", "torch", "bwd"), ("bench_layer", "sequential", "bwd"),
                     ("bench_layer", "fused", "fwd"), ("bench_layer", "fused", "fwd"), ("bench_layer", "fused", "bwd")]
    seq = report.rows[1][1]
    assert set(seq) == {"shape", "pass", "ep", "emulation", "routing", "flops", "schedule_ms", "schedule_exact",
                        "link_gbps",
                        "schedule", "median_ms", "p20_ms", "p80_ms", "iters", "tflops", "speedup_vs_torch",
                        "bitwise_repeat", "max_rel_err_vs_torch", "stages_ms", "speedup_vs_torch_variant_2n",
                        "replay_ms"}
    assert seq["link_gbps"] is None and seq["speedup_vs_torch"] == pytest.approx(2.5 / 2.0) and seq["ep"] == 64
    fused = report.rows[4][1]
    assert fused["best_of_run"] and not report.rows[5][1]["best_of_run"] and fused["link_gbps"] is None
    assert fused["speedup_vs_torch"] == pytest.approx(2.5 / 1.7)
    assert fused["overlap_ceiling_vs_sequential"] == pytest.approx(2.2 / (0.3 + 1.2 + 0.1 + 0.1))
    # fwd: 2.5 / 1.75 = 1.43x torch (>= 1.2), 2.0 / 1.75 = 1.14x sequential (>= 1.1): met;
    # bwd: 8.0 / 4.2 = 1.90x torch, 5.0 / 4.2 = 1.19x sequential: met; sequential bwd 8 / 5 = 1.6x torch
    assert report.failed == []
    # the retimed figure is judged, not the first: a retimed 1.85 ms forward is 1.08x sequential
    fwd[0]["retimed_speedup_vs_sequential"] = 2.0 / 1.85
    assert shape_report("kimi-k2.7", shape, measured, (base, ref), ({"median_ms": 0.03}, True),
                          BARS).failed == ["kimi-k2.7 fused fwd"]
    lowered = parse_bars(["fused_fwd_x_seq=1.05"], BARS)
    assert shape_report("kimi-k2.7", shape, measured, (base, ref), ({"median_ms": 0.03}, True),
                          lowered).failed == []
    # the schedule's bar is a ceiling; the sequential passes' bars x torch
    slow = shape_report("kimi-k2.7", shape, measured, (base, ref), ({"median_ms": 0.06}, True), lowered)
    assert slow.failed == ["kimi-k2.7 fwd", "kimi-k2.7 bwd"]
    assert any("(bar 1.05;" in line for line in slow.lines)  # the bar printed is the one judged
    torch_slower = shape_report("kimi-k2.7", shape, measured, ({**base, "bwd": {**base["bwd"], "median_ms": 6.0}},
                                                                 ref), ({"median_ms": 0.03}, True), lowered)
    assert torch_slower.failed == ["kimi-k2.7 bwd", "kimi-k2.7 fused bwd"]  # 6 / 5 = 1.2x < 1.3; 6 / 4.2 < 1.6
    # a skewed routing: every row records the emulation's fields, the FLOPs count rank 0's received rows
    skewed = {"emulation": "5 virtual ranks, rank 0 timed", "routing": "hot:0.25", "received_rows": 3 * 16384}
    rows = [r for _, r in shape_report("kimi-k2.7", shape, measured, (base, ref), ({"median_ms": 0.03}, True),
                                       BARS, skewed).rows]
    assert len(rows) == 7 and all({**r, **skewed} == r for r in rows)
    extra = 6 * shape.hidden * shape.ffn * 2 * 16384  # 2 N K more routed rows than uniform's N K
    assert [r["flops"] for r in rows[:2]] == [shape.forward_flops() + extra] * 2


def test_overlap_efficiency_is_the_share_of_the_link_cost_the_fused_pass_hides():
    from mok_proto.bench.layer_rows import overlap_efficiency

    # the link adds 2 ms to the sequential pass and 0.5 ms to the fused one: 75% hidden
    assert overlap_efficiency(10.0, 12.0, 8.0, 8.5) == pytest.approx(0.75)
    assert overlap_efficiency(10.0, 12.0, 8.0, 8.0) == pytest.approx(1.0)  # all hidden
    assert overlap_efficiency(10.0, 12.0, 8.0, 10.0) == pytest.approx(0.0)  # none: the fused pass pays it all
    assert overlap_efficiency(10.0, 12.0, 8.0, 11.0) == pytest.approx(-0.5)  # it pays more than the sequential
    # nothing to hide: the link adds no time to the sequential pass (or the clocks hid it): undefined
    assert overlap_efficiency(10.0, 10.0, 8.0, 8.5) is None and overlap_efficiency(10.0, 9.9, 8.0, 8.5) is None


def _link_case(link_fwd=None, link_bwd=None, equal=True):
    """A no-link run and a link run of the same settings, in another order, with distinct figures
    per setting (so a row paired with the wrong setting gets a wrong efficiency)."""
    import numpy as np

    no_link = _measured([_fused_row(0, 1.70, 2.00, best=(1.70, 2.00)), _fused_row(8, 1.90, 2.05)],
                        [_fused_row(0, 4.00, 5.00, best=(4.00, 5.00)), _fused_row(8, 4.50, 5.10)],
                        seq_ms=(1.95, 4.9))
    link_fwd = link_fwd or [_fused_row(8, 2.30, 2.65), _fused_row(0, 1.80, 2.40, best=(1.82, 2.42))]
    link_bwd = link_bwd or [_fused_row(8, 5.60, 6.00), _fused_row(0, 4.30, 6.10, best=(4.25, 6.00))]
    results = {k: v.copy() for k, v in no_link.results.items()}
    if not equal:
        results["w_up"].view(np.uint32)[0] ^= 1  # one bit of one gradient
    return no_link, _measured(link_fwd, link_bwd, seq_ms=(2.3, 6.2), results=results)


def test_link_rows_pair_each_setting_with_itself_without_the_link():
    from mok_proto.bench.emulation import emulated_shape
    from mok_proto.bench.layer_rows import BARS, LINK_FILE, link_report
    from mok_proto.link import LinkModel

    link = LinkModel(368, every_row=True)
    no_link, measured = _link_case()
    report = link_report("kimi-k2.7", emulated_shape("kimi-k2.7"), link, measured, no_link, BARS)
    assert all(f == LINK_FILE for f, _ in report.rows)
    rows = {(r["pass"], r["schedule"], r.get("comm_blocks")): r for _, r in report.rows}
    assert all(r["link_gbps"] == 368 and r["link_every_row"] and "speedup_vs_torch" not in r for r in rows.values())
    seq = rows["fwd", "sequential", None]
    assert seq["median_ms"] == 2.3 and seq["no_link_median_ms"] == 1.95 and seq["equal_to_no_link"]
    # each fused row against the same setting without the link, from the interleaved medians
    # (not the sequential graph's 1.95 / 2.3 ms): comm 8: 1 - (2.30 - 1.90) / (2.65 - 2.05)
    assert rows["fwd", "fused", 8]["overlap_efficiency"] == pytest.approx(1 - 0.40 / 0.60)
    assert rows["fwd", "fused", 0]["overlap_efficiency"] == pytest.approx(1 - 0.10 / 0.40)
    assert rows["fwd", "fused", 8]["no_link_median_ms"] == 1.90 and rows["bwd", "fused", 8]["no_link_median_ms"] == 4.5
    # the best (largest x sequential) is judged on its timing again: 1 - (1.82 - 1.70) / (2.42 - 2.00)
    best = rows["fwd", "fused", 0]
    assert best["best_of_run"] and best["retimed_overlap_efficiency"] == pytest.approx(1 - 0.12 / 0.42)
    assert "retimed_overlap_efficiency" not in rows["fwd", "fused", 8]
    assert rows["bwd", "fused", 0]["retimed_overlap_efficiency"] == pytest.approx(1 - 0.25 / 1.00)
    assert all(r["equal_to_no_link"] for r in rows.values())
    # met: fwd x sequential 2.42 / 1.82 = 1.33 (>= 1.15), overlap 0.71 < 0.8: missed; bwd 0.75 < 0.8: missed
    assert [f.split(": ", 1)[1] for f in report.failed] == ["overlap efficiency 0.71, bar >= 0.8",
                                                            "overlap efficiency 0.75, bar >= 0.8"]
    assert report.failed[0].startswith("kimi-k2.7 link 368 GB/s fused fwd")
    assert len(report.table) == 2 and report.table[0].split()[:2] == ["kimi-k2.7", "fwd"]


def test_link_bars_and_checks_each_catch_their_miss():
    from mok_proto.bench.cli import parse_bars
    from mok_proto.bench.emulation import emulated_shape
    from mok_proto.bench.layer_rows import BARS, link_report, link_table
    from mok_proto.link import LinkModel

    shape, link = emulated_shape("kimi-k2.7"), LinkModel(900, latency_us=2.0, every_row=True)
    lenient = parse_bars(["link_overlap_fwd=0.7,link_overlap_bwd=0.7,link_judged_gbps=900"], BARS)
    no_link, measured = _link_case()
    assert link_report("kimi-k2.7", shape, link, measured, no_link, lenient).failed == []
    # the forward's x sequential at the link speed: 2.42 / 2.15 = 1.13 < 1.15, and its efficiency
    # 1 - (2.15 - 1.70) / (2.42 - 2.00) = -0.07; the backward (5.2 / 4.6 = 1.13) has no x sequential bar
    no_link, measured = _link_case(link_fwd=[_fused_row(8, 2.30, 2.65), _fused_row(0, 1.80, 2.40, best=(2.15, 2.42))],
                                   link_bwd=[_fused_row(0, 4.30, 5.50, best=(4.60, 5.20)), _fused_row(8, 5.6, 6.0)])
    failed = link_report("kimi-k2.7", shape, link, measured, no_link, lenient).failed
    assert len(failed) == 3 and "fused fwd: x sequential 1.13, bar >= 1.15" in failed[0]
    assert "fused fwd: overlap efficiency -0.07, bar >= 0.7" in failed[1]
    assert "fused bwd: overlap efficiency -2.00" in failed[2]  # 1 - (4.6 - 4.0) / (5.2 - 5.0)
    # a link that costs the sequential pass nothing leaves the efficiency undefined: not met
    no_link, measured = _link_case(link_bwd=[_fused_row(0, 4.30, 4.90, best=(4.25, 4.95))])
    failed = link_report("kimi-k2.7", shape, link, measured, no_link, lenient).failed
    assert len(failed) == 1 and "fused bwd: overlap efficiency undefined" in failed[0]
    # results that differ from the run without the link (one bit of one gradient): the backward's
    # sequential row and every backward fused row fail; the forward's output is the same
    no_link, measured = _link_case(equal=False)
    report = link_report("kimi-k2.7", shape, link, measured, no_link, lenient)
    assert [f.split(": ", 1)[0] for f in report.failed] == ["kimi-k2.7 link 900 GB/s bwd",
                                                            "kimi-k2.7 link 900 GB/s fused bwd comm=8 minibatch=2048",
                                                            "kimi-k2.7 link 900 GB/s fused bwd comm=0 minibatch=2048"]
    assert all("not equal to the run without the link" in f for f in report.failed[1:])
    # a fused result unequal to the sequential pass of its own run
    no_link, measured = _link_case(link_fwd=[_fused_row(8, 2.30, 2.65, equal=False),
                                             _fused_row(0, 1.80, 2.40, best=(1.82, 2.42))])
    failed = link_report("kimi-k2.7", shape, link, measured, no_link, lenient).failed
    assert len(failed) == 1 and failed[0].endswith("not equal to sequential, not equal to the run without the link")
    lines = link_table(link, report.table)
    assert "900 GB/s per direction, round trip 2 us" in lines[0] and lines[1].split()[:3] == ["shape", "pass", "seq_ms"]


def test_link_speed_bars_are_judged_only_up_to_link_judged_gbps():
    from mok_proto.bench.cli import parse_bars
    from mok_proto.bench.emulation import emulated_shape
    from mok_proto.bench.layer_rows import BARS, link_report
    from mok_proto.link import LinkModel

    # a forward 1.13x sequential with efficiency -0.07 and a backward that differs from the run without the link
    slow = dict(link_fwd=[_fused_row(0, 1.80, 2.40, best=(2.15, 2.42))], equal=False)
    shape = emulated_shape("kimi-k2.7")
    for gbps, judged in ((368, True), (900, False)):
        no_link, measured = _link_case(**slow)
        report = link_report("kimi-k2.7", shape, LinkModel(gbps, latency_us=2.0, every_row=True), measured, no_link, BARS)
        speed = [f for f in report.failed if "x sequential" in f or "overlap efficiency" in f]
        assert bool(speed) == judged, (gbps, report.failed)
        assert any("not equal to the run without the link" in f for f in report.failed)  # always judged
        fwd = report.table[0].split()
        assert (fwd[7], fwd[9]) == (("1.15", "0.8") if judged else ("-", "-"))
    lowered = parse_bars(["link_judged_gbps=1000"], BARS)
    no_link, measured = _link_case(**slow)
    failed = link_report("kimi-k2.7", shape, LinkModel(900, latency_us=2.0, every_row=True), measured, no_link,
                         lowered).failed
    assert any("x sequential 1.13" in f for f in failed)


def test_same_results_compares_the_pass_s_own_results_bit_for_bit():
    import numpy as np

    from mok_proto.bench.layer_rows import same_results

    a = {"out": np.zeros(3, np.float32), "w_up": np.ones(3, np.float32), "x": np.ones(2, np.float32)}
    b = {k: v.copy() for k, v in a.items()}
    assert same_results(a, b, "fwd") and same_results(a, b, "bwd")
    b["x"][1] = -0.0 + 1.0000001  # one ulp off in one gradient
    assert same_results(a, b, "fwd") and not same_results(a, b, "bwd")
    c = {k: v.copy() for k, v in a.items()}
    c["out"][0] = -0.0  # equal as numbers, not as bits
    assert not same_results(a, c, "fwd") and same_results(a, c, "bwd")


def test_timeline_paths_keep_the_runs_apart():
    from mok_proto.bench.timeline_plot import timeline_path
    from mok_proto.link import LinkModel

    template = "results/timeline_fused_{link}{pass_}_{shape}_{git}.jsonl"
    assert timeline_path(template, "kimi-k2.7", "abc1234") == "results/timeline_fused_{pass_}_kimi-k2.7_abc1234.jsonl"
    assert (timeline_path(template, "kimi-k2.7", "abc1234", LinkModel(368.5)) ==
            "results/timeline_fused_link368.5_{pass_}_kimi-k2.7_abc1234.jsonl")
    assert timeline_path("", "kimi-k2.7", "abc1234") is None


def test_a_timeline_in_results_timelines_is_stored_and_indexed(tmp_path):
    """bench_layer's and sweep_overlap's timelines go into results/timelines/ gzipped, each with its
    index row (what the simulator and the notebooks find them by); a name taken gets a suffix; a
    timeline written elsewhere is left alone."""
    import gzip
    import json

    import numpy as np

    from mok_proto import results
    from mok_proto.bench import rows
    from mok_proto.bench.timeline_plot import free_timeline_path, index_timeline, write_timeline
    from mok_proto.trace import TRACE_DTYPE

    records = np.zeros(3, TRACE_DTYPE)
    records["end_ns"] = [100, 200, 300]
    plan = {"bench": "bench_layer", "shape": "kimi-k2.7", "comm_blocks": 0, "minibatch_rows": 2048, "claim_pairs": 9}
    stored, name = [], "timeline_fused_fwd_kimi-k2.7_abc1234.jsonl"
    for n in range(2):  # the same name twice (a second run at the same commit, or the other dispatch dtype)
        path = free_timeline_path(tmp_path / "timelines" / name, tmp_path)  # as bench/layer.py writes it
        write_timeline(records[:3 - n], path, "a title")
        stored.append(index_timeline(path, "fwd", plan, results_dir=tmp_path))
        assert not path.exists()  # the plain file is stored gzipped
    assert [r["file"] for r in stored] == ["timeline_fused_fwd_kimi-k2.7_abc1234.jsonl.gz",
                                           "timeline_fused_fwd_kimi-k2.7_abc1234_2.jsonl.gz"]
    first = results.timeline_index(tmp_path, "fwd", bench="bench_layer", shape="kimi-k2.7")[0]
    assert {k: first[k] for k in ("pass", "git", "comm_blocks", "minibatch_rows", "claim_pairs", "png")} == {
        "pass": "fwd", "git": rows.git_sha(), "comm_blocks": 0, "minibatch_rows": 2048, "claim_pairs": 9,
        "png": "timeline_fused_fwd_kimi-k2.7_abc1234.png"}
    assert all(first[k] == v for k, v in rows.kernel_features().items()) and "gpu" in first and "time" in first
    assert stored[1]["png"] == "timeline_fused_fwd_kimi-k2.7_abc1234_2.png"
    assert all((tmp_path / "timelines" / r["png"]).exists() for r in stored)  # each keeps its own picture
    # written at a taken name all the same, a timeline is still stored under a free one
    write_timeline(records, tmp_path / "timelines" / name, "a title")
    assert index_timeline(tmp_path / "timelines" / name, "fwd", plan, results_dir=tmp_path)["file"] == (
        "timeline_fused_fwd_kimi-k2.7_abc1234_3.jsonl.gz")
    assert free_timeline_path(tmp_path / name, tmp_path) == tmp_path / name  # elsewhere: as given, held or not
    with gzip.open(first["path"], "rt") as f:
        assert [json.loads(line)["end_ns"] for line in f] == [100, 200, 300]
    assert len(results.load_timeline(first["path"])) == 3
    elsewhere = tmp_path / "scratch.jsonl"
    write_timeline(records, elsewhere, "a title")
    assert index_timeline(elsewhere, "fwd", plan, results_dir=tmp_path) is None and elsewhere.exists()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_each_link_speed_runs_the_same_passes_with_only_the_link_added(monkeypatch, precision):
    """bench_layer.py's run of a shape (layer_run.run_shape) on stand-ins for the GPU: the run without
    the link, then per link speed the same `ours` call (shape, data, iters, settings) with the link
    and its own timeline; torch and the schedule once; the rows without the link to bench_layer,
    with `link_gbps` null, those with the link to bench_layer_link, judged against the same run. An
    FP8 layer's timelines are indexed with its precision and dispatch dtype (a BF16 one's without)."""
    from types import SimpleNamespace

    from mok_proto.bench import layer_run
    from mok_proto.bench.emulation import emulated_shape
    from mok_proto.bench.layer_rows import BARS, LINK_FILE, Report
    from mok_proto.link import LinkModel
    from mok_proto.routing import UNIFORM

    no_link, measured = _link_case()
    calls, reports = [], []

    def fake_ours(shape, data, iters, warmup, settings, trace_to, index=None, link=None, macrobatch_rows=None,
                  precision=None, dispatch_dtype=None, wgrad_precision=None):
        calls.append(dict(shape=shape.name, data=data, iters=iters, warmup=warmup, settings=settings,
                          trace_to=trace_to, index=index, link=link, ring=macrobatch_rows,
                          run=(precision, dispatch_dtype), wgrad=wgrad_precision))
        return no_link if link is None else measured

    monkeypatch.setattr(layer_run, "ours", fake_ours)
    fields = {"emulation": "2 virtual ranks, rank 0 timed", "routing": "uniform", "received_rows": 16384}
    monkeypatch.setattr(layer_run, "emulated_inputs",
                        lambda name, routing: (emulated_shape(name), {"topk_idx": [0, 1], "routing": routing}))
    monkeypatch.setattr(layer_run, "row_fields", lambda data: fields)
    monkeypatch.setattr(layer_run, "torch_pipeline", lambda *a: calls.append("torch") or _torch())
    monkeypatch.setattr(layer_run, "schedule_at_ep64", lambda *a: calls.append("schedule") or ({"median_ms": 0.03}, True))
    monkeypatch.setattr(layer_run, "git_sha", lambda: "abc1234")
    links = [LinkModel(368, every_row=True), LinkModel(900, every_row=True)]
    settings = {"fwd": [FusedKnobs(0, 2048), FusedKnobs(8, 2048)], "bwd": [FusedKnobs(0, 2048)]}
    args = SimpleNamespace(iters=3, warmup=1, settings=settings, bars=BARS, links=links, routing=UNIFORM,
                           timeline="results/timelines/timeline_fused_{link}{pass_}_{shape}_{git}.jsonl",
                           macrobatch_rows="0.25x", precision=precision, dispatch_dtypes=[precision])
    if precision == "bf16":
        monkeypatch.setattr(layer_run, "fp8_run", lambda *a: pytest.fail("an FP8 baseline in a BF16 run"))
    else:
        monkeypatch.setattr(layer_run, "fp8_run", lambda *a: calls.append("fp8 baselines"))
    got, tables = layer_run.run_shape("kimi-k2.7", args, reports.append)
    assert got is no_link and list(tables) == links and all(len(t) == 2 for t in tables.values())
    ours_calls = [c for c in calls if isinstance(c, dict)]
    assert [c["link"] for c in ours_calls] == [None, *links]
    assert calls[1:3] == ["torch", "schedule"] if precision == "bf16" else calls[1:4] == ["torch", "fp8 baselines", "schedule"]
    for c in ours_calls:  # the same call but for the link; the ring a quarter of rank 0's 16384 rows
        assert (c["shape"], c["data"], c["iters"], c["warmup"], c["settings"], c["ring"], c["run"]) == (
            "kimi-k2.7@ep64", {"topk_idx": [0, 1], "routing": UNIFORM}, 3, 1, settings, 4096, (precision, precision))
    assert fields["macrobatch_rows"] == 4096  # the ring asked for: a quarter of rank 0's rows
    from mok_proto.memory import layer_memory

    def memory(**kinds):  # what the layer's real EP=64 rank needs with its default ring
        return layer_memory(get_shape("kimi-k2.7"), 64, **kinds).total_bytes

    kinds = {} if precision == "bf16" else dict(precision="fp8", dispatch_dtype="fp8")
    assert {r["memory_bytes"] for rep in reports for _, r in rep.rows} == {memory(**kinds)}
    assert [c["trace_to"] for c in ours_calls] == [
        "results/timelines/timeline_fused_{pass_}_kimi-k2.7_abc1234.jsonl",
        "results/timelines/timeline_fused_link368_{pass_}_kimi-k2.7_abc1234.jsonl",
        "results/timelines/timeline_fused_link900_{pass_}_kimi-k2.7_abc1234.jsonl"]
    fp8_fields = {} if precision == "bf16" else {"precision": "fp8", "dispatch_dtype": "fp8"}
    assert ours_calls[0]["index"] == {"bench": "bench_layer", "shape": "kimi-k2.7", "routing": "uniform", **fp8_fields}
    assert ours_calls[2]["index"]["bench"] == "bench_layer_link" and ours_calls[2]["index"]["link_gbps"] == 900
    assert {k: ours_calls[2]["index"].get(k) for k in fp8_fields} == fp8_fields
    assert len(reports) == 3
    assert {f for f, _ in reports[0].rows} == {"bench_layer"} and all(r["link_gbps"] is None for _, r in reports[0].rows)
    assert all(f == LINK_FILE and r["link_gbps"] == g for rep, g in zip(reports[1:], (368, 900)) for f, r in rep.rows)
    assert all("speedup_vs_torch" not in r for rep in reports[1:] for _, r in rep.rows)
    assert all({**r, **fields} == r for rep in reports for _, r in rep.rows)  # every row records the routing
    assert all({k: r.get(k) for k in fp8_fields} == fp8_fields for rep in reports[1:] for _, r in rep.rows)
    if precision == "fp8":  # both dispatch dtypes: each layer with its links, the tables of both
        calls.clear()
        reports.clear()
        args.dispatch_dtypes = ["fp8", "bf16"]
        got, tables = layer_run.run_shape("kimi-k2.7", args, reports.append)
        ours_calls = [c for c in calls if isinstance(c, dict)]
        assert [(c["link"], c["run"][1]) for c in ours_calls] == [(None, "fp8"), *((g, "fp8") for g in links),
                                                                  (None, "bf16"), *((g, "bf16") for g in links)]
        assert [c for c in calls if not isinstance(c, dict)] == ["torch", "fp8 baselines", "schedule"]
        assert all(t[0] == "# fp8 dispatch" and t[3] == "# bf16 dispatch" and len(t) == 6 for t in tables.values())
        assert {r["dispatch_dtype"] for rep in reports[4:] for _, r in rep.rows} == {"bf16"}
        assert {r["dispatch_dtype"] for rep in reports[1:3] for _, r in rep.rows} == {"fp8"}
        # each layer's rows its own memory (the layouts differ: fp8 dispatch drops recv, adds the token codes)
        by_dtype = {d: memory(precision="fp8", dispatch_dtype=d) for d in ("fp8", "bf16")}
        assert len(set(by_dtype.values())) == 2
        assert {r["memory_bytes"] for rep in reports[3:] for _, r in rep.rows} == {by_dtype["bf16"]}
        assert {r["memory_bytes"] for rep in reports[:3] for _, r in rep.rows} == {by_dtype["fp8"]}
        assert [c["trace_to"] for c in ours_calls][::3] == [  # each layer's timelines under their own names
            f"results/timelines/timeline_fused_{{pass_}}_kimi-k2.7_abc1234_{d}-dispatch.jsonl" for d in ("fp8", "bf16")]
        # a link run's verdicts name the dtype too
        monkeypatch.setattr(layer_run, "link_report", lambda *a: Report(table=["row"], failed=["kimi-k2.7 link"]))
        reports.clear()
        layer_run.run_shape("kimi-k2.7", args, reports.append)
        assert [rep.failed for rep in reports][-1] == ["kimi-k2.7 link (bf16 dispatch)"]
        # and both weight-gradient precisions of one dispatch dtype: each its layer, timelines and rows
        from mok_proto.bench.layer_rows import Fp8Run

        monkeypatch.setattr(layer_run, "fp8_run", lambda *a: Fp8Run("fp8", "fp8", None, "no call", {}, "reference"))
        monkeypatch.setattr(layer_run, "shape_report", lambda name, shape, measured, base, sched, bars, fields, fp8:
                            Report(rows=[("bench_layer", {"schedule": "sequential", "wgrad_precision": fp8.wgrad_precision,
                                                          "memory_bytes": fields["memory_bytes"]})]))
        calls.clear()
        reports.clear()
        args.dispatch_dtypes, args.wgrad_precisions, args.links = ["fp8"], ["fp8", "bf16"], []
        layer_run.run_shape("kimi-k2.7", args, reports.append)
        ours_calls = [c for c in calls if isinstance(c, dict)]
        assert [(c["run"][1], c["wgrad"]) for c in ours_calls] == [("fp8", "fp8"), ("fp8", "bf16")]
        assert [c["index"].get("wgrad_precision") for c in ours_calls] == ["fp8", "bf16"]
        assert [c["trace_to"] for c in ours_calls] == [
            f"results/timelines/timeline_fused_{{pass_}}_kimi-k2.7_abc1234_{w}-wgrad.jsonl" for w in ("fp8", "bf16")]
        assert [r["wgrad_precision"] for rep in reports for _, r in rep.rows] == ["fp8", "bf16"]
        assert [r["memory_bytes"] for rep in reports for _, r in rep.rows] == [  # bf16 ones keep recv
            memory(precision="fp8", dispatch_dtype="fp8", wgrad_precision=w) for w in ("fp8", "bf16")]


def test_macrobatch_rows_option_and_replay_ms():
    """--macrobatch-rows: whole rows, or a fraction of rank 0's received rows in whole segments;
    replay_ms sums the backward's replay.<turn> stages (0 without a ring of several turns)."""
    from mok_proto.bench.emulation import check_ring_option, ring_rows
    from mok_proto.bench.layer_rows import replay_ms

    assert ring_rows(None, 46452) is None
    assert ring_rows("0.25x", 46452) == 11520 == 90 * SEGMENT_ROWS  # 11613 rows, rounded down to segments
    assert ring_rows("0.001x", 46452) == SEGMENT_ROWS and ring_rows("4096", 1) == 4096
    for good in ("0.25x", "1x", "512"):
        check_ring_option(good)
    for bad in ("300", "0x", "2x", "-256", "abc", "x"):
        with pytest.raises(ValueError, match="--macrobatch-rows"):
            check_ring_option(bad)
    stages = {"scale": 0.1, "shared": 0.5, "replay.1": 0.25, "turn.0": 1.0, "replay.2": 0.5, "token_grads": 0.2}
    assert replay_ms(stages) == 0.75
    assert replay_ms({"scale": 0.1, "experts": 2.0}) == 0.0
