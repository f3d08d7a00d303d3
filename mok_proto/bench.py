"""Benchmark harness: warm-ups, one CUDA event pair per stage and iteration, median with p20/p80,
the slowest rank, a copy-bandwidth ceiling measured in the same run, and JSON-lines results."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def require_gpu(prog: str, need_cupy: bool = True, need_torch: bool = False) -> None:
    """Exit 2 with ONE line (no traceback) unless this machine can run a GPU script: a CUDA device
    seen by CuPy and/or PyTorch, whichever the script uses. Call it after parsing arguments."""
    reason = None
    if need_cupy:
        from mok_proto.symm.gpu import require_cupy

        try:
            require_cupy(who=prog)
        except RuntimeError as e:
            reason = str(e)
    if need_torch and reason is None:
        try:
            import torch
        except Exception as e:  # noqa: BLE001 - any import failure means no torch here
            reason = f"{prog} needs torch (its baselines); torch is not importable ({type(e).__name__}: {e})"
        else:
            reason = None if torch.cuda.is_available() else f"{prog} needs an NVIDIA GPU; torch sees no CUDA device"
    if reason is not None:
        print(f"error: {reason} (install: pip install -c requirements.txt -e '.[gpu,bench]')", file=sys.stderr)
        sys.exit(2)


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
    at the end (work outside the marks is not timed). Returns {stage: [ms per iteration]} plus
    'total' (first mark to last)."""
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
            samples.setdefault(stage, []).append(elapsed(start, stop))
        samples.setdefault("total", []).append(elapsed(events[0][1], events[-1][1]))
    return samples


def rotating(runs: dict):
    """enqueue(mark) for time_stages that runs every entry of `runs` (name -> enqueue one run)
    once per iteration, a stage each, starting one later every iteration (A B, B A, ...). Variants
    timed this way see the same clocks: under its power cap the H200 moved its SM clock between
    1590 and 1980 MHz within 100 ms (nvidia-smi, 2026-12-01), and the same setting timed in two
    blocks one after the other differed by up to 13%."""
    names = list(runs)
    turn = [0]

    def enqueue(mark):
        k = turn[0] % len(names)
        turn[0] += 1
        for name in names[k:] + names[:k]:
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


def copy_ceiling_gbs(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy of nbytes: bytes COPIED per second (read + written is twice that)."""
    import cupy

    src = cupy.ones(nbytes // 4, dtype=np.float32)
    dst = cupy.empty_like(src)
    samples = time_stages(lambda mark: (mark("copy"), dst.__setitem__(Ellipsis, src), mark(None)), iters, 3)
    return nbytes / (np.median(samples["copy"]) * 1e-3) / 1e9


def peer_pull_gbs(heap, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Link ceiling under NVSHMEM: every rank copies nbytes from the next rank's symmetric buffer
    at once (a device copy through the peer mapping), in bytes per second per GPU."""
    import cupy

    buf = heap.alloc("link-ceiling", (nbytes // 4,), np.float32)
    dst = cupy.empty(nbytes // 4, np.float32)
    peer = (heap.rank + 1) % heap.num_ranks
    src = buf.instance(peer)
    heap.barrier()
    samples = time_stages(lambda mark: (mark("pull"), dst.__setitem__(Ellipsis, src), mark(None)), iters, 2)
    heap.free(buf)
    return nbytes / (np.median(samples["pull"]) * 1e-3) / 1e9


DIGEST_ROW_WORDS = 4096  # 32-bit words per fingerprint row of `digest`
# odd 64-bit multipliers, one per word of a row (fixed: digests compare across runs and machines)
_DIGEST_MULTIPLIERS = (np.random.default_rng(0x6D6F6B).integers(0, 2 ** 63, DIGEST_ROW_WORDS, dtype=np.uint64)
                       * np.uint64(2) + np.uint64(1))


def digest(arrays: dict, chunk_rows: int = 1 << 14) -> str:
    """SHA-256 (hex) of named arrays (NumPy or CuPy), for bitwise comparisons of results too large
    to copy to the host (a layer's fp32 weight gradients: tens of GB). Each array's name, dtype and
    shape are hashed with fingerprints of its bytes computed where the array lives: the bytes as
    32-bit words w (zero-padded), in rows of DIGEST_ROW_WORDS, each row's sum of w[i] * m[i] mod
    2^64 with fixed odd multipliers m. Equal arrays give equal digests; a row that differs in one
    word always changes its fingerprint (m[i] odd, |w - w'| < 2^32), and rows that differ in
    several words collide with probability about 2^-64."""
    from mok_proto.validate import array_module

    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        xp = array_module(a)
        h.update(f"{name}:{a.dtype.str}:{tuple(a.shape)};".encode())
        flat = xp.ascontiguousarray(a).reshape(-1).view(xp.uint8)
        words = xp.concatenate([flat, xp.zeros(-flat.size % 4, xp.uint8)]).view(xp.uint32) if flat.size % 4 \
            else flat.view(xp.uint32)
        mult = xp.asarray(_DIGEST_MULTIPLIERS)
        step = chunk_rows * DIGEST_ROW_WORDS
        for start in range(0, words.size, step):
            part = words[start:start + step]
            if part.size % DIGEST_ROW_WORDS:
                part = xp.concatenate([part, xp.zeros(-part.size % DIGEST_ROW_WORDS, xp.uint32)])
            rows = part.reshape(-1, DIGEST_ROW_WORDS).astype(xp.uint64) * mult  # wraps mod 2^64
            sums = rows.sum(axis=1, dtype=xp.uint64)
            h.update((sums.get() if xp is not np else sums).astype("<u8").tobytes())
    return h.hexdigest()


def use_all_cpus() -> None:
    """Let this process run on every CPU (a helper process of an MPI rank inherits the rank's
    binding, often one core)."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # no such call here, or not allowed: keep the binding
        pass


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


def gpu_name(device: int = 0) -> str:
    """The GPU's name as the driver gives it (e.g. "NVIDIA H100 80GB HBM3"), for results rows."""
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


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


# --- Power and clocks (scripts/power_probe.py) ---------------------------------------------------
# nvidia-smi's query, sampled every SMI_PERIOD_MS while one graph replays. clocks_event_reasons is a
# bit mask; SMI_POWER_CAP is its "SW power cap" bit (the board holds its power limit by lowering
# the SM clock).
SMI_QUERY = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"
SMI_PERIOD_MS = 20
SMI_POWER_CAP = 0x4


def smi_command(device: str, period_ms: int | None = SMI_PERIOD_MS) -> list:
    """nvidia-smi sampling SMI_QUERY of one GPU (`device`: its PCI bus id or index) every period_ms
    (None: once)."""
    loop = ["-lms", str(period_ms)] if period_ms else []
    return ["nvidia-smi", "-i", str(device), f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits", *loop]


def smi_samples(lines) -> np.ndarray:
    """nvidia-smi CSV lines of SMI_QUERY as a structured array (t: seconds since the epoch, read as
    this machine's local time like time.time(); sm_mhz; power_w; reasons). Lines that do not parse
    (a header, "[N/A]", a partial last line) are skipped."""
    dtype = np.dtype([("t", "f8"), ("sm_mhz", "f8"), ("power_w", "f8"), ("reasons", "i8")])
    out = []
    for line in lines:
        f = [x.strip() for x in line.split(",")]
        try:
            t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((t, float(f[1]), float(f[2]), int(f[3], 16)))
        except (ValueError, IndexError):
            continue
    return np.array(out, dtype)


SMI_SETTLE_S = 1.0  # power.draw is a one-second average (NVML, Ampere and later): skip a phase's first second


def phase_power(samples: np.ndarray, t0: float, t1: float, settle_s: float = SMI_SETTLE_S) -> dict:
    """Mean SM clock and power of the samples taken in [t0 + settle_s, t1] (a phase of replays of
    one graph; during the first settle_s the averaged power still holds the phase before), and the
    fraction of them under the power cap. ValueError if there is none (the phase was shorter than
    settle_s plus a sampling period, or nvidia-smi gave no sample)."""
    s = samples[(samples["t"] >= t0 + settle_s) & (samples["t"] <= t1)]
    if not len(s):
        raise ValueError(f"no nvidia-smi sample in [{t0 + settle_s:.3f}, {t1:.3f}]: make the phase longer")
    return {"sm_mhz": float(s["sm_mhz"].mean()), "power_w": float(s["power_w"].mean()),
            "power_capped": float(np.mean((s["reasons"] & SMI_POWER_CAP) != 0)), "samples": int(len(s))}
