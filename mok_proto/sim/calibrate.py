"""Calibrating a GPU parameter set on this project's results/ and writing it as data:

    python -m mok_proto.sim calibrate --gpu h200     # writes mok_proto/sim/calibration/h200.json
    python -m mok_proto.sim calibrate --gpu h100     # ... h100.json, from the H100 rows

The simulator reads those files (params.h200, params.h100); nothing else calibrates. A set is fitted
on a small fixed set of its GPU's measurements (gpus.SPECS: the rows whose `gpu` matches, the
selectors; recorded with the fitted values as the file's "sources"); every other measurement of that
GPU in results/ is a prediction that `python -m mok_proto.sim --validate` judges with it. Three
parameters come from the sequential layer's stages of ONE shape (the "layer" selector, the stages of
layer.LAYER_CALIBRATION), the fused kernel's copy and token-task rates from the timelines whose index
rows say sim_calibrates (fused.FUSED_CALIBRATION). The link is the 2 x H200 run's for every set
(gpus.GpuSpec.link_from), and a set whose GPU has no calibration timeline for a key carries that
key's fields over from another set (gpus.GpuSpec.fused_from); the sources name both.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from mok_proto import results
from mok_proto.config import get_shape
from mok_proto.problem import rows_per_expert
from mok_proto.sim import fused, gpus, layer
from mok_proto.sim.params import PROBLEMS, GpuParams, calibrated, calibration_file, grouped_gemm_ns, params_to_json

H200_CALIBRATION = gpus.SPECS["h200"].selectors  # what h200 is fitted on; everything else in results/ is predicted
ROW_MOVES = (("dispatch", "pull"), ("combine", "push"), ("combine", "pull"))  # row_move's bench_comm stages
NOTE = "calibrated on this project's {match} results by `python -m mok_proto.sim calibrate --gpu {gpu}` (sources)"
# The commands that measure each source's rows (on the GPU the rows must come from): what the error
# of a fit without them says.
MEASURES = {
    "bench_gemm": "python scripts/bench_gemm.py --shapes {shape}",
    "bench_comm": "python scripts/bench_comm.py --shapes {shape} --ep 8,64",
    "bench_layer": "python scripts/bench_layer.py --shapes {shape}",
    "x2/bench_comm": "NVSHMEM_DISABLE_NVLS=1 mpirun -n 2 python scripts/bench_comm.py --ep 2 --global-tokens 4096",
}


def gemm_rows_per_expert(row: dict) -> np.ndarray:
    """The rows per expert of a bench_gemm row's grouped GEMM."""
    return rows_per_expert(row["rows"], row["experts"], row["routing"])


def newest_gemm_rows(results_dir=results.RESULTS_DIR, measured_on: str = "h200") -> list[dict]:
    """bench_gemm's newest row of each (shape, routing, problem) measured on measured_on's GPU
    (gpus.SPECS): a run of a subset (--shapes, --routing, --problems) replaces only its own rows."""
    rows = gpus.rows_on(results.load("bench_gemm", results_dir), measured_on)
    return results.newest(rows, group_by=("shape", "routing", "problem"))


def newest_comm_rows(results_dir=results.RESULTS_DIR, measured_on: str = "h200") -> list[dict]:
    """bench_comm's newest run of each backend (virtual ranks on one GPU: results/; NVSHMEM on two
    GPUs: results/x2/) measured on measured_on's GPU (gpus.SPECS), by time; the emulated link's check
    rows are another measurement (left out)."""
    rows = results.load("bench_comm", results_dir) + results.load("bench_comm", results.machine_dir(2, results_dir))
    rows = [r for r in gpus.rows_on(rows, measured_on) if not results.is_link_check(r)]
    return results.newest(sorted(rows, key=lambda r: r["time"]), group_by=("backend",))


def stage_ms(row: dict, stage: str, signal: bool = False) -> float:
    return row["signal_stages" if signal else "stages"][stage]["median_ms"]


def comm_row(rows: list[dict], backend: str, shape: str, ep: int, policy: dict) -> dict:
    """The bench_comm row of one (backend, shape, EP, dispatch/combine directions)."""
    for r in rows:
        if (r["backend"], r["shape"], r["ep"]) == (backend, shape, ep) and all(r[op] == d for op, d in policy.items()):
            return r
    raise KeyError(f"no bench_comm row for {backend} {shape} EP={ep} {policy}")


def comm_bytes(row: dict, elem_bytes: int = 4) -> dict:
    """Bytes a bench_comm stage moves per GPU: pairs (token, choice), remote (cross the link)
    and local rows, and token rows read once (a push dispatch reads each token once)."""
    row_bytes = row["hidden"] * elem_bytes
    gpus = row["ep"] if row["backend"] == "nvshmem" else 1  # virtual ranks share one GPU
    pairs = row["ep"] * row["tokens_per_rank"] * row["top_k"] / gpus
    remote = row["remote_rows"] / gpus if row["backend"] == "nvshmem" else 0.0
    return {"pairs": pairs * row_bytes, "remote": remote * row_bytes, "local": (pairs - remote) * row_bytes,
            "tokens": row["ep"] * row["tokens_per_rank"] / gpus * row_bytes}


def calibration_stages(shape_name: str, measured_on: str = "h200") -> set:
    """{(pass, stage)} of `shape_name`'s bench_layer rows that set measured_on is fitted on (empty for
    the shapes that are only judged)."""
    if shape_name != gpus.spec(measured_on).selectors["layer"]:
        return set()
    return {ps for rows in layer.LAYER_CALIBRATION.values() for ps in rows}


def missing_rows(name: str, results_dir=results.RESULTS_DIR) -> list[tuple[str, str, str]]:
    """(on what: "an H100" or "2 H200s", the rows in words, the command that measures them) of each
    group of rows the fit of set `name` reads (`fit`) and results_dir lacks."""
    spec, link = gpus.spec(name), gpus.spec(gpus.spec(name).link_from)
    one, two = f"an {spec.match}", f"2 {link.match}s"
    out = []
    gemm_shape, routing = spec.selectors["gemm"]
    have = {r["problem"] for r in newest_gemm_rows(results_dir, name)
            if (r["shape"], r["routing"]) == (gemm_shape, routing)}
    if lacking := [p for p in PROBLEMS if p not in have]:
        out.append((one, f"bench_gemm {gemm_shape} {routing} ({', '.join(lacking)})",
                    MEASURES["bench_gemm"].format(shape=gemm_shape)))
    hbm_shape, hbm_ep, direction = spec.selectors["hbm"]
    move_shape, move_ep = spec.selectors["row_move"]
    comm = newest_comm_rows(results_dir, name)
    wanted = [(hbm_shape, hbm_ep, "dispatch", direction)] + [(move_shape, move_ep, op, d) for op, d in ROW_MOVES]
    lacking = [w for w in dict.fromkeys(wanted) if not _has_comm_row(comm, "virtual", *w)]
    for shape, ep in dict.fromkeys((shape, ep) for shape, ep, _, _ in lacking):
        stages = ", ".join(f"{op} {d}" for s, e, op, d in lacking if (s, e) == (shape, ep))
        out.append((one, f"bench_comm virtual {shape} EP={ep} ({stages})", MEASURES["bench_comm"].format(shape=shape)))
    layer_shape = spec.selectors["layer"]
    have = {r["pass"] for r in layer.measured_rows(results_dir, name) if r["shape"] == layer_shape}
    if lacking := [p for p in ("fwd", "bwd") if p not in have]:
        out.append((one, f"bench_layer {layer_shape} sequential ({', '.join(lacking)})",
                    MEASURES["bench_layer"].format(shape=layer_shape)))
    link_shape = spec.selectors["link"]
    links = newest_comm_rows(results_dir, spec.link_from)
    if lacking := [d for d in ("push", "pull") if not _has_comm_row(links, "nvshmem", link_shape, 2, "dispatch", d)]:
        out.append((two, f"x2/bench_comm nvshmem {link_shape} EP=2 ({', '.join(f'dispatch {d}' for d in lacking)})",
                    MEASURES["x2/bench_comm"]))
    return out


def _has_comm_row(rows: list[dict], backend: str, shape: str, ep: int, op: str, direction: str) -> bool:
    try:
        comm_row(rows, backend, shape, ep, {op: direction})
    except KeyError:
        return False
    return True


def check_rows(name: str, results_dir=results.RESULTS_DIR) -> None:
    """Raise ValueError, one line naming them and their commands, when results_dir lacks rows the fit
    of set `name` reads (`missing_rows`)."""
    missing = missing_rows(name, results_dir)
    if not missing:
        return
    parts = []
    for where in dict.fromkeys(w for w, _, _ in missing):
        whats = " and ".join(what for w, what, _ in missing if w == where)
        commands = " and ".join(f"`{c}`" for c in dict.fromkeys(c for w, _, c in missing if w == where))
        parts.append(f"{whats} on {where} with {commands}")
    raise ValueError(f"gpu {name}: {results_dir} lacks rows its fit needs; measure " + "; ".join(parts))


def fit(name: str, results_dir=results.RESULTS_DIR) -> GpuParams:
    """Set `name` (gpus.SPECS) fitted on its GPU's rows of results_dir (the selectors), the link on
    link_from's 2-GPU rows and the fused kernel's rates on its GPU's calibration timelines (a key
    without one: fused_from's calibration file). ValueError when rows are missing (`check_rows`)."""
    spec = gpus.spec(name)
    check_rows(name, results_dir)
    gemm_rows = newest_gemm_rows(results_dir, name)
    comm = newest_comm_rows(results_dir, name)
    base = GpuParams(
        name=name, num_sms=spec.num_sms,
        tile_tflops_per_sm={p: 1.0 for p in PROBLEMS},
        hbm_read_gbs=1.0, hbm_write_gbs=1.0, link_gbs=1.0, link_efficiency={"push": 1.0, "pull": 1.0},
        launch_ns=0.0, fence_ns=0.0, **spec.assumed)
    # GEMM: one rate per problem such that the simulated grouped GEMM of the selected rows takes the
    # measured time (the makespan scales as 1/rate).
    shape_name, routing = spec.selectors["gemm"]
    rates = {}
    for r in gemm_rows:
        if (r["shape"], r["routing"]) == (shape_name, routing):
            ns_at_one = grouped_gemm_ns(base, r["problem"], gemm_rows_per_expert(r), get_shape(r["shape"]))
            rates[r["problem"]] = ns_at_one / (r["ours"]["median_ms"] * 1e6)
    # HBM: a copy of B bytes reads and writes B: 1/copy = 1/read + 1/write; a push dispatch on
    # one GPU reads each token row once and writes K rows: t = tokens/read + pairs/write.
    shape_name, ep, _ = spec.selectors["hbm"]
    row = comm_row(comm, "virtual", shape_name, ep, {"dispatch": "push"})
    b = comm_bytes(row)
    t_ns = stage_ms(row, "dispatch") * 1e6
    inv_copy = 1.0 / row["copy_ceiling_gbs"]
    # tokens*(inv_copy - 1/w) + pairs/w = t  ->  1/w = (t - tokens*inv_copy) / (pairs - tokens)
    inv_write = (t_ns - b["tokens"] * inv_copy) / (b["pairs"] - b["tokens"])
    hbm_write, hbm_read = 1.0 / inv_write, 1.0 / (inv_copy - inv_write)
    # Row moves (one GPU): a pull dispatch, a push and a pull combine copy each (token, choice)
    # row once; efficiency = bytes copied / (that run's copy ceiling x time), median of the three.
    shape_name, ep = spec.selectors["row_move"]
    moves = [comm_row(comm, "virtual", shape_name, ep, {op: d}) for op, d in ROW_MOVES]
    row_eff = float(np.median([comm_bytes(r)["pairs"] / (r["copy_ceiling_gbs"] * stage_ms(r, op) * 1e6)
                               for r, (op, _) in zip(moves, ROW_MOVES)]))
    # Link (2 GPUs of link_from, one peer): stage = launch + (pull: rtt | push: fence + 1 peer's
    # signal) + remote bytes / (link * efficiency); the 4-byte-row stages give the fixed parts.
    links = comm if spec.link_from == name else newest_comm_rows(results_dir, spec.link_from)
    shape_name = spec.selectors["link"]
    push = comm_row(links, "nvshmem", shape_name, 2, {"dispatch": "push"})
    pull = comm_row(links, "nvshmem", shape_name, 2, {"dispatch": "pull"})
    launch = stage_ms(pull, "dispatch", signal=True) * 1e6 - base.rtt_ns
    fence = stage_ms(push, "dispatch", signal=True) * 1e6 - launch - base.signal_ns_per_peer
    link = push["link_ceiling_gbs"]
    eff = {}
    for d, r, fixed in (("push", push, launch + fence + base.signal_ns_per_peer), ("pull", pull, launch + base.rtt_ns)):
        eff[d] = comm_bytes(r)["remote"] / (link * (stage_ms(r, "dispatch") * 1e6 - fixed))
    nccl = results.newest(gpus.rows_on(results.load("bench_nccl_baseline", results.machine_dir(2, results_dir)),
                                       spec.link_from))
    nccl_eff = {op: float(np.median([n["pct_of_link"][op] for n in nccl])) / 100 for op in ("dispatch", "combine")} if nccl else {}
    micro = dataclasses.replace(
        base, tile_tflops_per_sm=rates, hbm_read_gbs=hbm_read, hbm_write_gbs=hbm_write, link_gbs=link,
        link_efficiency=eff, launch_ns=launch, fence_ns=fence, nccl_link_efficiency=nccl_eff,
        row_move_efficiency=row_eff)
    # Sustained load, busy-stream kernel boundaries and the token sums from the sequential layer's
    # stages of one shape; then the fused kernel's in-kernel copies and token tasks from timelines.
    carried = _carried_keys(name, results_dir)
    fitted = fused.calibrate(layer.calibrate(micro, spec.selectors["layer"], results_dir, name), results_dir, name,
                             calibrated(spec.fused_from) if carried else None)
    if "fused_gemm" in spec.selectors:
        fitted = fused.fit_fused_gemm(fitted, spec.selectors["fused_gemm"], results_dir, name)
    return dataclasses.replace(fitted, note=_note(spec, carried))


def fit_h200(results_dir=results.RESULTS_DIR) -> GpuParams:
    """H200 (132 SMs) fitted on H200_CALIBRATION's rows and the calibration timelines of results_dir (`fit`)."""
    return fit("h200", results_dir)


def _carried_keys(name: str, results_dir) -> list[str]:
    """The fused.FUSED_CALIBRATION keys set `name` carries over from its fused_from set: those without a
    calibration timeline of its GPU (none for a set without fused_from: its fit needs every one)."""
    if gpus.spec(name).fused_from is None:
        return []
    return [key for key in fused.FUSED_CALIBRATION if not fused.calibration_timelines(key, results_dir, name)]


def _carried_note(spec: gpus.GpuSpec) -> str:
    return f"assumed from {spec.fused_from}: no {spec.match} calibration timeline"


def _link_note(spec: gpus.GpuSpec) -> str:
    link = gpus.spec(spec.link_from)
    return (f"the 2 x {link.match} rows (results/x2), the only real link measurement: the {spec.name} set takes "
            f"the {link.name} set's")


def _note(spec: gpus.GpuSpec, carried: list[str]) -> str:
    """GpuParams.note of a fitted set: what it is calibrated on, and what comes from another GPU."""
    note = NOTE.format(match=spec.match, gpu=spec.name)
    if spec.link_from != spec.name:
        note += f"; link from the 2 x {gpus.spec(spec.link_from).match} rows"
    if carried:
        note += f"; {', '.join(carried)} {_carried_note(spec)}"
    return note


def sources(name: str, results_dir=results.RESULTS_DIR) -> dict:
    """What each group of set `name`'s parameters is fitted on (selectors of results/ rows and timeline
    index rows; a calibration file's "sources"). The rows are the set's GPU's (gpus.SPECS) but where a
    group says otherwise ("from": the link of another GPU, a fused key carried over)."""
    spec = gpus.spec(name)
    gemm_shape, routing = spec.selectors["gemm"]
    hbm_shape, hbm_ep, direction = spec.selectors["hbm"]
    move_shape, move_ep = spec.selectors["row_move"]
    newest_comm = "the newest run of each backend"
    out = {
        "gemm": {"results": "bench_gemm.jsonl", "rows": "the newest of each (shape, routing, problem)",
                 "where": {"shape": gemm_shape, "routing": routing}, "fits": ["tile_tflops_per_sm"]},
        "hbm": {"results": "bench_comm.jsonl", "rows": newest_comm, "stage": "dispatch",
                "where": {"backend": "virtual", "shape": hbm_shape, "ep": hbm_ep, "dispatch": direction},
                "fits": ["hbm_read_gbs", "hbm_write_gbs"]},
        "row_move": {"results": "bench_comm.jsonl", "rows": newest_comm, "stages": [list(m) for m in ROW_MOVES],
                     "where": {"backend": "virtual", "shape": move_shape, "ep": move_ep},
                     "fits": ["row_move_efficiency"]},
        "link": {"results": "x2/bench_comm.jsonl", "rows": newest_comm, "stages": [["dispatch", "push"], ["dispatch", "pull"]],
                 "where": {"backend": "nvshmem", "shape": spec.selectors["link"], "ep": 2},
                 "fits": ["link_gbs", "link_efficiency", "launch_ns", "fence_ns"]},
        "nccl": {"results": "x2/bench_nccl_baseline.jsonl", "rows": "the newest run", "fits": ["nccl_link_efficiency"]},
        "layer": {"results": "bench_layer.jsonl", "rows": "the newest run of the shape among the compared rows "
                  "(sim.layer.compared_rows)", "where": {"shape": spec.selectors["layer"], "schedule": "sequential"},
                  "stages": {f: [list(ps) for ps in stages] for f, stages in layer.LAYER_CALIBRATION.items()}},
        "assumed": sorted(spec.assumed),
    }
    if "fused_gemm" in spec.selectors:
        out["fused_gemm"] = {"results": "bench_layer.jsonl", "rows": "the newest run of the shape among the compared "
                             "rows, its fused passes (sim.fused.fused_gemm_rows)",
                             "where": {"shape": spec.selectors["fused_gemm"], "schedule": "fused"},
                             "fits": ["fused_gemm"]}
    if spec.link_from != name:
        out["link"]["from"] = out["nccl"]["from"] = _link_note(spec)
    carried = _carried_keys(name, results_dir)
    for key, (tasks, fits) in fused.FUSED_CALIBRATION.items():
        out[key] = {"timeline": {"sim_calibrates": key}, "tasks": tasks, "fits": list(fits)}
        if key in carried:
            out[key]["from"] = _carried_note(spec)
    return out


CALIBRATIONS = gpus.SPECS  # the calibrated GPU parameter sets, by name


def calibration(gpu: str, results_dir=results.RESULTS_DIR) -> dict:
    """The calibration file's document of GPU parameter set `gpu`, fitted on results_dir:
    {"gpu", "written_by", "params" (params.params_to_json), "sources"}."""
    gpus.spec(gpu)
    return {"gpu": gpu, "written_by": f"python -m mok_proto.sim calibrate --gpu {gpu}",
            "params": params_to_json(fit(gpu, results_dir)), "sources": sources(gpu, results_dir)}


def write_calibration(gpu: str, results_dir=results.RESULTS_DIR, path: Path | str | None = None) -> Path:
    """Fit `gpu` on results_dir and write its calibration file (default params.calibration_file)."""
    path = Path(path) if path is not None else calibration_file(gpu)
    document = calibration(gpu, results_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def describe(gpu: GpuParams) -> str:
    """The fitted parameters of a calibrated set, in words (what --validate prints)."""
    return (f"{gpu.note}; row_move_efficiency {gpu.row_move_efficiency:.3f}, " + layer.describe_calibration(gpu)
            + ", " + fused.describe_calibration(gpu))
