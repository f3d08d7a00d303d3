"""Results rows: one JSON line per row, appended to results/<name>.jsonl, stamped with the time and commit."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parents[2] / "results"


def git_sha() -> str:
    """The commit the results come from: $MOK_GIT_SHA when set (a copy of the tree on another
    machine may carry a stale .git: set it there to `git describe --always --dirty` of the source
    checkout), else `git describe` of this checkout."""
    if os.environ.get("MOK_GIT_SHA"):
        return os.environ["MOK_GIT_SHA"]
    try:
        # "-dirty" when the measured tree differs from the commit (e.g. a copy on the GPU machine)
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                              text=True, cwd=RESULTS_DIR.parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def append_result(name: str, record: dict, results_dir: Path | str = RESULTS_DIR) -> Path:
    """Append one JSON line (time and git stamp first) to <results_dir>/<name>.jsonl."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.jsonl"
    record = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git": git_sha(), **record}
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return path
