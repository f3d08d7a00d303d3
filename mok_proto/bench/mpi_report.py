"""The verdict and the table of the R-process benchmark (scripts/bench_layer_mpi.py)."""

from __future__ import annotations

import sys

from mok_proto.bench.cli import Bar
from mok_proto.bench.digests import describe_comparison

BARS = {"fused_fwd_x_torch": Bar(1.5, "the best fused forward x the torch + NCCL layer"),
        "fused_bwd_x_torch": Bar(1.4, "the best fused backward x the torch + NCCL layer")}
TORCH_REL_ERR = 5e-2  # max |ours - torch| / max |torch| (out, dx) beyond which the baseline is not the same layer


def judge(row: dict, bars: bool = True, limits: dict = BARS) -> list:
    """What of the bars (`limits`: {key: Bar}, BARS' keys) and checks this shape misses (and row
    gets its speedups and 'met'). bars=False (no torch layer ran): the speed bars are not judged
    (row['bars_judged'] says so)."""
    row["bars_judged"] = bars
    if "skipped" in row:
        return [f"skipped ({row['skipped']})"]
    missed = [f"{err['phase']} failed" for err in row.get("errors", [])]
    ours, torch_row = row.get("ours", {}), row.get("torch", {})
    torch_ms = {"fwd": torch_row.get("fwd", {}).get("median_ms"), "bwd": torch_row.get("bwd_median_ms")}
    row["speedup"] = {}
    for pass_ in ("fwd", "bwd"):
        bar = limits[f"fused_{pass_}_x_torch"]
        runs = ours.get("fused", {}).get(pass_, [])
        if not runs or (bars and torch_ms[pass_] is None):
            missed.append(f"fused {pass_} vs torch not measured" if bars else f"fused {pass_} not measured")
            continue
        best = min(runs, key=lambda r: r["median_ms"])
        seq = ours["sequential"][pass_]["median_ms"]
        row["speedup"][f"fused_{pass_}_vs_sequential"] = seq / best["median_ms"]
        if not bars:
            continue
        speedup = row["speedup"][f"fused_{pass_}_vs_torch"] = torch_ms[pass_] / best["median_ms"]
        row["speedup"][f"sequential_{pass_}_vs_torch"] = torch_ms[pass_] / seq
        if not bar.met(speedup):
            missed.append(f"fused {pass_} {speedup:.2f}x torch < {bar.value:g}x")
    bitwise = row.get("bitwise")
    if bitwise and not bitwise["all"]:
        missed.append("not bitwise equal to MoK's sequential: " + ", ".join(
            label for label, same in bitwise["equal_to_mok_sequential"].items() if not same))
    vs_single = row.get("bitwise_vs_single")
    if vs_single is not None and vs_single["equal"] is False:
        missed.append("differs from the single-process run")
    if vs_single is not None and vs_single["equal"] is None and not vs_single.get("skipped"):
        missed.append(f"not compared with the single-process run ({vs_single['why']})")
    errors = (row.get("torch") or {}).get("max_rel_err_vs_ours") or {}
    if any(err > TORCH_REL_ERR for err in errors.values()):  # a wrong baseline would make any speed-up
        missed.append(f"the torch layer differs from ours: {errors} (bound {TORCH_REL_ERR})")
    row["met"] = not missed
    return missed


def print_table(rows, link, digests_path, compare, bars: bool = True, limits: dict = BARS) -> None:
    def num(value, fmt=".3f"):
        return format(value, fmt) if isinstance(value, float) else "-"

    print(f"\n{'shape':<16}{'torch_fwd':>10}{'seq_fwd':>9}{'fused_fwd':>10}{'x torch':>8}{'x seq':>6}{'torch_bwd':>10}"
          f"{'seq_bwd':>9}{'fused_bwd':>10}{'x torch':>8}{'x seq':>6}  {'bitwise policies':<18}bitwise vs single")
    for row in rows:
        if "skipped" in row:
            print(f"{row['shape']:<16}skipped: {row['skipped']}")
            continue
        ours, t, speedup = row.get("ours", {}), row.get("torch", {}), row.get("speedup", {})
        seq, fused = ours.get("sequential", {}), ours.get("fused", {})
        best = {p: min((r["median_ms"] for r in fused.get(p, [])), default=None) for p in ("fwd", "bwd")}
        bitwise = row.get("bitwise", {}).get("all")
        cells = [num(t.get("fwd", {}).get("median_ms")), num(seq.get("fwd", {}).get("median_ms")), num(best["fwd"]),
                 num(speedup.get("fused_fwd_vs_torch"), ".2f"), num(speedup.get("fused_fwd_vs_sequential"), ".2f"),
                 num(t.get("bwd_median_ms")), num(seq.get("bwd", {}).get("median_ms")), num(best["bwd"]),
                 num(speedup.get("fused_bwd_vs_torch"), ".2f"), num(speedup.get("fused_bwd_vs_sequential"), ".2f")]
        widths = (10, 9, 10, 8, 6, 10, 9, 10, 8, 6)
        print(f"{row['shape']:<16}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths))
              + f"  {'yes' if bitwise else 'NO' if bitwise is False else '-':<18}"
              + describe_comparison(row.get("bitwise_vs_single")))
    judged = (f"bars: fused fwd >= {limits['fused_fwd_x_torch'].value:g}x, fused bwd >= "
              f"{limits['fused_bwd_x_torch'].value:g}x the torch layer" if bars
              else "bars not judged (no torch layer)")
    print(f"# {judged}; ms, median of the slowest rank; digests: {digests_path}"
          + ("" if compare else " (no --compare: bitwise vs single not checked)"))
    print(f"# push vs pull per transfer: sequential layer, eager stage ms / ms beyond the bytes at the link rate / % of "
          f"the NVSHMEM link ({link['nvshmem_pull_gbs']:.0f} GB/s):")
    for row in rows:
        for op, by in row.get("push_pull", {}).items():
            print(f"#   {row['shape']:<16}{op:<13}" + "   ".join(
                f"{d} {v['stage_ms']:.3f} / {v['overhead_ms']:.3f} / {v['pct_link']:.0f}%" for d, v in by.items()))
    sys.stdout.flush()
