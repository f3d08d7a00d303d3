"""Calibrating a GPU parameter set on this project's results/ and writing it as data:

    python -m mok_proto.sim calibrate --gpu h200     # writes mok_proto/sim/calibration/h200.json

The simulator reads that file (params.h200); nothing else calibrates. The h200 set uses a small fixed
set of measurements (H200_CALIBRATION, recorded with the fitted values as the file's "sources");
every other measurement in results/ is a prediction that `python -m mok_proto.sim --validate` judges.
Three parameters come from the sequential layer's stages of ONE shape (H200_CALIBRATION["layer"], the
stages of layer.LAYER_CALIBRATION), the fused kernel's copy and token-task rates from the timelines
whose index rows say sim_calibrates (fused.FUSED_CALIBRATION).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from mok_proto import results
from mok_proto.config import get_shape
from mok_proto.problem import rows_per_expert
from mok_proto.sim import fused, layer
from mok_proto.sim.params import PROBLEMS, GpuParams, calibration_file, grouped_gemm_ns, kernel_of, params_to_json

# What h200 is fitted on; everything else in results/ is predicted.
H200_CALIBRATION = {
    "gemm": ("kimi-k2.7", "uniform"),  # one tile rate per GEMM problem, from these rows
    "hbm": ("kimi-k2.7", 8, "push"),  # one-GPU push dispatch (+ the copy ceiling of that run)
    "row_move": ("kimi-k2.7", 8),  # one-GPU pull dispatch, push combine and pull combine
    "link": "kimi-k2.7",  # 2 x H200: push and pull dispatch, and their 4-byte-row signal stages
    "layer": "kimi-k2.7",  # bench_layer's sequential stages of this shape (layer.LAYER_CALIBRATION)
}
ROW_MOVES = (("dispatch", "pull"), ("combine", "push"), ("combine", "pull"))  # row_move's bench_comm stages
# Not measurable from our results, public or assumed (the file's sources say so): an NVLink 4 load
# round trip, the bulk loads one SM keeps in flight, the stores one SM posts, one peer's signal.
H200_ASSUMED = {"rtt_ns": 1000.0, "pull_window_bytes": 64 << 10, "sm_push_gbs": 100.0, "signal_ns_per_peer": 1000.0}
NOTE = "calibrated on this project's H200 results by `python -m mok_proto.sim calibrate --gpu {gpu}` (sources)"


def gemm_rows_per_expert(row: dict) -> np.ndarray:
    """The rows per expert of a bench_gemm row's grouped GEMM."""
    return rows_per_expert(row["rows"], row["experts"], row["routing"])


def newest_gemm_rows(results_dir=results.RESULTS_DIR) -> list[dict]:
    """bench_gemm's newest row of each (shape, routing, problem): a run of a subset (--shapes,
    --routing, --problems) replaces only its own rows."""
    return results.newest(results.load("bench_gemm", results_dir), group_by=("shape", "routing", "problem"))


def newest_comm_rows(results_dir=results.RESULTS_DIR) -> list[dict]:
    """bench_comm's newest run of each backend (virtual ranks on one GPU: results/; NVSHMEM on two
    GPUs: results/x2/), by time; the emulated link's check rows are another measurement (left out)."""
    rows = results.load("bench_comm", results_dir) + results.load("bench_comm", results.machine_dir(2, results_dir))
    rows = [r for r in rows if not results.is_link_check(r)]
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


def calibration_stages(shape_name: str) -> set:
    """{(pass, stage)} of `shape_name`'s bench_layer rows that h200 is fitted on (empty for the
    shapes that are only judged)."""
    if shape_name != H200_CALIBRATION["layer"]:
        return set()
    return {ps for rows in layer.LAYER_CALIBRATION.values() for ps in rows}


def fit_h200(results_dir=results.RESULTS_DIR) -> GpuParams:
    """H200 (132 SMs) fitted on H200_CALIBRATION's rows and the calibration timelines of results_dir."""
    gemm_rows = newest_gemm_rows(results_dir)
    comm = newest_comm_rows(results_dir)
    base = GpuParams(
        name="h200", num_sms=132,
        tile_tflops_per_sm={p: 1.0 for p in PROBLEMS},
        hbm_read_gbs=1.0, hbm_write_gbs=1.0, link_gbs=1.0, link_efficiency={"push": 1.0, "pull": 1.0},
        launch_ns=0.0, fence_ns=0.0, **H200_ASSUMED)
    # GEMM: one rate per problem such that the simulated kimi uniform grouped GEMM takes the
    # measured time (the makespan scales as 1/rate).
    shape_name, routing = H200_CALIBRATION["gemm"]
    rates = {}
    for r in gemm_rows:
        if (r["shape"], r["routing"]) == (shape_name, routing):
            ns_at_one = grouped_gemm_ns(base, r["problem"], gemm_rows_per_expert(r), get_shape(r["shape"]),
                                        pairs=kernel_of(r)["gemm_pairs"])
            rates[r["problem"]] = ns_at_one / (r["ours"]["median_ms"] * 1e6)
    # HBM: a copy of B bytes reads and writes B: 1/copy = 1/read + 1/write; a push dispatch on
    # one GPU reads each token row once and writes K rows: t = tokens/read + pairs/write.
    shape_name, ep, _ = H200_CALIBRATION["hbm"]
    row = comm_row(comm, "virtual", shape_name, ep, {"dispatch": "push"})
    b = comm_bytes(row)
    t_ns = stage_ms(row, "dispatch") * 1e6
    inv_copy = 1.0 / row["copy_ceiling_gbs"]
    # tokens*(inv_copy - 1/w) + pairs/w = t  ->  1/w = (t - tokens*inv_copy) / (pairs - tokens)
    inv_write = (t_ns - b["tokens"] * inv_copy) / (b["pairs"] - b["tokens"])
    hbm_write, hbm_read = 1.0 / inv_write, 1.0 / (inv_copy - inv_write)
    # Row moves (one GPU): a pull dispatch, a push and a pull combine copy each (token, choice)
    # row once; efficiency = bytes copied / (that run's copy ceiling x time), median of the three.
    shape_name, ep = H200_CALIBRATION["row_move"]
    moves = [comm_row(comm, "virtual", shape_name, ep, {op: d}) for op, d in ROW_MOVES]
    row_eff = float(np.median([comm_bytes(r)["pairs"] / (r["copy_ceiling_gbs"] * stage_ms(r, op) * 1e6)
                               for r, (op, _) in zip(moves, ROW_MOVES)]))
    # Link (2 x H200, one peer): stage = launch + (pull: rtt | push: fence + 1 peer's signal)
    # + remote bytes / (link * efficiency); the 4-byte-row stages give the fixed parts.
    shape_name = H200_CALIBRATION["link"]
    push = comm_row(comm, "nvshmem", shape_name, 2, {"dispatch": "push"})
    pull = comm_row(comm, "nvshmem", shape_name, 2, {"dispatch": "pull"})
    launch = stage_ms(pull, "dispatch", signal=True) * 1e6 - base.rtt_ns
    fence = stage_ms(push, "dispatch", signal=True) * 1e6 - launch - base.signal_ns_per_peer
    link = push["link_ceiling_gbs"]
    eff = {}
    for d, r, fixed in (("push", push, launch + fence + base.signal_ns_per_peer), ("pull", pull, launch + base.rtt_ns)):
        eff[d] = comm_bytes(r)["remote"] / (link * (stage_ms(r, "dispatch") * 1e6 - fixed))
    nccl = results.newest(results.load("bench_nccl_baseline", results.machine_dir(2, results_dir)))
    nccl_eff = {op: float(np.median([n["pct_of_link"][op] for n in nccl])) / 100 for op in ("dispatch", "combine")} if nccl else {}
    micro = dataclasses.replace(
        base, tile_tflops_per_sm=rates, hbm_read_gbs=hbm_read, hbm_write_gbs=hbm_write, link_gbs=link,
        link_efficiency=eff, launch_ns=launch, fence_ns=fence, nccl_link_efficiency=nccl_eff,
        row_move_efficiency=row_eff)
    # Sustained load, busy-stream kernel boundaries and the token sums from the sequential layer's
    # stages of one shape; then the fused kernel's in-kernel copies and token tasks from timelines.
    fitted = fused.calibrate(layer.calibrate(micro, H200_CALIBRATION["layer"], results_dir), results_dir)
    return dataclasses.replace(fitted, note=NOTE.format(gpu="h200"))


def h200_sources() -> dict:
    """What each group of h200's parameters is fitted on (selectors of results/ rows and timeline
    index rows; a calibration file's "sources")."""
    gemm_shape, routing = H200_CALIBRATION["gemm"]
    hbm_shape, hbm_ep, direction = H200_CALIBRATION["hbm"]
    move_shape, move_ep = H200_CALIBRATION["row_move"]
    newest_comm = "the newest run of each backend"
    sources = {
        "gemm": {"results": "bench_gemm.jsonl", "rows": "the newest of each (shape, routing, problem)",
                 "where": {"shape": gemm_shape, "routing": routing}, "fits": ["tile_tflops_per_sm"]},
        "hbm": {"results": "bench_comm.jsonl", "rows": newest_comm, "stage": "dispatch",
                "where": {"backend": "virtual", "shape": hbm_shape, "ep": hbm_ep, "dispatch": direction},
                "fits": ["hbm_read_gbs", "hbm_write_gbs"]},
        "row_move": {"results": "bench_comm.jsonl", "rows": newest_comm, "stages": [list(m) for m in ROW_MOVES],
                     "where": {"backend": "virtual", "shape": move_shape, "ep": move_ep},
                     "fits": ["row_move_efficiency"]},
        "link": {"results": "x2/bench_comm.jsonl", "rows": newest_comm, "stages": [["dispatch", "push"], ["dispatch", "pull"]],
                 "where": {"backend": "nvshmem", "shape": H200_CALIBRATION["link"], "ep": 2},
                 "fits": ["link_gbs", "link_efficiency", "launch_ns", "fence_ns"]},
        "nccl": {"results": "x2/bench_nccl_baseline.jsonl", "rows": "the newest run", "fits": ["nccl_link_efficiency"]},
        "layer": {"results": "bench_layer.jsonl", "rows": "the newest run of the shape among the compared rows "
                  "(sim.layer.compared_rows)", "where": {"shape": H200_CALIBRATION["layer"], "schedule": "sequential"},
                  "stages": {f: [list(ps) for ps in stages] for f, stages in layer.LAYER_CALIBRATION.items()}},
        "assumed": sorted(H200_ASSUMED),
    }
    for key, (tasks, fits) in fused.FUSED_CALIBRATION.items():
        sources[key] = {"timeline": {"sim_calibrates": key}, "tasks": tasks, "fits": list(fits)}
    return sources


CALIBRATIONS = {"h200": (fit_h200, h200_sources)}  # GPU parameter set -> (fit on results/, its sources)


def calibration(gpu: str, results_dir=results.RESULTS_DIR) -> dict:
    """The calibration file's document of GPU parameter set `gpu`, fitted on results_dir:
    {"gpu", "written_by", "params" (params.params_to_json), "sources"}."""
    try:
        fit, sources = CALIBRATIONS[gpu]
    except KeyError:
        raise ValueError(f"gpu: no calibration for {gpu!r}; calibrated sets: {', '.join(CALIBRATIONS)}") from None
    return {"gpu": gpu, "written_by": f"python -m mok_proto.sim calibrate --gpu {gpu}",
            "params": params_to_json(fit(results_dir)), "sources": sources()}


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
