"""Reading the benchmarks' JSON lines under results/ (never re-running them).

A *run* is a stretch of rows of one benchmark with the same git stamp and no gap of more than
RUN_GAP between consecutive rows; `newest` keeps the newest run per group (e.g. per backend).
"""

from __future__ import annotations

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
