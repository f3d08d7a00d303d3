"""The fused forward and backward (cuda/fused.cuh) bitwise equal to the sequential GPU layer:
virtual ranks W = 1, 2, 4, 8 in one process and NVSHMEM with 4 processes on one GPU; the checks
are in tests/mpi_programs/check_fused_layer.py. Both backends give the same fused output."""

import pytest

from conftest import run_ranks, run_virtual, sha_digests

pytestmark = pytest.mark.gpu
PROGRAM = "tests/mpi_programs/check_fused_layer.py"


def _virtual(num_ranks, *extra):
    return run_virtual(PROGRAM, num_ranks, f"OK fused layer backend=virtual R={num_ranks}", *extra)


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_virtual_ranks_fused_forward(num_ranks):
    assert len(sha_digests(_virtual(num_ranks))) == 3


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_virtual_ranks_fused_backward(num_ranks):
    # the backward's checks on its four (reverse-combine, reverse-dispatch) policies
    out = _virtual(num_ranks, "--backward", "--replays", "2")
    assert "4 backward policies" in out


def test_nvshmem_fused_forward_matches_virtual():
    pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")
    proc = run_ranks(4, PROGRAM, "--backend", "nvshmem", "--replays", "3", "--policies", "mok", timeout=900)
    assert "OK fused layer backend=nvshmem R=4" in proc.stdout
    nvshmem = sha_digests(proc.stdout)
    virtual = sha_digests(_virtual(4, "--replays", "1", "--policies", "mok"))
    assert nvshmem and nvshmem == virtual, (nvshmem, virtual)
