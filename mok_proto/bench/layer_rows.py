"""bench_layer.py's rows, verdicts and printed lines, from what mok_proto.bench.layer measured (no
GPU here): per shape the torch, sequential and fused rows, and the bars."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mok_proto.bench.cli import Bar
from mok_proto.bench.emulation import EP
from mok_proto.bench.layer import best_row
from mok_proto.bench.overlap import overlap_ceiling, stages_inside

EMULATION = "2 virtual ranks, rank 0 timed"
TORCH_REL_ERR = 0.05  # max |ours - torch| / max |torch| (bf16) beyond which the two are not the same layer
BARS = {
    "fwd_x_torch": Bar(1.0, "the sequential forward x torch"),
    "bwd_x_torch": Bar(1.3, "the sequential backward x torch"),
    "schedule_ms": Bar(0.05, "the device schedule at EP=64, ms", at_most=True),
    "fused_fwd_x_torch": Bar(1.2, "the best fused forward x torch"),
    "fused_fwd_x_seq": Bar(1.1, "the best fused forward x the sequential forward"),
    "fused_bwd_x_torch": Bar(1.6, "the best fused backward x torch"),
    "fused_bwd_x_seq": Bar(1.1, "the best fused backward x the sequential backward"),
}


@dataclass
class Report:
    """What one part of a shape gives: rows ((results file, row) to append), lines to print, and
    what missed a bar or a check."""

    rows: list = field(default_factory=list)
    lines: list = field(default_factory=list)
    failed: list = field(default_factory=list)


HEADER = (f"{'shape':<16}{'pass':<5}{'torch_ms':>9}{'ours_ms':>9}{'TFLOP/s':>9}{'x torch':>8}{'bar':>5}"
          f"{'bitwise':>8}{'sched_ms':>9}{'err':>9}{'x 2n':>7}")


def flops_of(shape) -> dict:
    """FLOPs as MoK counts them: forward 6 (N + N K) H I, backward twice that."""
    return {"fwd": shape.forward_flops(), "bwd": 2 * shape.forward_flops()}


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def shape_report(name, shape, measured, torch, schedule, bars) -> Report:
    """The shape's rows without the link (results/bench_layer.jsonl): per pass torch's and the
    sequential layer's, then every fused row; judged against `bars` ({key: Bar}, BARS' keys).
    measured: layer.Measured; torch: (stats, reference results) of torch_pipeline; schedule: (stats,
    whether it equals schedule.py) of schedule_at_ep64."""
    mine, stages, bitwise, got, fused_rows = measured
    base, ref = torch
    sched_ms, sched_exact = schedule[0]["median_ms"], schedule[1]
    flops, out = flops_of(shape), Report()
    out.lines.append(f"#   schedule at EP={EP}, N={shape.num_tokens} (one rank, graph): {sched_ms:.3f} ms, "
                     f"{'bit-identical to schedule.py' if sched_exact else 'DIFFERS from schedule.py'}")
    for pass_ in ("fwd", "bwd"):
        bar = bars[f"{pass_}_x_torch"]
        speedup = base[pass_]["median_ms"] / mine[pass_]["median_ms"]
        keys = ("out",) if pass_ == "fwd" else ("w_gate", "w_up", "w_down")
        err = max(float(np.abs(got[key] - ref[key]).max() / max(np.abs(ref[key]).max(), 1e-30)) for key in keys)
        if not (bar.met(speedup) and bitwise[pass_] and bars["schedule_ms"].met(sched_ms) and sched_exact
                and err <= TORCH_REL_ERR):
            out.failed.append(f"{name} {pass_}")
        variant_ms = base[pass_].get("variant_2n_bwd_ms", base[pass_]["median_ms"])
        variant_speedup = variant_ms / mine[pass_]["median_ms"]
        ours_tflops = tflops(flops[pass_], mine[pass_]["median_ms"])
        out.lines.append(f"{name:<16}{pass_:<5}{base[pass_]['median_ms']:>9.3f}{mine[pass_]['median_ms']:>9.3f}"
                         f"{ours_tflops:>9.0f}{speedup:>8.2f}{bar.value:>5.1f}{str(bitwise[pass_]):>8}"
                         f"{sched_ms:>9.3f}{err:>9.1e}{variant_speedup:>7.2f}")
        out.lines.append("#   stages (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in stages[pass_].items()))
        common = {"shape": name, "pass": pass_, "ep": EP, "emulation": EMULATION, "flops": flops[pass_],
                  "schedule_ms": sched_ms, "schedule_exact": sched_exact}
        out.rows.append(("bench_layer", {**common, "schedule": "torch", **base[pass_],
                                         "tflops": tflops(flops[pass_], base[pass_]["median_ms"]),
                                         "speedup_vs_torch": 1.0, "bitwise_repeat": None}))
        out.rows.append(("bench_layer", {**common, "schedule": "sequential", **mine[pass_], "tflops": ours_tflops,
                                         "speedup_vs_torch": speedup, "bitwise_repeat": bitwise[pass_],
                                         "max_rel_err_vs_torch": err, "stages_ms": stages[pass_],
                                         "speedup_vs_torch_variant_2n": variant_speedup}))
    for pass_, rows in fused_rows.items():
        if not rows:
            continue
        best = best_row(rows)
        ceiling = overlap_ceiling(stages[pass_], pass_, stages_inside(best))
        for row in rows:
            out.rows.append(("bench_layer", {"shape": name, "pass": pass_, "ep": EP, "schedule": "fused",
                                             "emulation": EMULATION, "flops": flops[pass_], "schedule_ms": sched_ms,
                                             "schedule_exact": sched_exact, **row,
                                             "tflops": tflops(flops[pass_], row["median_ms"]),
                                             "speedup_vs_torch": base[pass_]["median_ms"] / row["median_ms"],
                                             "best_of_run": row is best, "overlap_ceiling_vs_sequential": ceiling}))
        x_torch, x_seq = bars[f"fused_{pass_}_x_torch"], bars[f"fused_{pass_}_x_seq"]
        speedup = base[pass_]["median_ms"] / best["retimed_median_ms"]
        if not (x_torch.met(speedup) and x_seq.met(best["retimed_speedup_vs_sequential"])
                and all(r["equal_to_sequential"] and r["bitwise_repeat"] for r in rows)):
            out.failed.append(f"{name} fused {pass_}")
        out.lines.append(
            f"{name:<16}{pass_:<5}{base[pass_]['median_ms']:>9.3f}{best['retimed_median_ms']:>9.3f}"
            f"{tflops(flops[pass_], best['retimed_median_ms']):>9.0f}{speedup:>8.2f}{x_torch.value:>5.1f}"
            f"{str(best['bitwise_repeat']):>8}{sched_ms:>9.3f}{'':>9}{'':>7}  fused: comm={best['comm_blocks']} "
            f"minibatch={best['minibatch_tokens']} claim={best['claim_pairs']}, x sequential "
            f"{best['retimed_speedup_vs_sequential']:.2f} (bar {x_seq.value:g}; ceiling {ceiling:.2f}), equal to "
            f"sequential: {all(r['equal_to_sequential'] for r in rows)}")
    return out
