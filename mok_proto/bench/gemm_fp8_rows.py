"""bench_gemm.py --precision fp8's rows (scripts/bench_gemm.py): one problem timed with its variants
interleaved (our FP8 GEMM, our BF16 GEMM on the same problem, torch._scaled_grouped_mm), its results
row, its bars, the verdict and the printed line. Everything but `time_problem` is pure (CPU-tested)."""

from __future__ import annotations

import math

from mok_proto.bench.ceilings import of_dense
from mok_proto.bench.cli import Bar
from mok_proto.bench.gemm_fp8_problems import ERR_TOL
from mok_proto.bench.timing import paired_ratio, rotating, summarize, time_stages

BENCH = "bench_gemm_fp8"  # results/<BENCH>.jsonl: apart from bench_gemm's BF16 rows, which the simulator reads
VARIANTS = ("fp8", "bf16", "torch_fp8")  # the timed runs, as the rows name them
BASELINES = {"bf16": "our BF16 GEMM", "torch_fp8": "torch._scaled_grouped_mm (row-wise e4m3)"}
BARS = {f"{problem}_fp8_x_{base}": Bar(value, f"--precision fp8, {problem}: our FP8 GEMM x {BASELINES[base]}, "
                                              "the per-iteration time ratio of one interleaved run")
        for problem in ("gate_up", "down") for base, value in (("bf16", 1.5), ("torch_fp8", 1.25))}
HEADER = (f"{'shape':<16}{'routing':<8}{'problem':<14}{'fp8':>7}{'bf16':>7}{'torch8':>7}{'x bf16':>8}{'bar':>6}"
          f"{'x torch8':>9}{'bar':>6}{'of dense':>9}{'of fp8':>7}{'err':>9}  ok")


def time_problem(runs: dict, iters: int, warmup: int, before) -> dict:
    """{variant: [ms per iteration]}: the runs interleaved (timing.rotating: every run once per
    iteration, the first one moving along), `before` (the L2 flush and the sleep) ahead of each run."""
    samples = time_stages(rotating(runs, before), iters, warmup, api="torch")
    return {name: samples[name] for name in runs}


def fp8_row(problem: str, samples: dict, flops: int, max_rel_err: float, mismatched, torch_note, dense_tflops: float,
            dense_fp8_tflops, bars: dict, **fields) -> dict:
    """A results row of one problem: every variant's timing and TFLOP/s (torch_fp8 None where it did
    not run: torch_note says why), the paired ratios of our FP8 GEMM over the others, the bars it
    is judged by (their values), the output check, `fraction_of_dense` (over the dense BF16
    DENSE_N^3 matmul, as the BF16 rows) and `fraction_of_dense_fp8` (over the dense FP8 one)."""
    stats = {name: summarize(samples[name]) if name in samples else None for name in VARIANTS}
    tflops = {name: None if s is None else flops / (s["median_ms"] * 1e-3) / 1e12 for name, s in stats.items()}
    ratios = {base: paired_ratio(samples[base], samples["fp8"]) if base in samples else None for base in BASELINES}
    bare = {}
    if "fp8_no_epilogue" in samples:  # --epilogue-share
        bare = {"fp8_no_epilogue": summarize(samples["fp8_no_epilogue"])}
        bare["epilogue_share"] = 1.0 - bare["fp8_no_epilogue"]["median_ms"] / stats["fp8"]["median_ms"]
    row = {"precision": "fp8", **fields, "problem": problem, "flops": int(flops), **stats, **bare, "tflops": tflops,
           "ratio_vs_bf16": ratios["bf16"], "ratio_vs_torch_fp8": ratios["torch_fp8"], "torch_fp8_note": torch_note,
           "torch_fp8_recipe": "row-wise e4m3, bf16 out, use_fast_accum=False",
           "bars": {key: bar.value for key, bar in bars.items() if key.startswith(f"{problem}_fp8_x_")},
           "max_rel_err": max_rel_err, "err_tol": ERR_TOL, "mismatched": list(mismatched),
           "dense_fp8_tflops": dense_fp8_tflops,
           "fraction_of_dense_fp8": tflops["fp8"] / dense_fp8_tflops if dense_fp8_tflops else None}
    return of_dense(row, tflops["fp8"], dense_tflops)


def failures(row: dict, bars: dict) -> list:
    """Why a row fails (empty: it passes): an FP8 output off the float64 GEMM or not the bits it
    should be, a bar missed, or a bar whose baseline did not run (not measured: not passed)."""
    out = []
    if not row["max_rel_err"] <= ERR_TOL:  # NaN and inf fail too
        out.append(f"max rel err {row['max_rel_err']:.1e} > {ERR_TOL:.0e}")
    if row["mismatched"]:
        out.append("not the bits they should be: " + ", ".join(row["mismatched"]))
    for base, what in BASELINES.items():
        bar = bars.get(f"{row['problem']}_fp8_x_{base}")
        ratio = row[f"ratio_vs_{base}"]
        if bar is None or bar.met(ratio):
            continue
        out.append(f"x {what} not measured ({row['torch_fp8_note']}), bar {bar}" if ratio is None
                   else f"x {what} {ratio:.2f}, bar {bar}")
    return out


def line(row: dict, bars: dict, failed: list) -> str:
    """The row as bench_gemm.py --precision fp8 prints it (under HEADER)."""
    def num(value, spec, width):
        text = "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)
        return f"{text:>{width}}"

    def bar(base):
        b = bars.get(f"{row['problem']}_fp8_x_{base}")
        return num(None if b is None else b.value, ".2f", 6)

    tf = row["tflops"]
    ok = "yes" if not failed else ("WRONG" if row["mismatched"] or not row["max_rel_err"] <= ERR_TOL else "NO")
    return (f"{row['shape']:<16}{row['routing']:<8}{row['problem']:<14}{num(tf['fp8'], '.0f', 7)}"
            f"{num(tf['bf16'], '.0f', 7)}{num(tf['torch_fp8'], '.0f', 7)}{num(row['ratio_vs_bf16'], '.2f', 8)}"
            f"{bar('bf16')}{num(row['ratio_vs_torch_fp8'], '.2f', 9)}{bar('torch_fp8')}"
            f"{num(row['fraction_of_dense'], '.2f', 9)}{num(row['fraction_of_dense_fp8'], '.2f', 7)}"
            f"{num(row['max_rel_err'], '.1e', 9)}  {ok:<5}"
            + (f"{row['epilogue_share']:>7.1%}" if "epilogue_share" in row else "")).rstrip()
