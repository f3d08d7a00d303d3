"""The benchmark scripts as command-line tools over mok_proto.bench: each opens its docstring with
its command line, stays thin, imports no other script, shows its bars' defaults in --help and
refuses a bad bar in one line; results rows carry their stamp (mok_proto.bench.rows)."""

import ast
import json
import subprocess
import sys

import pytest

from conftest import ROOT, rank_env
from mok_proto.bench.cli import Bar, parse_bars

SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


def run(script: str, *args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True,
                          cwd=ROOT, env=rank_env(), timeout=60)


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_is_a_thin_tool_that_opens_with_its_command_line(script):
    text = script.read_text()
    tree = ast.parse(text)
    first = ast.get_docstring(tree, clean=False).split("\n")[0]
    assert f"python scripts/{script.name}" in first, first  # the exact command, first
    assert len(text.splitlines()) < 400
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {s.stem for s in SCRIPTS}, "a script imports another script"
    assert "sys.path" not in text


def test_library_modules_stay_under_700_lines():
    for path in (ROOT / "mok_proto" / "bench").glob("*.py"):
        assert len(path.read_text().splitlines()) < 700, path.name


@pytest.mark.parametrize("script,bars", [
    ("bench_layer.py", ["fwd_x_torch=1 (at least", "schedule_ms=0.05 (at most", "fused_bwd_x_torch=1.6",
                        "link_fused_fwd_x_seq=1.15", "link_overlap_fwd=0.8", "link_overlap_bwd=0.8"]),
    ("bench_layer_mpi.py", ["fused_fwd_x_torch=1.5", "fused_bwd_x_torch=1.4"]),
    ("bench_gemm.py", ["gate_up_x_torch=0.9", "down_bwd_x_torch=0.85", "gate_up_wgrad_x_torch=0.8"]),
])
def test_help_lists_every_bar_with_its_default_and_a_bad_bar_is_one_line(script, bars):
    proc = run(script, "--help")
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and all(bar in text for bar in bars), text
    assert "(default: 20)" in text or "(default: 10)" in text  # --iters' default, shown
    for bad, message in (("nope=1", "--bar: 'nope=1' is not KEY=VALUE"),
                         (bars[0].split("=")[0] + "=fast", "is not a finite number")):
        proc = run(script, "--bar", bad)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize("args,message", [
    (["--link-gbps", "0"], "--link-gbps, --link-latency-us: link gbps must be a finite number > 0"),
    (["--link-gbps", "368,x"], "--link-gbps: 'x' is not a number of GB/s"),
    (["--link-gbps", "368", "--link-latency-us", "-1"], "link latency_us must be a finite number >= 0"),
    (["--link-gbps", "368", "--timeline", "results/t_{pass_}_{shape}.jsonl"], "the template needs {link}"),
])
def test_bench_layer_link_options_refused_in_one_line(args, message):
    proc = run("bench_layer.py", *args)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize("script", ["bench_layer.py", "bench_layer_mpi.py"])
def test_routing_refused_in_one_line_naming_the_forms(script):
    for bad in ("zipf", "hot:0", "hot:1.01", "zipf:-1", "uniform:1", "skewed"):
        proc = run(script, "--routing", bad)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, lines
        assert "argument --routing: routing must be uniform, zipf:ALPHA (ALPHA > 0) or hot:FRACTION " in lines[0]
        assert repr(bad) in lines[0], lines
    help_text = " ".join(run(script, "--help").stdout.split())
    assert "--routing SPEC" in help_text and "(default: uniform)" in help_text


def test_bars_parse_and_judge():
    bars = {"x_seq": Bar(1.1, "x sequential"), "ms": Bar(0.05, "a time", at_most=True)}
    got = parse_bars(["x_seq=1.2", " ms = 0.1 ,x_seq=1.3"], bars)  # repeated and comma-separated; the last wins
    assert got == {"x_seq": Bar(1.3, "x sequential"), "ms": Bar(0.1, "a time", at_most=True)}
    assert parse_bars([], bars) == bars and bars["x_seq"].value == 1.1  # the defaults are not changed
    for bad in (["x_seq"], ["x_seq=1", "y=2"], ["x_seq=nan"], ["ms=inf"], ["ms="]):
        with pytest.raises(ValueError, match="--bar"):
            parse_bars(bad, bars)
    floor, ceiling = bars["x_seq"], bars["ms"]
    assert floor.met(1.1) and not floor.met(1.09) and ceiling.met(0.05) and not ceiling.met(0.051)
    assert not floor.met(None) and not floor.met(float("nan")) and not ceiling.met(None)  # not measured: not met
    assert str(floor) == ">= 1.1" and str(ceiling) == "<= 0.05"


def test_rows_carry_their_stamp(tmp_path, monkeypatch):
    from mok_proto.bench import rows

    monkeypatch.setattr(sys, "argv", [str(ROOT / "scripts" / "bench_layer.py"), "--shapes", "kimi-k2.7", "--bar",
                                      "fwd_x_torch=1.2"])
    monkeypatch.setattr(rows, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    path = rows.append_result("bench_x", {"shape": "kimi-k2.7", "median_ms": 1.5}, tmp_path)
    rows.append_result("bench_x", {"shape": "glm-5.2", "wait_spin": "plain"}, tmp_path)
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert list(first)[:7] == ["time", "git", "gpu", "command", "comm_mover", "wait_spin", "scale_traffic"]
    assert first["gpu"] == "NVIDIA H100 80GB HBM3" and first["git"] == rows.git_sha()
    assert first["command"] == "scripts/bench_layer.py --shapes kimi-k2.7 --bar fwd_x_torch=1.2"
    from mok_proto.kernels.features import CURRENT
    from mok_proto.sim.params import KERNEL  # what the simulator takes a row without them for: the same place

    assert {k: first[k] for k in CURRENT} == CURRENT == KERNEL == {
        "comm_mover": "warps", "wait_spin": "backoff", "scale_traffic": "stream"}
    assert first["median_ms"] == 1.5 and second["wait_spin"] == "plain"  # a row's own field wins
    assert rows.command_line(["/elsewhere/x.py", "a b"]) == "/elsewhere/x.py 'a b'"  # quoted as a shell takes it
