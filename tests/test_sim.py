"""Simulator: the H200 rows of --validate hold (and fail when a calibration is off by 2x), the
load matches the schedule, the model responds to what it models, and it is fast."""

import json
import time

import numpy as np
import pytest

from mok_proto import plan as P
from mok_proto import results, schedule, sim, trace
from mok_proto.config import MOK_POLICY, PAPER_SHAPES, get_shape
from mok_proto.sim import layer, validate
from mok_proto.sim.params import H200_CALIBRATION

KIMI = get_shape("kimi-k2.7")


@pytest.fixture(scope="module")
def h200():
    return sim.h200()


def test_validate_h200_rows_within_bar(h200):
    rows = validate.h200_rows(h200)
    judged = [r for r in rows if r.judged]
    assert len(judged) >= 130  # 133 today: 42 GEMMs, 24 one-GPU and 12 2 x H200 stages, 55 layer rows
    for group in ("h200 gemm", "h200 comm 1 GPU", "h200 comm 2 x H200"):
        assert sum(r.group == group for r in judged) >= 10, group
    bad = [(r.quantity, round(r.error * 100, 1)) for r in judged if not r.ok(validate.H200_TOLERANCE)]
    assert not bad
    # a row whose prediction is a calibration row's (the 2 x H200 kimi combines) is not judged
    combines = [r for r in rows if r.group == "h200 comm 2 x H200" and r.quantity.startswith("combine")
                and "kimi" in r.quantity]
    assert combines and all(r.check == "calibration" for r in combines)


def test_validate_row_checks():
    inside = validate.Row("g", "spread", 1.38, 2.0, "x", "range", reference_hi=3.53)
    outside = validate.Row("g", "spread", 1.38, 4.0, "x", "range", reference_hi=3.53)
    assert inside.ok(0.0) and inside.error == 0 and not outside.ok(1.0)
    assert abs(outside.error - (4.0 - 3.53) / 3.53) < 1e-12
    assumed = validate.Row("g", "push signalling", 103.0, 500.0, "us", "assumed")
    assert assumed.ok(0.0) and not assumed.judged and assumed.status(0.25) == "assumed"
    with pytest.raises(ValueError):
        validate.Row("g", "spread", 1.38, 2.0, "x", "range")  # a range needs its high end


def test_validate_sequential_layer_rows(h200):
    # every paper shape, both passes: the whole pass (graph) and each stage bench_layer times
    rows = [r for r in validate.h200_rows(h200) if r.group == "h200 layer sequential"]
    stages = {"fwd": ("pass (graph)", "schedule", "shared", "dispatch", "experts", "combine", "weighted_sum"),
              "bwd": ("pass (graph)", "scale", "shared", "rev_combine", "experts", "rev_dispatch", "wgrad",
                      "token_grads")}
    want = {f"{p} {stage} {shape}" for shape in PAPER_SHAPES for p, names in stages.items() for stage in names}
    assert {r.quantity for r in rows} == want
    # the rows the h200 parameters are fitted on (one shape, LAYER_CALIBRATION) and no others are
    # calibration; every other row is judged (nothing is excused as "explained" today)
    fitted = {f"{p} {stage} {H200_CALIBRATION['layer']}" for ps in layer.LAYER_CALIBRATION.values() for p, stage in ps}
    assert {r.quantity for r in rows if r.check == "calibration"} == fitted
    assert all(r.check == "judged" for r in rows if r.quantity not in fitted)
    judged = [r for r in rows if r.judged]
    assert len(judged) == len(want) - len(fitted)
    assert sum("pass (graph)" in r.quantity for r in judged) == 8
    bad = [(r.quantity, round(r.error * 100, 1)) for r in judged if not r.ok(validate.H200_TOLERANCE)]
    assert not bad


def _results_copy(tmp_path, edit_layer_row=None, extra_rows=()):
    """results/*.jsonl copied to tmp_path; edit_layer_row(row) may change bench_layer rows in place;
    extra_rows are appended to bench_layer.jsonl."""
    for src in results.RESULTS_DIR.glob("*.jsonl"):
        lines = src.read_text().splitlines()
        if src.name == "bench_layer.jsonl":
            rows = [json.loads(line) for line in lines if line.strip()]
            for row in rows:
                if edit_layer_row:
                    edit_layer_row(row)
            lines = [json.dumps(row) for row in [*rows, *extra_rows]]
        (tmp_path / src.name).write_text("\n".join(lines) + "\n")
    return tmp_path


FITTED = ("busy_kernel_ns", "sum_slots_efficiency", "sustained_gemm")


def test_layer_calibration_uses_only_its_stated_rows(h200, tmp_path):
    calib_shape = H200_CALIBRATION["layer"]
    fitted = layer.calibration_stages(calib_shape)
    # 0.7-1: the layer's GEMMs are slower than bench_gemm's isolated ones, not implausibly so
    assert 0.7 < h200.sustained_gemm < 1.0 and h200.busy_kernel_ns > 0 and 0 < h200.sum_slots_efficiency <= 1

    def slow_judged(row):  # every stage NOT in the fit: 2x slower
        for stage in row.get("stages_ms", {}):
            if row["schedule"] == "sequential" and not (row["shape"] == calib_shape and (row["pass"], stage) in fitted):
                row["stages_ms"][stage] *= 2
    judged_dir = tmp_path / "judged"
    judged_dir.mkdir()
    moved = sim.h200(_results_copy(judged_dir, slow_judged))
    assert all(getattr(moved, f) == getattr(h200, f) for f in FITTED)
    rows = [r for r in validate.sequential_layer_rows(moved, judged_dir) if r.check == "judged"]
    assert rows and all(not r.ok(validate.H200_TOLERANCE) for r in rows if "pass (graph)" not in r.quantity)

    for (pass_, stage), field in [(ps, f) for f in FITTED for ps in layer.LAYER_CALIBRATION[f]]:
        def slow_one(row, pass_=pass_, stage=stage):  # one fitted stage 20% slower
            if (row["shape"], row["schedule"], row["pass"]) == (calib_shape, "sequential", pass_):
                row["stages_ms"][stage] *= 1.2
        where = tmp_path / f"{pass_}-{stage}"
        where.mkdir()
        changed = sim.h200(_results_copy(where, slow_one))
        assert getattr(changed, field) != getattr(h200, field), (pass_, stage, field)


def test_layer_rows_use_the_newest_run_of_each_shape(h200, tmp_path):
    # a newer run of one shape only (another git stamp, later): that shape's rows come from it, the
    # others keep theirs
    newest = layer.measured_rows()
    glm = [dict(r, git="feedbee", time="2099-01-01T00:00:00+00:00", stages_ms={k: 2 * v for k, v in r["stages_ms"].items()})
           for r in newest if r["shape"] == "glm-5.2"]
    for r in glm:
        r.pop("run")
    rows = layer.measured_rows(_results_copy(tmp_path, extra_rows=glm))
    assert {r["shape"] for r in rows} == set(PAPER_SHAPES) and len(rows) == len(newest)
    git = {r["shape"]: r["git"] for r in newest}
    assert all(r["git"] == ("feedbee" if r["shape"] == "glm-5.2" else git[r["shape"]]) for r in rows)


@pytest.mark.parametrize("factors,moves,stays", [
    (dict(sustained_gemm=0.5), ("experts", "wgrad", "shared"), ("schedule", "dispatch", "combine", "weighted_sum")),
    (dict(busy_kernel_ns=3.0), ("schedule",), ()),
    (dict(sum_slots_efficiency=0.5), ("weighted_sum", "token_grads"), ("schedule", "dispatch", "experts", "scale")),
    (dict(row_move_efficiency=0.5), ("dispatch", "combine", "rev_combine", "rev_dispatch"),
     ("schedule", "experts", "weighted_sum", "scale")),
    (dict(hbm_write_gbs=0.5), ("scale",), ("schedule", "experts")),  # (a copy's rate moves too)
])
def test_layer_predictions_move_with_their_parameter(h200, factors, moves, stays):
    def predicted(gpu):
        return {r.quantity: r.predicted for r in validate.sequential_layer_rows(gpu)}
    base, moved = predicted(h200), predicted(h200.scaled(**factors))
    for quantity, value in base.items():
        stage = quantity.split(" ")[1]
        if stage in moves:
            assert moved[quantity] > 1.3 * value, quantity
        elif stage in stays:
            assert moved[quantity] == pytest.approx(value), quantity


def test_sustained_load_is_not_bench_gemm_and_not_gb300(h200):
    # bench_gemm's rows are isolated GEMMs: the sustained-load factor does not touch them
    gemm = [r.predicted for r in validate.h200_rows(h200) if r.group == "h200 gemm"]
    assert gemm == [r.predicted for r in validate.h200_rows(h200.scaled(sustained_gemm=0.5)) if r.group == "h200 gemm"]
    # the GB300 set keeps its spec-derived tile rates: no H200 sustained-load factor
    gb = sim.gb300_nvl72(h200)
    assert gb.sustained_gemm == 1.0 and gb.tile_ns("down", 4096) == gb.tile_ns("down", 4096, sustained=False)
    assert h200.tile_ns("down", 4096) > h200.tile_ns("down", 4096, sustained=False)
    with pytest.raises(ValueError, match="traffic"):
        h200.token_kernel_ns("copy", 1, 1)


def test_cli_validate_prints_every_row():
    from mok_proto.sim.__main__ import main
    assert main(["--validate", "--h200-only"]) == 0


@pytest.mark.parametrize("skew", [0.0, 1.0])
def test_load_matches_schedule(skew):
    # the simulator's load of a routing == the pull schedule's placement of the SAME routing
    shape, ranks = get_shape("medium"), 4
    topk = sim.route(shape, ranks, seed=1, skew=skew)  # [R, N, K]
    load = sim.load_from_topk(topk, shape.num_experts)
    for r in range(ranks):
        s = schedule.build_pull_schedule(topk, shape.num_experts, r, align=P.BM)
        assert np.array_equal(load.expert_offsets[r], s.expert_offsets)
        assert np.array_equal(load.tokens_per_expert[r], s.tokens_per_expert)
        real = s.src_rank[s.src_rank >= 0]
        assert load.local_fraction[r] == np.count_nonzero(real == r) / len(real)
    assert np.array_equal(sim.routed_load(shape, ranks, seed=1, skew=skew).expert_offsets, load.expert_offsets)


def test_model_responds(h200):
    gb = sim.gb300_nvl72(h200)
    fwd = dict(pass_="fwd", policy=MOK_POLICY, num_sms=gb.num_sms)
    fused = sim.simulate(P.fixed_split(KIMI, 64, 40, 2048, **fwd), gb)
    seq = sim.simulate(P.sequential(KIMI, 64, **fwd), gb)
    assert fused.time_ns < seq.time_ns  # overlap helps
    slow_link = sim.simulate(P.fixed_split(KIMI, 64, 40, 2048, **fwd), gb.scaled(link_gbs=0.25))
    assert slow_link.time_ns > fused.time_ns
    push = dict(MOK_POLICY, dispatch="push")
    pushed = sim.simulate(P.fixed_split(KIMI, 64, 40, 2048, pass_="fwd", policy=push, num_sms=gb.num_sms), gb)
    def first_gate_up_ns(result):
        return result.start_ns[result.plan.tasks["kind"] == int(P.TaskKind.GATE_UP)].min()
    # a pushed dispatch waits for 63 peers' signals (the shared expert hides part of it)
    assert first_gate_up_ns(pushed) > first_gate_up_ns(fused) + 10e3
    load = sim.routed_load(KIMI, 64, skew=0.3)
    capacity = -(-int(load.expert_offsets[:, -1].max()) // 2048) * 2048
    skewed = sim.simulate(P.fixed_split(KIMI, 64, 40, 2048, capacity_rows=capacity, **fwd), gb, load)
    assert skewed.time_ns > fused.time_ns  # the hottest rank decides


def test_simulate_rejects_a_plan_that_cannot_run(h200):
    # a counter whose target (and its waiters' targets) is one below its signals: waiters would
    # start before the last signal and the simulated time would be too short
    p = P.fixed_split(get_shape("small"), 4, 2, 128, 2, pass_="fwd", policy=MOK_POLICY, num_sms=6,
                      capacity_rows=512)
    t, counters = p.tasks.copy(), p.counters.copy()
    c = int(np.flatnonzero(counters["kind"] == int(P.CounterKind.FIRST_DONE))[0])
    counters["target"][c] -= 1
    t["wait_target"][t["wait_counter"] == c] -= 1
    with pytest.raises(P.PlanError, match="target"):
        sim.simulate(P.with_tasks(p, t, counters), sim.gb300_nvl72(h200))


def test_ep64_kimi_forward_is_fast(h200):
    gb = sim.gb300_nvl72(h200)
    t0 = time.process_time()  # CPU time of this process: other load on the machine does not count
    p = P.fixed_split(KIMI, 64, 40, 2048, pass_="fwd", policy=MOK_POLICY, num_sms=gb.num_sms)
    result = sim.simulate(p, gb)  # includes p.check()
    assert time.process_time() - t0 < 2.0
    rec = result.records()
    assert rec.dtype == trace.TRACE_DTYPE and len(rec) == len(p.tasks)
    assert np.all(rec["end_ns"] >= rec["start_ns"])
    # in-order per CTA: a CTA's tasks do not overlap
    for b in (0, 100):
        r = rec[rec["block"] == b]
        assert np.all(r["start_ns"][1:] >= r["end_ns"][:-1] - 1e-6)
