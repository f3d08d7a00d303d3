"""Reading the benchmarks' JSON lines under results/ (never re-running them), and the fused
passes' in-kernel timelines (`timeline_files`, `load_timeline`, `timeline_events`, `timeline_summary`):
the forward's by default, the backward's with pass_="bwd" (their own file prefix). A timeline is
stored plain (`.jsonl`, as scripts/bench_layer.py writes it) or gzip-compressed (`.jsonl.gz`, as
results/ keeps them); the same name is the same timeline, and what reads or finds one here takes
either spelling (`open_text`, `read_text`, `jsonl_files`, `timeline_file`).

A *run* is a stretch of rows of one benchmark with the same git stamp and no gap of more than
RUN_GAP between consecutive rows; `newest` keeps the newest run per group (e.g. per backend).
"""

from __future__ import annotations

import gzip
import json
from datetime import datetime, timedelta
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
RUN_GAP = timedelta(minutes=10)


def load(name: str, results_dir: Path | str = RESULTS_DIR) -> list[dict]:
    """Rows of results/<name>.jsonl with a 'run' label ('<git> <start time>') added; [] if absent."""
    path = Path(results_dir) / f"{name}.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["time"])
    run, last_time, last_git = None, None, None
    for row in rows:
        t = datetime.fromisoformat(row["time"])
        if run is None or row.get("git") != last_git or t - last_time > RUN_GAP:
            run = f"{row.get('git', 'unknown')} {row['time'][:16]}"
        row["run"], last_time, last_git = run, t, row.get("git")
    return rows


def newest(rows: list[dict], group_by: tuple = ()) -> list[dict]:
    """The rows of the newest run of each group (rows share a group when their group_by
    fields are equal)."""
    latest: dict[tuple, str] = {}
    for row in rows:
        key = tuple(row.get(k) for k in group_by)
        latest[key] = max(latest.get(key, ""), row["run"], key=lambda run: run.split(" ", 1)[-1])
    return [r for r in rows if r["run"] == latest[tuple(r.get(k) for k in group_by)]]


# The two spellings of a JSON-lines file: plain, and gzip-compressed (the same rows).
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


def open_text(path: Path | str):
    """A .jsonl file opened for reading text; a .jsonl.gz one gunzipped."""
    path = Path(path)
    return gzip.open(path, "rt") if path.suffix == ".gz" else path.open()


def read_text(path: Path | str) -> str:
    """The text of a .jsonl file; of a .jsonl.gz one, gunzipped."""
    with open_text(path) as f:
        return f.read()


def plain_name(path: Path | str) -> str:
    """A file's name as written, whichever way it is stored: `x.jsonl.gz` -> `x.jsonl`."""
    return Path(path).name.removesuffix(".gz")


def jsonl_files(directory: Path | str, pattern: str) -> list[Path]:
    """The files `<pattern>.jsonl` and `<pattern>.jsonl.gz` under directory (pattern: a Path.glob
    pattern without the suffix, e.g. "**/timeline_fused_*"), one per name (the plain .jsonl where
    both exist), sorted by their plain path."""
    found = {}
    for suffix in reversed(JSONL_SUFFIXES):  # the .gz first: a plain .jsonl of the same name replaces it
        for path in Path(directory).glob(pattern + suffix):
            found[path.with_name(plain_name(path))] = path
    return [found[plain] for plain in sorted(found)]


# scripts/bench_layer.py --timeline: <prefix><shape>[_<git>].jsonl, one prefix per pass (results/
# keeps them as .jsonl.gz)
TIMELINE_PREFIXES = {"fwd": "timeline_fused_fwd_", "bwd": "timeline_fused_bwd_"}
TIMELINE_PREFIX = TIMELINE_PREFIXES["fwd"]


def timeline_files(results_dir: Path | str = RESULTS_DIR, pass_: str = "fwd") -> list[Path]:
    """The measured in-kernel timelines of the fused forward (pass_="bwd": backward) under
    results/ (.jsonl or .jsonl.gz: `jsonl_files`), by name."""
    return jsonl_files(results_dir, f"{TIMELINE_PREFIXES[pass_]}*")


def timeline_file(name: str, results_dir: Path | str = RESULTS_DIR) -> Path:
    """The file of timeline `name` (`<prefix><shape>[_<git>].jsonl`, or that + .gz) in results_dir:
    the plain .jsonl if it exists, else the .jsonl.gz."""
    plain = Path(results_dir) / plain_name(name)
    for path in (plain, plain.with_name(plain.name + ".gz")):
        if path.exists():
            return path
    raise FileNotFoundError(f"no timeline {plain.name} (nor {plain.name}.gz) in {plain.parent}")


def timeline_name(path: Path | str) -> tuple[str, str]:
    """(shape, git stamp or "") of a timeline file `<prefix><shape>[_<git>].jsonl[.gz]` of either
    pass (shape names hold no underscore)."""
    name = plain_name(path)
    prefix = next((p for p in TIMELINE_PREFIXES.values() if name.startswith(p)), TIMELINE_PREFIX)
    stem = name[len(prefix):].removesuffix(".jsonl")
    shape, _, git = stem.partition("_")
    return shape, git


def load_timeline(path: Path | str):
    """A timeline's JSON lines (.jsonl or .jsonl.gz) as mok_proto.trace records (TRACE_DTYPE; `kind`
    is the TaskKind name lower-cased in the file), in file order (the plan's task order; `claimed`
    False where the file has none: files before 99c90df ran no pool, and the stored ones bench_layer
    wrote at 99c90df and b0e48a6, before it recorded the field, were annotated from their plans). The role
    is the task's (comm for a mover task: a transfer's chunk or the token gradients, as
    GpuMoELayer.forward_timeline records it now;
    older files gave every task of a compute CTA the compute role, spare warps' transfers included;
    files before communication tasks carried their chunk count in col_tile get it from their tasks)."""
    import numpy as np

    from mok_proto.plan import COMM_KINDS, MOVER_KINDS, TaskKind
    from mok_proto.trace import ROLES, TRACE_DTYPE

    rows = [json.loads(line) for line in read_text(path).splitlines() if line.strip()]
    rec = np.zeros(len(rows), TRACE_DTYPE)
    for name in TRACE_DTYPE.names:
        values = [r.get(name, False) if name == "claimed" else r[name] for r in rows]  # (no pool before 99c90df)
        rec[name] = [int(TaskKind[v.upper()]) for v in values] if name == "kind" else values
    comm = np.isin(rec["kind"], [int(k) for k in COMM_KINDS])
    rec["role"] = np.where(np.isin(rec["kind"], [int(k) for k in MOVER_KINDS]), ROLES.index("comm"),
                           ROLES.index("compute"))
    # files before communication tasks carried their chunk count (col_tile) have -1 there: every
    # minibatch's transfer then had one chunk per task of it
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
    `kinds`: per task kind (name) the summed task time per compute lane (`per_lane_ns`) and its
    span (`first_ns`, `last_ns`). Tasks that took no time (past the real rows) are left out.
    The tail, over the lanes with GEMM time: `lane_end_min_ns` / `lane_end_max_ns`, the earliest
    and latest of the lanes' last GEMM ends; `tail_idle_mean_ns`, the mean time from a lane's last
    GEMM end to the makespan; `end_busy_corr`, the correlation of a lane's last end with its GEMM
    time (near 1: the lanes that end last are those that worked longest, not those that waited;
    None with fewer than two lanes or no spread; 0.85-1.00 in the timelines of 491ec86). With no
    lane's GEMM time the three tail times are 0.0."""
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
    busy, ends, covers = [], [], []
    for lane in lanes:
        mine = gemm[gemm["block"] == lane]
        mine = mine[np.argsort(mine["start_ns"], kind="stable")]
        covered, end = 0.0, -np.inf
        for s, e in zip(mine["start_ns"].tolist(), mine["end_ns"].tolist()):
            covered += max(0.0, e - max(s, end))  # the part of [s, e) after everything before it
            end = max(end, e)
        busy.append(covered / makespan)
        if len(mine):
            ends.append(float(end - t0))
            covers.append(covered)
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
            "kinds": kinds, "lane_end_min_ns": min(ends, default=0.0), "lane_end_max_ns": max(ends, default=0.0),
            "tail_idle_mean_ns": float(makespan - np.mean(ends)) if ends else 0.0, "end_busy_corr": corr}
