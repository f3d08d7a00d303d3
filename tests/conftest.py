"""Shared test helpers: how to launch ranks, and when GPU / MPI tests must skip (with a reason)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def find_mpiexec():
    """The launcher next to this Python (the mpich wheel's), else one on PATH; None if absent."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def mpiexec_cmd(num_ranks: int, *args: str) -> list[str]:
    launcher = find_mpiexec()
    if launcher is None:
        pytest.skip("no mpiexec/mpirun found (install the mpich wheel: ./run test does)")
    cmd = [launcher, "-n", str(num_ranks)]
    version = subprocess.run([launcher, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--allow-run-as-root", "--oversubscribe"]
    return cmd + [sys.executable, *args]


def rank_env() -> dict:
    """The environment ranks run in: this checkout importable, no NVLink multicast, quiet UCX, one
    OpenBLAS thread (several ranks share the cores)."""
    return dict(os.environ, UCX_LOG_LEVEL="error", NVSHMEM_DISABLE_NVLS="1", NCCL_NVLS_ENABLE="0",
                OPENBLAS_NUM_THREADS="1",
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def remove_stale_mpich_segments(shm_dir: Path = Path("/dev/shm"), min_age_s: float = 60.0) -> list[Path]:
    """Remove MPICH's shared-memory segments (mpich_shm_*) that no live process maps and that are
    older than min_age_s; return them. A rank killed by a signal (the tests that stop or kill one)
    never unlinks its job's segments, so they pile up run after run (4 MB each); with hundreds of
    them, two 4-rank jobs at once (pytest's workers) saw a rank SIGKILLed after the demo's PASS
    about one job in eight, and none once they were gone. A segment a job still maps, or one
    created in the last min_age_s (a job starting), is left alone."""
    now = time.time()
    old = []
    for path in shm_dir.glob("mpich_shm_*"):
        try:
            if now - path.stat().st_mtime > min_age_s:
                old.append(path)
        except OSError:
            continue
    if not old:
        return []
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(maxsplit=5)[-1] for line in maps.read_text().splitlines()
                          if "mpich_shm_" in line)
        except OSError:  # a process that ended, or one of another user
            continue
    removed = [path for path in old if str(path) not in mapped]
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def run_ranks(num_ranks: int, *args: str, timeout: float = 180, expect_rc: int | None = 0):
    """Run `python args...` on num_ranks ranks; return the CompletedProcess (checked against expect_rc)."""
    remove_stale_mpich_segments()
    proc = subprocess.run(mpiexec_cmd(num_ranks, *args), capture_output=True, text=True, timeout=timeout,
                          env=rank_env(), cwd=ROOT)
    if expect_rc is not None and proc.returncode != expect_rc:
        raise AssertionError(f"exit {proc.returncode} (expected {expect_rc}) from {' '.join(args)} on "
                             f"{num_ranks} ranks\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    return proc


@functools.cache
def run_cases(num_ranks: int, program: str, *cases: str):
    """`program --case C ...` on num_ranks ranks: every case in one job, each printing its OK line;
    the CompletedProcess whatever its exit (check_case reads it). Cached: the tests of those cases
    share the job (put them in one xdist group)."""
    return run_ranks(num_ranks, program, *[arg for case in cases for arg in ("--case", case)], expect_rc=None)


def check_case(proc, ok_line: str, case: str, token: str):
    """The case (`token`, as run_cases passed it) passed in run_cases' job: its OK line printed, and
    a job that failed names another case (`FAILED CASE`: a later one; a rank may fail after rank 0's
    OK line, and a failure naming no case, e.g. at exit, fails every case of the job)."""
    failed = set(re.findall(r"^FAILED CASE (\S+)$", proc.stderr, re.M))
    ok = ok_line in proc.stdout and (proc.returncode == 0 or (failed and token not in failed))
    assert ok, (f"{case} not OK (job exit {proc.returncode}, failed cases {sorted(failed)})\n--- stdout\n"
                f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")


def gpu_reason() -> str | None:
    """None if CuPy sees a GPU, else why GPU tests skip."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means no GPU path here
        return f"cupy is not importable ({type(e).__name__}); GPU tests need an NVIDIA GPU and cupy-cuda13x"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device visible"
    except Exception as e:  # noqa: BLE001
        return f"no usable CUDA device ({e})"
    return None


SHARED_FIXTURES = ("h200_validation",)  # module-scoped and slow: the tests reading one run on one worker


@pytest.hookimpl(tryfirst=True)  # before xdist's loadgroup reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in set(SHARED_FIXTURES) & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group(name))
    gpu_items = [item for item in items if "gpu" in item.keywords]
    reason = gpu_reason() if gpu_items else None
    if reason:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=reason))
    # (xdist's own worker count: the environment variable it sets is inherited by any pytest a worker starts)
    alone = None if reason else alone_reason(int(getattr(config, "workerinput", {}).get("workercount", 1)))
    if alone:
        for item in items:
            if "gpu_alone" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=alone))


def alone_reason(workers: int) -> str | None:
    """Why a `gpu_alone` test skips on one of `workers` pytest workers (None: it runs): the other
    workers' kernels time-slice with the one it times."""
    if workers <= 1:
        return None
    return (f"timed against the clock: needs the GPU alone, and {workers} pytest workers share it; "
            "run `python3 -m pytest -m gpu_alone`")


def sha_digests(stdout: str) -> dict:
    """{case: digest} of the `SHA <case> <digest>` lines a GPU check program prints."""
    return dict(re.findall(r"^SHA (\S+) (\w+)$", stdout, re.M))


def run_virtual(program: str, num_ranks: int, ok_line: str, *extra: str, timeout: float = 900) -> str:
    """Run a GPU check program on `num_ranks` virtual ranks in one process; its stdout (checked:
    exit 0 and `ok_line` printed). The ranks' environment: make_problem's router logits are a BLAS
    matmul whose bits follow OpenBLAS's thread count, so the digests compare with run_ranks'."""
    proc = subprocess.run([sys.executable, program, "--backend", "virtual", "--ranks", str(num_ranks), *extra],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=rank_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ok_line in proc.stdout, proc.stdout[-3000:]
    return proc.stdout


class SiteRecord:
    """Stands in for a wrapper's own ErrorRecord on the CPU (kernels.gemm.site_record needs CuPy)."""

    def __init__(self, site: str):
        self.site, self.ptr = site, 0x5170 + len(site)


@pytest.fixture
def own_records(monkeypatch):
    """The wrappers' own error records are SiteRecords."""
    from mok_proto.kernels import gemm

    monkeypatch.setattr(gemm, "site_record", SiteRecord)


@pytest.fixture
def no_launch(monkeypatch, own_records):
    """The GEMM and quantizer wrappers check their arguments, then launch nothing."""
    from mok_proto.kernels import fp8, gemm

    monkeypatch.setattr(gemm, "launch_grouped", lambda *args: None)
    monkeypatch.setattr(gemm, "tensor_map", lambda *args, **kwargs: 0)
    monkeypatch.setattr(fp8, "_launch_segments", lambda kernel, grid, fields: None)
