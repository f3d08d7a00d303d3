"""Results rows: one JSON line per row, appended to results/<name>.jsonl, each stamped with where it
comes from: the time, the commit, the GPU, the command line, and the kernel features it ran with."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from mok_proto.bench.device import gpu_name
from mok_proto.kernels.features import kernel_features

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


def command_line(argv=None) -> str:
    """The command this process runs (sys.argv: the script, relative to the checkout when inside it,
    and its arguments), as a shell would take it."""
    argv = list(sys.argv if argv is None else argv)
    if argv:
        script = Path(argv[0]).resolve()
        if script.is_relative_to(RESULTS_DIR.parent):
            argv[0] = str(script.relative_to(RESULTS_DIR.parent))
    return shlex.join(argv)


def stamp() -> dict:
    """Where a row comes from: the time, the commit, the GPU, the command line, the kernel features."""
    return {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "git": git_sha(),
            "gpu": gpu_name(), "command": command_line(), **kernel_features()}


def append_result(name: str, record: dict, results_dir: Path | str = RESULTS_DIR) -> Path:
    """Append one JSON line to <results_dir>/<name>.jsonl: the stamp first, then `record` (whose
    fields win over the stamp's)."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.jsonl"
    record = {**stamp(), **record}
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return path
