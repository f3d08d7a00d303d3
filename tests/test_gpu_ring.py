"""The GPU layer through a ring of several turns (docs/design.md 3.1) under worst-case routing:
virtual W = 2, 4, 8 and NVSHMEM with 4 processes; the checks are in
tests/mpi_programs/check_gpu_ring.py."""

import pytest

from conftest import run_ranks, run_virtual

pytestmark = pytest.mark.gpu
PROGRAM = "tests/mpi_programs/check_gpu_ring.py"


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_virtual_ring_worst_case_routing(num_ranks):
    policies = "all" if num_ranks == 2 else "mok"
    run_virtual(PROGRAM, num_ranks, f"OK gpu ring worst case backend=virtual R={num_ranks}", "--policies", policies,
                "--replays", "2")


def test_nvshmem_ring_worst_case_routing_four_processes():
    pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")
    proc = run_ranks(4, PROGRAM, "--backend", "nvshmem", "--policies", "mok", "--replays", "1", timeout=900)
    assert "OK gpu ring worst case backend=nvshmem R=4" in proc.stdout, proc.stdout
