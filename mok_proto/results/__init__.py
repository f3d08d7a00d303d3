"""Reading the benchmarks' results under results/ (never re-running them).

Layout: one append-only JSON-lines file per benchmark, `<bench>.jsonl`, per machine folder (results/
for one GPU, results/x2/ for two, ...); every row holds `time`, `git`, `gpu` and the settings and kernel
features it depends on. The fused passes' in-kernel timelines live under results/timelines/ with an
index (`mok_proto.results.timelines`, its names re-exported here).

A *run* is a stretch of rows of one benchmark with the same git stamp and no gap of more than
RUN_GAP between consecutive rows; `newest` keeps the newest run per group (e.g. per backend).
A JSON-lines file is stored plain (`.jsonl`) or gzip-compressed (`.jsonl.gz`); the same name is the
same rows, and what reads or finds one here takes either spelling (`open_text`, `read_text`,
`jsonl_files`).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path

from mok_proto.kernels.features import is_experimental
from mok_proto.results.files import JSONL_SUFFIXES, RESULTS_DIR, jsonl_files, open_text, plain_name, read_text
from mok_proto.results.timelines import (
    INDEX, TIMELINE_EVENTS, TIMELINE_PREFIX, TIMELINE_PREFIXES, TIMELINES, add_timeline, comm_bars_from_ready,
    load_timeline, timeline_events, timeline_file, timeline_files, timeline_index, timeline_name, timeline_summary,
    timelines_dir)

RUN_GAP = timedelta(minutes=10)


def load(name: str, results_dir: Path | str = RESULTS_DIR, experimental: bool = False) -> list[dict]:
    """Rows of <results_dir>/<name>.jsonl with a 'run' label ('<git> <start time>') added; [] if absent.
    Rows of experimental kernel variants (`is_experimental`) only with experimental=True, so that
    the status table, the simulator's fits and its judgements see the default kernels only."""
    path = Path(results_dir) / f"{name}.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if experimental or not is_experimental(r)]
    rows.sort(key=lambda r: r["time"])
    run, last_time, last_git = None, None, None
    for row in rows:
        t = datetime.fromisoformat(row["time"])
        if run is None or row.get("git") != last_git or t - last_time > RUN_GAP:
            run = f"{row.get('git', 'unknown')} {row['time'][:16]}"
        row["run"], last_time, last_git = run, t, row.get("git")
    return rows


def machine_dir(num_gpus: int = 1, results_dir: Path | str = RESULTS_DIR) -> Path:
    """The folder of a machine's results: results/ for one GPU, results/x<N>/ for N GPUs."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be at least 1, got {num_gpus}")
    return Path(results_dir) if num_gpus == 1 else Path(results_dir) / f"x{num_gpus}"


def is_link_check(row: dict) -> bool:
    """Whether a bench_comm row is of its emulated-link check (`--link-gbps`: one row per stage and
    direction, against the 2-GPU run), not of a timed round (a row per policy, its `stages`)."""
    return "stage" in row


def newest(rows: list[dict], group_by: tuple = ()) -> list[dict]:
    """The rows of the newest run of each group (rows share a group when their group_by
    fields are equal)."""
    latest: dict[tuple, str] = {}
    for row in rows:
        key = tuple(row.get(k) for k in group_by)
        latest[key] = max(latest.get(key, ""), row["run"], key=lambda run: run.split(" ", 1)[-1])
    return [r for r in rows if r["run"] == latest[tuple(r.get(k) for k in group_by)]]


__all__ = ["INDEX", "JSONL_SUFFIXES", "RESULTS_DIR", "RUN_GAP", "TIMELINES", "TIMELINE_EVENTS", "TIMELINE_PREFIX",
           "TIMELINE_PREFIXES", "add_timeline", "comm_bars_from_ready", "is_experimental", "is_link_check", "jsonl_files", "load",
           "load_timeline", "machine_dir", "newest", "open_text", "plain_name", "read_text", "timeline_events",
           "timeline_file", "timeline_files", "timeline_index", "timeline_name", "timeline_summary", "timelines_dir"]
