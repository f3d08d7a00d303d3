"""GPU communication round: virtual ranks W = 1, 2, 4, 8 in one process and
NVSHMEM with 4 processes on one GPU; see tests/mpi_programs/check_gpu_comm.py for the checks."""

import subprocess
import sys

import pytest

from conftest import ROOT, run_ranks

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_virtual_ranks_round(num_ranks):
    proc = subprocess.run([sys.executable, "tests/mpi_programs/check_gpu_comm.py", "--backend", "virtual",
                           "--ranks", str(num_ranks)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"OK gpu comm backend=virtual R={num_ranks}" in proc.stdout


def test_nvshmem_round_four_processes():
    pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")
    proc = run_ranks(4, "tests/mpi_programs/check_gpu_comm.py", "--backend", "nvshmem", "--replays", "3",
                     timeout=600)
    assert "OK gpu comm backend=nvshmem R=4" in proc.stdout
