"""Command lines a new user types: ./run's options, the demo's refusals and help, the scripts' --help."""

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import ROOT, alone_reason, gpu_reason, rank_env, run_ranks
from mok_proto import demo
from mok_proto.config import PRESETS, RunConfig
from mok_proto.demo import estimate_bytes

SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


@pytest.mark.parametrize("args,message", [
    (["-n", "0"], "-n must be a positive integer (the number of ranks), got '0'"),
    (["-n", "-1"], "-n must be a positive integer (the number of ranks), got '-1'"),
    (["-n", "abc"], "-n must be a positive integer (the number of ranks), got 'abc'"),
    (["--shape", "tiny", "-n", "2x"], "got '2x'"),  # -n after other options is still ./run's
    (["--shape", "tiny", "-n"], "-n needs a value"),
])
def test_run_demo_bad_rank_count_one_line_exit_2(args, message):
    proc = subprocess.run([str(ROOT / "run"), "demo", *args], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


# Option values the demo refuses before MPI starts (the issue's `--seed -1` reached the ranks: four
# numpy tracebacks, exit 3; `--timeout 1e10` a traceback on every rank; `--shape=` ran the default).
BAD_DEMO_OPTIONS = [
    (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--seed=-5"], "--seed must be an integer >= 0, got -5"),
    (["--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
    (["--timeout", "0"], "--timeout must be a number of seconds > 0 and <= 1e+06, got 0"),
    (["--timeout", "-2"], "--timeout must be a number of seconds > 0 and <= 1e+06, got -2"),
    (["--timeout", "nan"], "got nan"),
    (["--timeout", "inf"], "got inf"),
    (["--timeout", "1e10"], "got 1e+10"),
    (["--timeout", "abc"], "argument --timeout: invalid float value: 'abc'"),
    (["--shape="], "shape: unknown preset ''"),
    (["--routing", "zipf"], "--routing must be random, skewed or one-expert, got 'zipf'"),
    (["--dtype", "float16"], "dtype must be one of float32, float64, got 'float16'"),
    (["--policy", "dispatch=pull,dispatch=push"], "--policy names dispatch more than once"),
    (["--policy", "dispatch"], "policy: expected operator=direction, got 'dispatch'"),
    (["--virtual", "-1"], "--virtual R runs R ranks in one process: a positive count"),
]


@pytest.fixture
def no_mpi_start(monkeypatch):
    """A demo run that got past its checks would start MPI in this process: fail instead."""
    def refuse(rank):
        raise AssertionError("the demo accepted the options and went on to start MPI")

    monkeypatch.setattr("mok_proto.symm.watchdog.LastResort", refuse)
    monkeypatch.setenv("UCX_LOG_LEVEL", os.environ.get("UCX_LOG_LEVEL", "error"))  # demo.main sets it: undone after
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("args,message", BAD_DEMO_OPTIONS, ids=[" ".join(a) for a, _ in BAD_DEMO_OPTIONS])
def test_demo_bad_option_value_one_line_exit_2_on_rank_0_only(args, message, no_mpi_start, monkeypatch, capsys):
    argv = ["--backend", "cpu", *args]  # the CPU's checks on any machine
    assert demo.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("mok_proto.demo: error: ") and message in err, err
    monkeypatch.setenv("PMI_RANK", "1")  # any other rank of the job says nothing
    assert demo.main(argv) == 2
    assert capsys.readouterr() == ("", "")


def test_demo_good_option_values_pass_the_checks(no_mpi_start):
    """The edges of the accepted values get as far as starting MPI (here: the stand-in's AssertionError)."""
    for args in (["--seed", "0"], ["--seed", str(2**70)], ["--timeout", "1e6"], ["--timeout", "0.5"],
                 ["--policy", "dispatch=push,combine=pull"], ["--policy", ""]):
        with pytest.raises(AssertionError, match="start MPI"):
            demo.main(["--backend", "cpu", *args])


@pytest.mark.mpi
def test_demo_negative_seed_one_line_from_four_ranks():
    proc = run_ranks(4, "-m", "mok_proto.demo", "--seed", "-1", expect_rc=2)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert lines == ["mok_proto.demo: error: --seed must be an integer >= 0, got -1"], lines


@pytest.mark.mpi
def test_paper_shape_on_cpu_refused_in_one_line():
    proc = run_ranks(4, "-m", "mok_proto.demo", "--shape", "kimi-k2.7", "--backend", "cpu", expect_rc=2)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert "kimi-k2.7 on the cpu backend needs about" in lines[0] and "GiB limit" in lines[0], lines


def test_memory_estimate_grows_with_the_shape():
    """The refusal compares this estimate with the memory limit: it must see the weights' size."""
    small, kimi = (estimate_bytes(RunConfig(PRESETS[name], num_ranks=4)) for name in ("small", "kimi-k2.7"))
    weights = 3 * 384 * 7168 * 2048 * 4  # kimi's routed expert weights in float32, held by every rank
    assert small < 2**27 and kimi > weights


@pytest.mark.mpi
def test_demo_help_printed_once_and_says_what_auto_does():
    proc = run_ranks(3, "-m", "mok_proto.demo", "-h")
    assert proc.stdout.count("usage:") == 1, proc.stdout
    assert "auto: the GPU when CuPy sees one" in " ".join(proc.stdout.split())


def test_demo_gpu_backend_without_a_gpu_is_one_line():
    """On a machine without CuPy/GPU, --backend gpu (and --virtual) refuse in one line, exit 2."""
    from mok_proto.symm.gpu import require_cupy

    try:
        require_cupy()
    except RuntimeError:
        pass
    else:
        pytest.skip("a GPU is present: the GPU backend runs (tests/test_gpu_layer.py)")
    for extra in (["--backend", "gpu"], ["--virtual", "2"]):
        proc = subprocess.run([sys.executable, "-m", "mok_proto.demo", *extra], capture_output=True, text=True,
                              cwd=ROOT, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "GPU" in lines[0], (extra, proc.stderr)


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_help_needs_no_gpu_package(script):
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT,
                          env=rank_env(), timeout=60)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_without_gpu_says_so_in_one_line(script):
    if importlib.util.find_spec("cupy") or importlib.util.find_spec("torch"):
        pytest.skip("cupy or torch is installed here: whether a script runs depends on the GPU")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT,
                          env=rank_env(), timeout=60)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert script.name in lines[0] and "needs" in lines[0] and "Traceback" not in proc.stderr


def test_gpu_check_help_runs_nothing():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--help"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0 and "One command for a GPU session" in proc.stdout and "[gpu_check]" not in proc.stderr


def _gpu_check(tmp_path, nvidia_smi_says: str):
    """Run gpu_check.sh --no-bench with a stand-in nvidia-smi and this Python as python3."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{nvidia_smi_says}\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               MOK_WHEELS=str(tmp_path / "no-wheels"),  # not the checkout's .whl/, which a developer may have
               PYTEST_ADDOPTS="--assert=plain")  # the inner pytest only collects and skips: no assert rewriting
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--no-bench"], capture_output=True,
                          text=True, env=env, timeout=300)


def test_gpu_check_without_a_gpu_fails_in_one_line_and_runs_nothing(tmp_path):
    proc = _gpu_check(tmp_path, "echo 'No devices were found'; exit 6")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "[gpu_check] no GPU here: nvidia-smi -L lists none (or is not installed); nothing was run"], proc.stderr
    assert not (tmp_path / "out").exists()


def test_gpu_check_fails_when_every_gpu_test_skipped(tmp_path):
    """nvidia-smi sees a GPU but the tests cannot use it (e.g. no CuPy): 163 skipped is a failure."""
    if gpu_reason() is None:
        pytest.skip("CuPy sees a GPU here: the GPU tests would run")
    proc = _gpu_check(tmp_path, "echo 'GPU 0: stand-in (UUID: GPU-0)'")
    assert proc.returncode == 1, proc.stderr
    reason = [line for line in proc.stderr.splitlines() if "no GPU test passed" in line]
    assert len(reason) == 1 and "skipped" in reason[0], proc.stderr
    assert "passed" not in (tmp_path / "out" / "gpu_tests.txt").read_text().splitlines()[-1]


def test_gpu_alone_tests_run_only_on_a_gpu_of_their_own():
    """Under several pytest-xdist workers a `gpu_alone` test skips (another worker's kernels would
    time-slice with what it times); gpu_check.sh runs those after the parallel pass, on one."""
    assert alone_reason(1) is None
    assert "6 pytest workers" in alone_reason(6) and "-m gpu_alone" in alone_reason(2)
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert "python3 -m pytest -m gpu_alone" in script


def test_bench_gemm_unknown_problem_refused_before_any_gpu_work():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gemm.py"), "--problems", "down,dwon"],
                          capture_output=True, text=True, cwd=ROOT, env=rank_env(), timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "unknown problem(s) dwon" in proc.stderr and "gate_up_wgrad" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gemm.py"), "--problems", ","],
                          capture_output=True, text=True, cwd=ROOT, env=rank_env(), timeout=60)
    assert proc.returncode == 2 and "--problems names no problem" in proc.stderr, proc.stderr


def test_sim_cli_fused_backward_against_the_sequential_plan(capsys):
    """`--fused --pass bwd` simulates plan.fused_backward (it used to refuse), and --vs-sequential
    prints the sequential plan's time of the same pass and the ratio of the two printed times."""
    import re

    from mok_proto.sim.__main__ import main

    args = ["--shape", "qwen3.5-397b", "--ep", "64", "--gpu", "h200", "--pass", "bwd", "--comm-sms", "8",
            "--minibatch", "4096"]
    assert main(args + ["--fused", "--vs-sequential"]) == 0
    header, out = capsys.readouterr().out.split("\n", 1)
    assert out.startswith("fused_backward bwd: qwen3.5-397b R=64"), out
    fused_us = float(re.search(r"h200: ([\d.]+) us", out).group(1))
    seq_us, ratio = (float(v) for v in re.search(r"sequential plan: ([\d.]+) us; x sequential ([\d.]+)", out).groups())
    assert ratio == pytest.approx(seq_us / fused_us, abs=0.006) and seq_us != fused_us
    assert main(args + ["--sequential"]) == 0  # the baseline is this pass's sequential plan
    header, out = capsys.readouterr().out.split("\n", 1)
    assert out.startswith("sequential bwd: qwen3.5-397b R=64"), out
    assert float(re.search(r"h200: ([\d.]+) us", out).group(1)) == seq_us
    assert main(args + ["--sequential", "--vs-sequential"]) == 2  # nothing to compare
    assert "drop --sequential" in capsys.readouterr().err


SIM = [sys.executable, "-m", "mok_proto.sim"]


def test_sim_help_shows_every_default_and_choice():
    proc = subprocess.run([*SIM, "--help"], capture_output=True, text=True, cwd=ROOT, env=rank_env(), timeout=60)
    text = "".join(proc.stdout.split())  # (argparse wraps long values anywhere)
    assert proc.returncode == 0, proc.stderr
    for want in ("--shape {kimi-k2.7,glm-5.2,qwen3.5-397b,deepseek-v4-pro,", "(default kimi-k2.7)", "(default 64)",
                 "--gpu {h200,h100,gb300-nvl72}", "(default gb300-nvl72)", "--pass {fwd,bwd}", "(default fwd)",
                 "communicating SMs (default 40; with --fused 0", "receive rows per minibatch (default 2048; with --fused 1024",
                 "--assign {round_robin,balanced,balanced_all}", "(default round_robin forward, balanced backward)",
                 "--raster {row,col}", "an int >= 0, all or tail (default all forward, tail backward)",
                 "(default MoK's: dispatch=pull,combine=push,rev_combine=pull,rev_dispatch=push)"):
        assert "".join(want.split()) in text, want


@pytest.mark.parametrize("args,message", [
    (["--ep", "0"], "--ep must be a positive divisor of kimi-k2.7's 384 experts, got 0"),
    (["--ep", "-64"], "--ep must be a positive divisor of kimi-k2.7's 384 experts, got -64"),
    (["--ep", "5"], "--ep must be a positive divisor of kimi-k2.7's 384 experts, got 5"),
    (["--ep", "abc"], "argument --ep: invalid int value: 'abc'"),
    (["--minibatch", "0"], "--minibatch must be >= 1 and --comm-sms >= 0, got 0 and 40"),
    (["--fused", "--minibatch", "0"], "--minibatch must be >= 1 and --comm-sms >= 0, got 0 and 0"),
    (["--sequential", "--comm-sms", "-8"], "--minibatch must be >= 1 and --comm-sms >= 0, got 2048 and -8"),
    (["--fused", "--minibatch", "100"], "minibatch_rows must be a multiple of 256"),
    (["--shape", "kimi"], "argument --shape: invalid choice: 'kimi'"),
    (["--gpu", "a100"], "argument --gpu: invalid choice: 'a100'"),
    (["--pass", "both"], "argument --pass: invalid choice: 'both'"),
    (["--sequential", "--fused"], "--sequential and --fused name two plans: give one"),
    (["--claim", "3"], "--claim applies to the megakernel's plan: add --fused"),
    (["--fused", "--claim", "-1"], "claim must be an int >= 0 or one of all, tail, got '-1'"),
    (["--policy", "dispatch=both"], "policy: dispatch must be push or pull"),
    (["--routing", "hot"], "argument --routing: routing must be uniform, zipf:ALPHA (ALPHA > 0) or hot:FRACTION"),
    (["--routing", "zipf:0"], "got 'zipf:0'"),
    (["--routing", "hot:1.5"], "got 'hot:1.5'"),
    (["--validate", "--routing", "hot:0.5"], "--validate compares the measured rows of uniform routing"),
])
def test_sim_bad_input_one_line_exit_2(args, message, capsys):
    from mok_proto.sim.__main__ import main

    try:
        rc = main(args)
    except SystemExit as e:  # argparse's refusals
        rc = e.code
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and not captured.out and len(lines) == 1 and message in lines[0], (rc, captured)
    assert lines[0].startswith("python -m mok_proto.sim: error: ")


def test_sim_header_names_every_setting_and_its_defaults(capsys):
    from mok_proto.sim.__main__ import main

    assert main(["--shape", "tile", "--ep", "2", "--gpu", "h200", "--fused", "--minibatch", "256"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header == ("# shape tile, ep 2, gpu h200, pass fwd (default), plan fused, policy dispatch=pull,"
                      "combine=push,rev_combine=pull,rev_dispatch=push (default), routing uniform (default), "
                      "comm-sms 0 (default), minibatch 256, assign round_robin (default), raster row (default), "
                      "claim all (default), segment-rows 128 (default)"), header
    assert main(["--shape", "tile", "--ep", "2", "--gpu", "h200", "--pass", "bwd", "--comm-sms", "8",
                 "--policy", "dispatch=push"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header == ("# shape tile, ep 2, gpu h200, pass bwd, plan fixed_split, policy dispatch=push,"
                      "combine=push,rev_combine=pull,rev_dispatch=push, routing uniform (default), comm-sms 8, "
                      "minibatch 2048 (default)"), header
