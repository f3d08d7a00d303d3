"""Command lines a new user types: ./run's options, the demo's refusals and help, the scripts' --help."""

import importlib.util
import subprocess
import sys

import pytest

from conftest import ROOT, rank_env, run_ranks
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
                 "--gpu {h200,gb300-nvl72}", "(default gb300-nvl72)", "--pass {fwd,bwd}", "(default fwd)",
                 "communicating SMs (default 40; with --fused 0", "receive rows per minibatch (default 2048; with --fused 1024",
                 "--assign {round_robin,balanced}", "(default round_robin forward, balanced backward)",
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
    (["--gpu", "h100"], "argument --gpu: invalid choice: 'h100'"),
    (["--pass", "both"], "argument --pass: invalid choice: 'both'"),
    (["--sequential", "--fused"], "--sequential and --fused name two plans: give one"),
    (["--claim", "3"], "--claim applies to the megakernel's plan: add --fused"),
    (["--fused", "--claim", "-1"], "claim must be an int >= 0 or one of all, tail, got '-1'"),
    (["--policy", "dispatch=both"], "policy: dispatch must be push or pull"),
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
                      "combine=push,rev_combine=pull,rev_dispatch=push (default), comm-sms 0 (default), minibatch 256, "
                      "assign round_robin (default), raster row (default), claim all (default)"), header
    assert main(["--shape", "tile", "--ep", "2", "--gpu", "h200", "--pass", "bwd", "--comm-sms", "8",
                 "--policy", "dispatch=push"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header == ("# shape tile, ep 2, gpu h200, pass bwd, plan fixed_split, policy dispatch=push,"
                      "combine=push,rev_combine=pull,rev_dispatch=push, comm-sms 8, minibatch 2048 (default)"), header
