"""CPU checks of bench_gemm.py --precision fp8 (mok_proto.bench.gemm_fp8_problems, gemm_fp8_rows):
the layout and the quantized operands (NumPy, mok_proto.fp8: the bits the CUDA quantizers give),
every problem's FP8 and BF16 launch on them (the wrappers' checks, with the launch and the
tensor maps recorded instead), the float64 output check against the reference and against wrong
outputs, the rows, bars and verdicts, torch without _scaled_grouped_mm, and the command line. The
GPU run itself is the device's."""

import subprocess
import sys
import types

import numpy as np
import pytest

from conftest import ROOT, gpu_reason, rank_env
from mok_proto import fp8
from mok_proto.bench import gemm_fp8_problems as P
from mok_proto.bench import gemm_fp8_rows as R
from mok_proto.bench.cli import Bar
from mok_proto.config import MoEShape
from mok_proto.kernels import gemm, gemm_fp8
from mok_proto.plan import SEGMENT_ROWS
from mok_proto.reference import from_bf16, to_bf16

# H != I, so that a weight passed in the wrong orientation is refused by the wrappers' shape checks
SHAPE = MoEShape("tiny-fp8", hidden=512, ffn=256, num_experts=3, top_k=2, num_tokens=150)


@pytest.fixture(scope="module")
def base():
    return P.make_operands(SHAPE, 1, SHAPE.num_tokens, "skewed", np, P.REFERENCE)


@pytest.fixture
def ops(base):
    """The module's operands with fresh outputs (tests write into them)."""
    fresh = P.make_operands(SHAPE, 1, SHAPE.num_tokens, "skewed", np, P.REFERENCE)  # only its zeroed outputs are used
    assert fresh.rows == base.rows
    return types.SimpleNamespace(**{**vars(base), "out8": fresh.out8, "out16": fresh.out16, "check8": fresh.check8})


def test_layout_aligns_segments_and_scatter_places_rows():
    offsets, rows = P.aligned_layout(np.array([100, 0, 300, 256]), 256)
    assert offsets.tolist() == [0, 256, 256, 768] and rows == 1024 and offsets.dtype == np.int32
    offsets, rows = P.aligned_layout(np.array([5, 11, 16]), 16)  # torch's weight-gradient groups
    assert offsets.tolist() == [0, 16, 32] and rows == 48
    assert P.aligned_layout(np.array([5, 11]), 1)[0].tolist() == [0, 5]  # packed
    packed = np.arange(12, dtype=np.uint16).reshape(6, 2) + 1
    out = P.scatter(packed, np.array([2, 0, 4]), np.array([0, 4, 4]), 9, np)
    assert out[:2].tolist() == packed[:2].tolist() and out[4:8].tolist() == packed[2:].tolist()
    assert not out[[2, 3, 8]].any()


def test_operands_sit_in_the_layer_layout_and_are_the_reference_quantization(base):
    ops = base
    assert ops.counts.tolist() == [165, 81, 54] and ops.total == 300  # skewed: 1/(e+1), the rest to expert 0
    padded = [-(-c // SEGMENT_ROWS) * SEGMENT_ROWS for c in (165, 81, 54)]  # each expert in whole segments
    assert ops.offsets.tolist() == [0, padded[0], padded[0] + padded[1]] and ops.rows == sum(padded)
    assert ops.inside.sum() == 300 and ops.inside[:165].all() and not ops.inside[165:padded[0]].any()
    for name in ("x", "dy", "h", "g", "u", "dg", "du"):  # each expert's rows, in order; zeros between
        assert np.array_equal(ops.bf[name][ops.inside], ops.src[name]), name
        assert not ops.bf[name][~ops.inside].any(), name
    assert ops.src["x"].dtype == np.uint16 and ops.bf["w_down"].shape == (3, 256, 512)
    x = from_bf16(ops.bf["x"])
    for got, want in ((ops.q["x"], fp8.quantize_rows(x)), (ops.q["x_t"], fp8.quantize_rows(x.T))):
        assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()
    w = from_bf16(ops.bf["w_gate"])
    codes_t, scales_t = fp8.quantize_blocks(np.ascontiguousarray(w.swapaxes(1, 2)))  # W^T, [El, I, H]
    assert ops.q["w_gate_t"][0].tobytes() == codes_t.tobytes() and ops.q["w_gate_t"][1].tobytes() == scales_t.tobytes()
    # the float64 dequantization is decode x scale, exactly: within fp8.dequantize_rows' one float32 rounding
    deq = P.dequantize_rows(ops.q["h"], np)
    assert deq.dtype == np.float64 and np.allclose(deq, fp8.dequantize_rows(*ops.q["h"]), rtol=2 ** -24, atol=0)
    wd = P.dequantize_blocks((ops.q["w_down"][0][1], ops.q["w_down"][1][1]), np)
    assert np.allclose(wd, fp8.dequantize_blocks(ops.q["w_down"][0][1], ops.q["w_down"][1][1]), rtol=2 ** -24, atol=0)
    # and near the bf16 values: e4m3 keeps 3 mantissa bits (half a step: 2^-4 of the block's largest power of two)
    h, scales = from_bf16(ops.bf["h"]), np.repeat(ops.q["h"][1], fp8.BLOCK, axis=1)
    assert np.all(np.abs(deq - h) <= 2.0 ** -4 * np.maximum(np.abs(h), 2.0 ** -6 * scales))
    assert P.flops("gate_up", ops) == 2 * 2 * 300 * 512 * 256 and P.flops("down", ops) == 2 * 300 * 512 * 256


@pytest.fixture
def launches(monkeypatch):
    """Replace the launch and the tensor-map encoder of both GEMM families: [(namespace, problem, fields)]."""
    seen = []
    monkeypatch.setattr(gemm, "tensor_map", lambda array, *dims, **kw: ("map", array.shape, dims))

    def launch(module, namespace, struct, problem, site, error, pack_only, fields):
        seen.append((namespace, problem, fields))

    monkeypatch.setattr(gemm, "launch_grouped", launch)
    return seen


@pytest.mark.parametrize("name", P.FLOPS)
def test_every_problem_launches_both_precisions_on_its_operands(name, ops, launches):
    runs = P.ours(ops, name)
    assert set(runs) == {"fp8", "bf16"}
    runs["fp8"]()
    runs["bf16"]()
    (ns8, problem8, f8), (ns16, problem16, f16) = launches
    assert (ns8, problem8, ns16, problem16) == ("mok::gemm_fp8", name, "mok::gemm", name)
    for f in (f8, f16):
        assert f["num_groups"] == 3 and f["row_offsets"] is ops.d_offsets and f["row_counts"] is ops.d_counts
    out = {"gate_up": "h", "down": "y", "down_bwd": "dg", "gate_up_bwd": "dx", "down_wgrad": "dwd",
           "gate_up_wgrad": "dwg"}[name]
    assert f8["out1"] is ops.out8[out] and f16["out1"] is ops.out16[out] and ops.out8[out] is not ops.out16[out]
    if name == "gate_up":  # timed as the BF16 rows time it: h (and hq), not g and u
        assert f8["out2"] == 0 and f16["out2"] == 0 and f8["out_codes"] is ops.out8["hq"][0]
    if name in ("down_wgrad", "gate_up_wgrad"):  # K = the rows, in blocks of 128 of the padded layout
        assert f8["a_scale_stride"] == ops.rows // fp8.BLOCK
    if name == "down_bwd":  # both read the same bf16 g, u; FP8 quantizes dg, du as the layer's does
        assert f8["tmap_aux1"] == f16["tmap_aux1"]
        assert f8["out_codes"] is ops.out8["dgq"][0] and f8["out_scales2"] is ops.out8["duq"][1]


def test_the_check_launch_writes_g_and_u(ops, launches):
    P.check_launch(ops)
    (ns, problem, f), = launches
    assert (ns, problem) == ("mok::gemm_fp8", "gate_up")
    assert f["out1"] is ops.check8["h"] and f["out2"] is ops.check8["g"] and f["out3"] is ops.check8["u"]


def _write_reference_outputs(ops):
    """Every FP8 output as the float64 GEMM on fp8.dequantize_*'s operands would give it (rounded as the
    kernels store it), the gate_up check launch's g, u and both launches' h, hq alike."""
    deq = {k: fp8.dequantize_rows(*ops.q[k]).astype(np.float64) for k in P.QUANTIZED + tuple(
        f"{a}_t" for a in P.QUANTIZED)}

    def w(key, e):
        return fp8.dequantize_blocks(ops.q[key][0][e], ops.q[key][1][e]).astype(np.float64)

    o, c = ops.out8, ops.check8
    for e, (off, cnt) in enumerate(zip(ops.offsets, ops.counts)):
        s = slice(off, off + cnt)
        c["g"][s], c["u"][s] = to_bf16(deq["x"][s] @ w("w_gate_t", e).T), to_bf16(deq["x"][s] @ w("w_up_t", e).T)
        o["y"][s] = to_bf16(deq["h"][s] @ w("w_down_t", e).T)
        dh = deq["dy"][s] @ w("w_down", e).T
        g, u = from_bf16(ops.bf["g"][s]).astype(np.float64), from_bf16(ops.bf["u"][s]).astype(np.float64)
        sig = 1 / (1 + np.exp(-g))
        o["dg"][s], o["du"][s] = to_bf16(dh * u * sig * (1 + g * (1 - sig))), to_bf16(dh * g * sig)
        o["dx"][s] = to_bf16(deq["dg"][s] @ w("w_gate", e).T + deq["du"][s] @ w("w_up", e).T)
        o["dwd"][e] = deq["h_t"][:, s] @ deq["dy_t"][:, s].T
        o["dwg"][e], o["dwu"][e] = deq["x_t"][:, s] @ deq["dg_t"][:, s].T, deq["x_t"][:, s] @ deq["du_t"][:, s].T
    gf, uf = from_bf16(c["g"]), from_bf16(c["u"])
    o["h"][...] = c["h"][...] = to_bf16(gf / (1 + np.exp(-gf)) * uf)
    codes, scales = P.REFERENCE.quantize_rows(o["h"])
    for hq in (o["hq"], c["hq"]):
        hq[0][...], hq[1][...] = codes, scales


def test_check_accepts_the_reference_and_catches_each_kind_of_wrong_output(ops):
    _write_reference_outputs(ops)
    for name in P.FLOPS:
        error, mismatched = P.fp8_error(name, ops, P.REFERENCE)
        assert error < 1e-5 and mismatched == [], (name, error, mismatched)
    o, e1 = ops.out8, slice(int(ops.offsets[1]), int(ops.offsets[1] + ops.counts[1]))
    o["y"][~ops.inside] = to_bf16(np.float32(1e4))  # the gaps between experts are not outputs
    assert P.fp8_error("down", ops, P.REFERENCE)[0] < 1e-5
    ref = from_bf16(o["y"][e1]).astype(np.float64)
    o["y"][e1.start + 3, 7] = to_bf16(np.array([ref[3, 7] + 0.01 * np.abs(ref).max()], np.float32))[0]
    assert 0.005 < P.fp8_error("down", ops, P.REFERENCE)[0] < 0.012  # 1% of expert 1's max, less its roundings
    o["dwg"][2] *= np.float32(1.01)  # one expert's gradient 1% off (a scale applied twice, say)
    assert 0.009 < P.fp8_error("gate_up_wgrad", ops, P.REFERENCE)[0] < 0.011
    o["dwd"][0, 5, 5] = np.nan
    assert P.fp8_error("down_wgrad", ops, P.REFERENCE)[0] == np.inf
    o["du"][e1] = to_bf16(from_bf16(o["du"][e1]) * np.float32(1.02))  # down_bwd: dh 2% off in one expert
    assert 0.01 < P.fp8_error("down_bwd", ops, P.REFERENCE)[0] < 0.03
    ops.check8["u"][e1] = to_bf16(-from_bf16(ops.check8["u"][e1]))  # gate_up's GEMM, through its g and u
    assert P.fp8_error("gate_up", ops, P.REFERENCE)[0] > 1
    ops.check8["u"][e1] = to_bf16(-from_bf16(ops.check8["u"][e1]))
    o["hq"][0][e1.start, 0] ^= 1  # one code of the timed launch's hq
    assert P.fp8_error("gate_up", ops, P.REFERENCE)[1] == ["hq (check launch)", "hq (quantize_rows(h))"]


def test_implied_error_allows_the_output_rounding_only():
    want = np.array([[1.0, -3.0, 0.5], [2.0, 1e-3, -7.0]])
    assert P.implied_error(from_bf16(to_bf16(want.astype(np.float32))), want, P.BF16_STEP, np) == 0.0
    got = want.copy()
    got[1, 2] += 0.07  # 1% of max |want|
    assert P.implied_error(got, want, 0.0, np) == pytest.approx(0.01)
    step = P.BF16_STEP  # the rounding of |want| = 7 is allowed, not the 0.07
    assert P.implied_error(got, want, step, np) == pytest.approx((0.07 - 7 * step) / (1 + step) / 7)
    assert P.implied_error(np.zeros((0, 3)), np.zeros((0, 3)), 0.0, np) == 0.0


def test_torch_without_scaled_grouped_mm_is_said_and_its_bar_not_met(ops, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(__version__="2.3.0"))
    run, note = P.torch_fp8(ops, "gate_up")
    assert run is None and note == "torch 2.3.0 has no torch._scaled_grouped_mm"
    samples = {"fp8": [1.0, 1.0, 1.0], "bf16": [2.0, 2.0, 2.0]}
    row = R.fp8_row("gate_up", samples, 10**12, 1e-4, [], note, 800.0, None, R.BARS, shape="s", routing="uniform")
    assert row["torch_fp8"] is None and row["tflops"]["torch_fp8"] is None and row["ratio_vs_torch_fp8"] is None
    assert R.failures(row, R.BARS) == [f"x torch._scaled_grouped_mm (row-wise e4m3) not measured ({note}), bar >= 1.25"]
    row = R.fp8_row("down_bwd", samples, 10**12, 1e-4, [], note, 800.0, None, R.BARS, shape="s", routing="uniform")
    assert R.failures(row, R.BARS) == [] and row["bars"] == {}  # no bar on the backward problems


def test_rows_record_ratios_and_bars_judge_them():
    samples = {"fp8": [1.0, 1.0, 1.1], "bf16": [1.6, 1.5, 1.7], "torch_fp8": [1.3, 1.2, 1.4]}
    fields = dict(shape="kimi-k2.7", ep=64, routing="uniform", experts=6, rows=16384)
    row = R.fp8_row("gate_up", samples, 2 * 10**12, 1e-3, [], None, 800.0, 1600.0, R.BARS, **fields)
    assert row["precision"] == "fp8" and row["shape"] == "kimi-k2.7" and row["experts"] == 6
    assert row["fp8"]["median_ms"] == 1.0 and row["bf16"]["median_ms"] == 1.6
    assert row["tflops"] == {"fp8": pytest.approx(2000.0), "bf16": pytest.approx(1250.0),
                             "torch_fp8": pytest.approx(2000 / 1.3)}
    # medians of the per-iteration ratios (1.6, 1.5, 1.545...), (1.3, 1.2, 1.27...): not the medians' ratio
    assert row["ratio_vs_bf16"] == pytest.approx(1.7 / 1.1) and row["ratio_vs_torch_fp8"] == pytest.approx(1.4 / 1.1)
    assert row["fraction_of_dense"] == pytest.approx(2.5) and row["fraction_of_dense_fp8"] == pytest.approx(1.25)
    assert row["bars"] == {"gate_up_fp8_x_bf16": 1.5, "gate_up_fp8_x_torch_fp8": 1.25}
    assert row["err_tol"] == P.ERR_TOL == 2e-3 and row["torch_fp8_note"] is None
    assert R.failures(row, R.BARS) == []
    assert R.line(row, R.BARS, []).split()[-1] == "yes"
    slow = R.fp8_row("gate_up", {**samples, "torch_fp8": [1.2, 1.2, 1.3]}, 10**12, 1e-3, [], None, 800.0, None,
                     R.BARS, **fields)
    assert R.failures(slow, R.BARS) == ["x torch._scaled_grouped_mm (row-wise e4m3) 1.20, bar >= 1.25"]
    assert R.line(slow, R.BARS, ["x"]).split()[-1] == "NO"
    strict = {**R.BARS, "gate_up_fp8_x_bf16": Bar(1.6, "stricter")}
    assert R.failures(row, strict) == ["x our BF16 GEMM 1.55, bar >= 1.6"]
    for error, mismatched, why in ((3e-3, [], "max rel err 3.0e-03 > 2e-03"), (float("nan"), [], "max rel err nan"),
                                   (1e-4, ["hq (check launch)"], "not the bits they should be: hq (check launch)")):
        bad = R.fp8_row("down", samples, 10**12, error, mismatched, None, 800.0, None, R.BARS, **fields)
        assert [f for f in R.failures(bad, R.BARS) if f.startswith(why)], (error, mismatched)
        assert R.line(bad, R.BARS, ["x"]).split()[-1] == "WRONG"


def test_epilogue_share_is_what_the_bare_build_saves():
    # --epilogue-share: the FP8 GEMM built without epilogue, timed in the same interleaved runs
    samples = {"fp8": [1.0, 1.0, 1.2], "bf16": [1.5, 1.5, 1.5], "fp8_no_epilogue": [0.8, 0.75, 0.9]}
    row = R.fp8_row("down_bwd", samples, 10**12, 1e-4, [], "no torch", 800.0, None, R.BARS, shape="s", routing="uniform")
    assert row["fp8_no_epilogue"]["median_ms"] == 0.8 and row["epilogue_share"] == pytest.approx(0.2)
    assert R.line(row, R.BARS, []).split()[-2:] == ["yes", "20.0%"]
    plain = R.fp8_row("down_bwd", {k: v for k, v in samples.items() if k != "fp8_no_epilogue"}, 10**12, 1e-4, [],
                      "no torch", 800.0, None, R.BARS, shape="s", routing="uniform")
    assert "epilogue_share" not in plain and R.line(plain, R.BARS, []).endswith("yes")

def test_rotating_runs_before_each_run_outside_its_stage():
    from mok_proto.bench import rotating

    calls = []
    enqueue = rotating({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                       before=lambda: calls.append("flush"))
    enqueue(lambda stage: calls.append(("mark", stage)))
    assert calls == ["flush", ("mark", "a"), "a", ("mark", None), "flush", ("mark", "b"), "b", ("mark", None)]


def test_time_stages_times_each_run_and_not_what_runs_before_it(monkeypatch):
    """On a fake clock (each run 1 ms, each flush 100 ms): every stage's sample is its run's 1 ms,
    whatever the rotation; the flushes count in 'total' only."""
    from mok_proto.bench import rotating, timing

    now = [0.0]

    class Event:
        def record(self):
            self.t = now[0]

        def synchronize(self):
            pass

    monkeypatch.setattr(timing, "_events", lambda api: (Event, lambda: None, lambda a, b: b.t - a.t))

    def tick(ms):
        now[0] += ms

    runs = {"a": lambda: tick(1.0), "b": lambda: tick(1.0), "c": lambda: tick(1.0)}
    samples = timing.time_stages(rotating(runs, before=lambda: tick(100.0)), iters=4, warmup=1)
    assert set(samples) == {"a", "b", "c", "total"}
    assert all(samples[k] == [1.0] * 4 for k in runs), samples
    assert samples["total"] == [203.0] * 4  # three runs, the two flushes between them


def _script(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gemm.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, env=rank_env(), timeout=60)


def test_precision_option_and_its_bars():
    text = " ".join(_script("--help").stdout.split())
    assert "--precision {bf16,fp8}" in text and "(default: bf16)" in text
    for bar in ("gate_up_fp8_x_bf16=1.5", "down_fp8_x_bf16=1.5", "gate_up_fp8_x_torch_fp8=1.25",
                "down_fp8_x_torch_fp8=1.25", "gate_up_x_torch=0.9"):
        assert bar in text, bar
    for args, message in ((["--precision", "fp16"], "argument --precision: invalid choice: 'fp16'"),
                          (["--bar", "gate_up_fp8_x_bf16=2"], "'gate_up_fp8_x_bf16=2' is not KEY=VALUE"),
                          (["--precision", "fp8", "--bar", "gate_up_x_torch=1"], "'gate_up_x_torch=1' is not KEY"),
                          (["--precision", "fp8", "--bar", "down_fp8_x_torch_fp8=x"], "is not a finite number")):
        proc = _script(*args)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], (args, lines)


def test_fp8_bars_pass_parsing_and_the_run_needs_a_gpu():
    if gpu_reason() is None:
        pytest.skip("a GPU is here: the command would run the benchmark")
    proc = _script("--precision", "fp8", "--bar", "gate_up_fp8_x_bf16=1.6,down_fp8_x_torch_fp8=1.3")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "bench_gemm.py needs" in lines[0], lines


def test_results_report_shows_fp8_rows(tmp_path):
    import json

    from mok_proto.results import report

    row = R.fp8_row("down", {"fp8": [1.0], "bf16": [1.5]}, 10**12, 1e-4, [], "no torch", 800.0, 1500.0, R.BARS,
                    shape="glm-5.2", ep=64, routing="uniform", rows=16384)
    (tmp_path / "bench_gemm_fp8.jsonl").write_text(json.dumps({"time": "2026-12-06T10:00:00+00:00", "git": "abc",
                                                               "gpu": "NVIDIA H100 80GB HBM3", **row}) + "\n")
    text = report.markdown(tmp_path)
    assert "## bench_gemm_fp8 (one GPU, NVIDIA H100 80GB HBM3)" in text
    assert "| glm-5.2 | uniform | down | 16384 | 1000 | 1.50 | - | 1.25 | 0.67 | 1.0e-04 |" in text
