"""The fused forward and backward (cuda/fused.cuh) bitwise equal to the sequential GPU layer:
virtual ranks W = 1, 2, 4, 8 in one process and NVSHMEM with 4 processes on one GPU; the checks
are in tests/mpi_programs/check_fused_layer.py. Both backends give the same fused output and, with
--backward, the same fused gradients."""

import pytest

from conftest import run_ranks, run_virtual, sha_digests

pytestmark = pytest.mark.gpu
PROGRAM = "tests/mpi_programs/check_fused_layer.py"


def _virtual(num_ranks, *extra):
    return run_virtual(PROGRAM, num_ranks, f"OK fused layer backend=virtual R={num_ranks}", *extra)


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_virtual_ranks_fused_forward(num_ranks):
    assert len(sha_digests(_virtual(num_ranks))) == 3


BWD_DIGESTS = ["bwd-no-shared", "bwd-one-expert", "bwd-random"]  # `SHA bwd-<case>`: one per case


@pytest.mark.parametrize("num_ranks,replays", [(1, 2), (2, 20), (4, 2), (8, 20)])
def test_virtual_ranks_fused_backward(num_ranks, replays):
    # the backward's checks on its four (reverse-combine, reverse-dispatch) policies, forward + backward
    # graph replays (20 on two W; W = 4 replays 20 in the NVSHMEM comparison) and the backward's error paths
    out = _virtual(num_ranks, "--backward", "--replays", str(replays))
    assert "4 backward policies" in out
    # `replays` replays of each of the 3 cases' graphs: the forward's, and forward + backward's
    assert f"{3 * replays} of the forward, {3 * replays} of forward + backward" in out, out[-3000:]
    missing = 4 if num_ranks > 1 else 0  # a missing peer needs one
    flag = "checked" if num_ranks > 1 else "n/a"  # a peer's missing reverse-dispatch flag needs a peer
    assert (f"OK fused backward errors: counter timeout, peer flag timeout {flag}, missing peer ({missing} "
            "policies), overflow") in out
    assert sorted(key for key in sha_digests(out) if key.startswith("bwd-")) == BWD_DIGESTS


def test_nvshmem_fused_forward_matches_virtual():
    pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")
    proc = run_ranks(4, PROGRAM, "--backend", "nvshmem", "--replays", "3", "--policies", "mok", timeout=900)
    assert "OK fused layer backend=nvshmem R=4" in proc.stdout
    nvshmem = sha_digests(proc.stdout)
    virtual = sha_digests(_virtual(4, "--replays", "1", "--policies", "mok"))
    assert nvshmem and nvshmem == virtual, (nvshmem, virtual)


def test_nvshmem_fused_backward_matches_virtual():
    pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")
    args = ("--backward", "--replays", "20", "--policies", "mok")
    proc = run_ranks(4, PROGRAM, "--backend", "nvshmem", *args, timeout=900)
    assert "OK fused layer backend=nvshmem R=4" in proc.stdout
    assert "60 of the forward, 60 of forward + backward" in proc.stdout  # 20 replays per graph, 3 cases
    assert "OK fused backward errors: counter timeout, peer flag timeout n/a" in proc.stdout
    nvshmem = sha_digests(proc.stdout)
    virtual = sha_digests(_virtual(4, *args))
    assert sorted(key for key in nvshmem if key.startswith("bwd-")) == BWD_DIGESTS, nvshmem
    assert nvshmem == virtual, (nvshmem, virtual)  # the gradients' digests, and the output's
