"""Benchmark harness: warm-ups, one CUDA event pair per stage and iteration, median with p20/p80,
the slowest rank, a copy-bandwidth ceiling measured in the same run, and JSON-lines results."""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def summarize(samples_ms):
    a = np.asarray(samples_ms, dtype=np.float64)
    return {"median_ms": float(np.median(a)), "p20_ms": float(np.percentile(a, 20)),
            "p80_ms": float(np.percentile(a, 80)), "iters": int(a.size)}


def time_stages(enqueue, iters: int, warmup: int):
    """enqueue(mark) enqueues one iteration and calls mark(stage) before each stage and mark(None)
    at the end. Returns {stage: [ms per iteration]} plus 'total'."""
    import cupy

    for _ in range(warmup):
        enqueue(lambda stage: None)
    cupy.cuda.Device().synchronize()
    samples: dict[str, list] = {}
    for _ in range(iters):
        events = []

        def mark(stage):
            ev = cupy.cuda.Event()
            ev.record()
            events.append((stage, ev))

        enqueue(mark)
        events[-1][1].synchronize()
        for (stage, start), (_, stop) in zip(events, events[1:]):
            samples.setdefault(stage, []).append(cupy.cuda.get_elapsed_time(start, stop))
        samples.setdefault("total", []).append(cupy.cuda.get_elapsed_time(events[0][1], events[-1][1]))
    return samples


def copy_ceiling_gbs(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy of nbytes: bytes COPIED per second (read + written is twice that)."""
    import cupy

    src = cupy.ones(nbytes // 4, dtype=np.float32)
    dst = cupy.empty_like(src)
    samples = time_stages(lambda mark: (mark("copy"), dst.__setitem__(Ellipsis, src), mark(None)), iters, 3)
    return nbytes / (np.median(samples["copy"]) * 1e-3) / 1e9


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=RESULTS_DIR.parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def append_result(name: str, record: dict) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.jsonl"
    record = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git": git_sha(), **record}
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return path
