"""The fused passes' measured in-kernel timelines: results/timelines/<name>.jsonl.gz, one JSON record
per plan task (scripts/bench_layer.py --timeline, scripts/sweep_overlap.py), and the index
results/timelines/index.jsonl, one row per file:

    file, bench, pass, shape, git, time, gpu: the file and the run that traced it;
    comm_mover, wait_spin, scale_traffic: the kernel features of that run (as its benchmark rows);
    comm_blocks, minibatch_rows, segment_rows, claim_pairs: the plan it ran;
    precision, dispatch_dtype: an FP8 layer's ("fp8" experts); absent for a BF16 layer;
    png: its picture beside it, where kept;
    sim_compared: true when `python -m mok_proto.sim --validate` compares it with its simulated plan;
    sim_calibrates: the h200 parameters fitted on it (a key of mok_proto.sim.calibrate.SOURCES);
    sim_explained: {timeline event: why the model misses it}, rows shown but not judged.

Code finds a timeline through the index (`timeline_index`, `timeline_files`), never by its name.
Readers: `load_timeline`, `timeline_events`, `timeline_summary`.
"""

from __future__ import annotations

import functools
import gzip
import json
import operator
import shutil
from pathlib import Path

from mok_proto.kernels.features import is_experimental
from mok_proto.results.files import RESULTS_DIR, open_text, plain_name, read_text

TIMELINES = "timelines"  # results/<TIMELINES>/: the timelines and their index
INDEX = "index.jsonl"
# scripts/bench_layer.py --timeline names its files <prefix><shape>[_<git>].jsonl, one prefix per pass
TIMELINE_PREFIXES = {"fwd": "timeline_fused_fwd_", "bwd": "timeline_fused_bwd_"}
TIMELINE_PREFIX = TIMELINE_PREFIXES["fwd"]


def timelines_dir(results_dir: Path | str = RESULTS_DIR) -> Path:
    """The folder of the timelines and their index under results_dir."""
    return Path(results_dir) / TIMELINES


def timeline_index(results_dir: Path | str = RESULTS_DIR, pass_: str | None = None, **where) -> list[dict]:
    """The index's rows ([] without an index), in its order, each with `path` (its file) added; only
    those of pass_ (when given) whose fields equal `where` (e.g. sim_calibrates="fused"), and none of
    an experimental kernel variant (features.is_experimental)."""
    path = timelines_dir(results_dir) / INDEX
    if not path.exists():
        return []
    if pass_ is not None:
        where["pass"] = pass_
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [dict(r, path=path.parent / r["file"]) for r in rows
            if not is_experimental(r) and all(r.get(k) == v for k, v in where.items())]


def timeline_files(results_dir: Path | str = RESULTS_DIR, pass_: str = "fwd") -> list[Path]:
    """bench_layer's timelines of the fused forward (pass_="bwd": backward) in the index, by name."""
    return sorted((r["path"] for r in timeline_index(results_dir, pass_, bench="bench_layer")), key=lambda p: p.name)


def timeline_file(name: str, results_dir: Path | str = RESULTS_DIR) -> Path:
    """The file of timeline `name` (`x.jsonl`, or that + .gz) in results_dir's timelines folder: the plain
    .jsonl if it exists, else the .jsonl.gz."""
    plain = timelines_dir(results_dir) / plain_name(name)
    for path in (plain, plain.with_name(plain.name + ".gz")):
        if path.exists():
            return path
    raise FileNotFoundError(f"no timeline {plain.name} (nor {plain.name}.gz) in {plain.parent}")


def add_timeline(path: Path | str, results_dir: Path | str = RESULTS_DIR, pass_: str | None = None, **fields) -> dict:
    """Store a written timeline (a .jsonl or .jsonl.gz file) gzipped in results_dir's timelines folder
    and append its index row, {"file": the stored name, "pass": pass_, **fields} (the fields of the
    module doc); returns the row. Raises FileExistsError when the index names that file already."""
    if pass_ is not None:
        fields = {"pass": pass_, **fields}
    path, folder = Path(path), timelines_dir(results_dir)
    name = plain_name(path) + ".gz"
    if any(r["file"] == name for r in timeline_index(results_dir)):
        raise FileExistsError(f"{folder / INDEX} already holds {name}")
    folder.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        shutil.copyfile(path, folder / name)
    else:
        with path.open("rb") as src, gzip.open(folder / name, "wb") as dst:
            shutil.copyfileobj(src, dst)
    row = {"file": name, **fields}
    with (folder / INDEX).open("a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def timeline_name(path: Path | str) -> tuple[str, str]:
    """(shape, git stamp or "") of a file named as scripts/bench_layer.py names timelines,
    `<prefix><shape>[_<git>].jsonl[.gz]`, of either pass (shape names hold no underscore)."""
    name = plain_name(path)
    prefix = next((p for p in TIMELINE_PREFIXES.values() if name.startswith(p)), TIMELINE_PREFIX)
    stem = name[len(prefix):].removesuffix(".jsonl")
    shape, _, git = stem.partition("_")
    return shape, git


def load_timeline(path: Path | str):
    """A timeline's JSON lines (.jsonl or .jsonl.gz) as mok_proto.trace records (TRACE_DTYPE; `kind`
    is the TaskKind name lower-cased in the file), in file order (the plan's task order). `claimed`
    is False where the file has no such field (kernels without a claimed pool). The role is the
    task's (comm for a mover task: a transfer's chunk, the scale or the token gradients), whatever
    the file says (older files gave every task of a compute CTA the compute role). Communication
    tasks of files that did not record their chunk count (col_tile -1) get it from their tasks.
    Read files are cached per (path, size, modification time); each call returns its own copy."""
    path = Path(path)
    stat = path.stat()
    return _load_timeline(str(path.resolve()), stat.st_size, stat.st_mtime_ns).copy()


@functools.lru_cache(maxsize=64)
def _load_timeline(path: str, size: int, mtime_ns: int):
    import numpy as np

    from mok_proto.plan import COMM_KINDS, MOVER_KINDS, TaskKind
    from mok_proto.trace import ROLES, TRACE_DTYPE

    rows = json.loads("[" + ",".join(line for line in read_text(path).splitlines() if line.strip()) + "]")
    rec = np.zeros(len(rows), TRACE_DTYPE)
    for name in TRACE_DTYPE.names:
        if name == "claimed":
            rec[name] = [r.get(name, False) for r in rows]
            continue
        values = list(map(operator.itemgetter(name), rows))
        if name == "kind":
            ids = {v: int(TaskKind[v.upper()]) for v in set(values)}
            values = list(map(ids.__getitem__, values))
        rec[name] = values
    comm = np.isin(rec["kind"], [int(k) for k in COMM_KINDS])
    rec["role"] = np.where(np.isin(rec["kind"], [int(k) for k in MOVER_KINDS]), ROLES.index("comm"),
                           ROLES.index("compute"))
    # without a recorded chunk count (col_tile -1), every minibatch's transfer had one chunk per task of it
    old = np.flatnonzero(comm & (rec["col_tile"] == -1))
    if len(old):
        _, inverse, counts = np.unique(np.stack([rec["kind"][old], rec["minibatch"][old]], axis=1), axis=0,
                                       return_inverse=True, return_counts=True)
        rec["col_tile"][old] = counts[inverse.ravel()]
    return rec


def comm_bars_from_ready(path: Path | str) -> bool:
    """Whether a timeline's communication bars start when their task's wait is met (files written
    since the marker `comm_bars_from: ready`), not when the task began waiting (older files)."""
    with open_text(path) as f:
        first = f.readline()
    return bool(first.strip()) and json.loads(first).get("comm_bars_from") == "ready"


TIMELINE_EVENTS = ("dispatch end", "compute end", "kernel end")


def timeline_events(records) -> dict:
    """{TIMELINE_EVENTS: ns from the first task's start} of timeline records (measured or
    simulated): the last dispatch's end (0 without one), the last GEMM tile's end, the last task's
    end (the kernel's)."""
    import numpy as np

    from mok_proto.plan import MOVER_KINDS, TaskKind

    t0 = records["start_ns"].min()
    comm = np.isin(records["kind"], [int(k) for k in MOVER_KINDS])
    dispatch = records["kind"] == int(TaskKind.DISPATCH)
    return {"dispatch end": float(records["end_ns"][dispatch].max() - t0) if dispatch.any() else 0.0,
            "compute end": float(records["end_ns"][~comm].max() - t0),
            "kernel end": float(records["end_ns"].max() - t0)}


def timeline_summary(records) -> dict:
    """Where a fused pass's time went, from its timeline (measured or simulated records):
    `makespan_ns` (first start to last end); `busy_mean` / `busy_min`: per compute lane (SM), the
    time covered by its GEMM tasks (the union of their intervals: a tile's loads overlap the
    previous tile's epilogue) as a fraction of the makespan, averaged / the least busy lane;
    `mover_lanes`, the CTAs that moved rows, and `mover_busy_mean_ns` / `mover_busy_max_ns`, the
    time their mover tasks covered, averaged / the busiest (beside `busy_mean` * makespan, the GEMM
    time of a lane: where the movers' is the longer, the pass waits on its movers, not its GEMMs);
    `kinds`: per task kind (name) the summed task time per compute lane (`per_lane_ns`) and its
    span (`first_ns`, `last_ns`). Tasks that took no time (past the real rows) are left out.
    The tail, over the lanes with GEMM time: `lane_end_min_ns` / `lane_end_max_ns`, the earliest
    and latest of the lanes' last GEMM ends; `tail_idle_mean_ns`, the mean time from a lane's last
    GEMM end to the makespan; `end_busy_corr`, the correlation of a lane's last end with its GEMM
    time (near 1: the lanes that end last are those that worked longest, not those that waited;
    None with fewer than two lanes or no spread). With no lane's GEMM time the three tail times are 0.0."""
    import numpy as np

    from mok_proto.plan import MOVER_KINDS, TaskKind

    took = records["end_ns"] > records["start_ns"]
    if not took.any():
        raise ValueError("timeline_summary: no task took any time")
    rec = records[took]
    t0 = rec["start_ns"].min()
    makespan = float(rec["end_ns"].max() - t0)
    is_gemm = ~np.isin(records["kind"], [int(k) for k in MOVER_KINDS])
    lanes = np.unique(records["block"][is_gemm])  # a lane whose tiles all took no time counts, idle
    gemm = records[took & is_gemm]

    def covered(tasks) -> tuple[float, float]:  # the union of the tasks' intervals, and its end
        tasks = tasks[np.argsort(tasks["start_ns"], kind="stable")]
        total, end = 0.0, -np.inf
        for s, e in zip(tasks["start_ns"].tolist(), tasks["end_ns"].tolist()):
            total += max(0.0, e - max(s, end))  # the part of [s, e) after everything before it
            end = max(end, e)
        return total, end

    busy, ends, covers = [], [], []
    for lane in lanes:
        mine = gemm[gemm["block"] == lane]
        total, end = covered(mine)
        busy.append(total / makespan)
        if len(mine):
            ends.append(float(end - t0))
            covers.append(total)
    moves = records[took & ~is_gemm]
    mover = [covered(moves[moves["block"] == lane])[0] for lane in np.unique(moves["block"])]
    kinds = {}
    for kind in np.unique(rec["kind"]):
        sel = rec[rec["kind"] == kind]
        kinds[TaskKind(int(kind)).name.lower()] = {
            "per_lane_ns": float((sel["end_ns"] - sel["start_ns"]).sum() / max(len(lanes), 1)),
            "first_ns": float(sel["start_ns"].min() - t0), "last_ns": float(sel["end_ns"].max() - t0)}
    corr = None
    if len(ends) > 1 and np.ptp(ends) > 0 and np.ptp(covers) > 0:
        corr = float(np.corrcoef(ends, covers)[0, 1])
    return {"makespan_ns": makespan, "compute_lanes": int(len(lanes)),
            "busy_mean": float(np.mean(busy)) if busy else 0.0, "busy_min": float(np.min(busy)) if busy else 0.0,
            "kinds": kinds, "mover_lanes": len(mover),
            "mover_busy_mean_ns": float(np.mean(mover)) if mover else 0.0, "mover_busy_max_ns": max(mover, default=0.0),
            "lane_end_min_ns": min(ends, default=0.0), "lane_end_max_ns": max(ends, default=0.0),
            "tail_idle_mean_ns": float(makespan - np.mean(ends)) if ends else 0.0, "end_busy_corr": corr}
