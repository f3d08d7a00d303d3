"""bench_layer.py's rows, verdicts and printed lines, from what mok_proto.bench.layer measured (no
GPU here): per shape the torch, sequential and fused rows without the emulated link, and at each
link speed the sequential and fused rows with it, their overlap efficiency, and the bars.

Overlap efficiency of a fused setting at a link speed: 1 - (t_fused_link - t_fused) / (t_seq_link -
t_seq), the share of the time the link adds to the sequential pass that the fused pass hides (1:
all of it; 0: none; below 0 the fused pass loses more to the link than the sequential pass). Each
t is a median of one interleaved run (the fused setting's replays against the sequential pass's:
`median_ms`, `sequential_median_ms` of its row), with the link and without it, the same setting."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mok_proto.accuracy import ERR_REL_RMS_RECIPE, error_table
from mok_proto.bench.cli import Bar
from mok_proto.bench.emulation import EMULATION, EP
from mok_proto.routing import UNIFORM
from mok_proto.bench.layer import best_row
from mok_proto.bench.overlap import overlap_ceiling, stages_inside

TORCH_REL_ERR = 0.05  # max |ours - torch| / max |torch| (bf16) beyond which the two are not the same layer
LINK_FILE = "bench_layer_link"  # the rows with the emulated link (bench_layer's rows stay without it)
BARS = {
    "fwd_x_torch": Bar(1.0, "the sequential forward x torch"),
    "bwd_x_torch": Bar(1.3, "the sequential backward x torch"),
    "schedule_ms": Bar(0.05, "the device schedule at EP=64, ms", at_most=True),
    "fused_fwd_x_torch": Bar(1.2, "the best fused forward x torch"),
    "fused_fwd_x_seq": Bar(1.1, "the best fused forward x the sequential forward"),
    "fused_bwd_x_torch": Bar(1.6, "the best fused backward x torch"),
    "fused_bwd_x_seq": Bar(1.1, "the best fused backward x the sequential backward"),
    "link_fused_fwd_x_seq": Bar(1.15, "--link-gbps: the best fused forward x the sequential forward at the link speed"),
    "link_overlap_fwd": Bar(0.8, "--link-gbps: the best fused forward's overlap efficiency"),
    "link_overlap_bwd": Bar(0.8, "--link-gbps: the best fused backward's overlap efficiency"),
    # Above this speed the link adds about the run-to-run spread to a pass: its figures are reported only.
    "link_judged_gbps": Bar(368.0, "--link-gbps: the link speed bars are judged at speeds up to this, GB/s",
                            at_most=True),
}
# A run with FP8 routed experts (--precision fp8) is judged by the FP8 layer's bars (issue 35): its
# fused passes against the BF16 torch pipeline, the forward against the torch FP8 one too. Fused x
# sequential is printed, not judged (no FP8 bar sets it); the emulated link's bars stay (overlap).
FP8_BARS = {**{key: bar for key, bar in BARS.items() if key not in ("fused_fwd_x_seq", "fused_bwd_x_seq")},
            "fused_fwd_x_torch": Bar(1.5, "FP8: the best fused forward x the BF16 torch pipeline"),
            "fused_fwd_x_torch_fp8": Bar(1.3, "FP8: the best fused forward x the torch FP8 pipeline"),
            "fused_bwd_x_torch": Bar(2.0, "FP8: the best fused backward x the BF16 torch pipeline")}


@dataclass
class Report:
    """What one part of a shape gives: rows ((results file, row) to append), lines to print now,
    what missed a bar or a check, and rows of a table printed after every shape (link_table)."""

    rows: list = field(default_factory=list)
    lines: list = field(default_factory=list)
    failed: list = field(default_factory=list)
    table: list = field(default_factory=list)


HEADER = (f"{'shape':<16}{'pass':<5}{'torch_ms':>9}{'ours_ms':>9}{'TFLOP/s':>9}{'x torch':>8}{'bar':>5}"
          f"{'bitwise':>8}{'sched_ms':>9}{'err':>9}{'x 2n':>7}")


UNIFORM_FIELDS = {"emulation": EMULATION, "routing": str(UNIFORM)}  # rows' fields without emulation.row_fields


def flops_of(shape, fields: dict | None = None) -> dict:
    """FLOPs as MoK counts them: forward 6 (N + N K) H I, backward twice that; under a skewed
    routing (fields: emulation.row_fields) the routed GEMMs count rank 0's received rows for N K."""
    fwd = shape.forward_flops()
    if fields and fields["routing"] != str(UNIFORM):
        fwd += 6 * shape.hidden * shape.ffn * (fields["received_rows"] - shape.num_tokens * shape.top_k)
    return {"fwd": fwd, "bwd": 2 * fwd}


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def replay_ms(stages: dict) -> float:
    """What the backward spent replaying the forward of turns the ring did not keep (its
    `replay.<turn>` stages, layer/gpu_ring.py); 0 with one turn and in the forward."""
    return float(sum(ms for stage, ms in stages.items() if stage.startswith("replay.")))


def shape_report(name, shape, measured, torch, schedule, bars, fields: dict = UNIFORM_FIELDS, fp8=None) -> Report:
    """The shape's rows without the link (results/bench_layer.jsonl): per pass torch's and the
    sequential layer's, then every fused row; judged against `bars` ({key: Bar}: BARS', or FP8_BARS' for an FP8 run).
    measured: layer.Measured; torch: (stats, reference results) of torch_pipeline; schedule: (stats,
    whether it equals schedule.py) of schedule_at_ep64; fields: what every row records of the
    emulation (emulation.row_fields: its virtual ranks, routing, rank 0's received rows). fp8: an
    Fp8Run where the layer ran FP8 routed experts (fp8_fields: its rows' further fields and the
    torch_fp8 row; the error judged is err_rel_rms against its reference, not the max against torch)."""
    mine, stages, bitwise, got, fused_rows = measured
    base, ref = torch
    sched_ms, sched_exact = schedule[0]["median_ms"], schedule[1]
    flops, out = flops_of(shape, fields), Report()
    out.lines.append(f"#   schedule at EP={EP}, N={shape.num_tokens} (one rank, graph): {sched_ms:.3f} ms, "
                     f"{'bit-identical to schedule.py' if sched_exact else 'DIFFERS from schedule.py'}")
    for pass_ in ("fwd", "bwd"):
        bar = bars[f"{pass_}_x_torch"]
        speedup = base[pass_]["median_ms"] / mine[pass_]["median_ms"]
        keys = ("out",) if pass_ == "fwd" else ("w_gate", "w_up", "w_down")
        err = max(float(np.abs(got[key] - ref[key]).max() / max(np.abs(ref[key]).max(), 1e-30)) for key in keys)
        extra = {} if fp8 is None else fp8_fields(fp8, pass_, got, mine[pass_]["median_ms"])
        accurate = err <= TORCH_REL_ERR if fp8 is None else extra["err_rel_rms"] <= ERR_REL_RMS_RECIPE
        if not (bar.met(speedup) and bitwise[pass_] and bars["schedule_ms"].met(sched_ms) and sched_exact
                and accurate):
            out.failed.append(f"{name} {pass_}")
        variant_ms = base[pass_].get("variant_2n_bwd_ms", base[pass_]["median_ms"])
        variant_speedup = variant_ms / mine[pass_]["median_ms"]
        ours_tflops = tflops(flops[pass_], mine[pass_]["median_ms"])
        out.lines.append(f"{name:<16}{pass_:<5}{base[pass_]['median_ms']:>9.3f}{mine[pass_]['median_ms']:>9.3f}"
                         f"{ours_tflops:>9.0f}{speedup:>8.2f}{bar.value:>5.1f}{str(bitwise[pass_]):>8}"
                         f"{sched_ms:>9.3f}{err:>9.1e}{variant_speedup:>7.2f}")
        out.lines.append("#   stages (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in stages[pass_].items()))
        common = {"shape": name, "pass": pass_, "ep": EP, **fields, "flops": flops[pass_],
                  "schedule_ms": sched_ms, "schedule_exact": sched_exact, "link_gbps": None}
        if fp8 is not None:
            common.update(precision=fp8.precision, dispatch_dtype=fp8.dispatch_dtype,
                          wgrad_precision=fp8.wgrad_precision)
            out.lines.append(fp8_line(pass_, extra, fp8))
        out.rows.append(("bench_layer", {**common, "schedule": "torch", **base[pass_],
                                         "tflops": tflops(flops[pass_], base[pass_]["median_ms"]),
                                         "speedup_vs_torch": 1.0, "bitwise_repeat": None}))
        if fp8 is not None and pass_ == "fwd" and fp8.torch_fp8 is not None:
            out.rows.append(("bench_layer", {**common, "schedule": "torch_fp8", **fp8.torch_fp8,
                                             "tflops": tflops(flops[pass_], fp8.torch_fp8["median_ms"]),
                                             "speedup_vs_torch": base[pass_]["median_ms"] / fp8.torch_fp8["median_ms"],
                                             "bitwise_repeat": None, "torch_fp8_note": fp8.note}))
        out.rows.append(("bench_layer", {**common, "schedule": "sequential", **mine[pass_], "tflops": ours_tflops,
                                         "speedup_vs_torch": speedup, "bitwise_repeat": bitwise[pass_],
                                         "max_rel_err_vs_torch": err, "stages_ms": stages[pass_],
                                         "replay_ms": replay_ms(stages[pass_]),
                                         "speedup_vs_torch_variant_2n": variant_speedup, **extra}))
    for pass_, rows in fused_rows.items():
        if not rows:
            continue
        best = best_row(rows)
        ceiling = overlap_ceiling(stages[pass_], pass_, stages_inside(best))
        for row in rows:
            precision = {} if fp8 is None else {  # the fused FP8 passes (fused_forward_fp8, fused_backward_fp8)
                "precision": fp8.precision, "dispatch_dtype": fp8.dispatch_dtype,
                "wgrad_precision": fp8.wgrad_precision,
                "speedup_vs_torch_fp8": (fp8.torch_fp8["median_ms"] / row["median_ms"]
                                         if fp8.torch_fp8 is not None and pass_ == "fwd" else None)}
            out.rows.append(("bench_layer", {"shape": name, "pass": pass_, "ep": EP, "schedule": "fused",
                                             **fields, "flops": flops[pass_], "schedule_ms": sched_ms,
                                             "schedule_exact": sched_exact, "link_gbps": None, **row,
                                             "tflops": tflops(flops[pass_], row["median_ms"]),
                                             "speedup_vs_torch": base[pass_]["median_ms"] / row["median_ms"],
                                             "best_of_run": row is best, "overlap_ceiling_vs_sequential": ceiling,
                                             **precision}))
        # (a bar set without x_seq or x_torch_fp8 keys does not judge them: BARS has no x_torch_fp8)
        x_torch, x_seq = bars[f"fused_{pass_}_x_torch"], bars.get(f"fused_{pass_}_x_seq")
        x_fp8 = bars.get(f"fused_{pass_}_x_torch_fp8")
        speedup = base[pass_]["median_ms"] / best["retimed_median_ms"]
        fp8_speedup = (fp8.torch_fp8["median_ms"] / best["retimed_median_ms"]
                       if fp8 is not None and fp8.torch_fp8 is not None and pass_ == "fwd" else None)
        if not (x_torch.met(speedup) and (x_seq is None or x_seq.met(best["retimed_speedup_vs_sequential"]))
                and (x_fp8 is None or (fp8_speedup is not None and x_fp8.met(fp8_speedup)))
                and all(r["equal_to_sequential"] and r["bitwise_repeat"] for r in rows)):
            out.failed.append(f"{name} fused {pass_}")
        vs_fp8 = "" if x_fp8 is None else (
            f", x torch fp8 {'n/a' if fp8_speedup is None else f'{fp8_speedup:.2f}'} (bar {x_fp8.value:g})")
        out.lines.append(
            f"{name:<16}{pass_:<5}{base[pass_]['median_ms']:>9.3f}{best['retimed_median_ms']:>9.3f}"
            f"{tflops(flops[pass_], best['retimed_median_ms']):>9.0f}{speedup:>8.2f}{x_torch.value:>5.1f}"
            f"{str(best['bitwise_repeat']):>8}{sched_ms:>9.3f}{'':>9}{'':>7}  fused: comm={best['comm_blocks']} "
            f"minibatch={best['minibatch_tokens']} claim={best['claim_pairs']}, x sequential "
            f"{best['retimed_speedup_vs_sequential']:.2f} ({'not judged' if x_seq is None else f'bar {x_seq.value:g}'}; "
            f"ceiling {'n/a: a ring of turns' if ceiling is None else f'{ceiling:.2f}'}){vs_fp8}, equal to "
            f"sequential: {all(r['equal_to_sequential'] for r in rows)}")
    return out


@dataclass
class Fp8Run:
    """What an FP8 run adds to its rows: the layer's precision, dispatch dtype and weight-gradient
    precision, the torch FP8 pipeline's forward stats (None: torch has none or refused it) and why
    its backward (or all of it) is not timed (`note`), and the results the layer's are measured
    against (`reference`: {array: NumPy}, named by `reference_name`)."""

    precision: str
    dispatch_dtype: str
    torch_fp8: dict | None
    note: str
    reference: dict
    reference_name: str
    wgrad_precision: str = "fp8"  # the routed weight gradients' (RunConfig.wgrad_precision)


def fp8_fields(fp8: Fp8Run, pass_: str, got: dict, ours_ms: float) -> dict:
    """An FP8 sequential row's further fields: speedup_vs_torch_fp8 (None where the torch FP8
    pipeline did not time the pass) with torch_fp8_note; err_rel_rms and err_max, the largest over
    the pass's arrays (fwd: the output; bwd: every gradient) against fp8.reference, `errors` per
    array, err_reference naming it."""
    keys = ["out"] if pass_ == "fwd" else sorted(k for k in fp8.reference if k != "out")
    table = error_table({k: got[k] for k in keys}, {k: fp8.reference[k] for k in keys})
    timed = fp8.torch_fp8 is not None and pass_ == "fwd"
    return {"speedup_vs_torch_fp8": fp8.torch_fp8["median_ms"] / ours_ms if timed else None,
            "torch_fp8_note": fp8.note, "err_rel_rms": max(e["err_rel_rms"] for e in table.values()),
            "err_max": max(e["err_max"] for e in table.values()), "errors": table,
            "err_reference": fp8.reference_name}


def fp8_line(pass_: str, extra: dict, fp8: Fp8Run) -> str:
    """The printed line of an FP8 sequential pass: its errors and its speedup over torch's FP8 pipeline."""
    worst = max(extra["errors"], key=lambda k: extra["errors"][k]["err_rel_rms"])
    x_fp8 = extra["speedup_vs_torch_fp8"]
    return (f"#   fp8 {pass_} (dispatch {fp8.dispatch_dtype}, wgrad {fp8.wgrad_precision}): err_rel_rms {extra['err_rel_rms']:.4f} ({worst}; bar "
            f"{ERR_REL_RMS_RECIPE:g}), err_max {extra['err_max']:.4f} against the {fp8.reference_name}; x torch fp8 "
            + (f"{x_fp8:.2f} ({fp8.torch_fp8['median_ms']:.3f} ms)" if x_fp8 is not None else "n/a") + f": {fp8.note}")


def overlap_efficiency(seq_ms: float, seq_link_ms: float, fused_ms: float, fused_link_ms: float) -> float | None:
    """1 - (fused_link_ms - fused_ms) / (seq_link_ms - seq_ms) (module doc); None where the link adds
    no time to the sequential pass (nothing to hide: not defined)."""
    cost = seq_link_ms - seq_ms
    if not cost > 0:
        return None
    return 1.0 - (fused_link_ms - fused_ms) / cost


def setting(row: dict) -> tuple:
    """A fused row's setting: (communication CTAs, minibatch rows, claim as asked)."""
    return row["comm_blocks"], row["minibatch_tokens"], row["claim"]


def same_results(a: dict, b: dict, pass_: str) -> bool:
    """Whether two runs' sequential results of a pass (Measured.results) are bitwise equal: the
    output (fwd), every gradient (bwd)."""
    keys = ["out"] if pass_ == "fwd" else sorted(k for k in a if k != "out")
    return sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in keys)


def link_report(name, shape, link, measured, no_link, bars, fields: dict = UNIFORM_FIELDS) -> Report:
    """The shape's rows at one link speed (results/<LINK_FILE>.jsonl; no torch: the torch pipeline
    crosses no link): per pass the sequential row, then every fused row with its overlap efficiency
    against the same setting without the link (`no_link`: that run's layer.Measured); the best fused
    setting (best_row) is judged on its timing again (retimed_*). Checks: every result bitwise equal
    to the run without the link (`equal_to_no_link`) and to the sequential pass; bars: the fused
    forward x sequential at the link speed, the overlap efficiency of each pass. `table`: this
    link speed's table rows (link_table); fields: shape_report's."""
    flops, out, speed = flops_of(shape, fields), Report(), f"link {link.gbps:g} GB/s"
    for pass_ in ("fwd", "bwd"):
        seq, seq_no_link = measured.stats[pass_], no_link.stats[pass_]
        equal = same_results(measured.results, no_link.results, pass_)
        common = {"shape": name, "pass": pass_, "ep": EP, **fields, "flops": flops[pass_], **link.describe()}
        out.rows.append((LINK_FILE, {**common, "schedule": "sequential", **seq,
                                     "tflops": tflops(flops[pass_], seq["median_ms"]),
                                     "bitwise_repeat": measured.bitwise[pass_], "stages_ms": measured.stages[pass_],
                                     "no_link_median_ms": seq_no_link["median_ms"], "equal_to_no_link": equal}))
        if not (measured.bitwise[pass_] and equal):
            out.failed.append(f"{name} {speed} {pass_}: sequential " + ("not bitwise equal to the run without the "
                                                                         "link" if not equal else "repeat differs"))
        rows = measured.fused_rows[pass_]
        if not rows:
            out.table.append(f"{name:<16}{pass_:<5}{seq_no_link['median_ms']:>9.3f}{seq['median_ms']:>9.3f}")
            continue
        by_setting = {setting(r): r for r in no_link.fused_rows[pass_]}
        best = best_row(rows)
        for row in rows:
            base = by_setting.get(setting(row))
            got = {"no_link_median_ms": None, "no_link_sequential_median_ms": None, "overlap_efficiency": None}
            if base is not None:
                got = {"no_link_median_ms": base["median_ms"],
                       "no_link_sequential_median_ms": base["sequential_median_ms"],
                       "overlap_efficiency": overlap_efficiency(seq_ms=base["sequential_median_ms"],
                                                                seq_link_ms=row["sequential_median_ms"],
                                                                fused_ms=base["median_ms"],
                                                                fused_link_ms=row["median_ms"])}
            if row is best:
                seq_ms, fused_ms = retimed_no_link(base)
                got["retimed_overlap_efficiency"] = None if base is None else overlap_efficiency(
                    seq_ms, best["retimed_sequential_median_ms"], fused_ms, best["retimed_median_ms"])
            row.update(got, equal_to_no_link=equal and row["equal_to_sequential"])
            out.rows.append((LINK_FILE, {**common, "schedule": "fused", **row,
                                         "tflops": tflops(flops[pass_], row["median_ms"]), "best_of_run": row is best}))
        judged = bars["link_judged_gbps"].met(link.gbps)
        out.failed += judge_link(f"{name} {speed}", pass_, rows, best, bars, speed_bars=judged)
        out.table.append(link_line(name, pass_, best, retimed_no_link(by_setting.get(setting(best))), bars, judged))
    return out


def retimed_no_link(base: dict | None) -> tuple:
    """(sequential ms, fused ms) of a setting's run without the link: its timing again where it was
    that run's best (retimed_*), else its first; (nan, nan) where that run lacks the setting."""
    if base is None:
        return float("nan"), float("nan")
    return (base.get("retimed_sequential_median_ms", base["sequential_median_ms"]),
            base.get("retimed_median_ms", base["median_ms"]))


def judge_link(label: str, pass_: str, rows: list, best: dict, bars, speed_bars: bool = True) -> list:
    """What a pass's fused rows at one link speed miss: a result unequal to the sequential pass or to
    the run without the link, or (speed_bars: the link speed is judged, bar link_judged_gbps) the
    best setting under the bars (the forward's x sequential, each pass's overlap efficiency, both from
    its timing again)."""
    missed = [f"{label} fused {pass_} comm={r['comm_blocks']} minibatch={r['minibatch_tokens']}: " + ", ".join(
        what for what, ok in (("not equal to sequential", r["equal_to_sequential"]),
                              ("repeat differs", r["bitwise_repeat"]),
                              ("not equal to the run without the link", r["equal_to_no_link"])) if not ok)
        for r in rows if not (r["equal_to_sequential"] and r["bitwise_repeat"] and r["equal_to_no_link"])]
    if not speed_bars:
        return missed
    x_seq = bars.get(f"link_fused_{pass_}_x_seq")
    if x_seq is not None and not x_seq.met(best["retimed_speedup_vs_sequential"]):
        missed.append(f"{label} fused {pass_}: x sequential {best['retimed_speedup_vs_sequential']:.2f}, bar {x_seq}")
    overlap, got = bars[f"link_overlap_{pass_}"], best.get("retimed_overlap_efficiency")
    if not overlap.met(got):
        missed.append(f"{label} fused {pass_}: overlap efficiency " + (
            f"{got:.2f}, bar {overlap}" if got is not None else
            "undefined (the link adds no time to the sequential pass, or no run without it)"))
    return missed


LINK_HEADER = (f"{'shape':<16}{'pass':<5}{'seq_ms':>9}{'seq_link':>9}{'fused_ms':>9}{'fus_link':>9}{'x seq':>7}"
               f"{'bar':>6}{'overlap':>8}{'bar':>6}{'equal':>7}  setting")


def link_line(name: str, pass_: str, best: dict, no_link: tuple, bars, judged: bool = True) -> str:
    """One row of a link speed's table: the best fused setting's figures with and without the link
    (the bars' columns '-' where the speed is not judged)."""
    x_seq, overlap = bars.get(f"link_fused_{pass_}_x_seq"), bars[f"link_overlap_{pass_}"]
    if not judged:
        x_seq = overlap = None
    eff = best.get("retimed_overlap_efficiency")
    return (f"{name:<16}{pass_:<5}{no_link[0]:>9.3f}{best['retimed_sequential_median_ms']:>9.3f}{no_link[1]:>9.3f}"
            f"{best['retimed_median_ms']:>9.3f}{best['retimed_speedup_vs_sequential']:>7.2f}"
            f"{'-' if x_seq is None else f'{x_seq.value:g}':>6}{'-' if eff is None else f'{eff:.2f}':>8}"
            f"{'-' if overlap is None else f'{overlap.value:g}':>6}{str(best['equal_to_no_link'] and best['equal_to_sequential']):>7}  "
            f"comm={best['comm_blocks']} minibatch={best['minibatch_tokens']} claim={best['claim_pairs']}")


def link_table(link, lines: list) -> list:
    """The lines of one link speed's table: its title, the header, the rows of every shape."""
    return [f"# with the emulated link: {link.gbps:g} GB/s per direction, round trip {link.latency_us:g} us, every "
            f"row pays (ms: the best fused setting's sequential and fused passes, interleaved, without and with "
            f"the link)", LINK_HEADER, *lines]
