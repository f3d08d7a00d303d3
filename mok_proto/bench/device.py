"""What this machine can run: a CUDA device seen by CuPy and/or PyTorch, its name, the MPI stack,
and the CPUs a process may use."""

from __future__ import annotations

import os
import sys


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


def gpu_name() -> str | None:
    """The current GPU's name as the driver gives it (e.g. "NVIDIA H100 80GB HBM3"), for results
    rows: CuPy's, else torch's; None where neither sees a GPU."""
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - no CuPy or no device here: ask torch
        pass
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no torch either: the row says so
        return None


def require_mpi_stack() -> None:
    """Exit 2 with one line unless mpi4py and nvshmem4py import (after require_gpu)."""
    for module, what in (("mpi4py", "mpi4py (the ranks)"), ("nvshmem.core", "nvshmem4py (nvshmem4py-cu13)")):
        try:
            __import__(module)
        except Exception as e:  # noqa: BLE001 - any import failure means it is not usable here
            print(f"error: bench_layer_mpi.py needs {what}; import {module} failed ({type(e).__name__}: {e}); "
                  f"without them only --single R runs", file=sys.stderr)
            sys.exit(2)


def use_all_cpus() -> None:
    """Let this process run on every CPU (a helper process of an MPI rank inherits the rank's
    binding, often one core)."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # no such call here, or not allowed: keep the binding
        pass
