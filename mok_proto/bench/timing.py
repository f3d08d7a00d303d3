"""Timing on the GPU: warm-ups, one CUDA event pair per stage and iteration, median with p20/p80,
the slowest rank, and runs interleaved so that variants see the same clocks."""

from __future__ import annotations

import numpy as np


def summarize(samples_ms):
    a = np.asarray(samples_ms, dtype=np.float64)
    return {"median_ms": float(np.median(a)), "p20_ms": float(np.percentile(a, 20)),
            "p80_ms": float(np.percentile(a, 80)), "iters": int(a.size)}


def slowest_rank(stats: dict, comm) -> dict:
    """Replace each stage's median, p20 and p80 by the largest over the ranks of `comm` (None: one
    process): every statistic is the slowest rank's."""
    if comm is not None:
        from mpi4py import MPI

        for st in stats.values():
            for key in ("median_ms", "p20_ms", "p80_ms"):
                st[key] = comm.allreduce(st[key], op=MPI.MAX)
    return stats


def _events(api: str):
    """(new timing event, synchronize the device, elapsed ms between two events) of CuPy or PyTorch."""
    if api == "torch":
        import torch

        return (lambda: torch.cuda.Event(enable_timing=True)), torch.cuda.synchronize, lambda a, b: a.elapsed_time(b)
    if api == "cupy":
        import cupy

        return cupy.cuda.Event, cupy.cuda.runtime.deviceSynchronize, cupy.cuda.get_elapsed_time
    raise ValueError(f"event api must be cupy or torch, got {api!r}")


def time_stages(enqueue, iters: int, warmup: int, api: str = "cupy"):
    """enqueue(mark) enqueues one iteration and calls mark(stage) before each stage and mark(None)
    at its end (a stage runs to the next mark; work after a mark(None) and before the next stage's
    mark is not timed). Returns {stage: [ms per iteration]} plus 'total' (first mark to last, gaps
    included)."""
    new_event, synchronize, elapsed = _events(api)
    for _ in range(warmup):
        enqueue(lambda stage: None)
    synchronize()
    samples: dict[str, list] = {}
    for _ in range(iters):
        events = []

        def mark(stage):
            ev = new_event()
            ev.record()
            events.append((stage, ev))

        enqueue(mark)
        events[-1][1].synchronize()
        for (stage, start), (_, stop) in zip(events, events[1:]):
            if stage is not None:
                samples.setdefault(stage, []).append(elapsed(start, stop))
        samples.setdefault("total", []).append(elapsed(events[0][1], events[-1][1]))
    return samples


def rotating(runs: dict, before=None):
    """enqueue(mark) for time_stages that runs every entry of `runs` (name -> enqueue one run)
    once per iteration, a stage each, starting one later every iteration (A B, B A, ...). Variants
    timed this way see the same clocks: under its power cap a GPU moves its SM clock within one
    pass's time, so variants timed in blocks one after the other differ by the clock's moves.
    before: called before each run, outside every stage (untimed: an L2 flush, say): the run
    before it is closed first (mark(None))."""
    names = list(runs)
    turn = [0]

    def enqueue(mark):
        k = turn[0] % len(names)
        turn[0] += 1
        for i, name in enumerate(names[k:] + names[:k]):
            if before is not None:
                if i:
                    mark(None)
                before()
            mark(name)
            runs[name]()
        mark(None)

    return enqueue


def paired_ratio(numerator, denominator) -> float:
    """Median over iterations of numerator[i] / denominator[i] (samples of one rotating run: the
    two runs of an iteration are neighbours in time)."""
    a, b = np.asarray(numerator, np.float64), np.asarray(denominator, np.float64)
    if a.shape != b.shape or not a.size:
        raise ValueError(f"paired samples must have one equal, nonzero length, got {a.shape} and {b.shape}")
    return float(np.median(a / b))

