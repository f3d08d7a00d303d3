"""CPU checks of bench_layer.py --precision fp8 (scripts/bench_layer.py, mok_proto.bench.layer_run,
layer_rows): its options, its rows' fields and verdicts, and that the default run is unchanged, on
stand-ins for the GPU."""

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ROOT, rank_env
from test_bench_layer_cpu import _fused_row, _measured, _torch

from mok_proto.bench import layer_cli, layer_run
from mok_proto.bench.emulation import emulated_shape
from mok_proto.bench.layer_rows import BARS, FP8_BARS, Fp8Run, Report, shape_report
from mok_proto.bench.settings import DEFAULT_FUSED
from mok_proto.routing import UNIFORM


def test_precision_options():
    default = layer_cli.parse_args([])
    assert (default.precision, default.dispatch_dtype) == ("bf16", "bf16")
    assert [k.comm_blocks for k in default.settings["fwd"]] == [k.comm_blocks for k in DEFAULT_FUSED]
    fp8 = layer_cli.parse_args(["--precision", "fp8", "--dispatch-dtype", "fp8", "--sweep"])
    assert (fp8.precision, fp8.dispatch_dtype) == ("fp8", "fp8")
    for run in (fp8, layer_cli.parse_args(["--precision", "fp8", "--sweep"])):  # both fused passes run FP8
        for pass_ in ("fwd", "bwd"):
            assert [k.comm_blocks for k in run.settings[pass_]] == [k.comm_blocks for k in layer_cli.SWEEP]
        assert all(k.routed_wgrads is None for k in run.settings["bwd"])  # (the FP8 layer's plan: after the kernel)
    assert layer_cli.parse_args(["--precision", "fp8", "--no-fused"]).settings == {"fwd": [], "bwd": []}
    assert layer_cli.parse_args(["--precision", "fp8"]).dispatch_dtypes == ["bf16"]
    both = layer_cli.parse_args(["--precision", "fp8", "--dispatch-dtype", "fp8, bf16,fp8"])
    assert both.dispatch_dtypes == ["fp8", "bf16"]  # in the order given, each once
    assert layer_cli.parse_args(["--precision", "fp8"]).wgrad_precisions == [None]  # the layer's default
    assert layer_cli.parse_args(["--precision", "fp8", "--wgrad-precision", "bf16,fp8"]).wgrad_precisions == ["bf16", "fp8"]


@pytest.mark.parametrize("args,message", [
    (["--dispatch-dtype", "fp8"], "--dispatch-dtype fp8 needs --precision fp8"),
    (["--precision", "fp8", "--directions", "all"], "--directions: with --precision fp8 only 'mok'"),
    (["--precision", "fp16"], "argument --precision: invalid choice: 'fp16'"),
    (["--precision", "fp8", "--dispatch-dtype", "bf16,e5m2"], "--dispatch-dtype: 'e5m2' is not one of bf16, fp8"),
    (["--dispatch-dtype", "bf16,fp8"], "--dispatch-dtype fp8 needs --precision fp8"),
    (["--wgrad-precision", "bf16"], "--wgrad-precision needs --precision fp8"),
    (["--precision", "fp8", "--wgrad-precision", "fp8,fp16"], "--wgrad-precision: 'fp16' is not one of bf16, fp8"),
])
def test_precision_options_refused_in_one_line(args, message):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_layer.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, env=rank_env(), timeout=60)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], lines


def _fp8_case(torch_fp8=(1.6,), scale=None):
    """(measured, torch, Fp8Run): the layer's results a known relative error off the reference
    (x `scale` per array, default 1.01), the torch FP8 forward at torch_fp8[0] ms (None: refused)."""
    keys = ("out", "w_down", "w_gate", "w_up", "x")
    reference = {k: np.arange(1, 9, dtype=np.float32) * (i + 1) for i, k in enumerate(keys)}
    scale = {**dict.fromkeys(keys, 1.01), **(scale or {})}
    results = {k: (v * np.float32(scale[k])).astype(np.float32) for k, v in reference.items()}
    measured = _measured([], [], results=results)
    base, ref = _torch()
    ref["out"] = results["out"] * np.float32(1.2)  # 20% off torch: beyond TORCH_REL_ERR, not judged in fp8
    ref.update({k: results[k] for k in ("w_down", "w_gate", "w_up")})
    stats = None if torch_fp8 is None else {"median_ms": torch_fp8[0], "p20_ms": 1.5, "p80_ms": 1.7, "iters": 5}
    note = "no call" if torch_fp8 is None else "forward only: no backward"
    return measured, (base, ref), Fp8Run("fp8", "fp8", stats, note, reference, "bf16 layer, same inputs and run")


def test_fp8_rows_record_precision_speedups_and_errors():
    shape = emulated_shape("kimi-k2.7")
    measured, torch, fp8 = _fp8_case(scale={"w_up": 1.03})
    report = shape_report("kimi-k2.7", shape, measured, torch, ({"median_ms": 0.03}, True), BARS, fp8=fp8)
    names = [(r["schedule"], r["pass"]) for _, r in report.rows]
    assert names == [("torch", "fwd"), ("torch_fp8", "fwd"), ("sequential", "fwd"), ("torch", "bwd"),
                     ("sequential", "bwd")]  # the torch FP8 pipeline: forward only
    assert all((r["precision"], r["dispatch_dtype"]) == ("fp8", "fp8") for _, r in report.rows)
    torch_fp8, fwd, bwd = report.rows[1][1], report.rows[2][1], report.rows[4][1]
    assert torch_fp8["median_ms"] == 1.6 and torch_fp8["speedup_vs_torch"] == pytest.approx(2.5 / 1.6)
    assert fwd["speedup_vs_torch"] == pytest.approx(2.5 / 2.0)  # the BF16 pipeline stays the baseline
    assert fwd["speedup_vs_torch_fp8"] == pytest.approx(1.6 / 2.0) and bwd["speedup_vs_torch_fp8"] is None
    assert bwd["torch_fp8_note"] == "forward only: no backward" and bwd["err_reference"] == fp8.reference_name
    assert fwd["err_rel_rms"] == pytest.approx(0.01, rel=1e-5) and fwd["err_max"] == pytest.approx(0.01, rel=1e-5)
    assert set(fwd["errors"]) == {"out"} and set(bwd["errors"]) == {"w_down", "w_gate", "w_up", "x"}
    assert bwd["err_rel_rms"] == pytest.approx(0.03, rel=1e-5)  # the worst array: w_up
    assert bwd["errors"]["x"]["err_rel_rms"] == pytest.approx(0.01, rel=1e-5)
    # judged by err_rel_rms against the reference, not by the max error against torch (20% here)
    assert fwd["max_rel_err_vs_torch"] > 0.05 and report.failed == []
    lines = [line for line in report.lines if line.startswith("#   fp8 ")]
    assert len(lines) == 2 and "err_rel_rms 0.0300 (w_up; bar 0.08)" in lines[1] and "x torch fp8 n/a" in lines[1]
    assert "x torch fp8 0.80 (1.600 ms)" in lines[0]


def test_fused_fp8_forward_rows_record_their_precision():
    # fused_forward_fp8's rows carry the run's precision (the results' FP8 views keep them apart from
    # the BF16 fused rows) and their speedup over torch's FP8 pipeline
    shape = emulated_shape("kimi-k2.7")
    measured, torch, fp8 = _fp8_case()
    measured = measured._replace(fused_rows={"fwd": [_fused_row(0, 1.25, 2.0, best=(1.25, 2.0))], "bwd": []})
    report = shape_report("kimi-k2.7", shape, measured, torch, ({"median_ms": 0.03}, True), BARS, fp8=fp8)
    fused = [r for _, r in report.rows if r["schedule"] == "fused"]
    assert len(fused) == 1 and (fused[0]["precision"], fused[0]["dispatch_dtype"]) == ("fp8", "fp8")
    assert fused[0]["speedup_vs_torch_fp8"] == pytest.approx(1.6 / 1.25)
    assert fused[0]["speedup_vs_torch"] == pytest.approx(2.5 / 1.25)


def test_fp8_runs_are_judged_by_the_fp8_bars(capsys):
    assert layer_cli.parse_args([]).bars == BARS
    fp8 = layer_cli.parse_args(["--precision", "fp8", "--bar", "fused_fwd_x_torch_fp8=1.4"]).bars
    assert (fp8["fused_fwd_x_torch"].value, fp8["fused_bwd_x_torch"].value) == (1.5, 2.0)
    assert fp8["fused_fwd_x_torch_fp8"].value == 1.4 and "fused_fwd_x_seq" not in fp8
    # the emulated link's bars stay (link_report reads them), only fused x sequential is not judged
    assert set(FP8_BARS) == set(BARS) - {"fused_fwd_x_seq", "fused_bwd_x_seq"} | {"fused_fwd_x_torch_fp8"}
    assert layer_cli.parse_args(["--precision", "fp8", "--bar", "link_fused_fwd_x_seq=1.2"]).bars[
        "link_fused_fwd_x_seq"].value == 1.2
    for refused in (["--bar", "fused_fwd_x_torch_fp8=1.4"],  # a BF16 run has no torch FP8 bar
                    ["--precision", "fp8", "--bar", "link_overlap_fwd=0.7,fused_bwd_x_seq=1.2"]):
        with pytest.raises(SystemExit):
            layer_cli.parse_args(refused)
    with pytest.raises(SystemExit):
        layer_cli.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "With --precision fp8 (the FP8 layer's bars): fused_fwd_x_torch=1.5" in help_text
    assert "fused_fwd_x_torch_fp8=1.3" in help_text
    shape = emulated_shape("kimi-k2.7")

    def failed(fwd_ms, bwd_ms, torch_fp8=(2.4,), bars=FP8_BARS):
        # torch: forward 2.5 ms, backward 8.0; the sequential passes 2.0 and 5.0 ms (fused x sequential < 1);
        # the first timings (9 ms) would miss every bar: the verdicts read the timing again
        measured, torch, run = _fp8_case(torch_fp8=torch_fp8)
        measured = measured._replace(fused_rows={"fwd": [_fused_row(0, 9.0, 2.0, best=(fwd_ms, 1.5))],
                                                 "bwd": [_fused_row(0, 9.0, 5.0, best=(bwd_ms, 3.7))]})
        report = shape_report("kimi-k2.7", shape, measured, torch, ({"median_ms": 0.03}, True), bars, fp8=run)
        return report.failed, [line for line in report.lines if "fused:" in line]

    got, lines = failed(1.6, 3.9)  # 1.56x torch, 1.50x torch FP8; backward 2.05x
    assert got == [] and "x torch fp8 1.50 (bar 1.3)" in lines[0] and "(not judged;" in lines[0]
    assert "x torch fp8" not in lines[1]
    assert failed(1.6, 3.9, bars=BARS)[0] == ["kimi-k2.7 fused fwd", "kimi-k2.7 fused bwd"]  # x sequential < 1.1
    assert failed(1.7, 3.9)[0] == ["kimi-k2.7 fused fwd"]  # 1.47x torch
    assert failed(1.6, 3.9, torch_fp8=(2.0,))[0] == ["kimi-k2.7 fused fwd"]  # 1.25x torch FP8
    got, lines = failed(1.6, 3.9, torch_fp8=None)  # no torch FP8 pipeline: its bar is not met
    assert got == ["kimi-k2.7 fused fwd"] and "x torch fp8 n/a (bar 1.3)" in lines[0]
    assert failed(1.6, 4.1)[0] == ["kimi-k2.7 fused bwd"]  # 1.95x torch


def test_fp8_rows_fail_beyond_the_recipe_bound_and_without_torch_fp8():
    shape = emulated_shape("kimi-k2.7")
    measured, torch, fp8 = _fp8_case(torch_fp8=None, scale={"x": 1.09})
    report = shape_report("kimi-k2.7", shape, measured, torch, ({"median_ms": 0.03}, True), BARS, fp8=fp8)
    assert report.failed == ["kimi-k2.7 bwd"]  # dx 9% off: over ERR_REL_RMS_RECIPE
    assert [r["schedule"] for _, r in report.rows].count("torch_fp8") == 0
    fwd = report.rows[1][1]
    assert fwd["speedup_vs_torch_fp8"] is None and fwd["torch_fp8_note"] == "no call"


def test_run_shape_adds_the_fp8_baselines_only_with_fp8(monkeypatch):
    """The FP8 run: ours with the run's precision, then fp8_run on the same inputs and ring (its
    reference the BF16 layer's results: layer_results with no precision), handed to shape_report."""
    calls, reports = [], []
    data = {"topk_idx": [0, 1], "routing": UNIFORM}
    monkeypatch.setattr(layer_run, "emulated_inputs", lambda name, routing: (emulated_shape(name), data))
    monkeypatch.setattr(layer_run, "row_fields", lambda d: {"emulation": "2 virtual ranks, rank 0 timed",
                                                            "routing": "uniform", "received_rows": 16384})
    monkeypatch.setattr(layer_run, "ours", lambda *a, **kw: calls.append(("ours", kw["precision"],
                                                                          kw["dispatch_dtype"])) or "measured")
    monkeypatch.setattr(layer_run, "torch_pipeline", lambda *a: "torch")
    monkeypatch.setattr(layer_run, "schedule_at_ep64", lambda *a: "schedule")
    monkeypatch.setattr(layer_run, "shape_report", lambda *a: reports.append(a) or Report(
        rows=[("bench_layer", {"schedule": s}) for s in ("torch", "torch_fp8", "sequential")], failed=["kimi-k2.7 fwd"]))
    monkeypatch.setattr(layer_run, "torch_fp8_pipeline", lambda *a: ({"median_ms": 1.0}, None))
    monkeypatch.setattr(layer_run, "backward_note", lambda: "forward only")
    monkeypatch.setattr(layer_run, "layer_results", lambda shape, d, ring, **run: calls.append(("ref", d, ring, run))
                        or {"out": 0})
    args = SimpleNamespace(iters=3, warmup=1, settings={"fwd": [], "bwd": []}, bars=BARS, links=[], routing=UNIFORM,
                           timeline="", macrobatch_rows="4096", precision="fp8", dispatch_dtypes=["fp8"])
    layer_run.run_shape("kimi-k2.7", args, lambda report: None)
    assert calls == [("ours", "fp8", "fp8"), ("ref", data, 4096, {})]
    fp8 = reports[0][-1]
    assert (fp8.precision, fp8.dispatch_dtype, fp8.torch_fp8, fp8.note, fp8.reference) == (
        "fp8", "fp8", {"median_ms": 1.0}, "forward only", {"out": 0})
    monkeypatch.setattr(layer_run, "torch_fp8_pipeline", lambda *a: (None, "refused"))
    refused = layer_run.fp8_run(emulated_shape("kimi-k2.7"), data, args, None, "bf16")
    assert (refused.note, refused.dispatch_dtype) == ("refused", "bf16")  # no probe then
    # both dispatch dtypes in one run: a layer each, in the order given; the baselines and the
    # reference once, each report naming its dtype
    calls.clear()
    reports.clear()
    monkeypatch.setattr(layer_run, "torch_pipeline", lambda *a: calls.append(("torch",)) or "torch")
    args.dispatch_dtypes = ["fp8", "bf16"]
    emitted = []
    layer_run.run_shape("kimi-k2.7", args, emitted.append)
    assert calls == [("ours", "fp8", "fp8"), ("torch",), ("ref", data, 4096, {}), ("ours", "fp8", "bf16")]
    assert [r[-1].dispatch_dtype for r in reports] == ["fp8", "bf16"] and reports[0][3] == reports[1][3] == "torch"
    # the torch rows once (the first layer's report), each verdict naming its dispatch dtype
    assert [[r["schedule"] for _, r in e.rows] for e in emitted] == [["torch", "torch_fp8", "sequential"],
                                                                     ["sequential"]]
    assert [e.failed for e in emitted] == [["kimi-k2.7 fwd (fp8 dispatch)"], ["kimi-k2.7 fwd (bf16 dispatch)"]]
    args.precision, args.dispatch_dtypes = "bf16", ["bf16"]
    calls.clear()
    layer_run.run_shape("kimi-k2.7", args, lambda report: None)
    assert calls == [("ours", "bf16", "bf16"), ("torch",)] and reports[-1][-1] is None  # no FP8 baselines


@pytest.mark.parametrize("argv", [[], ["--precision", "fp8"]])
def test_main_runs_both_fused_passes_in_either_precision(monkeypatch, capsys, argv):
    import mok_proto.bench as bench
    from mok_proto.bench import ceilings
    from mok_proto.bench.layer_rows import Report

    seen, recorded = [], []

    def fake_run_shape(name, args, emit):
        seen.append(args.settings)
        emit(Report(rows=[("bench_layer", {"tflops": 1.0})]))
        return SimpleNamespace(fused_rows={"fwd": [], "bwd": []}), {}

    monkeypatch.setattr(layer_cli, "run_shape", fake_run_shape)
    monkeypatch.setattr(bench, "require_gpu", lambda *a, **kw: None)
    monkeypatch.setattr(bench, "append_result", lambda file, row: recorded.append((file, row)))
    monkeypatch.setattr(ceilings, "dense_matmul_tflops", lambda: 100.0)
    assert layer_cli.main(["--shapes", "kimi-k2.7", *argv]) == 0
    out = capsys.readouterr().out
    assert "skipped" not in out
    assert bool(seen[0]["fwd"]) and bool(seen[0]["bwd"]) and recorded[0][0] == "bench_layer"
