"""The GPU layer (bf16, stage by stage): virtual ranks W = 1, 2, 4, 8 in one process and NVSHMEM
with 2 and 4 processes on one GPU; the checks are in tests/mpi_programs/check_gpu_layer.py. The
same global problem gives bitwise-identical results on both backends."""

import subprocess
import sys

import pytest

from conftest import ROOT, run_ranks, run_virtual, sha_digests

pytestmark = pytest.mark.gpu
PROGRAM = "tests/mpi_programs/check_gpu_layer.py"


def _virtual(num_ranks, *extra):
    return run_virtual(PROGRAM, num_ranks, f"OK gpu layer backend=virtual R={num_ranks}", *extra)


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_virtual_ranks_layer(num_ranks):
    assert len(sha_digests(_virtual(num_ranks))) == 4


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_nvshmem_layer_matches_virtual(num_ranks):
    pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")
    proc = run_ranks(num_ranks, PROGRAM, "--backend", "nvshmem", "--replays", "3", "--policies", "mok", timeout=900)
    assert f"OK gpu layer backend=nvshmem R={num_ranks}" in proc.stdout
    nvshmem = sha_digests(proc.stdout)
    virtual = sha_digests(_virtual(num_ranks, "--replays", "1", "--policies", "mok"))
    assert nvshmem and nvshmem == virtual, (nvshmem, virtual)


def test_demo_on_the_gpu_virtual_ranks():
    proc = subprocess.run([sys.executable, "-m", "mok_proto.demo", "--backend", "gpu", "--virtual", "4"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "backend=gpu (virtual ranks in one process)" in proc.stdout and "PASS" in proc.stdout


def test_demo_on_the_gpu_nvshmem_two_processes():
    pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")
    proc = run_ranks(2, "-m", "mok_proto.demo", "--backend", "gpu", timeout=600)
    assert "backend=gpu (NVSHMEM, one process per rank)" in proc.stdout and "PASS" in proc.stdout
