"""Protocol tests under real mpiexec ranks: symmetric-memory conformance, the distributed layer
against the reference for every direction policy, and the demo's CLI contract."""

import re

import pytest

from conftest import check_case, run_cases, run_ranks

pytestmark = pytest.mark.mpi

# H,I,E,K,N,num_shared -- E divisible by every R used with it
LAYER_CASES = [
    ("16,8,12,2,5,1", "random", (1, 2, 3, 4)),
    ("24,8,12,3,7,0", "random", (2, 3)),  # no shared expert, H not a power of two
    ("16,8,12,2,5,1", "one-expert", (2, 4)),  # every token's first choice on expert 0
    ("16,8,12,2,1,1", "random", (3,)),  # one token per rank: most experts get nothing
    ("8,4,4,4,3,1", "random", (2,)),  # K = E
    ("16,8,24,4,9,1", "skewed", (4,)),
]


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_symm_conformance_cpu(num_ranks):
    proc = run_ranks(num_ranks, "tests/mpi_programs/check_symm.py", "--backend", "cpu")
    assert f"OK symm conformance backend=cpu R={num_ranks}" in proc.stdout


@pytest.mark.parametrize("shape,routing,num_ranks",
                         [pytest.param(s, r, n, marks=pytest.mark.xdist_group(f"check_layer_R{n}"))
                          for s, r, ranks in LAYER_CASES for n in ranks])
def test_layer_matches_reference_all_policies(shape, routing, num_ranks):
    """Every case of one rank count in one job (the first of its tests starts it)."""
    proc = run_cases(num_ranks, "tests/mpi_programs/check_layer.py",
                     *[f"{s}:{r}" for s, r, ranks in LAYER_CASES if num_ranks in ranks])
    check_case(proc, f"OK R={num_ranks} {shape} routing={routing}: 16 policies x 2 runs bitwise equal",
               f"case {shape} routing={routing} on {num_ranks} ranks", f"{shape}:{routing}")


def _demo_rows(stdout):
    rows = re.findall(r"^\s*(\d+)\s+[\d.]+\s+[\d.]+\s+([\d.e+-]+)\s+\(\S+\)\s+([0-9a-f]{16})\s+([0-9a-f]{16})$",
                      stdout, flags=re.M)
    return {int(r): (float(err), out, grads) for r, err, out, grads in rows}


def test_demo_checksums_equal_across_policies():
    mok = run_ranks(4, "-m", "mok_proto.demo", "--seed", "7")
    flipped = run_ranks(4, "-m", "mok_proto.demo", "--seed", "7", "--policy",
                        "dispatch=push,combine=pull,rev_combine=push,rev_dispatch=pull")
    a, b = _demo_rows(mok.stdout), _demo_rows(flipped.stdout)
    assert sorted(a) == [0, 1, 2, 3], mok.stdout
    assert "PASS" in mok.stdout and "PASS" in flipped.stdout
    assert {r: v[1:] for r, v in a.items()} == {r: v[1:] for r, v in b.items()}
    assert len({v[1] for v in a.values()}) == 4, "ranks hold different tokens, so different outputs"
    other_seed = _demo_rows(run_ranks(4, "-m", "mok_proto.demo", "--seed", "8").stdout)
    assert other_seed[0][1] != a[0][1], "the checksum must depend on the data"


def test_demo_fp8_prints_err_rel_rms_and_dispatch_dtype_moves_no_bit():
    procs = {d: run_ranks(2, "-m", "mok_proto.demo", "--precision", "fp8", "--dispatch-dtype", d)
             for d in ("bf16", "fp8")}
    rows = {d: _demo_rows(p.stdout) for d, p in procs.items()}
    assert sorted(rows["bf16"]) == [0, 1] and all("PASS" in p.stdout for p in procs.values())
    assert "rel_rms_err" in procs["bf16"].stdout and "dispatch fp8" in procs["fp8"].stdout
    assert rows["bf16"] == rows["fp8"]  # the same codes, whoever quantizes
    # an FP8 layer's error is that of e4m3, far above bf16's and within the recipe's bound
    from mok_proto.accuracy import ERR_REL_RMS_RECIPE
    assert all(0.01 < err <= ERR_REL_RMS_RECIPE for err, _, _ in rows["bf16"].values())
    # bf16 weight gradients: the same output, other gradients
    proc = run_ranks(2, "-m", "mok_proto.demo", "--precision", "fp8", "--wgrad-precision", "bf16")
    bf16_wgrads = _demo_rows(proc.stdout)
    assert "PASS" in proc.stdout and "weight gradients bf16" in proc.stdout
    assert all(bf16_wgrads[r][1] == rows["bf16"][r][1] and bf16_wgrads[r][2] != rows["bf16"][r][2] for r in (0, 1))


@pytest.mark.parametrize("args,message", [
    (["--precision", "fp16"], "--precision and --dispatch-dtype must be one of"),
    (["--wgrad-precision", "bf16"], "--wgrad-precision needs --precision fp8"),
    (["--precision", "fp8", "--wgrad-precision", "e4m3"], "wgrad_precision must be None or one of bf16, fp8"),
    (["--policy", "dispatch=sideways"], "dispatch must be push or pull"),
    (["--policy", "gather=pull"], "unknown operator 'gather'"),
    (["--shape", "huge"], "unknown preset 'huge'"),
    (["--backend", "tpu"], "--backend must be one of"),
    (["--nonsense"], "unrecognized arguments"),
])
def test_demo_bad_argument_one_line_exit_2(args, message):
    proc = run_ranks(2, "-m", "mok_proto.demo", *args, expect_rc=2)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_demo_ranks_not_dividing_experts_exit_2():
    proc = run_ranks(5, "-m", "mok_proto.demo", expect_rc=2)  # small has E=24
    assert "not divisible" in proc.stderr


def test_demo_error_never_hides_a_nan():
    import numpy as np

    from mok_proto.demo import rel_error

    ref = np.ones((2, 3))
    assert rel_error(ref, ref) == 0.0
    bad = ref.copy()
    bad[1, 2] = np.nan
    assert rel_error(bad, ref) == float("inf")
    assert rel_error(ref * 1.5, ref) == 0.5


# H,I,E,K,N,num_shared, R: El = E/R >= K (worst-case routing puts every choice on rank 0)
RING_CASES = [("16,8,8,2,12,1", 2), ("16,8,16,3,9,1", 4), ("8,4,24,3,5,0", 8)]


SKEWED_RING = "16,8,8,2,12,1:skewed:all"  # on 2 ranks, in one job with the worst case of 2 ranks


def ring_job(num_ranks):
    """check_ring.py's cases of num_ranks ranks in one job."""
    cases = [f"{s}:worst-case:some" for s, n in RING_CASES if n == num_ranks]
    return run_cases(num_ranks, "tests/mpi_programs/check_ring.py", *cases, *[SKEWED_RING] * (num_ranks == 2))


@pytest.mark.parametrize("shape,num_ranks", [pytest.param(s, n, marks=pytest.mark.xdist_group(f"check_ring_R{n}"))
                                             for s, n in RING_CASES])
def test_ring_worst_case_routing_bitwise_equal(shape, num_ranks):
    """Every token's every choice on rank 0: rings of a quarter of its rows and of one segment run
    forward and backward (replaying) and give the bits of a ring that holds everything."""
    check_case(ring_job(num_ranks), f"OK R={num_ranks} {shape} routing=worst-case",
               f"case {shape} routing=worst-case on {num_ranks} ranks", f"{shape}:worst-case:some")


@pytest.mark.xdist_group("check_ring_R2")
def test_ring_skewed_routing_all_policies():
    proc = ring_job(2)
    check_case(proc, "OK R=2 16,8,8,2,12,1 routing=skewed: ", "case 16,8,8,2,12,1 routing=skewed on 2 ranks",
               SKEWED_RING)
    assert "16 policies bitwise equal to one turn" in proc.stdout, proc.stdout
