"""The simulator against our measurements and the MoK paper's GB300 NVL72 numbers.

Measured rows are judged per GPU: each calibrated set (sim.gpus.SPECS: h200, h100) against the rows
measured on its GPU only (`measured_rows`; the functions below take `measured_on`, the set's name),
their groups labelled with the set's name ("h200 gemm", "h100 link", ...).

Rows: (group, quantity, reference value, predicted value, unit, check, note). What a row's
`check` says about it:

* "judged": a prediction; measured rows must be within MEASURED_TOLERANCE of the measurement,
  paper rows are judged within PAPER_TOLERANCE (or explained in the note).
* "range": a prediction judged inside/outside a published range [lo, hi].
* "calibration": agrees by construction, not judged: a measurement the set's parameters are fitted
  on, or a row whose prediction is a calibration row's (the same formula on the same bytes).
* "assumed": the prediction is set by an assumed parameter (params.py), shown, not judged.
* "explained": a prediction against a measurement that holds what the model leaves out, named in
  the note (LAYER_EXPLAINED: fixed per stage, a fused bench_layer row by its own sim_explained field,
  TIMELINE_EXPLAINED per timeline and event, and the fused measurements whose kernel's counter
  waits spun on ld.acquire beside spare warps that move rows, params.spare_warps_spun: a rule on
  the git stamp and the plan, not chosen by the error); its error is shown and MISS printed
  beside it, but it is not judged.
* "informational": a prediction shown with its error, not judged, because nothing in the model
  was checked on that kind of measurement before (the fused backward's per-kind task times per SM,
  `fused_backward_rows`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mok_proto import plan as plans
from mok_proto import results
from mok_proto.config import MOK_POLICY, ep_share, get_shape
from mok_proto.link import LinkModel
from mok_proto.plan import TaskKind
from mok_proto.sim import fused, gpus, layer
from mok_proto.sim.calibrate import (ROW_MOVES, calibration_stages, comm_bytes, gemm_rows_per_expert, newest_comm_rows,
                                     newest_gemm_rows, stage_ms)
from mok_proto.sim.model import simulate
from mok_proto.sim.params import (GpuParams, calibration_file, gb300_nvl72, get_params, grouped_gemm_ns,
                                  nccl_links, spare_warps_spun)

MEASURED_TOLERANCE = 0.15  # every measured group of every calibrated set
PAPER_TOLERANCE = 0.25
PAPER = {  # MoK at GB300 NVL72, EP=64, 2048 tokens/GPU, BF16 (MOK_NOTES)
    "pull_signal_us": 18.0, "push_signal_us": 103.0, "fwd_speedup": 1.92, "bwd_speedup": 1.58,
    "spread_lo": 1.38, "spread_hi": 3.53, "comm_sms_fwd": 40, "comm_sms_bwd": 28,
}
MINIBATCH_SWEEP = (256, 512, 1024, 2048, 4096, 8192)


CHECKS = ("judged", "range", "calibration", "assumed", "explained", "informational")


@dataclass(frozen=True)
class Row:
    group: str
    quantity: str
    reference: float  # "range": the low end
    predicted: float
    unit: str
    check: str = "judged"  # one of CHECKS (module doc)
    note: str = ""
    reference_hi: float | None = None  # "range": the high end

    def __post_init__(self):
        if self.check not in CHECKS or (self.check == "range") != (self.reference_hi is not None):
            raise ValueError(f"{self.quantity}: check {self.check!r} (a range needs reference_hi)")

    @property
    def judged(self) -> bool:
        return self.check in ("judged", "range")

    @property
    def error(self) -> float:
        """Relative error; for a range, to the nearest end (0 inside)."""
        if self.check == "range":
            end = min(max(self.predicted, self.reference), self.reference_hi)
            return (self.predicted - end) / end
        return (self.predicted - self.reference) / self.reference

    def ok(self, tolerance: float) -> bool:
        """Within the bar (a range: inside it); rows that are not judged never fail."""
        if self.check == "range":
            return self.error == 0.0
        return not self.judged or abs(self.error) <= tolerance

    def status(self, tolerance: float) -> str:
        if self.check == "explained":
            return "explained" + ("" if abs(self.error) <= tolerance else " (MISS)")
        if not self.judged:
            return self.check
        if self.check == "range":
            return "in range" if self.ok(tolerance) else "OUT OF RANGE"
        return "ok" if self.ok(tolerance) else "MISS"

    def reference_text(self) -> str:
        if self.check == "range":
            return f"{self.reference:.3g}-{self.reference_hi:.3g}"
        return f"{self.reference:.4g}"


def comm_stage_ns(gpu: GpuParams, row: dict, direction: str, dispatch: bool) -> float:
    """A standalone bench_comm stage (dispatch or combine) as the model predicts it."""
    b = comm_bytes(row)
    if row["backend"] == "virtual":  # one GPU: HBM reads and writes
        if dispatch and direction == "push":  # reads a token once, writes its K rows
            return b["tokens"] / gpu.hbm_read_gbs + b["pairs"] / gpu.hbm_write_gbs
        return gpu.row_copy_ns(b["pairs"])
    fixed = gpu.launch_ns + (gpu.rtt_ns if direction == "pull" else gpu.signal_wait_ns(row["ep"]))
    moved = max(b["remote"] / (gpu.link_gbs * gpu.link_efficiency[direction]), gpu.row_copy_ns(b["local"]))
    return fixed + moved


def measured_rows(measured_on: str, gpu: GpuParams | None = None, results_dir=results.RESULTS_DIR) -> list[Row]:
    """Every measured row of set measured_on's GPU (gpus.SPECS) against `gpu` (default: that set as
    its calibration file holds it): the standalone kernels, the sequential layer, the fused passes and
    their timelines, the emulated link."""
    gpu = gpu or get_params(measured_on)
    return (kernel_rows(gpu, results_dir, measured_on) + sequential_layer_rows(gpu, results_dir, measured_on)
            + fused_rows(gpu, results_dir, measured_on) + fused_backward_rows(gpu, results_dir, measured_on)
            + link_rows(gpu, results_dir, measured_on))


def h200_rows(gpu: GpuParams | None = None, results_dir=results.RESULTS_DIR) -> list[Row]:
    """The H200's measured rows (`measured_rows`)."""
    return measured_rows("h200", gpu, results_dir)


def calibrated_sets() -> tuple[list[str], list[str]]:
    """(the calibrated sets whose calibration file exists, one line for each other set: its GPU's rows
    are left out, and how to calibrate it)."""
    have, notes = [], []
    for name, spec in gpus.SPECS.items():
        if calibration_file(name).exists():
            have.append(name)
        else:
            notes.append(f"# {name}: no {calibration_file(name).name}: the {spec.match} rows are left out "
                         f"(python -m mok_proto.sim calibrate --gpu {name} writes it)")
    return have, notes


def kernel_rows(gpu: GpuParams, results_dir=results.RESULTS_DIR, measured_on: str = "h200") -> list[Row]:
    """The standalone kernels' rows of measured_on's GPU: bench_gemm's grouped GEMMs and bench_comm's
    transfers (the 2-GPU ones where that GPU ran them)."""
    spec = gpus.spec(measured_on)
    selectors = spec.selectors
    rows = []
    for r in newest_gemm_rows(results_dir, measured_on):
        s = get_shape(r["shape"])
        counts = gemm_rows_per_expert(r)
        calib = (r["shape"], r["routing"]) == selectors["gemm"]
        rows.append(Row(f"{measured_on} gemm", f"{r['problem']} {r['shape']} {r['routing']}", r["ours"]["median_ms"],
                        grouped_gemm_ns(gpu, r["problem"], counts, s) / 1e6, "ms",
                        "calibration" if calib else "judged"))
    seen = set()
    for r in newest_comm_rows(results_dir, measured_on):
        for op in ("dispatch", "combine"):
            key = (r["backend"], r["shape"], r["ep"], op, r[op])
            if key in seen:
                continue
            seen.add(key)
            where = "1 GPU" if r["backend"] == "virtual" else f"2 x {spec.match}"
            one_gpu = r["backend"] == "virtual"
            calib = ((one_gpu and (r["shape"], r["ep"], r[op]) == selectors["hbm"] and op == "dispatch")
                     or (one_gpu and (r["shape"], r["ep"]) == selectors["row_move"] and (op, r[op]) in ROW_MOVES)
                     or (not one_gpu and spec.link_from == measured_on and r["shape"] == selectors["link"]
                         and op == "dispatch"))
            rows.append(Row(f"{measured_on} comm {where}", f"{op} {r[op]} {r['shape']} EP={r['ep']}", stage_ms(r, op),
                            comm_stage_ns(gpu, r, r[op], op == "dispatch") / 1e6, "ms",
                            "calibration" if calib else "judged"))
    return _same_as_calibration(rows)


# Sequential-layer stages whose measurement holds what the model leaves out: (shape | None for
# every shape, pass, stage | "total") -> why. Fixed here, not chosen from the error. None today:
# since bench_layer runs both passes back to back, every stage is GPU time.
LAYER_EXPLAINED: dict = {}


def sequential_layer_rows(gpu: GpuParams, results_dir=results.RESULTS_DIR, measured_on: str = "h200") -> list[Row]:
    """bench_layer's sequential rows of measured_on's GPU (one EP=64 rank's share on one GPU; the newest
    run of each shape) against the sequential plan simulated on that load (sim/layer.py): the whole pass
    (graph replays) and every stage (eager, one event per stage, the GPU kept busy). The stages the
    set's parameters are fitted on (layer.LAYER_CALIBRATION, one shape) are calibration rows."""
    one = layer.one_gpu(gpu)
    fitted_by = {ps: name for name, stages in layer.LAYER_CALIBRATION.items() for ps in stages}
    rows = []
    for r in layer.measured_rows(results_dir, measured_on):
        predicted = layer.sequential_stages_ns(ep_share(r["shape"], r["ep"]), r["pass"], one.recorded_at(r))
        calib = calibration_stages(r["shape"], measured_on)
        measured = {"total": r["median_ms"], **{k: v for k, v in r["stages_ms"].items() if k != "total"}}
        for stage, ms in measured.items():
            why = LAYER_EXPLAINED.get((r["shape"], r["pass"], stage)) or LAYER_EXPLAINED.get((None, r["pass"], stage))
            what = "pass (graph)" if stage == "total" else stage
            if (r["pass"], stage) in calib:
                check, note = "calibration", f"fits {fitted_by[r['pass'], stage]}"
            else:
                check, note = ("explained", why) if why else ("judged", "")
            rows.append(Row(f"{measured_on} layer sequential", f"{r['pass']} {what} {r['shape']}", ms,
                            predicted[stage] / 1e6, "ms", check, note=note))
    return rows


FUSED_MEDIANS = ((TaskKind.COMBINE, "combine chunk"), (TaskKind.GATE_UP, "gate_up tile"), (TaskKind.DOWN, "down tile"))
# The calibration timelines (index rows with sim_calibrates, fused.FUSED_CALIBRATION) whose dispatch
# tasks fit in-kernel copy parameters: key -> those parameters.
FUSED_FITS = {key: ", ".join(fits) for key, (tasks, fits) in fused.FUSED_CALIBRATION.items() if tasks == "dispatch"}
# Why a fused measurement of params.spare_warps_spun (wait_spin "acquire", spare warps moving rows) is
# explained, not judged.
SPUN = ("its kernel spun on ld.acquire with 64 ns sleeps in the counter waits (wait_spin acquire) while the "
        "spare warps of every CTA moved rows, which slowed the pass (an A/B run of the two spins); the model has "
        "no cost for spinning")
# A timeline event the model leaves something out of is explained by its index row (sim_explained:
# {event: why}), named in the note.


def compared_timelines(results_dir=results.RESULTS_DIR, pass_: str = "fwd", measured_on: str = "h200") -> list[dict]:
    """The index rows of bench_layer's timelines of pass_ measured on measured_on's GPU that sim
    --validate compares (sim_compared): the forward's by file name, the backward's by time (then name)."""
    found = results.timeline_index(results_dir, pass_, bench="bench_layer", sim_compared=True)
    found = gpus.rows_on(found, measured_on)
    return sorted(found, key=lambda e: (e["file"],) if pass_ == "fwd" else (e["time"], e["file"]))


def fused_rows(gpu: GpuParams, results_dir=results.RESULTS_DIR, measured_on: str = "h200") -> list[Row]:
    """The fused forward on measured_on's GPU (one EP=64 rank's share, sim/fused.py): each compared in-kernel
    timeline (`compared_timelines`) against the simulated timeline of the same plan (dispatch end,
    compute end, kernel end from the first task's start; the median combine chunk and routed GEMM
    tiles, over the tasks that move rows or compute tiles in the simulation), and bench_layer's
    fused passes (graph replays, with the tile pairs the row claimed) of every compared run
    (layer.compared_rows). Each measurement is simulated with the kernel that recorded it
    (GpuParams.recorded_at its kernel features: the bulk ring or the warp movers). A calibration timeline's dispatch end is the event its dispatch tasks
    fit (FUSED_FITS, by its sim_calibrates): calibration rows. A measurement of
    params.spare_warps_spun (the acquire spin beside spare warps that move rows) is explained (SPUN),
    and so is a timeline event its index row explains (sim_explained); every other row is judged.
    No combine-chunk median for comm_blocks == 0 in files without the `comm_bars_from: ready` marker
    (see the NOTE below)."""
    rows = []
    for entry in compared_timelines(results_dir, "fwd", measured_on):
        path, shape_name, git = entry["path"], entry["shape"], entry.get("git", "")
        measured = results.load_timeline(path)
        plan, result = fused.simulate_timeline(measured, ep_share(shape_name, fused.EP), gpu, kernel=entry)
        predicted = result.records(0)
        label = f"{shape_name} C={plan.comm_blocks} MB={plan.minibatch_rows} {git or 'timeline'}"
        fits = FUSED_FITS.get(entry.get("sim_calibrates"))
        spun = spare_warps_spun(entry, plan.comm_blocks, plan.spread_from)

        def check(copies: bool = False, event: str = "") -> dict:  # calibration: a row set by the copies fitted here
            if copies and fits:
                return dict(check="calibration", note=f"fits {fits}")
            why = SPUN if spun else entry.get("sim_explained", {}).get(event)
            return dict(check="explained", note=why) if why else {}
        want, got = results.timeline_events(measured), results.timeline_events(predicted)
        for event in results.TIMELINE_EVENTS:
            rows.append(Row(f"{measured_on} fused", f"fwd {event} {label}", want[event] / 1e6, got[event] / 1e6, "ms",
                            **check(event == "dispatch end", event)))
        fixed = gpu.recorded_at(entry).fused_task_ns(plan.comm_blocks)
        busy = predicted["end_ns"] - predicted["start_ns"] > fixed  # tasks with work (rows or tiles)
        for kind, what in FUSED_MEDIANS:
            sel = busy & (measured["kind"] == int(kind))
            if kind == TaskKind.COMBINE and not plan.comm_blocks and not results.comm_bars_from_ready(path):
                # NOTE: a spare-warp combine chunk starts waiting for its minibatch's down tiles as
                # soon as the previous chunk is done, and files without the `comm_bars_from: ready`
                # marker draw a chunk from that start: its measured bar is wait + copy, the
                # simulated one the copy. Not the same quantity, so no row; the kernel end (set by
                # the last combines) is judged above.
                continue
            if sel.any():
                rows.append(Row(f"{measured_on} fused", f"fwd {what} median {label}",
                                float(np.median(measured["end_ns"][sel] - measured["start_ns"][sel])) / 1e3,
                                float(np.median(predicted["end_ns"][sel] - predicted["start_ns"][sel])) / 1e3, "us",
                                **check()))
    runs: dict = {}  # printed run by run
    for r in layer.compared_rows(results_dir, measured_on=measured_on):
        if r["schedule"] == "fused" and r.get("pass", "fwd") == "fwd":  # pass_ns: forward only
            runs.setdefault(r["run"], []).append(r)
    fitted = _fused_gemm_fitted(results_dir, measured_on)
    for found in runs.values():
        for r in found:
            ns = fused.pass_ns(ep_share(r["shape"], r["ep"]), gpu.recorded_at(r), r["comm_blocks"],
                               r["minibatch_tokens"], r["num_sms"], r.get("claim_pairs", 0), r.get("segment_rows"))
            why = r.get("sim_explained") or (
                SPUN if spare_warps_spun(r, r["comm_blocks"], r.get("spread_from")) else "")
            check = ("calibration", "fits fused_gemm") if _row_key(r) in fitted else ("explained", why) if why else ()
            rows.append(Row(f"{measured_on} fused", f"fwd pass (graph) {r['shape']} C={r['comm_blocks']} MB={r['minibatch_tokens']}"
                            f" {r['git']}", r["median_ms"], ns / 1e6, "ms", *check))
    return rows


def _row_key(row: dict) -> str:
    """A results row as a key: every field it recorded (the loader's `run` aside)."""
    return json.dumps({k: v for k, v in row.items() if k != "run"}, sort_keys=True)


def _fused_gemm_fitted(results_dir, measured_on: str) -> set:
    """The keys (`_row_key`) of the rows set measured_on's fused_gemm is fitted on (none when it is not fitted)."""
    shape = gpus.spec(measured_on).selectors.get("fused_gemm")
    return {_row_key(r) for r in fused.fused_gemm_rows(shape, results_dir, measured_on)} if shape else set()


def link_rows(gpu: GpuParams, results_dir=results.RESULTS_DIR, measured_on: str = "h200") -> list[Row]:
    """bench_layer.py --link-gbps's rows of measured_on's GPU (layer.link_rows: one EP=64 rank's share on one GPU, every
    row rank 0 moves paying the emulated link), each pass (graph replays) simulated with its link and
    the kernel that ran it (GpuParams.recorded_at): a sequential row as sim/layer.py's stages (their
    sum), a fused row as the plan its knobs build (plan.FusedKnobs.from_row, fused.fused_pass_ns).
    Every row is judged, but a fused pass of params.spare_warps_spun is explained (SPUN)."""
    rows = []
    for r in layer.link_rows(results_dir, measured_on):
        link = LinkModel(r["link_gbps"], r["link_latency_us"], r["link_every_row"])
        shape, pass_, ran = ep_share(r["shape"], r["ep"]), r["pass"], gpu.recorded_at(r)
        what = f"{pass_} {r['schedule']} {r['shape']} link {link.gbps:g} GB/s"
        why = ""
        if r["schedule"] == "sequential":
            ns = layer.sequential_stages_ns(shape, pass_, layer.one_gpu(ran), link=link)["total"]
        else:
            ns = fused.fused_pass_ns(shape, ran, pass_, plans.FusedKnobs.from_row(r), r["num_sms"], link)
            what += f" C={r['comm_blocks']} MB={r['minibatch_tokens']}"
            why = SPUN if spare_warps_spun(r, r["comm_blocks"], r.get("spread_from")) else ""
        rows.append(Row(f"{measured_on} link", what, r["median_ms"], ns / 1e6, "ms",
                        *(("explained", why) if why else ())))
    return rows


def link_note(results_dir=results.RESULTS_DIR, measured_on: str = "h200") -> str | None:
    """A line for --validate when it judges no row of bench_layer.py --link-gbps of measured_on's GPU:
    why (no file, or no row of it compared)."""
    path = Path(results_dir) / f"{layer.LINK_RESULTS}.jsonl"
    if not path.exists():
        return (f"# {measured_on} link: no {path.name} in {results_dir} (scripts/bench_layer.py --link-gbps writes "
                "it): nothing judged")
    if not layer.link_rows(results_dir, measured_on):
        return (f"# {measured_on} link: no row of {path.name} is compared (none of an {gpus.spec(measured_on).match} "
                "under MoK's directions without sim_left_out)")
    return None


def fused_backward_rows(gpu: GpuParams, results_dir=results.RESULTS_DIR, measured_on: str = "h200") -> list[Row]:
    """The fused backward on measured_on's GPU (one EP=64 rank's share; sim/fused.py rebuilds the
    fused_backward plan each compared timeline (`compared_timelines`) ran and simulates it, with the
    kernel it ran, GpuParams.recorded_at): the kernel end from the first task's start (judged;
    explained for a kernel of params.spare_warps_spun, SPUN), and per task kind the summed task time
    per compute SM (results.timeline_summary's per_lane_ns; informational, but for the scale and
    token-gradient tasks of the timeline the movers' token rates are fitted on, sim_calibrates
    "fused_token": calibration)."""
    rows = []
    for entry in compared_timelines(results_dir, "bwd", measured_on):
        shape_name, git = entry["shape"], entry.get("git", "")
        measured = results.load_timeline(entry["path"])
        plan, result = fused.simulate_timeline(measured, ep_share(shape_name, fused.EP), gpu, kernel=entry)
        predicted = result.records(0)
        label = f"{shape_name} C={plan.comm_blocks} MB={plan.minibatch_rows} {git}"
        want, got = results.timeline_events(measured), results.timeline_events(predicted)
        spun = spare_warps_spun(entry, plan.comm_blocks, plan.spread_from)
        rows.append(Row(f"{measured_on} fused", f"bwd kernel end {label}", want["kernel end"] / 1e6, got["kernel end"] / 1e6, "ms",
                        *(("explained", SPUN) if spun else ())))
        want, got = results.timeline_summary(measured)["kinds"], results.timeline_summary(predicted)["kinds"]
        fitted = entry.get("sim_calibrates") == "fused_token"
        for kind in (k for k in want if k in got):
            token = fitted and kind in (TaskKind.SCALE.name.lower(), TaskKind.SLOT_SUM.name.lower())
            rows.append(Row(f"{measured_on} fused", f"bwd {kind} per SM {label}", want[kind]["per_lane_ns"] / 1e3,
                            got[kind]["per_lane_ns"] / 1e3, "us",
                            *(("calibration", "fits token_read_gbs, token_write_gbs") if token else ("informational",))))
    return rows


def _same_as_calibration(rows: list[Row]) -> list[Row]:
    """Rows whose prediction is exactly a calibration row's of the same group (the same formula on
    the same bytes, e.g. the 2 x H200 kimi combines vs the calibrated dispatches) agree by
    construction: they become calibration rows."""
    fitted = {(r.group, r.predicted): r.quantity for r in rows if r.check == "calibration"}
    return [dataclasses.replace(r, check="calibration", note=f"prediction is {fitted[r.group, r.predicted]}'s")
            if r.check == "judged" and (r.group, r.predicted) in fitted else r for r in rows]


def paper_rows(gpu: GpuParams | None = None, shape_name: str = "kimi-k2.7") -> list[Row]:
    gpu = gpu or gb300_nvl72()
    shape, ranks = get_shape(shape_name), 64
    rows = [
        Row("paper gb300", "pull dispatch signalling", PAPER["pull_signal_us"], (gpu.launch_ns + gpu.rtt_ns) / 1e3, "us",
            note="launch (H200-measured) + one round trip: the launch we measured on H200 is shorter than theirs"),
        Row("paper gb300", "push dispatch signalling", PAPER["push_signal_us"],
            (gpu.launch_ns + gpu.signal_wait_ns(ranks)) / 1e3, "us", "assumed",
            note=f"launch + fence + {ranks - 1} peers x signal_ns_per_peer = {gpu.signal_ns_per_peer / 1e3:g} us, "
                 "an assumed round trip (params.py): not a prediction"),
    ]
    for pass_, paper in (("fwd", PAPER["fwd_speedup"]), ("bwd", PAPER["bwd_speedup"])):
        comm = PAPER["comm_sms_fwd"] if pass_ == "fwd" else PAPER["comm_sms_bwd"]
        sweep = {mb: simulate(plans.fixed_split(shape, ranks, comm, mb, pass_=pass_, policy=MOK_POLICY,
                                                num_sms=gpu.num_sms), gpu).time_ns
                 for mb in (MINIBATCH_SWEEP if pass_ == "fwd" else (2048,))}
        seq = plans.sequential(shape, ranks, pass_=pass_, policy=MOK_POLICY, num_sms=gpu.num_sms)
        baseline = simulate(seq, nccl_links(gpu)).time_ns
        rows.append(Row("paper gb300", f"{pass_} speedup fused / sequential NCCL-like", paper,
                        baseline / min(sweep.values()), "x",
                        note="our baseline has no PyTorch permute/layout/host-sync or unfused SwiGLU kernels"))
        if pass_ == "fwd":
            spread = max(sweep.values()) / min(sweep.values())
            rows.append(Row("paper gb300", f"fwd minibatch spread worst/best ({MINIBATCH_SWEEP[0]}..{MINIBATCH_SWEEP[-1]} rows)",
                            PAPER["spread_lo"], spread, "x", "range", reference_hi=PAPER["spread_hi"],
                            note="the paper's range over its minibatch sweep; error % to the nearest end"))
    return rows


def format_table(rows: list[Row], tolerance_of) -> str:
    """One line per row; a group header with its bar; a summary of what was judged."""
    lines = [f"{'quantity':<52} {'measured/published':>18} {'predicted':>10} {'error %':>8}  status"]
    group = None
    for row in rows:
        if row.group != group:
            group = row.group
            lines.append(f"# {group} (bar: within {tolerance_of(group) * 100:.0f}%)")
        status = row.status(tolerance_of(group))
        show_note = row.note and status not in ("ok", "in range", "explained")
        lines.append(f"{row.quantity:<52} {row.reference_text():>15} {row.unit:<2} {row.predicted:>10.4g} "
                     f"{row.error * 100:>+8.1f}  {status}" + (f"  ({row.note})" if show_note else ""))
    for group in dict.fromkeys(r.group for r in rows):
        g = [r for r in rows if r.group == group]
        judged = [r for r in g if r.judged]
        passed = sum(r.ok(tolerance_of(group)) for r in judged)
        others = ", ".join(f"{sum(r.check == c for r in g)} {c}" for c in ("calibration", "assumed", "explained",
                                                                                  "informational")
                           if any(r.check == c for r in g))
        outside = sum(abs(r.error) > tolerance_of(group) for r in g if r.check == "explained")
        lines.append(f"# {group}: {passed} of {len(judged)} judged rows pass" + (f" ({others}: not judged)" if others else "")
                     + (f"; {outside} explained rows are OUTSIDE the bar" if outside else ""))
    return "\n".join(lines)


def tolerance_of(group: str) -> float:
    """The bar of a group: MEASURED_TOLERANCE for a calibrated set's ("h100 link"), else the paper's."""
    return MEASURED_TOLERANCE if group.split(" ", 1)[0] in gpus.SPECS else PAPER_TOLERANCE
