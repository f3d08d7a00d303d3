"""The GPU layer with FP8 routed experts (sequential and fused passes): virtual ranks W = 1, 2, 4, 8
in one process and NVSHMEM with 2 and 4 processes on one GPU; the checks are in
tests/mpi_programs/check_gpu_fp8_layer.py (every quantization point bitwise, every routed GEMM
within the FP8 GEMM bound, err_rel_rms against the float64 reference, both dispatch dtypes and
rings of several turns bitwise equal). The same global problem gives the same bits on both backends."""

import pytest

from conftest import run_ranks, run_virtual, sha_digests

pytestmark = pytest.mark.gpu
PROGRAM = "tests/mpi_programs/check_gpu_fp8_layer.py"


def _virtual(num_ranks, *extra):
    return run_virtual(PROGRAM, num_ranks, f"OK gpu fp8 layer backend=virtual R={num_ranks}", *extra)


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_virtual_ranks_fp8_layer(num_ranks):
    extra = () if num_ranks == 2 else ("--policies", "mok", "--replays", "3")  # every policy once (W = 2)
    assert len(sha_digests(_virtual(num_ranks, *extra))) == 3


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_nvshmem_fp8_layer_matches_virtual(num_ranks):
    pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")
    proc = run_ranks(num_ranks, PROGRAM, "--backend", "nvshmem", "--replays", "2", "--policies", "mok", timeout=900)
    assert f"OK gpu fp8 layer backend=nvshmem R={num_ranks}" in proc.stdout
    nvshmem = sha_digests(proc.stdout)
    virtual = sha_digests(_virtual(num_ranks, "--replays", "1", "--policies", "mok"))
    assert nvshmem and nvshmem == virtual, (nvshmem, virtual)


def test_demo_fp8_on_the_gpu_virtual_ranks():
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-m", "mok_proto.demo", "--backend", "gpu", "--virtual", "2", "--precision",
                           "fp8", "--dispatch-dtype", "fp8"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "dtype=fp8" in proc.stdout and "dispatch fp8" in proc.stdout and "PASS" in proc.stdout
