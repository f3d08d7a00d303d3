"""The plan helper processes of a benchmark."""

from __future__ import annotations

import os


def use_all_cpus() -> None:
    """Let this process run on every CPU (a helper process of an MPI rank inherits the rank's
    binding, often one core)."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # no such call here, or not allowed: keep the binding
        pass
