"""Simulator: the H200 rows of --validate hold (and fail when a calibration is off by 2x), the
load matches the schedule, the model responds to what it models, and it is fast."""

import dataclasses
import functools
import gzip
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from mok_proto import plan as P
from mok_proto import results, schedule, sim, trace
from mok_proto.config import MOK_POLICY, PAPER_SHAPES, ep_share, get_shape
from mok_proto.sim import calibrate, fused, layer, model, params, validate
from mok_proto.sim.calibrate import H200_CALIBRATION

KIMI = get_shape("kimi-k2.7")
KIMI_SHARE = ep_share("kimi-k2.7", 64)  # bench_layer's emulation: one EP=64 rank's share, 2 virtual ranks


@pytest.fixture(scope="module")
def h200():
    return sim.h200()


@pytest.fixture(scope="module")
def h200_validation(h200):
    """validate.h200_rows(h200), computed once for the tests that read it (it simulates every
    measured timeline and bench row: the longest call of this file)."""
    return validate.h200_rows(h200)


def test_validate_h200_rows_within_bar(h200, h200_validation):
    rows = h200_validation
    judged = [r for r in rows if r.judged]
    assert len(judged) >= 195  # 202 today: 42 GEMMs, 24 one-GPU and 12 2 x H200 stages, 55 layer rows, 69 fused (8 backward)
    for group in ("h200 gemm", "h200 comm 1 GPU", "h200 comm 2 x H200"):
        assert sum(r.group == group for r in judged) >= 10, group
    bad = [(r.quantity, round(r.error * 100, 1)) for r in judged if not r.ok(validate.MEASURED_TOLERANCE)]
    assert not bad
    # a row whose prediction is a calibration row's (the 2 x H200 kimi combines) is not judged
    combines = [r for r in rows if r.group == "h200 comm 2 x H200" and r.quantity.startswith("combine")
                and "kimi" in r.quantity]
    assert combines and all(r.check == "calibration" for r in combines)


def test_calibrate_command_reproduces_the_frozen_calibration(tmp_path, capsys):
    # `python -m mok_proto.sim calibrate --gpu h200` fits on results/ what calibration/h200.json holds,
    # which the simulator reads; the file names its sources by selectors and index keys, no commit
    import re

    from mok_proto.sim import __main__ as cli

    out = tmp_path / "h200.json"
    assert cli.main(["calibrate", "--gpu", "h200", "--out", str(out)]) == 0
    frozen_text = params.calibration_file("h200").read_text()
    assert json.loads(out.read_text()) == json.loads(frozen_text)
    assert capsys.readouterr().out.startswith(f"wrote {out}: calibrated on")
    frozen = json.loads(frozen_text)
    assert dataclasses.asdict(sim.h200()) == frozen["params"]
    assert not re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", frozen_text)
    assert frozen["sources"]["fused_spare"]["timeline"] == {"sim_calibrates": "fused_spare"}
    assert frozen["sources"]["layer"]["where"] == {"shape": H200_CALIBRATION["layer"], "schedule": "sequential"}
    # the h100 file too: what its fit on results/ gives today (its fused_gemm on the H100 fused rows)
    out = tmp_path / "h100.json"
    assert cli.main(["calibrate", "--gpu", "h100", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == json.loads(params.calibration_file("h100").read_text())
    assert json.loads(out.read_text())["params"]["fused_gemm"] < 1.0
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:  # spec-derived: nothing to calibrate
        cli.main(["calibrate", "--gpu", "gb300-nvl72"])
    err = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(err) == 1 and "invalid choice: 'gb300-nvl72'" in err[0]


def test_h200_is_read_from_its_calibration_file(tmp_path, monkeypatch):
    document = json.loads(params.calibration_file("h200").read_text())
    document["params"]["busy_kernel_ns"] = 1234.5
    (tmp_path / "h200.json").write_text(json.dumps(document))
    monkeypatch.setattr(params, "CALIBRATION_DIR", tmp_path)
    assert sim.h200().busy_kernel_ns == 1234.5 and sim.gb300_nvl72().busy_kernel_ns == 1234.5
    (tmp_path / "h200.json").unlink()
    with pytest.raises(ValueError, match="calibrate --gpu h200"):
        sim.get_params("h200")


def test_validate_row_checks():
    inside = validate.Row("g", "spread", 1.38, 2.0, "x", "range", reference_hi=3.53)
    outside = validate.Row("g", "spread", 1.38, 4.0, "x", "range", reference_hi=3.53)
    assert inside.ok(0.0) and inside.error == 0 and not outside.ok(1.0)
    assert abs(outside.error - (4.0 - 3.53) / 3.53) < 1e-12
    assumed = validate.Row("g", "push signalling", 103.0, 500.0, "us", "assumed")
    assert assumed.ok(0.0) and not assumed.judged and assumed.status(0.25) == "assumed"
    with pytest.raises(ValueError):
        validate.Row("g", "spread", 1.38, 2.0, "x", "range")  # a range needs its high end


def test_validate_sequential_layer_rows(h200, h200_validation):
    # every paper shape, both passes: the whole pass (graph) and each stage bench_layer times
    rows = [r for r in h200_validation if r.group == "h200 layer sequential"]
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
    bad = [(r.quantity, round(r.error * 100, 1)) for r in judged if not r.ok(validate.MEASURED_TOLERANCE)]
    assert not bad


def _results_copy(tmp_path, edit_layer_row=None, extra_rows=(), only=None):
    """results/'s JSON lines (every machine folder) and its timelines with their index copied to
    tmp_path; edit_layer_row(row) may change bench_layer's rows in place; extra_rows are appended to
    bench_layer.jsonl; only: the paths (relative to results/) of the files to copy, None for all."""
    root = results.RESULTS_DIR
    for src in results.jsonl_files(root, "**/*"):  # (the timelines' index is JSON lines too)
        rel = src.relative_to(root)
        if only is not None and str(rel) not in only:
            continue
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel != Path("bench_layer.jsonl"):
            shutil.copy(src, tmp_path / rel)
            continue
        rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
        for row in rows:
            if edit_layer_row:
                edit_layer_row(row)
        (tmp_path / rel).write_text("\n".join(json.dumps(row) for row in [*rows, *extra_rows]) + "\n")
    return tmp_path


FITTED = ("busy_kernel_ns", "sum_slots_efficiency", "sustained_gemm")


def test_layer_calibration_uses_only_its_stated_rows(h200, tmp_path):
    calib_shape = H200_CALIBRATION["layer"]
    fitted = calibrate.calibration_stages(calib_shape)
    # 0.7-1: the layer's GEMMs are slower than bench_gemm's isolated ones, not implausibly so
    assert 0.7 < h200.sustained_gemm < 1.0 and h200.busy_kernel_ns > 0 and 0 < h200.sum_slots_efficiency <= 1

    def slow_judged(row):  # every stage NOT in the fit: 2x slower
        for stage in row.get("stages_ms", {}):
            if row["schedule"] == "sequential" and not (row["shape"] == calib_shape and (row["pass"], stage) in fitted):
                row["stages_ms"][stage] *= 2
    judged_dir = tmp_path / "judged"
    judged_dir.mkdir()
    moved = layer.calibrate(h200, calib_shape, _results_copy(judged_dir, slow_judged, only={"bench_layer.jsonl"}))
    assert all(getattr(moved, f) == getattr(h200, f) for f in FITTED)
    rows = [r for r in validate.sequential_layer_rows(moved, judged_dir) if r.check == "judged"]
    assert rows and all(not r.ok(validate.MEASURED_TOLERANCE) for r in rows if "pass (graph)" not in r.quantity)

    for (pass_, stage), field in [(ps, f) for f in FITTED for ps in layer.LAYER_CALIBRATION[f]]:
        def slow_one(row, pass_=pass_, stage=stage):  # one fitted stage 20% slower
            if (row["shape"], row["schedule"], row["pass"], row.get("routing", "uniform")) == (
                    calib_shape, "sequential", pass_, "uniform"):  # (skewed rows have other stages)
                row["stages_ms"][stage] *= 1.2
        where = tmp_path / f"{pass_}-{stage}"
        where.mkdir()
        changed = layer.calibrate(h200, calib_shape, _results_copy(where, slow_one, only={"bench_layer.jsonl"}))
        assert getattr(changed, field) != getattr(h200, field), (pass_, stage, field)


def test_layer_rows_use_the_newest_run_of_each_shape(h200, tmp_path):
    # a newer run of one shape only (another git stamp, later): that shape's rows come from it, the
    # others keep theirs
    newest = layer.measured_rows()
    # the newest run among the compared rows (not a run marked sim_left_out, nor another policy's)
    latest = {}
    for r in layer.compared_rows():
        if r["schedule"] == "sequential" and r["time"] > latest.get(r["shape"], {"time": ""})["time"]:
            latest[r["shape"]] = r
    assert {r["shape"]: r["run"] for r in newest} == {k: r["run"] for k, r in latest.items()}
    glm = [dict(r, git="feedbee", time="2099-01-01T00:00:00+00:00", stages_ms={k: 2 * v for k, v in r["stages_ms"].items()})
           for r in newest if r["shape"] == "glm-5.2"]
    for r in glm:
        r.pop("run")
    rows = layer.measured_rows(_results_copy(tmp_path, extra_rows=glm))
    assert {r["shape"] for r in rows} == set(PAPER_SHAPES) and len(rows) == len(newest)
    git = {r["shape"]: r["git"] for r in newest}
    assert all(r["git"] == ("feedbee" if r["shape"] == "glm-5.2" else git[r["shape"]]) for r in rows)


def test_every_bench_layer_run_is_compared_or_says_why_not():
    # a run's rows are all compared or all left out with a reason (sim_left_out), or ran other transfer
    # directions than MoK's (their `policy`), skewed routing, FP8 routed experts (`precision`) or on
    # another GPU than the h200 parameters' (the H100 runs); compared_rows keeps exactly the others
    rows = results.load("bench_layer")
    why = {}
    for r in rows:
        why.setdefault(r["run"], set()).add(r.get("sim_left_out"))
    assert all(len(reasons) == 1 for reasons in why.values()), why
    left_out = {run for run, reasons in why.items() if reasons != {None}}
    assert left_out and all(len(next(iter(why[run]))) > 20 for run in left_out)
    other_policy = {r["run"] for r in rows if r.get("policy", MOK_POLICY) != MOK_POLICY}
    assert other_policy and not other_policy & left_out
    skewed = {r["run"] for r in rows if r.get("routing", "uniform") != "uniform"}  # the simulator's routing is uniform
    other_gpu = {r["run"] for r in rows if "H200" not in r.get("gpu", "H200")}
    fp8 = {r["run"] for r in rows if r.get("precision", "bf16") != "bf16"}  # the model's GEMMs are BF16
    assert other_gpu and fp8 and not other_gpu & left_out
    assert {r["run"] for r in layer.compared_rows()} == set(why) - left_out - other_policy - skewed - other_gpu - fp8
    assert not any("sim_left_out" in r or r.get("policy", MOK_POLICY) != MOK_POLICY for r in layer.compared_rows())


def _layer_predicted(gpu):
    return {r.quantity: r.predicted for r in validate.sequential_layer_rows(gpu)}


@pytest.fixture(scope="module")
def h200_layer_predicted(h200):
    """_layer_predicted(h200), computed once for the parametrized test below (the same unscaled
    baseline for every case; a pure function of the parameters and results/)."""
    return _layer_predicted(h200)


@pytest.mark.parametrize("factors,moves,stays", [
    (dict(sustained_gemm=0.5), ("experts", "wgrad", "shared"), ("schedule", "dispatch", "combine", "weighted_sum")),
    (dict(busy_kernel_ns=3.0), ("schedule",), ()),
    (dict(sum_slots_efficiency=0.5), ("weighted_sum", "token_grads"), ("schedule", "dispatch", "experts", "scale")),
    (dict(row_move_efficiency=0.5), ("dispatch", "combine", "rev_combine", "rev_dispatch"),
     ("schedule", "experts", "weighted_sum", "scale")),
    (dict(hbm_write_gbs=0.5), ("scale",), ("schedule", "experts")),  # (a copy's rate moves too)
])
def test_layer_predictions_move_with_their_parameter(h200, h200_layer_predicted, factors, moves, stays):
    base, moved = h200_layer_predicted, _layer_predicted(h200.scaled(**factors))
    for quantity, value in base.items():
        stage = quantity.split(" ")[1]
        if stage in moves:
            assert moved[quantity] > 1.3 * value, quantity
        elif stage in stays:
            assert moved[quantity] == pytest.approx(value), quantity


def test_sustained_load_is_not_bench_gemm_and_not_gb300(h200, h200_validation):
    # bench_gemm's rows are isolated GEMMs: the sustained-load factor does not touch them
    gemm = [r.predicted for r in h200_validation if r.group == "h200 gemm"]
    assert gemm == [r.predicted for r in validate.kernel_rows(h200.scaled(sustained_gemm=0.5)) if r.group == "h200 gemm"]
    # the GB300 set keeps its spec-derived tile rates: no H200 sustained-load factor
    gb = sim.gb300_nvl72(h200)
    assert gb.sustained_gemm == 1.0 and gb.tile_ns("down", 4096) == gb.tile_ns("down", 4096, sustained=False)
    assert h200.tile_ns("down", 4096) > h200.tile_ns("down", 4096, sustained=False)
    with pytest.raises(ValueError, match="traffic"):
        h200.token_kernel_ns("copy", 1, 1)


def test_cli_validate_prints_every_row(h200, h200_validation, monkeypatch):
    from mok_proto.sim import __main__ as cli

    # The CLI runs as it is (its own parameter sets, its judging, its table); only its call of
    # measured_rows is answered from the module's fixture when it asks for what the fixture computed
    # (the h200 rows, the same parameters, the default results/: a pure function of those, the longest
    # computation here); any other arguments are computed as before.
    def measured_rows(name, gpu=None, results_dir=results.RESULTS_DIR):
        if name == "h200" and gpu is not None and gpu == h200 and results_dir == results.RESULTS_DIR:
            return list(h200_validation)
        return validate.measured_rows(name, gpu, results_dir)

    monkeypatch.setattr(cli, "measured_rows", measured_rows)
    assert cli.main(["--validate", "--measured-only"]) == 0


@pytest.mark.parametrize("skew,align", [(0.0, P.BM), (1.0, P.BM), (0.0, P.PAIR_ROWS)])
def test_load_matches_schedule(skew, align):
    # the simulator's load of a routing == the pull schedule's placement of the SAME routing
    shape, ranks = get_shape("medium"), 4
    topk = sim.route(shape, ranks, seed=1, skew=skew)  # [R, N, K]
    load = sim.load_from_topk(topk, shape.num_experts, align)
    for r in range(ranks):
        s = schedule.build_pull_schedule(topk, shape.num_experts, r, align=align)
        assert np.array_equal(load.expert_offsets[r], s.expert_offsets)
        assert np.array_equal(load.tokens_per_expert[r], s.tokens_per_expert)
        real = s.src_rank[s.src_rank >= 0]
        assert load.local_fraction[r] == np.count_nonzero(real == r) / len(real)
    assert np.array_equal(sim.routed_load(shape, ranks, seed=1, skew=skew, align=align).expert_offsets,
                          load.expert_offsets)


def test_model_responds(h200):
    gb = sim.gb300_nvl72(h200)
    fwd = dict(pass_="fwd", policy=MOK_POLICY, num_sms=gb.num_sms)
    split = P.fixed_split(KIMI, 64, 40, 2048, **fwd)
    fused = sim.simulate(split, gb)
    seq = sim.simulate(P.sequential(KIMI, 64, **fwd), gb)
    assert fused.time_ns < seq.time_ns  # overlap helps
    slow_link = sim.simulate(split, gb.scaled(link_gbs=0.25))
    assert slow_link.time_ns > fused.time_ns
    push = dict(MOK_POLICY, dispatch="push")
    pushed = sim.simulate(P.fixed_split(KIMI, 64, 40, 2048, pass_="fwd", policy=push, num_sms=gb.num_sms), gb)
    def first_gate_up_ns(result):
        return result.start_ns[result.plan.tasks["kind"] == int(P.TaskKind.GATE_UP)].min()
    # a pushed dispatch waits for 63 peers' signals (the shared expert hides part of it)
    assert first_gate_up_ns(pushed) > first_gate_up_ns(fused) + 10e3
    # the hottest rank decides (on 8 ranks: a skewed routing of 64 x 2048 tokens takes seconds to draw)
    load = sim.routed_load(KIMI, 8, skew=0.3)
    capacity = -(-int(load.expert_offsets[:, -1].max()) // 2048) * 2048
    split8 = P.fixed_split(KIMI, 8, 40, 2048, capacity_rows=capacity, **fwd)
    assert sim.simulate(split8, gb, load).time_ns > sim.simulate(split8, gb).time_ns


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


# ---------------------------------------------------------------------------------------------
# The fused forward (plan.fused_forward, cuda/fused.cuh)
# ---------------------------------------------------------------------------------------------
# the calibration timelines (index rows): kimi, comm 8, the bulk ring; comm 12, the warp movers; comm 0, the spare warps
CALIBRATION_TIMELINE, WARPS_TIMELINE, SPARE_TIMELINE = (fused.calibration_timeline(k) for k in
                                                        ("fused_bulk", "fused", "fused_spare"))
# kimi's comm-0 forward of a kernel whose counter waits spun on ld.acquire (the spare warps' old calibration)
OLD_SPARE_TIMELINE, = results.timeline_index(pass_="fwd", bench="bench_layer", shape="kimi-k2.7", comm_blocks=0,
                                              wait_spin="acquire")


_RESULTS: dict = {}  # the emulated simulations of the plans these tests build, once per (plan, parameters)


def _built(make, shape, knobs, policy=MOK_POLICY, num_sms=132, capacity_rows=None):
    """make's plan on 2 ranks, built once: fused._fused_plan's, which the simulator's own callers
    share (a plan is never changed: a test edits a copy)."""
    pass_ = {P.fused_forward: "fwd", P.fused_backward: "bwd"}[make]
    return fused._fused_plan(pass_, shape, 2, knobs, tuple(policy.items()), num_sms, capacity_rows)


def _fused_plan(comm_blocks, minibatch_rows=2048, num_sms=132, policy=MOK_POLICY):
    # claim 0: the plans of the kernels measured before the claimed pool (99c90df)
    return _built(P.fused_forward, KIMI_SHARE, P.FusedKnobs(comm_blocks, minibatch_rows, claim=0), policy,
                  num_sms=num_sms)


def _emulated(plan, gpu):
    """A plan as bench_layer runs it: one EP=64 share on one H200 (its load: the plan's shape's)."""
    key = (id(plan), repr(gpu))
    if key not in _RESULTS or _RESULTS[key].plan is not plan:
        _RESULTS[key] = sim.simulate(plan, layer.one_gpu(gpu), fused.emulated_load(plan.shape))
    return _RESULTS[key]


def _spread_plan(minibatch_rows=2048, num_sms=132):
    """A fused forward with comm_blocks == 0: the chunks spread over compute CTAs (chunk c on CTA c,
    run by spare warps beside its GEMM tiles)."""
    return _built(P.fused_forward, KIMI_SHARE, P.FusedKnobs(0, minibatch_rows, claim=0), num_sms=num_sms)


def _comm(rec):
    return np.isin(rec["kind"], [int(k) for k in P.COMM_KINDS])


def test_fused_timeline_is_the_plan_it_ran(h200):
    measured = results.load_timeline(CALIBRATION_TIMELINE["path"])
    assert (CALIBRATION_TIMELINE["shape"], CALIBRATION_TIMELINE["comm_mover"]) == ("kimi-k2.7", "bulk")
    plan, result = fused.simulate_timeline(measured, KIMI_SHARE, h200, kernel=CALIBRATION_TIMELINE)
    assert (plan.comm_blocks, plan.minibatch_rows, plan.num_sms, plan.ring_minibatches) == (8, 2048, 132, 10)
    simulated = result.records(0)
    assert len(simulated) == len(measured) == len(plan.tasks)
    for key in fused.KEY + ("role",):  # one simulated record per measured one, the same task
        assert np.array_equal(simulated[key], measured[key]), key
    assert np.array_equal(measured["role"] == 0, _comm(measured))  # role by kind (older files: by CTA)
    # records of no plan are refused (a small plan's: the refusal tries every order, assignment and raster)
    tile = get_shape("tile")
    small = _built(P.fused_forward, tile, P.FusedKnobs(2, 1024, claim=0), num_sms=16)
    records = sim.simulate(small, h200).records(0)
    assert np.array_equal(fused.timeline_plan(records, tile).tasks, small.tasks)
    shuffled = records.copy()
    shuffled[[0, 1]] = shuffled[[1, 0]]  # CTA 0's first two tasks swapped
    assert (shuffled["block"][:2] == 0).all() and not np.array_equal(shuffled["minibatch"], records["minibatch"])
    with pytest.raises(ValueError, match="not those of any"):
        fused.timeline_plan(shuffled, tile)


def test_old_timeline_files_get_their_chunk_counts(tmp_path):
    # files written before communication tasks carried their chunk count (col_tile -1 there): each
    # (kind, minibatch) transfer had one chunk per task of it; GEMM tasks keep their column tile
    plan = P.fused_forward(KIMI_SHARE, 2, P.FusedKnobs(8, 2048, spread_from=8, claim=0), policy=MOK_POLICY, num_sms=132)
    rows = []
    for t in plan.tasks:
        kind = P.TaskKind(int(t["kind"]))
        col = -1 if kind in P.COMM_KINDS else int(t["col_tile"])
        rows.append({"rank": 0, "block": int(t["block"]), "role": 0, "kind": kind.name.lower(),
                     "minibatch": int(t["minibatch"]), "expert": -1, "row_tile": int(t["row_tile"]), "col_tile": col,
                     "start_ns": 0.0, "end_ns": 1.0})
    path = tmp_path / "timeline_fused_fwd_kimi-k2.7_old.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rec = results.load_timeline(path)
    assert np.array_equal(rec["col_tile"], plan.tasks["col_tile"])  # 8 per chunk, 132 for minibatches >= 8
    assert set(rec["col_tile"][_comm(rec)].tolist()) == {8, 132}


def test_gzipped_timeline_is_the_same_timeline(tmp_path):
    # results/timelines/ keeps its timelines as .jsonl.gz, bench_layer writes .jsonl: both read alike, one
    # name stem is one timeline (the plain file where both exist), and add_timeline stores a written one
    # gzipped with its index row
    text = "".join(line + "\n" for line in results.read_text(SPARE_TIMELINE["path"]).splitlines()[:500])
    name = results.plain_name(SPARE_TIMELINE["path"])
    plain, packed, both = (results.timelines_dir(tmp_path / d) for d in ("plain", "packed", "both"))
    for d in (plain, packed, both):
        d.mkdir(parents=True)
    for d in (plain, both):
        (d / name).write_text(text)
    for d in (packed, both):
        (d / f"{name}.gz").write_bytes(gzip.compress(text.encode()))
    want = results.load_timeline(plain / name)
    got = results.load_timeline(packed / f"{name}.gz")
    assert len(want) == 500 and want.dtype == got.dtype and all(np.array_equal(want[k], got[k]) for k in want.dtype.names)
    assert results.comm_bars_from_ready(packed / f"{name}.gz") and results.comm_bars_from_ready(plain / name)
    assert results.timeline_name(packed / f"{name}.gz") == results.timeline_name(plain / name) == (
        "kimi-k2.7", SPARE_TIMELINE["git"])
    assert [results.timeline_file(name, tmp_path / "packed")] == [packed / f"{name}.gz"]
    assert [results.timeline_file(f"{name}.gz", tmp_path / "both")] == [both / name]
    assert results.jsonl_files(tmp_path, "**/timeline_fused_*") == [both / name, packed / f"{name}.gz", plain / name]
    with pytest.raises(FileNotFoundError, match=f"no timeline {name} \\(nor {name}.gz\\)"):
        results.timeline_file(name, tmp_path)
    # an index finds them: add_timeline gzips a written file into the timelines folder, appends its row
    store = tmp_path / "store"
    row = results.add_timeline(plain / name, store, pass_="fwd", bench="bench_layer", shape="kimi-k2.7")
    assert row == {"file": f"{name}.gz", "pass": "fwd", "bench": "bench_layer", "shape": "kimi-k2.7"}
    assert results.timeline_files(store) == [results.timelines_dir(store) / f"{name}.gz"]
    assert results.timeline_files(store, pass_="bwd") == [] and results.timeline_files(tmp_path / "plain") == []
    stored = results.load_timeline(results.timeline_files(store)[0])
    assert all(np.array_equal(want[k], stored[k]) for k in want.dtype.names)
    assert results.timeline_index(store, shape="kimi-k2.7")[0]["path"] == results.timeline_files(store)[0]
    with pytest.raises(FileExistsError):
        results.add_timeline(packed / f"{name}.gz", store, pass_="fwd")


def test_validate_fused_rows(h200, h200_validation):
    rows = [r for r in h200_validation if r.group == "h200 fused"]
    for git in ("62f5296", "1685ef1"):  # the calibration timelines: the bulk ring's (comm 8), the warp movers' (comm 12)
        by = {r.quantity.split(" kimi")[0]: r for r in rows if r.quantity.endswith(git) and " kimi" in r.quantity}
        # the dispatch tasks fit the copy rate: the dispatch end is calibration; the rest is judged
        assert by["fwd dispatch end"].check == "calibration", git
        for what in ("fwd compute end", "fwd kernel end", "fwd combine chunk median", "fwd gate_up tile median",
                     "fwd down tile median"):
            assert by[what].check == "judged" and by[what].ok(validate.MEASURED_TOLERANCE), (git, what)
    assert 500 < h200.bulk_row_ns < 700 and 0 < h200.bulk_task_ns < 10e3  # 0.6 us per 14 KB row, a few us
    assert 18 < h200.comm_cta_gbs < 26 and 0 < h200.comm_task_ns < 10e3  # ~22 GB/s per CTA, a few us
    assert h200.comm_mover == "warps"  # what sim.h200() predicts for new plans
    # the other comm-12 forward timelines of the warp movers (glm, deepseek): every row judged
    other = [r for r in rows if r.quantity.startswith("fwd ") and "pass (graph)" not in r.quantity
             and r.quantity.endswith("C=12 MB=2048 1685ef1") and " kimi" not in r.quantity]
    assert len(other) == 12 and all(r.check == "judged" for r in other)
    # the spare warps' rate: fitted on the e48bf6e comm_blocks == 0 timeline, ~7 GB/s and ~2.4 us per task
    assert (SPARE_TIMELINE["shape"], SPARE_TIMELINE["git"], SPARE_TIMELINE["comm_blocks"]) == ("kimi-k2.7", "e48bf6e", 0)
    assert 5 < h200.spare_cta_gbs < 9 and 1e3 < h200.spare_task_ns < 3.5e3
    spare = {r.quantity.split(" kimi")[0]: r for r in rows if " kimi" in r.quantity and " C=0 " in r.quantity
             and r.quantity.endswith("e48bf6e") and r.quantity.startswith("fwd ")}
    assert spare["fwd dispatch end"].check == "calibration"
    others = {q: r for q, r in spare.items() if q != "fwd dispatch end"}
    assert len(others) == 6 and all(r.check == "judged" and r.ok(validate.MEASURED_TOLERANCE) for r in others.values())


@functools.cache
def _timeline_rows(path) -> list[dict]:
    """A stored timeline's JSON rows, read once (shared: copy a row before changing it)."""
    return [json.loads(line) for line in results.read_text(path).splitlines()]


def _timeline_copy(tmp_path, edit, timeline=CALIBRATION_TIMELINE, alone=False):
    """results/ (its JSON lines and timelines, `_results_copy`) in tmp_path (made here); edit(rows) may
    change the JSON rows of `timeline` (an index row: a calibration timeline), written there under its
    name. alone: that timeline and its index row only."""
    tmp_path.mkdir()
    name = f"{results.TIMELINES}/{timeline['file']}"
    _results_copy(tmp_path, only={name, f"{results.TIMELINES}/{results.INDEX}"} if alone else None)
    rows = [dict(r) for r in _timeline_rows(timeline["path"])]
    edit(rows)
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    (tmp_path / name).write_bytes(gzip.compress(text.encode(), compresslevel=1))  # (the same rows, sooner)
    if alone:
        index = tmp_path / results.TIMELINES / results.INDEX
        index.write_text("".join(line + "\n" for line in index.read_text().splitlines()
                                 if json.loads(line)["file"] == timeline["file"]))
    return tmp_path


# (calibration timeline, the fields its dispatch tasks fit, the other movers' fields)
MOVER_FITS = [(CALIBRATION_TIMELINE, ("bulk_row_ns", "bulk_task_ns"), ("comm_cta_gbs", "comm_task_ns", "spare_cta_gbs")),
              (WARPS_TIMELINE, ("comm_cta_gbs", "comm_task_ns"), ("bulk_row_ns", "bulk_task_ns", "spare_task_ns")),
              (SPARE_TIMELINE, ("spare_cta_gbs", "spare_task_ns"), ("comm_cta_gbs", "bulk_row_ns", "bulk_task_ns"))]


@pytest.mark.parametrize("timeline,fits,others", MOVER_FITS, ids=["bulk", "warps", "spare"])
def test_fused_calibration_uses_only_the_dispatch_tasks(h200, tmp_path, timeline, fits, others):
    git = timeline["git"]

    def slow_compute(rows):  # every GEMM and combine task 1.5x later and longer: the fit must not move
        for r in rows:
            if r["kind"] != "dispatch":
                r["start_ns"], r["end_ns"] = 1.5 * r["start_ns"], 1.5 * r["end_ns"]
    where = _timeline_copy(tmp_path / "compute", slow_compute, timeline)
    moved = fused.calibrate(h200, where)
    assert all(getattr(moved, f) == getattr(h200, f) for f in fits + others)
    # The rows below are the edited timeline's: fused_rows computes a timeline's rows from its own
    # records and the parameters only, so it is given that timeline alone (the other timelines and
    # bench_layer's passes, seconds to simulate, add rows the filter drops)
    alone = _timeline_copy(tmp_path / "compute-alone", slow_compute, timeline, alone=True)
    ends = [r for r in validate.fused_rows(moved, alone) if r.quantity.endswith(git) and " kimi" in r.quantity
            and " end " in r.quantity]
    judged = [r for r in ends if r.judged]
    assert len(judged) == 2 and not any(r.ok(validate.MEASURED_TOLERANCE) for r in judged)  # compute end, kernel end

    def slow_dispatch(rows):  # every dispatch 1.25x longer: 1.25x the fixed cost and the time per byte (row)
        for r in rows:
            if r["kind"] == "dispatch":
                r["end_ns"] = r["start_ns"] + 1.25 * (r["end_ns"] - r["start_ns"])
    changed = fused.calibrate(h200, _timeline_copy(tmp_path / "dispatch", slow_dispatch, timeline))
    rate, fixed = fits
    assert getattr(changed, fixed) == pytest.approx(1.25 * getattr(h200, fixed), rel=1e-6)
    assert getattr(changed, rate) == pytest.approx(getattr(h200, rate) * (1 / 1.25 if rate.endswith("gbs") else 1.25),
                                                   rel=1e-6)
    assert all(getattr(changed, f) == getattr(h200, f) for f in others)


def test_fused_calibration_recovers_the_warp_movers_rate(h200, tmp_path):
    # the warp movers' dispatch tasks rewritten as 2.5 us + bytes at 30 GB/s (each task's rows: those the
    # simulator gives it): the calibration gives back 30 GB/s and 2.5 us
    measured = results.load_timeline(WARPS_TIMELINE["path"])
    plan = fused.timeline_plan(measured, KIMI_SHARE, prefer=WARPS_TIMELINE)
    _, used = model.fused_chunk_rows(plan, fused.emulated_load(KIMI_SHARE, align=model.plan_align(plan)))
    row_bytes = KIMI_SHARE.hidden * model.ELEM_BYTES

    def at_30_gbs(rows):
        for r in rows:
            if r["kind"] == "dispatch":
                r["end_ns"] = r["start_ns"] + 2500.0 + used[r["minibatch"], r["row_tile"], 0] * row_bytes / 30.0
    fitted = fused.calibrate(h200, _timeline_copy(tmp_path / "synthetic", at_30_gbs, WARPS_TIMELINE))
    assert fitted.comm_cta_gbs == pytest.approx(30.0, rel=1e-6) and fitted.comm_task_ns == pytest.approx(2500.0, rel=1e-6)
    # a calibration timeline of the other mover is refused (its index row names its kernel)
    with pytest.raises(ValueError, match="bulk movers, but this calibration needs the warps"):
        fused._fit_dispatch(CALIBRATION_TIMELINE, "warps")


QWEN_SHARE = ep_share("qwen3.5-397b", 64)  # 8 KB rows (kimi: 14 KB)


def _chunk_us(shape, gpu, comm_blocks=8):
    """The median busy dispatch chunk (us) of the fused forward on one EP=64 share (bench_layer's
    emulation), and its rows."""
    plan = _built(P.fused_forward, shape, P.FusedKnobs(comm_blocks, 2048), num_sms=132, capacity_rows=12 * 2048)
    load = fused.emulated_load(shape)
    rec = sim.simulate(plan, layer.one_gpu(gpu), load).records(0)
    _, used = model.fused_chunk_rows(plan, load)
    sel = rec["kind"] == int(P.TaskKind.DISPATCH)
    rows = used[rec["minibatch"][sel], rec["row_tile"][sel], 0]
    full = rows == rows.max()
    return float(np.median((rec["end_ns"] - rec["start_ns"])[sel][full])) / 1e3, int(rows.max())


def test_comm_mover_copies_per_byte_the_bulk_ring_per_row(h200):
    # the warp movers (since aceb6ae): a full chunk of qwen's 8 KB rows takes ~8/14 of kimi's 14 KB one
    # (measured at 1685ef1, comm 12: 66-68 us against 108-114 us); the bulk ring: the same time per row
    bulk = h200.recorded_at(CALIBRATION_TIMELINE)
    assert bulk.comm_mover == "bulk" and h200.recorded_at(WARPS_TIMELINE).comm_mover == "warps"
    assert h200.recorded_at({}).comm_mover == "warps"  # a measurement without the field: the current kernel
    (kimi_us, kimi_rows), (qwen_us, qwen_rows) = _chunk_us(KIMI_SHARE, h200), _chunk_us(QWEN_SHARE, h200)
    assert kimi_rows == qwen_rows == 256
    fixed = h200.comm_task_ns / 1e3
    assert (qwen_us - fixed) / (kimi_us - fixed) == pytest.approx(QWEN_SHARE.hidden / KIMI_SHARE.hidden, rel=0.02)
    assert kimi_us == pytest.approx(fixed + 256 * KIMI_SHARE.hidden * model.ELEM_BYTES / h200.comm_cta_gbs / 1e3, rel=0.02)
    (kimi_bulk, _), (qwen_bulk, _) = _chunk_us(KIMI_SHARE, bulk), _chunk_us(QWEN_SHARE, bulk)
    assert qwen_bulk == pytest.approx(kimi_bulk, rel=0.02)
    assert qwen_bulk > 1.5 * qwen_us
    # the spare warps (comm_blocks == 0) are not the communicating CTAs' movers: unchanged by comm_mover
    assert _chunk_us(QWEN_SHARE, h200, 0) == _chunk_us(QWEN_SHARE, bulk, 0)
    with pytest.raises(ValueError, match="comm_mover"):
        dataclasses.replace(h200, comm_mover="tma")


def test_qwen_chunks_judge_the_mover(h200):
    # qwen's comm-12 backward at 1685ef1 (8 KB rows, the warp movers): the transfers' task time per SM
    # within 10% with the per-byte rate fitted on kimi's 14 KB rows, and 40% over it per row (the bulk ring's model)
    entry, = results.timeline_index(pass_="bwd", shape="qwen3.5-397b", git=WARPS_TIMELINE["git"])
    path = entry["path"]
    measured = results.timeline_summary(results.load_timeline(path))["kinds"]
    for gpu, low, high in ((h200, 0.9, 1.1), (h200.recorded_at({"comm_mover": "bulk"}), 1.4, 2.0)):
        ran = {"comm_mover": gpu.comm_mover, "scale_traffic": gpu.scale_traffic, "segment_rows": entry["segment_rows"]}
        plan, result = fused.simulate_timeline(results.load_timeline(path), QWEN_SHARE, gpu, kernel=ran)
        assert plan.comm_blocks == 12
        got = results.timeline_summary(result.records(0))["kinds"]
        for kind in ("rev_combine", "rev_dispatch"):
            ratio = got[kind]["per_lane_ns"] / measured[kind]["per_lane_ns"]
            assert low < ratio < high, (gpu.comm_mover, kind, ratio)


@functools.cache
def _kernel_fields_by_stamp() -> dict:
    """{git stamp: {kernel feature field: value}} over results/'s rows (every machine folder) and the
    timelines' index, read once (shared: read it only); fails if one stamp carries two values of a field."""
    measured = [r for src in results.jsonl_files(results.RESULTS_DIR, "**/*") if src.suffix == ".jsonl"
                for r in results.load(src.stem, src.parent)] + results.timeline_index()
    fields = {}
    for r in measured:
        for k in ("comm_mover", "wait_spin", "scale_traffic"):
            if k in r:
                fields.setdefault(r["git"], {}).setdefault(k, set()).add(r[k])
    assert all(len(v) == 1 for f in fields.values() for v in f.values()), fields
    return {git: {k: v.pop() for k, v in f.items()} for git, f in fields.items()}


def _is_before(stamps, commit: str) -> dict:
    """{git stamp: whether it is older than `commit`}; skips without the git history."""
    import subprocess

    root = results.RESULTS_DIR.parent
    if subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=root, capture_output=True).returncode:
        pytest.skip(f"no git history with {commit}")
    return {stamp: subprocess.run(["git", "merge-base", "--is-ancestor", stamp, f"{commit}^"], cwd=root,
                                  capture_output=True).returncode == 0  # (a commit is its own ancestor: commit^)
            for stamp in stamps}


@pytest.mark.parametrize("field,old,commit", [("comm_mover", "bulk", "aceb6ae"), ("wait_spin", "acquire", "e48bf6e"),
                                              ("scale_traffic", "scatter", "e7e9bd0")])
def test_kernel_fields_follow_the_git_history(field, old, commit):
    # every measurement of results/ (rows and timelines) with a git stamp of a commit carries the kernel
    # feature that commit's kernels had: the old one iff the stamp is older than the commit that changed it
    stamps = {git: f[field] for git, f in _kernel_fields_by_stamp().items() if field in f and git != "unknown"}
    assert {"1685ef1", "e48bf6e", "e7e9bd0"} <= set(stamps) and old in stamps.values()
    for stamp, before in _is_before(stamps, commit).items():
        assert before == (stamps[stamp] == old), (field, stamp)


def test_spare_warps_copy_per_byte(h200):
    # e48bf6e, comm 0: a dispatch chunk of qwen's 8 KB rows takes ~0.6x a chunk of kimi's 14 KB rows (as many
    # rows: the same minibatch over 132 CTAs), as their bytes say and not their rows (a row's time the same:
    # ~1x, what the per-row model fitted at b905f19 said, putting qwen's chunks 50% over); the per-byte rate
    # fitted on kimi predicts qwen's chunks within 10%
    def chunk_us(entry, shape):  # median busy dispatch chunk: measured, simulated
        measured = results.load_timeline(entry["path"])
        plan, result = fused.simulate_timeline(measured, shape, h200, kernel=entry)
        assert plan.comm_blocks == 0
        rec = result.records(0)
        sel = (rec["kind"] == int(P.TaskKind.DISPATCH)) & (rec["end_ns"] - rec["start_ns"] > h200.spare_task_ns)
        return tuple(float(np.median(r["end_ns"][sel] - r["start_ns"][sel])) / 1e3 for r in (measured, rec))

    (kimi_m, kimi_s) = chunk_us(SPARE_TIMELINE, KIMI_SHARE)
    qwen, = results.timeline_index(pass_="fwd", shape="qwen3.5-397b", git=SPARE_TIMELINE["git"])
    (qwen_m, qwen_s) = chunk_us(qwen, QWEN_SHARE)
    assert qwen_m / kimi_m < 0.7
    assert qwen_s / kimi_s == pytest.approx(qwen_m / kimi_m, rel=0.1) and qwen_s == pytest.approx(qwen_m, rel=0.1)
    # the spare warps' rate is a byte rate: a chunk's copy scales with the row size at the same rows
    assert h200.fused_chunk_copy_ns(0, 16, 8192) == pytest.approx(h200.fused_chunk_copy_ns(0, 16, 16384) / 2)


def test_spare_calibration_needs_the_backoff_kernel():
    # the spare warps' copy rate is fitted on a kernel whose counter waits back off (e48bf6e on): the b905f19
    # comm-0 timeline (the old calibration, acquire spin) is refused, the e48bf6e one taken
    assert OLD_SPARE_TIMELINE["git"] == "b905f19" and SPARE_TIMELINE["wait_spin"] == "backoff"
    with pytest.raises(ValueError, match="ran the acquire spin"):
        fused._fit_dispatch(OLD_SPARE_TIMELINE, "spare")
    (fixed, row_ns), row_bytes = fused._fit_dispatch(SPARE_TIMELINE, "spare")
    assert row_bytes == KIMI_SHARE.hidden * model.ELEM_BYTES and 1e3 < fixed < 3.5e3 and 1500 < row_ns < 2500


def test_acquire_spin_rule_decides_which_fused_rows_are_judged(h200, h200_validation):
    # a fused row is explained (validate.SPUN, not judged) iff its kernel ran the acquire spin (stamp before
    # e48bf6e) in a pass whose spare warps move rows (comm 0): a rule on the stamp and the plan, not the error
    import re

    from mok_proto.sim.params import spare_warps_spun
    acquire, backoff = {"wait_spin": "acquire"}, {"wait_spin": "backoff"}
    assert spare_warps_spun(acquire, 0) and spare_warps_spun(acquire, 12, spread_from=7)
    assert not spare_warps_spun(acquire, 12) and not spare_warps_spun(backoff, 0) and not spare_warps_spun({}, 0)
    assert not spare_warps_spun(backoff, 12, spread_from=7)
    wait_spin = {git: f["wait_spin"] for git, f in _kernel_fields_by_stamp().items() if "wait_spin" in f}
    rows = [r for r in h200_validation if r.group == "h200 fused" and r.check != "informational"]
    # explained per event (their own test)
    timeline_notes = {why for e in results.timeline_index() for why in e.get("sim_explained", {}).values()}
    for r in rows:
        git, comm = r.quantity.rsplit(" ", 1)[1], int(re.search(r" C=(\d+) ", r.quantity).group(1))
        spun = wait_spin[git] == "acquire" and comm == 0
        if not spun and r.note in timeline_notes:
            continue
        assert (r.check == "explained") == spun, r.quantity
        assert r.note == validate.SPUN if spun else r.check in ("judged", "calibration"), r.quantity
    # the old spare-warp calibration timeline (b905f19) stays as history: shown, explained
    old = [r for r in rows if r.quantity.endswith("C=0 MB=1024 b905f19") and " kimi" in r.quantity]
    assert len(old) == 5 and all(r.check == "explained" for r in old)
    # every e48bf6e row (4 forward timelines, 8 bench_layer forward passes, 4 backward kernel ends) is judged
    # and within the bar, but kimi's forward dispatch end (the spare warps' calibration)
    new = [r for r in rows if r.quantity.endswith("e48bf6e")]
    assert len(new) == 4 * 6 + 8 + 4
    calibration = [r.quantity for r in new if r.check == "calibration"]
    assert calibration == ["fwd dispatch end kimi-k2.7 C=0 MB=2048 e48bf6e"]
    assert all(r.check == "judged" and r.ok(validate.MEASURED_TOLERANCE) for r in new if r.quantity not in calibration)


def test_fused_pass_rows_from_bench_layer(h200, tmp_path):
    # bench_layer's fused rows (graph replays), when present, are judged against the simulated pass:
    # the schedule, the kernel, the flag and wait, the weighted sum (2.91 ms measured at 62f5296)
    row = {"shape": "kimi-k2.7", "pass": "fwd", "ep": 64, "schedule": "fused", "comm_blocks": 8,
           "minibatch_tokens": 2048, "num_sms": 132, "median_ms": 2.91, "git": "62f5296",
           "time": "2099-01-01T00:00:00+00:00", "comm_mover": "bulk", "wait_spin": "acquire", "scale_traffic": "scatter"}
    # a fused backward row of the same run is not judged against the forward's simulation
    bwd = {**row, "pass": "bwd", "median_ms": 4.5, "time": "2099-01-01T00:00:01+00:00"}
    # bench_layer.jsonl alone (its own rows and these two): fused_rows computes a pass's row from that
    # row and the parameters only; the timelines (seconds to simulate) would add rows the filter drops
    rows = validate.fused_rows(h200, _results_copy(tmp_path, extra_rows=[row, bwd], only={"bench_layer.jsonl"}))
    # the compared runs' fused forward rows (not those of the runs marked sim_left_out), the newest this one
    compared = {r["run"] for r in layer.compared_rows(tmp_path) if r["schedule"] == "fused" and r["pass"] == "fwd"}
    assert sum(r.quantity.startswith("fwd pass (graph)") for r in rows) == sum(
        r["run"] in compared and r["schedule"] == "fused" and r["pass"] == "fwd" for r in layer.compared_rows(tmp_path))
    assert not any(r.quantity.endswith("249b630") for r in rows)  # a run left out (claimed pools)
    passes = [r for r in rows if "pass (graph) kimi" in r.quantity and r.quantity.endswith("62f5296")]  # the newest kimi run: this row
    assert len(passes) == 1 and passes[0].check == "judged" and passes[0].ok(validate.MEASURED_TOLERANCE)
    predicted = passes[0].predicted * 1e6
    kernel = _emulated(_fused_plan(8), h200.recorded_at(row)).kernel_ns  # the row's kernel: the bulk ring
    assert predicted > kernel + model.epilogue_kernel_ns(KIMI_SHARE, layer.one_gpu(h200), 132)


def test_fused_time_grows_when_copies_become_the_bottleneck(h200):
    got = {c: _emulated(_fused_plan(c), h200) for c in (8, 4, 2)}
    ends = {c: results.timeline_events(r.records(0)) for c, r in got.items()}
    assert got[2].kernel_ns > got[4].kernel_ns > 1.3 * got[8].kernel_ns
    # a quarter of the communicating CTAs: every chunk 4x the rows, the dispatches 4x longer
    assert ends[2]["dispatch end"] == pytest.approx(4 * ends[8]["dispatch end"], rel=0.1)
    # comm-bound: the kernel lasts as long as one communicating CTA's dispatches and combines
    rec = got[2].records(0)
    cta0 = rec[rec["block"] == 0]
    assert got[2].kernel_ns >= (cta0["end_ns"] - cta0["start_ns"]).sum() - 1e-6
    assert got[2].kernel_ns > 1.5 * ends[2]["dispatch end"]


def test_fused_records_roles_and_cluster_pairs(h200):
    plan = _fused_plan(8)
    rec = _emulated(plan, h200).records(0)
    assert rec.dtype == trace.TRACE_DTYPE and len(rec) == len(plan.tasks)
    comm = _comm(rec)
    assert comm.any() and np.all(rec["block"][comm] < 8) and np.all(rec["block"][~comm] >= 8)
    assert np.array_equal(rec["role"] == 0, comm)
    # a tile pair: CTAs 2j and 2j + 1 start and end it together (one 256-row tile sharing B)
    for even in range(8, 132, 2):
        a, b = rec[rec["block"] == even], rec[rec["block"] == even + 1]
        assert np.array_equal(a["start_ns"], b["start_ns"]) and np.array_equal(a["end_ns"], b["end_ns"])
        assert np.all(a["start_ns"][1:] >= a["end_ns"][:-1] - 1e-6)  # in order, one at a time


def test_fused_kernel_time_excludes_the_weighted_sum(h200):
    gpu = layer.one_gpu(h200)
    base = _emulated(_fused_plan(8), h200)
    after = 3 * gpu.launch_ns + model.epilogue_kernel_ns(KIMI_SHARE, gpu, 132)  # flag, wait, weighted sum
    assert base.time_ns - base.kernel_ns >= after
    slow_sum = _emulated(_fused_plan(8), h200.scaled(sum_slots_efficiency=0.5))
    assert slow_sum.kernel_ns == pytest.approx(base.kernel_ns)
    assert slow_sum.time_ns > base.time_ns + 0.9 * model.epilogue_kernel_ns(KIMI_SHARE, gpu, 132)
    # the other directions run as their own launches: a pull combine after the kernel
    pull = _emulated(_fused_plan(8, policy=dict(MOK_POLICY, combine="pull")), h200)
    assert not (pull.records(0)["kind"] == int(P.TaskKind.COMBINE)).any()
    assert pull.time_ns - pull.kernel_ns > after + gpu.row_copy_ns(KIMI_SHARE.num_tokens * KIMI_SHARE.top_k
                                                                   * KIMI_SHARE.hidden * model.ELEM_BYTES)


def test_fused_comm_spread_over_compute_ctas(h200, monkeypatch):
    plan = _spread_plan()
    result = _emulated(plan, h200)
    rec = result.records(0)
    assert len(rec) == len(plan.tasks) and plan.comm_blocks == 0
    comm = _comm(rec)
    carriers = np.unique(rec["block"][comm])
    assert len(carriers) and set(carriers.tolist()) <= set(rec["block"][~comm].tolist())  # compute CTAs
    assert np.all(rec["role"][comm] == 0) and np.all(rec["role"][~comm] == 1)
    overlapped = False
    for b in carriers:  # two streams on one CTA: comm tasks in order, beside its GEMM tasks
        c, g = rec[(rec["block"] == b) & comm], rec[(rec["block"] == b) & ~comm]
        assert np.all(c["start_ns"][1:] >= c["end_ns"][:-1] - 1e-6)
        assert np.all(g["start_ns"][1:] >= g["end_ns"][:-1] - 1e-6)
        overlapped |= bool(np.any((c["start_ns"][:, None] < g["end_ns"][None]) & (g["start_ns"][None] < c["end_ns"][:, None])))
    assert overlapped
    # spare warps copy at their own rate, not a communicating CTA's
    slow_spare = _emulated(plan, h200.scaled(spare_cta_gbs=0.01))
    assert results.timeline_events(slow_spare.records(0))["dispatch end"] > 2 * results.timeline_events(rec)["dispatch end"]
    assert _emulated(plan, h200.scaled(comm_cta_gbs=0.1)).time_ns == pytest.approx(result.time_ns)
    split = _fused_plan(8)
    assert _emulated(split, h200.scaled(spare_cta_gbs=0.01)).time_ns == pytest.approx(
        _emulated(split, h200).time_ns)


def test_spread_timeline_rows_are_judged_without_a_combine_median(h200, tmp_path):
    # a comm_blocks == 0 timeline that is not the calibration one: every row judged (here the
    # "measured" timeline is the simulated one: every error is 0), and no combine-chunk median
    # (a spare-warp combine's bar includes its wait: validate.fused_rows' NOTE); a timeline the index
    # does not mark sim_compared is not compared
    plan = P.fused_forward(KIMI_SHARE, 2, P.FusedKnobs(0, 2048), policy=MOK_POLICY, num_sms=132,
                           capacity_rows=10 * 2048)
    rec = _emulated(plan, h200).records(0)
    rec["start_ns"], rec["end_ns"] = rec["start_ns"] - rec["start_ns"].min(), rec["end_ns"] - rec["start_ns"].min()
    rows = [{name: (P.TaskKind(int(r["kind"])).name.lower() if name == "kind" else r[name].item())
             for name in trace.TRACE_DTYPE.names} for r in rec]
    written = tmp_path / f"{results.TIMELINE_PREFIX}kimi-k2.7_spread.jsonl"
    written.write_text("\n".join(json.dumps(r) for r in rows))
    results.add_timeline(written, tmp_path, pass_="fwd", bench="bench_layer", shape="kimi-k2.7")
    assert validate.fused_rows(h200, tmp_path) == []
    results.add_timeline(written.rename(written.with_name("again.jsonl")), tmp_path, pass_="fwd", bench="bench_layer",
                         shape="kimi-k2.7", sim_compared=True)
    got = {r.quantity.split(" kimi")[0]: r for r in validate.fused_rows(h200, tmp_path)}
    assert "fwd combine chunk median" not in got and "fwd dispatch end" in got
    assert all(r.check == "judged" and r.error == pytest.approx(0, abs=1e-9) for r in got.values())


def test_fused_deadlock_is_rejected(h200, monkeypatch):
    # without Plan.check (patched out), the simulator's own scheduler catches a plan that cannot
    # run: a CTA's spare warps combine minibatch 0 before they dispatch anything
    plan = _spread_plan()
    monkeypatch.setattr(P.Plan, "check", lambda self: None)
    t = plan.tasks.copy()
    comm = np.flatnonzero(_comm(t) & (t["block"] == 0))
    t[comm] = t[comm][np.argsort(-t["kind"][comm], kind="stable")]  # COMBINE before DISPATCH
    t["seq"][comm] = np.sort(t["seq"][comm])
    bad = dataclasses.replace(plan, tasks=t)
    assert int(P.TaskKind.COMBINE) > int(P.TaskKind.DISPATCH)
    with pytest.raises(P.PlanError, match="deadlock"):
        _emulated(bad, h200)


def test_simulate_rejects_a_load_padded_for_another_plan(h200):
    pairs = _built(P.fused_forward, KIMI_SHARE, P.FusedKnobs(0, 2048, claim=0, segment_rows=P.PAIR_ROWS), num_sms=132)
    with pytest.raises(ValueError, match=f"padded to {P.PAIR_ROWS}"):
        sim.simulate(pairs, layer.one_gpu(h200), layer.emulated_load(KIMI_SHARE))  # SEGMENT_ROWS segments


def test_ep64_kimi_fused_forward_is_fast(h200, monkeypatch):
    gb = sim.gb300_nvl72(h200)
    t0 = time.process_time()
    p = P.fused_forward(KIMI, 64, P.FusedKnobs(40, 2048), policy=MOK_POLICY, num_sms=gb.num_sms)
    result = sim.simulate(p, gb)  # includes p.check()
    assert time.process_time() - t0 < 2.0
    assert len(result.records()) == len(p.tasks) and result.kernel_ns < result.time_ns


def test_measured_grid_takes_the_newest_fused_points(h200, tmp_path):
    # the heatmap of overlap_explorer.ipynb: the simulated grid, and the newest run's measured
    # fused forward points on it (older runs, off-grid points, other shapes and passes ignored)
    from mok_proto.sim import fused as sim_fused

    old, new = dict(git="old", time="2026-12-01T07:00:00"), dict(git="new", time="2026-12-01T08:00:00")
    lines = [dict(**old, shape="kimi-k2.7", schedule="fused", comm_blocks=0, minibatch_tokens=1024, median_ms=9.0),
             dict(**new, shape="kimi-k2.7", schedule="fused", comm_blocks=0, minibatch_tokens=1024, median_ms=2.8),
             dict(**new, shape="kimi-k2.7", schedule="fused", comm_blocks=8, minibatch_tokens=3072, median_ms=3.0),
             dict(**new, shape="kimi-k2.7", schedule="sequential", median_ms=2.7),
             dict(**new, shape="glm-5.2", schedule="fused", comm_blocks=0, minibatch_tokens=1024, median_ms=2.4),
             dict(**new, shape="kimi-k2.7", schedule="fused", comm_blocks=0, minibatch_tokens=2048, median_ms=5.0,
                  **{"pass": "bwd"})]
    (tmp_path / "bench_layer.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    sim_ms, measured = sim_fused.measured_grid("kimi-k2.7", h200, (0, 8), (1024, 2048), tmp_path)
    assert measured == {(0, 1024): 2.8}
    assert sim_ms.shape == (2, 2) and np.isfinite(sim_ms).all() and (sim_ms > 0.5).all()


def test_measured_grid_takes_the_newest_run_over_the_bench_files(h200, tmp_path):
    # the newest run among bench_layer's compared rows and sweep_overlap.jsonl (its minibatch key is
    # minibatch_rows), after dropping the points whose spare warps ran the acquire spin (1685ef1's
    # comm-0 row, the newest but one, is left out), the points of the bulk ring with communicating
    # CTAs and the runs marked sim_left_out (the newest row of all)
    from mok_proto.sim import fused as sim_fused

    def write(name, rows):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(dict(shape="kimi-k2.7", **r)) + "\n" for r in rows))

    fused_row = dict(schedule="fused", minibatch_tokens=2048)
    write("bench_layer", [dict(git="old", time="2026-12-01T07:00:00", schedule="fused", comm_blocks=0,
                               minibatch_tokens=1024, median_ms=9.0),
                          dict(git="e48bf6e", time="2026-12-01T08:00:00", comm_blocks=0, median_ms=2.9, **fused_row),
                          dict(git="e48bf6e", time="2026-12-01T08:00:20", comm_blocks=12, median_ms=3.0, **fused_row),
                          dict(git="1685ef1", time="2026-12-01T09:00:00", comm_blocks=0, median_ms=3.7,
                               wait_spin="acquire", **fused_row),
                          dict(git="ec6738a", time="2026-12-01T09:30:00", comm_blocks=8, median_ms=3.1,
                               comm_mover="bulk", **fused_row),
                          dict(git="249b630", time="2026-12-01T10:00:00", comm_blocks=0, median_ms=2.5,
                               sim_left_out="claimed pools", **fused_row)])
    write("sweep_overlap", [dict(git="e48bf6e", time="2026-12-01T08:00:10", comm_blocks=8, minibatch_rows=1024,
                                 median_ms=2.95)])
    _, measured = sim_fused.measured_grid("kimi-k2.7", h200, (0, 8, 12), (1024, 2048), tmp_path)
    assert measured == {(0, 2048): 2.9, (12, 2048): 3.0, (8, 1024): 2.95}


def test_timeline_summary_counts_overlapping_tiles_once():
    """Three compute lanes and one comm task, rows out of order: lane 0's tiles overlap (loads
    under the previous epilogue) and one lies inside another, each instant counted once (busy 1.0);
    lane 1 has a gap (union 300 of its 500 ns span); lane 2's only tile took no time (an idle lane,
    busy 0); the comm task is not busy time but has its kind row."""
    rows = [  # block, kind, start, end
        (1, P.TaskKind.DOWN, 500, 600), (0, P.TaskKind.DOWN, 300, 1100), (0, P.TaskKind.GATE_UP, 100, 400),
        (1, P.TaskKind.DISPATCH, 100, 1100), (0, P.TaskKind.GATE_UP, 500, 700), (1, P.TaskKind.GATE_UP, 100, 300),
        (2, P.TaskKind.GATE_UP, 100, 100)]
    rec = trace.empty(len(rows))
    for r, (block, kind, start, end) in zip(rec, rows):
        r["block"], r["kind"], r["start_ns"], r["end_ns"] = block, int(kind), start, end
    got = results.timeline_summary(rec)
    assert got["makespan_ns"] == 1000 and got["compute_lanes"] == 3
    assert got["busy_mean"] == pytest.approx((1.0 + 0.3 + 0.0) / 3) and got["busy_min"] == 0.0
    assert got["kinds"]["gate_up"] == {"per_lane_ns": pytest.approx(700 / 3), "first_ns": 0.0, "last_ns": 600.0}
    assert got["kinds"]["down"]["per_lane_ns"] == pytest.approx(900 / 3)
    assert got["kinds"]["dispatch"]["last_ns"] == 1000.0
    assert (got["mover_lanes"], got["mover_busy_mean_ns"]) == (1, 1000.0)  # lane 1's dispatch
    # the tail: lane 0's last GEMM ends at 1000, lane 1's at 500 (lane 2 has no GEMM time: left out),
    # so 250 ns idle on average after them; the later end has the more GEMM time (corr 1)
    assert (got["lane_end_min_ns"], got["lane_end_max_ns"], got["tail_idle_mean_ns"]) == (500.0, 1000.0, 250.0)
    assert got["end_busy_corr"] == pytest.approx(1.0)
    late = (rec["block"] == 1) & (rec["kind"] != int(P.TaskKind.DISPATCH))
    rec["start_ns"][late] += 600  # lane 1's tiles later: it ends last (1100) with less GEMM time (300 < 1000)
    rec["end_ns"][late] += 600
    got = results.timeline_summary(rec)
    assert (got["lane_end_max_ns"], got["makespan_ns"], got["tail_idle_mean_ns"]) == (1100.0, 1100.0, 50.0)
    assert got["end_busy_corr"] == pytest.approx(-1.0)


def test_timeline_summary_mover_lanes():
    """The movers' busy time per CTA that moved rows: lane 0's dispatch and combine overlap (700 ns
    covered, not 800), lane 1 moves 200 ns, lane 2's one move took no time (not a mover lane); beside them
    the lanes' GEMM time, which is the shorter here (the pass waits on its movers)."""
    rows = [  # block, kind, start, end
        (0, P.TaskKind.DISPATCH, 0, 400), (0, P.TaskKind.COMBINE, 300, 700), (1, P.TaskKind.DISPATCH, 0, 200),
        (2, P.TaskKind.DISPATCH, 300, 300),
        (0, P.TaskKind.GATE_UP, 0, 300), (1, P.TaskKind.DOWN, 100, 500), (2, P.TaskKind.DOWN, 200, 550)]
    rec = trace.empty(len(rows))
    for r, (block, kind, start, end) in zip(rec, rows):
        r["block"], r["kind"], r["start_ns"], r["end_ns"] = block, int(kind), start, end
    got = results.timeline_summary(rec)
    assert (got["mover_lanes"], got["mover_busy_mean_ns"], got["mover_busy_max_ns"]) == (2, 450.0, 700.0)
    assert got["busy_mean"] * got["makespan_ns"] == pytest.approx((300 + 400 + 350) / 3)
    gemm_only = results.timeline_summary(rec[4:])
    assert (gemm_only["mover_lanes"], gemm_only["mover_busy_mean_ns"], gemm_only["mover_busy_max_ns"]) == (0, 0.0, 0.0)


def test_timeline_summary_tail_correlation():
    """Four lanes, one tile each: the lanes' ends against their (merged) GEMM time, a correlation
    strictly between -1 and 1 (numpy's, on the values the summary must use); equal GEMM times or a
    single lane: None."""
    spans = [(0, 400), (0, 300), (100, 500), (300, 500)]  # ends 400, 300, 500, 500; GEMM time 400, 300, 400, 200
    rec = trace.empty(len(spans) + 1)
    for b, (r, (start, end)) in enumerate(zip(rec, spans)):
        r["block"], r["kind"], r["start_ns"], r["end_ns"] = b, int(P.TaskKind.GATE_UP), start, end
    rec[-1]["block"], rec[-1]["kind"], rec[-1]["start_ns"], rec[-1]["end_ns"] = 0, int(P.TaskKind.DOWN), 100, 300  # inside lane 0's tile
    got = results.timeline_summary(rec)
    want = np.corrcoef([400, 300, 500, 500], [400, 300, 400, 200])[0, 1]
    assert -0.9 < want < 0.9 and got["end_busy_corr"] == pytest.approx(want)
    assert (got["lane_end_min_ns"], got["lane_end_max_ns"], got["tail_idle_mean_ns"]) == (300.0, 500.0, 75.0)
    same = rec[:2].copy()
    same["end_ns"] = same["start_ns"] + 300  # two lanes, the same end and GEMM time: no spread
    assert results.timeline_summary(same)["end_busy_corr"] is None
    assert results.timeline_summary(rec[:1])["end_busy_corr"] is None  # one lane


# The fused backward (plan.fused_backward, cuda/fused.cuh fused_backward)

BWD = P.PASS_KINDS["bwd"]


def _bwd_plan(comm_blocks, minibatch_rows=2048, shape=KIMI_SHARE, policy=MOK_POLICY, **knobs):
    knobs.setdefault("claim", 0)  # as the kernels measured before the claimed pool (99c90df)
    return _built(P.fused_backward, shape, P.FusedKnobs(comm_blocks, minibatch_rows, **knobs), policy, num_sms=132,
                  capacity_rows=10 * minibatch_rows)


_emulated_bwd = _emulated  # (the load is the plan's shape's)


def _kinds(rec, kinds):
    return np.isin(rec["kind"], [int(k) for k in kinds])


def test_fused_backward_simulates_every_task(h200):
    plan = _bwd_plan(8)
    result = _emulated_bwd(plan, h200)
    rec = result.records(0)
    assert len(rec) == len(plan.tasks) and np.array_equal(rec["kind"], plan.tasks["kind"])
    assert np.all(np.isfinite(rec["start_ns"])) and np.all(rec["end_ns"] >= rec["start_ns"])
    # every GEMM kind and both transfers take time; the chunks run on the communicating CTAs
    busy = rec["end_ns"] > rec["start_ns"]
    for k in (BWD.comm_in, BWD.comm_out, BWD.first, BWD.second, BWD.shared_first, BWD.shared_second,
              *BWD.wgrad, *BWD.shared_wgrad):
        assert busy[rec["kind"] == int(k)].any(), k
    assert np.all(rec["block"][_comm(rec)] < 8) and np.all(rec["role"][_comm(rec)] == 0)
    # dy_slots = w * dout (scale) and the slot sum and d topk_weights run inside the kernel (scale and
    # token_grads, the defaults): one SCALE task per 16 tokens first and one SLOT_SUM task last on
    # the CTAs' movers, round robin; before the kernel only begin_round and the counters' memset
    one = layer.one_gpu(h200)
    assert plan.scale and plan.token_grads
    for kind, after_kind, first in ((P.TaskKind.SCALE, None, True), (P.TaskKind.SLOT_SUM, BWD.comm_out, False)):
        mine = rec["kind"] == int(kind)
        assert mine.sum() == KIMI_SHARE.num_tokens // P.EPILOGUE_ROWS and busy[mine].all()
        assert np.array_equal(rec["block"][mine], np.arange(mine.sum()) % 132) and np.all(rec["role"][mine] == 0)
        if after_kind is not None:  # after every rank's reverse-dispatch
            assert rec["start_ns"][mine].min() >= rec["end_ns"][rec["kind"] == int(after_kind)].max()
        else:  # before every reverse-combine chunk (they wait for every rank's scale)
            assert rec["end_ns"][mine].max() <= rec["start_ns"][rec["kind"] == int(BWD.comm_in)].min()
    assert result.time_ns == pytest.approx(result.kernel_ns + 2 * one.launch_ns, rel=0.01)
    # both outside: the scale kernel and its publish before, the slot sum and d topk_weights after
    outside = _emulated_bwd(_bwd_plan(8, token_grads=False, scale=False), h200)
    around = 4 * one.launch_ns + model.epilogue_kernel_ns(KIMI_SHARE, one, 132) + sum(
        model.token_kernel_ns(KIMI_SHARE, one, k) for k in (model.SCALE_TO_SLOTS, model.TOPK_WEIGHT_GRAD))
    assert not outside.plan.token_grads and not outside.plan.scale
    assert outside.time_ns > outside.kernel_ns + around
    slow_scale = _emulated_bwd(outside.plan, h200.scaled(hbm_write_gbs=0.5))  # scale_to_slots writes K slot rows
    assert slow_scale.kernel_ns == pytest.approx(outside.kernel_ns)
    assert slow_scale.time_ns > outside.time_ns + model.token_kernel_ns(KIMI_SHARE, one, model.SCALE_TO_SLOTS) * 0.5


def test_fused_backward_weight_gradients_after_their_data_gradients(h200):
    plan = _bwd_plan(8)
    rec = _emulated_bwd(plan, h200).records(0)

    def early(rec):  # weight-gradient tiles that start before a data-gradient tile they need ended
        first_end = rec["end_ns"][rec["kind"] == int(BWD.first)].max()
        shared_end = rec["end_ns"][rec["kind"] == int(BWD.shared_first)].max()
        routed = rec["start_ns"][_kinds(rec, BWD.wgrad)] < first_end  # deferred: after every down_bwd tile
        shared = rec["start_ns"][rec["kind"] == int(P.TaskKind.SHARED_GATE_UP_WGRAD)] < shared_end
        return int(routed.sum() + shared.sum())

    assert early(rec) == 0
    # without the waits on DATA_GRAD_DONE / SHARED_DONE the simulator would start them early
    tasks = plan.tasks.copy()
    wg = np.isin(tasks["kind"], [int(k) for k in (*BWD.wgrad, P.TaskKind.SHARED_GATE_UP_WGRAD)])
    tasks["wait_counter"][wg] = -1
    loose = P.with_tasks(plan, tasks)
    with pytest.raises(P.PlanError):  # the plan check rejects it (data flow) ...
        loose.check()
    loose.__dict__["_checked"] = True  # ... and unchecked the simulation starts them early
    assert early(_emulated_bwd(loose, h200).records(0)) > 0


def test_fused_backward_responds_to_what_it_models(h200):
    base = _emulated_bwd(_bwd_plan(8), h200)
    fewer = _emulated_bwd(_bwd_plan(2), h200)
    spare = _emulated_bwd(_bwd_plan(0), h200)
    for k in (BWD.comm_in, BWD.comm_out):
        # a quarter of the communicating CTAs: each chunk moves 4x the rows
        chunk = lambda r: np.median(np.diff(np.stack([r.start_ns[:, 0], r.end_ns[:, 0]]), axis=0)[0][  # noqa: E731
            (r.plan.tasks["kind"] == int(k)) & (r.end_ns[:, 0] > r.start_ns[:, 0])])
        assert chunk(fewer) > 3 * chunk(base), k
    assert fewer.kind_span_ns([BWD.comm_in]) > 3 * base.kind_span_ns([BWD.comm_in])
    assert fewer.kernel_ns > base.kernel_ns
    # comm_blocks == 0: the spare warps of every CTA move the rows beside its tiles
    assert spare.records(0)["block"][_comm(spare.records(0))].max() == 131
    # a slower in-kernel copy lengthens only the transfers' chunks
    slow = _emulated_bwd(_bwd_plan(8), h200.scaled(comm_cta_gbs=0.5))
    assert slow.kind_span_ns([BWD.comm_in]) > 1.5 * base.kind_span_ns([BWD.comm_in])
    # a larger ffn: twice the weight-gradient tiles (each as long: k = the expert's rows), a longer wgrad phase
    wide = dataclasses.replace(KIMI_SHARE, ffn=2 * KIMI_SHARE.ffn, shared_ffn=KIMI_SHARE.shared_ffn_size)
    big = _emulated_bwd(_bwd_plan(8, shape=wide), h200)
    wgrad = lambda r: _kinds(r.records(0), BWD.wgrad)  # noqa: E731
    assert wgrad(big).sum() == 2 * wgrad(base).sum()
    assert big.kind_span_ns(BWD.wgrad) > 1.6 * base.kind_span_ns(BWD.wgrad)
    # a wgrad tile's time is the GEMM model's tile at k = its expert's rows (sustained load)
    rec, load = base.records(0), base.load
    sel = rec["kind"] == int(P.TaskKind.DOWN_WGRAD)
    want = layer.one_gpu(h200).tile_ns("down_wgrad", load.tokens_per_expert[0, base.plan.tasks["expert"][sel]])
    assert np.allclose(rec["end_ns"][sel] - rec["start_ns"][sel], want)
    slow_gemm = _emulated_bwd(_bwd_plan(8), h200.scaled(sustained_gemm=0.5))
    assert slow_gemm.kind_span_ns(BWD.wgrad) > 1.8 * base.kind_span_ns(BWD.wgrad)


def test_fused_backward_against_the_sequential_backward(h200):
    # One EP=64 share on one H200 (bench_layer): the transfers are HBM copies, little to hide, and
    # the fused kernel gives 8 CTAs to them: about the sequential time
    # (measured, kimi C=8 MB=2048: 5.94 vs 5.87 ms at d689e07, 6.38 vs 6.01 at ec6738a).
    one = layer.one_gpu(h200)
    seq_plan = layer._sequential_plan(KIMI_SHARE, "bwd", 132)  # (its 2 ranks, MoK's policy: built once)
    seq = sim.simulate(seq_plan, one,
                       layer.emulated_load(KIMI_SHARE))
    fused_bwd = _emulated_bwd(_bwd_plan(8), h200)
    gemm = np.isin(seq.records(0)["kind"], [int(k) for k in P.PROBLEM_OF])  # (not the token tasks: movers' work)
    gemm_work = (seq.end_ns[gemm, 0] - seq.start_ns[gemm, 0]).sum() / 124  # the GEMMs on the compute CTAs
    assert gemm_work < fused_bwd.kernel_ns < fused_bwd.time_ns
    assert fused_bwd.time_ns == pytest.approx(seq.time_ns, rel=0.1)
    # Two ranks over the link: the sequential backward waits for every transfer, the fused one hides
    # them behind its tiles, so a slower link costs the sequential pass and not the fused one.
    fused_plan = P.fused_backward(KIMI_SHARE, 2, P.FusedKnobs(8, 2048), policy=MOK_POLICY, num_sms=132)

    def both(gpu):
        return sim.simulate(fused_plan, gpu).time_ns, sim.simulate(seq_plan, gpu).time_ns
    (fast_fused, fast_seq), (slow_fused, slow_seq) = both(h200), both(h200.scaled(link_gbs=0.5))
    assert fast_fused < fast_seq and slow_fused < slow_seq
    assert slow_seq - fast_seq > 0.5e6 and slow_fused - fast_fused < 0.05 * fast_fused


def test_backward_timelines_are_kept_apart_and_simulated(h200, h200_validation):
    forward = results.timeline_files()
    backward = results.timeline_files(pass_="bwd")
    assert forward and backward and not set(forward) & set(backward)
    assert all(p.name.startswith(results.TIMELINE_PREFIX) for p in forward)
    compared = validate.compared_timelines(pass_="bwd")
    assert [e["time"] for e in compared] == sorted(e["time"] for e in compared)  # the backward's: by time
    entry = compared[1]
    path = entry["path"]
    assert path in backward and (entry["shape"], entry["git"]) == ("kimi-k2.7", "d689e07")
    measured = results.load_timeline(path)
    plan, result = fused.simulate_timeline(measured, KIMI_SHARE, h200, kernel=entry)
    assert plan.strategy == "fused_backward" and plan.comm_blocks == 8
    predicted = result.records(0)
    for key in fused.KEY + ("role",):
        assert np.array_equal(predicted[key], measured[key]), key
    rows = [r for r in h200_validation if r.quantity.startswith("bwd ")]
    ends = [r for r in rows if " kernel end " in r.quantity]
    assert len(ends) == len(compared) == 14
    # judged, but the comm-0 kernel ends of 1685ef1 (glm, kimi): the acquire spin's (params.spare_warps_spun)
    spun = {r.quantity for r in ends if r.check == "explained" and r.note == validate.SPUN}
    assert spun == {"bwd kernel end glm-5.2 C=0 MB=2048 1685ef1", "bwd kernel end kimi-k2.7 C=0 MB=2048 1685ef1"}
    assert all(r.check == "judged" and r.ok(validate.MEASURED_TOLERANCE) for r in ends if r.quantity not in spun)
    assert sum(r.quantity.endswith("e48bf6e") and r.judged for r in ends) == 4
    # 491ec86's plans run the scale and the token gradients inside (SCALE, SLOT_SUM tasks): their kernel
    # ends are judged too, and their token tasks have per-SM rows
    assert sum(r.quantity.endswith("491ec86") and r.judged for r in ends) == 4
    per_sm = [r for r in rows if " per SM " in r.quantity]
    assert len(per_sm) == 148 and not any(r.judged for r in per_sm)
    assert {r.quantity.split(" per SM ")[0] for r in per_sm if r.quantity.endswith("491ec86")} >= {"bwd scale",
                                                                                                 "bwd slot_sum"}
    # informational, but the token tasks of the timeline the movers' token rates are fitted on
    fitted = {r.quantity for r in per_sm if r.check == "calibration"}
    assert fitted == {"bwd scale per SM kimi-k2.7 C=0 MB=2048 491ec86", "bwd slot_sum per SM kimi-k2.7 C=0 MB=2048 491ec86"}
    assert all(r.check == "informational" for r in per_sm if r.quantity not in fitted)


def test_token_task_rates_fitted_on_one_backward_timeline(h200, h200_validation):
    """The fused backward's SCALE and SLOT_SUM tasks on the spare warps (GpuParams.token_read_gbs /
    token_write_gbs): fitted on kimi's 491ec86 backward (~4.6 GB/s read, ~7 GB/s written per CTA),
    which they then reproduce; glm's tasks (another shape, not fitted on) within 15%; without the
    rates the model falls back to the tasks' share of the standalone kernels, which put them 3.6-8.2x
    short."""
    token = fused.calibration_timeline("fused_token")
    assert (token["shape"], token["git"]) == ("kimi-k2.7", "491ec86")
    assert 3 < h200.token_read_gbs < 7 and 5 < h200.token_write_gbs < 10
    rows = {r.quantity: r for r in h200_validation if " per SM " in r.quantity and r.quantity.endswith("491ec86")}
    for kind in ("scale", "slot_sum"):
        kimi, glm = rows[f"bwd {kind} per SM kimi-k2.7 C=0 MB=2048 491ec86"], rows[f"bwd {kind} per SM glm-5.2 C=0 MB=2048 491ec86"]
        assert kimi.predicted == pytest.approx(kimi.reference, rel=0.02), kind  # least squares over both kinds
        assert glm.predicted == pytest.approx(glm.reference, rel=0.15), kind
    measured = results.load_timeline(token["path"])
    unfitted = dataclasses.replace(h200, token_read_gbs=0.0, token_write_gbs=0.0)
    _, result = fused.simulate_timeline(measured, KIMI_SHARE, unfitted, kernel=token)
    old = results.timeline_summary(result.records(0))["kinds"]
    for kind in ("scale", "slot_sum"):
        assert old[kind]["per_lane_ns"] < rows[f"bwd {kind} per SM kimi-k2.7 C=0 MB=2048 491ec86"].reference * 1e3 / 4
    # the bytes: a scale task reads a row and writes K per token, a token-gradient task reads 2K + 1 (+ the
    # shared expert's dx) and writes one; the last tile of 16 tokens may be short
    shape = ep_share("kimi-k2.7", fused.EP)
    row = shape.hidden * model.ELEM_BYTES
    reads, writes = model.token_task_bytes(shape, P.TaskKind.SLOT_SUM, np.array([0]))
    assert (reads[0], writes[0]) == (16 * row * (2 * shape.top_k + 1 + shape.num_shared), 16 * row)
    reads, writes = model.token_task_bytes(shape, P.TaskKind.SCALE, np.array([0]))
    assert (reads[0], writes[0]) == (16 * row, 16 * row * shape.top_k)
    with pytest.raises(ValueError, match="token-side"):
        model.token_task_bytes(shape, P.TaskKind.WEIGHTED_SUM, np.array([0]))


def test_token_task_calibration_needs_a_backward_with_its_token_tasks_inside():
    token = fused.calibration_timeline("fused_token")
    forward, = results.timeline_index(pass_="fwd", shape="kimi-k2.7", git=token["git"])
    with pytest.raises(ValueError, match="token-task calibration needs"):
        fused._fit_token(forward)
    outside, = results.timeline_index(pass_="bwd", shape="kimi-k2.7", git=SPARE_TIMELINE["git"])
    with pytest.raises(ValueError, match="token-task calibration needs"):  # e48bf6e's ran them outside
        fused._fit_token(outside)


# ---------------------------------------------------------------------------------------------
# Which cluster takes each tile pair (plan.fused_forward / fused_backward's assign)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["glm-5.2", "kimi-k2.7"])
@pytest.mark.parametrize("pass_", P.PASSES)
def test_balanced_assignment_is_not_slower(h200, name, pass_):
    """The balanced assignment's pass, simulated as bench_layer runs it (one EP=64 share on one
    H200, minibatch 2048, 0 and 8 communicating CTAs, bench_layer's capacity 1.15 N K and a
    capacity the rows fill), takes at most 0.5% longer than round robin's (simulated: glm's
    comm-0 forward +0.3% at bench capacity, the others 0 to -3%), and less over the cases.
    Costing the tiles past the expected rows as full ones (tile_cost without row_pair) fails
    it: +1.5% (glm) and +1.9% (kimi) for the comm-0 forward. (Only these two assignments are
    simulated, the claim's; the plans are fused._fused_plan's, built once for every test.)"""
    shape = ep_share(name, 64)
    load = fused.emulated_load(shape)
    filled = -(-int(load.expert_offsets[:, -1].max()) // 2048) * 2048
    bench = -(-int(1.15 * shape.num_tokens * shape.top_k) // 2048) * 2048
    assigns = ("round_robin", "balanced")
    total = dict.fromkeys(assigns, 0)
    for capacity in (filled, bench):
        for comm in (0, 8):
            plans = {assign: fused._fused_plan(pass_, shape, 2, P.FusedKnobs(comm, 2048, assign=assign, claim=0),
                                               tuple(MOK_POLICY.items()), 132, capacity) for assign in assigns}
            ns = {assign: sim.simulate(p, layer.one_gpu(h200), load).time_ns for assign, p in plans.items()}
            assert ns["balanced"] <= 1.005 * ns["round_robin"], (capacity, comm, ns)
            for assign in assigns:
                total[assign] += ns[assign]
    assert total["balanced"] < total["round_robin"], total


def test_timeline_of_a_balanced_plan_is_recognized(h200):
    # a timeline recorded under the balanced assignment rebuilds to that plan (and not round robin's)
    plan = P.fused_forward(KIMI_SHARE, 2, P.FusedKnobs(8, 2048, assign="balanced", claim=0), policy=MOK_POLICY,
                           num_sms=132)
    rebuilt = fused.timeline_plan(_emulated(plan, h200).records(0), KIMI_SHARE)
    assert rebuilt.assign == "balanced" and np.array_equal(rebuilt.tasks, plan.tasks)


def test_timeline_of_a_col_raster_plan_is_recognized(h200):
    # a timeline recorded with the pairs in column order rebuilds to that plan (not the row order's)
    plan = P.fused_forward(KIMI_SHARE, 2, P.FusedKnobs(8, 2048, raster="col", claim=0), policy=MOK_POLICY, num_sms=132)
    rebuilt = fused.timeline_plan(_emulated(plan, h200).records(0), KIMI_SHARE)
    assert rebuilt.raster == "col" and np.array_equal(rebuilt.tasks, plan.tasks)


def test_spread_combine_chunks_and_timeline(h200):
    # a plan that spreads the last combines over every CTA: its chunks move every real row of
    # each minibatch once (fused_chunk_rows of the outgoing transfer), a chunk on a compute CTA
    # costs what the same chunk costs in a comm-0 plan (the spare warps), one on a communicating CTA
    # less (its 12 warps), and its timeline rebuilds to that plan
    load = fused.emulated_load(KIMI_SHARE)
    plan = P.fused_forward(KIMI_SHARE, 2, P.FusedKnobs(12, 2048, spread_from=7, claim=0), policy=MOK_POLICY,
                           num_sms=132)
    real, _ = model.fused_chunk_rows(plan, load, outgoing=True)
    whole = model._real_rows_per_minibatch(plan, load)  # [M, R]
    assert np.array_equal(real.sum(axis=1), whole) and real.shape[1] == 132
    assert not real[:7, 12:].any() and real[7:, 12:].any()  # chunks past the communicating CTAs' 12: spread ones
    rec = _emulated(plan, h200).records(0)
    rebuilt = fused.timeline_plan(rec, KIMI_SHARE)
    assert rebuilt.spread_from == 7 and np.array_equal(rebuilt.tasks, plan.tasks)

    def chunk_ns(p):  # minibatch 7's combine chunks (row_tile order), as simulated
        r = _emulated(p, h200).records(0)
        sel = np.flatnonzero((r["kind"] == int(P.TaskKind.COMBINE)) & (r["minibatch"] == 7))
        sel = sel[np.argsort(r["row_tile"][sel])]
        return (r["end_ns"] - r["start_ns"])[sel]

    spread_ns = chunk_ns(plan)
    comm0_ns = chunk_ns(P.fused_forward(KIMI_SHARE, 2, P.FusedKnobs(0, 2048), policy=MOK_POLICY, num_sms=132))
    assert len(spread_ns) == len(comm0_ns) == 132
    assert np.allclose(spread_ns[12:], comm0_ns[12:]) and (spread_ns[:12] < comm0_ns[:12]).all()


def test_explained_timeline_events_name_stored_timelines(h200_validation):
    # an explanation outlives nothing: its timeline is stored and compared, and validate marks exactly its rows
    explains = [(e, event) for e in results.timeline_index() for event in e.get("sim_explained", {})]
    assert explains
    for e, event in explains:
        assert e["path"].exists() and e.get("sim_compared") and event in results.TIMELINE_EVENTS, (e["file"], event)
    notes = {e["sim_explained"][event] for e, event in explains}
    explained = [r for r in h200_validation if r.check == "explained" and r.note in notes]
    assert len(explained) == len(explains)
    # and each still needs it: a row back inside the bar is judged again (drop its entry)
    assert all(abs(r.error) > validate.MEASURED_TOLERANCE for r in explained), [(r.quantity, r.error) for r in explained]


def test_scale_to_slots_priced_by_the_kernel_that_ran(h200):
    # e7e9bd0's scale_to_slots reads each dout row once ("stream"); the kernels before it read it K
    # times ("scatter"): each run's scale stages are predicted with its own kernel's pattern
    assert h200.scale_traffic == "stream"  # sim.h200() predicts the current kernel
    one = layer.one_gpu(h200)
    rows = [r for r in results.load("bench_layer") if r["git"] == "e7e9bd0" and r["schedule"] == "sequential"
            and r["pass"] == "bwd"]
    assert {r["shape"] for r in rows} == set(PAPER_SHAPES) and {r["scale_traffic"] for r in rows} == {"stream"}
    assert {r["scale_traffic"] for r in results.load("bench_layer") if r["git"] == "a1db532"} == {"scatter"}
    for r in rows:
        share, measured = ep_share(r["shape"], r["ep"]), r["stages_ms"]["scale"] * 1e6
        now = layer.sequential_stages_ns(share, "bwd", one.recorded_at(r))["scale"]
        before = layer.sequential_stages_ns(share, "bwd", one.recorded_at({"scale_traffic": "scatter"}))["scale"]
        assert abs(now / measured - 1) <= validate.MEASURED_TOLERANCE, (r["shape"], now, measured)
        assert before / measured - 1 > validate.MEASURED_TOLERANCE  # the old kernel's price misses it


def test_a_partial_bench_gemm_run_replaces_only_its_rows(tmp_path):
    # bench_gemm --problems/--shapes/--routing appends a subset: the simulator keeps every other
    # (shape, routing, problem)'s newest row and still calibrates
    _results_copy(tmp_path)
    full = calibrate.newest_gemm_rows(tmp_path)
    newer = {k: v for k, v in full[0].items() if k != "run"}
    newer.update(time="2099-01-01T00:00:00+00:00", git="partial")
    with open(tmp_path / "bench_gemm.jsonl", "a") as f:
        f.write(json.dumps(newer) + "\n")
    rows = calibrate.newest_gemm_rows(tmp_path)
    key = ("shape", "routing", "problem")
    assert len(rows) == len(full)
    assert [r["git"] for r in rows if all(r[k] == full[0][k] for k in key)] == ["partial"]
    assert sorted(r["time"] for r in rows)[:-1] == sorted(r["time"] for r in full if r is not full[0])
    calibrate.fit_h200(tmp_path)  # every problem still has rows to fit


def test_a_link_check_run_leaves_the_comm_rows_alone(h200, tmp_path):
    # bench_comm --link-gbps appends rows of another kind (a stage per row, no `stages`) to
    # bench_comm.jsonl: the newest timed round of each backend still calibrates and is judged
    _results_copy(tmp_path, only={"bench_comm.jsonl", "x2/bench_comm.jsonl"})
    before = calibrate.newest_comm_rows(tmp_path)
    check = {"backend": "virtual", "shape": "kimi-k2.7", "ep": 2, "tokens_per_rank": 2048, "stage": "dispatch",
             "direction": "push", "median_ms": 1.0, "link_gbps": 368.0, "x2_measured_ms": 0.5,
             "time": "2099-01-01T00:00:00+00:00", "git": "link-check"}
    with open(tmp_path / "bench_comm.jsonl", "a") as f:
        f.write(json.dumps(check) + "\n")
    assert results.is_link_check(check) and not any(results.is_link_check(r) for r in before)
    assert calibrate.newest_comm_rows(tmp_path) == before
    assert validate.kernel_rows(h200, tmp_path)  # reads every newest comm row's dispatch and combine


@pytest.mark.parametrize("pass_", P.PASSES)
def test_claimed_pairs_run_on_the_cluster_free_first(h200, pass_):
    # the pool (plan claim): each pair on one cluster's two CTAs, after that cluster's table, in
    # claim order per cluster; the same work as the plan without a pool, so the static plan's
    # padded-pair imbalance can only shrink when every pair is claimed
    shape = ep_share("qwen3.5-397b")
    build = P.fused_forward if pass_ == "fwd" else P.fused_backward
    static = sim.simulate(build(shape, 2, P.FusedKnobs(0, 2048, claim=0), policy=MOK_POLICY, num_sms=132), h200)
    for claim in (40, "all"):
        plan = build(shape, 2, P.FusedKnobs(0, 2048, claim=claim), policy=MOK_POLICY, num_sms=132)
        res = sim.simulate(plan, h200)
        pool = np.flatnonzero(plan.tasks["block"] == plan.pool_block)
        for rank in range(plan.num_ranks):
            rec = res.records(rank)
            even, odd = rec["block"][pool[0::2]], rec["block"][pool[1::2]]
            assert ((even % 2 == 0) & (odd == even + 1) & (even < plan.num_sms)).all()
            tables = plan.tasks["block"] != plan.pool_block
            for cta in np.unique(even):  # after its own table, its claimed pairs in claim order
                mine = pool[0::2][even == cta]
                own = tables & (rec["block"] == cta) & ~np.isin(plan.tasks["kind"], [int(k) for k in P.MOVER_KINDS])
                assert not own.any() or rec["start_ns"][mine].min() >= rec["end_ns"][own].max()
                assert (np.diff(rec["start_ns"][mine]) >= 0).all()
        if claim == "all":
            assert res.kernel_ns <= static.kernel_ns


def test_timeline_plan_finds_the_claimed_pool():
    # a traced backward whose tail (66 clusters, 4 pairs each) was claimed at run time: the plan is found
    # from the records, its pool rows (recorded with the CTA that claimed them) last (a BF16 layer's: the
    # plans timeline_plan tries are)
    claimed = [e for e in results.timeline_index(pass_="bwd", shape="kimi-k2.7")
               if e["claim_pairs"] and e.get("precision", "bf16") == "bf16"]
    entry = max(claimed, key=lambda e: e["time"])
    rec = results.load_timeline(entry["path"])
    plan = fused.timeline_plan(rec, ep_share("kimi-k2.7"), prefer=entry)
    assert plan.claim_pairs == 264 and plan.pass_ == "bwd"
    pool = np.flatnonzero(plan.tasks["block"] == plan.pool_block)
    assert len(pool) == 2 * 264 and pool[0] == len(plan.tasks) - 2 * 264
    even, odd = rec["block"][pool[0::2]], rec["block"][pool[1::2]]
    assert ((even % 2 == 0) & (odd == even + 1)).all() and len(np.unique(even)) > 1  # claimed by several clusters


def test_cli_simulates_a_chosen_claim(capsys):
    from mok_proto.sim import __main__ as cli

    args = ["--gpu", "h200", "--fused", "--shape", "tile", "--ep", "2", "--comm-sms", "0", "--minibatch", "256"]
    got = {}
    for claim in ("3", None):
        assert cli.main(args + (["--claim", claim] if claim else [])) == 0
        got[claim] = int(capsys.readouterr().out.split("claim_pairs=")[1].split()[0])
    assert got["3"] == 3 and got[None] > 3  # the forward's default: every pair
    assert cli.main(args + ["--claim", "most"]) == 2  # a bad claim: one line, exit 2
    assert "claim" in capsys.readouterr().err
