"""ab_layer.py's command line (mok_proto.bench.ab_cli) and mok_proto.bench.ab on the CPU: worker processes over two stand-in trees
(a fake `mok_proto.bench.emulation` and a fake `cupy` whose replays "take" a set time), so the
protocol, the alternation, the ratio and the checks run for real without a GPU."""

import json
import textwrap
from pathlib import Path

import pytest

from mok_proto.bench import ab, ab_cli

ROOT = Path(__file__).resolve().parents[1]

FAKE_EMULATION = """
import os
MS, BITS, TURNS = {ms}, {bits!r}, {turns}

class Layer:
    num_turns, ring_rows = TURNS, 4096
    def __init__(self, precision="bf16"):
        self.precision, self.plans = precision, []
    def fused_forward_plan(self, knobs):
        return "fwd " + knobs.text
    def fused_backward_plan(self, knobs):
        return "bwd " + knobs.text
    def set_forward_plan(self, plan):
        self.plans.append(plan)
    def set_backward_plan(self, plan):
        self.plans.append(plan)
    def enqueue_forward(self):
        pass
    def enqueue_backward(self):
        pass
    def capture(self, forward=True, backward=True):
        return Graph()
    def check(self):
        pass
    def close(self):
        pass

class Graph:
    def launch(self, stream):
        pass

class Heap:
    def close(self):
        pass

def emulated_shape(name):
    if name == "broken":
        raise ValueError("no such shape here")
    return name

def make_inputs(shape, seed=0):
    return {{"seed": seed}}

def staged_layer(shape, data, precision="bf16"):
    return Heap(), Layer(precision)

def result_bytes(layer, name):
    return (BITS + name + layer.precision + ",".join(layer.plans)).encode()
"""

FAKE_PLAN = """
class FusedKnobs:
    def __init__(self, text):
        self.text = text
    @classmethod
    def parse(cls, text):
        return cls(text)
"""

FAKE_CUPY = """
import os
from mok_proto.bench import emulation

class cuda:
    class Stream:
        def __init__(self, non_blocking=False):
            pass
        def synchronize(self):
            with open(os.environ["AB_LOG"], "a") as f:
                f.write(emulation.BITS[0])
    class Event:
        def record(self, stream=None):
            pass
    @staticmethod
    def get_elapsed_time(a, b):
        return emulation.MS
"""


def fake_tree(root: Path, ms: float, bits: str, turns: int = 1, old: bool = False) -> Path:
    """A stand-in tree; old: one from before FP8 and fused A/Bs (staged_layer(shape, data), no plan)."""
    emulation = FAKE_EMULATION.format(ms=ms, bits=bits, turns=turns)
    (root / "mok_proto" / "bench").mkdir(parents=True)
    (root / "mok_proto" / "__init__.py").write_text("")
    (root / "mok_proto" / "bench" / "__init__.py").write_text("")
    if old:
        emulation = emulation.replace('def staged_layer(shape, data, precision="bf16"):', "def staged_layer(shape, data):")
        emulation = emulation.replace("Heap(), Layer(precision)", "Heap(), Layer()")
    else:
        (root / "mok_proto" / "plan.py").write_text(FAKE_PLAN)
    (root / "mok_proto" / "bench" / "emulation.py").write_text(emulation)
    (root / "cupy.py").write_text(textwrap.dedent(FAKE_CUPY))
    return root


@pytest.fixture
def log(tmp_path, monkeypatch):
    path = tmp_path / "order.log"
    monkeypatch.setenv("AB_LOG", str(path))
    return path


def test_workers_alternate_and_the_ratio_is_b_over_a(tmp_path, log):
    a = ab.Worker(fake_tree(tmp_path / "a", 2.0, "A-bits"), "A")
    b = ab.Worker(fake_tree(tmp_path / "b", 2.5, "B-bits"), "B")
    try:
        da, db = a.ask(cmd="setup", shape="kimi-k2.7"), b.ask(cmd="setup", shape="kimi-k2.7")
        assert da["digest"]["fwd"] != db["digest"]["fwd"] and da["num_turns"] == 1
        log.write_text("")  # the setups' synchronizations
        res = ab.interleaved(a, b, "fwd", rounds=4, iters=3, warmup=1)
    finally:
        a.close()
        b.close()
    assert res["ratio"] == pytest.approx(1.25) and res["a"]["median_ms"] == pytest.approx(2.0)
    assert log.read_text() == "ABBAABBA"  # one synchronization per timed block, the order flipping each round


def test_setup_builds_the_precision_and_fused_plans_asked_for(tmp_path, log):
    import hashlib

    w = ab.Worker(fake_tree(tmp_path / "a", 1.0, "A"), "A")
    try:
        plain = w.ask(cmd="setup", shape="kimi-k2.7")["digest"]
        fused = w.ask(cmd="setup", shape="kimi-k2.7", precision="fp8", fused="0:2048")["digest"]
    finally:
        w.close()
    assert plain["fwd"] == hashlib.sha256(b"Afwdbf16").hexdigest()
    assert fused["fwd"] == hashlib.sha256(b"Afwdfp8fwd 0:2048,bwd 0:2048").hexdigest()

def test_an_older_tree_serves_the_plain_setup_and_refuses_what_it_lacks(tmp_path, log):
    w = ab.Worker(fake_tree(tmp_path / "a", 1.0, "A", old=True), "base (A)")
    try:
        assert w.ask(cmd="setup", shape="kimi-k2.7")["num_turns"] == 1
        with pytest.raises(RuntimeError, match=r"base \(A\) worker failed: TypeError"):
            w.ask(cmd="setup", shape="kimi-k2.7", precision="fp8")
    finally:
        w.close()

def test_a_worker_error_is_one_line_naming_the_worker(tmp_path, log):
    w = ab.Worker(fake_tree(tmp_path / "a", 1.0, "A"), "base (A)")
    try:
        with pytest.raises(RuntimeError, match=r"base \(A\) worker failed: ValueError: no such shape here"):
            w.ask(cmd="setup", shape="broken")
    finally:
        w.close()


def test_tree_of_exports_a_revision_and_refuses_nonsense(tmp_path):
    tree = ab.tree_of("HEAD", tmp_path)
    assert (tree / "mok_proto" / "layer" / "gpu.py").is_file() and (tree / "cuda").is_dir()
    assert ab.tree_of(str(tree), tmp_path / "x") == tree.resolve()  # a folder is taken as is
    with pytest.raises(ValueError, match="neither a folder"):
        ab.tree_of("no-such-revision-anywhere", tmp_path / "y")


@pytest.mark.parametrize("ms_b, bits_b, turns, failed", [
    (2.0, "same", 1, []),
    (2.1, "same", 1, ["B/A 1.050 > 1.03"]),
    (2.0, "other", 1, ["results differ"]),
    (2.0, "same", 2, ["runs 2 turns"]),
])
def test_script_checks(tmp_path, log, monkeypatch, capsys, ms_b, bits_b, turns, failed):
    base = fake_tree(tmp_path / "a", 2.0, "same")
    monkeypatch.setattr(ab_cli, "ROOT", fake_tree(tmp_path / "b", ms_b, bits_b, turns))
    monkeypatch.setattr(ab_cli, "append_result", lambda name, row: rows.append((name, row)))
    rows = []
    args = ab_cli.parse_args(["--base", str(base), "--shapes", "kimi-k2.7", "--rounds", "2", "--iters", "2"])
    code = ab_cli.run(args)
    err = capsys.readouterr().err
    assert code == (1 if failed else 0)
    for text in failed:
        assert text in err
    assert [r["pass"] for _, r in rows] == ["fwd", "bwd"] and all(name == "ab_layer" for name, _ in rows)
    assert rows[0][1]["precision"] == "bf16" and rows[0][1]["schedule"] == "sequential" and rows[0][1]["fused"] is None
    assert rows[0][1]["equal_to_base"] == (bits_b == "same") and rows[0][1]["num_turns"] == turns
    json.dumps(rows)  # rows are JSON


def test_script_refuses_bad_arguments(capsys):
    assert ab_cli.run(ab_cli.parse_args(["--shapes", "kimi-k2.7"])) == 2  # no --base
    for argv in (["--base", "HEAD", "--shapes", "nope"], ["--base", "HEAD", "--rounds", "0"],
                 ["--base", "HEAD", "--fused", "0"], ["--base", "HEAD", "--precision", "fp4"]):
        with pytest.raises(SystemExit) as e:
            ab_cli.parse_args(argv)
        assert e.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_worker_runs_on_its_own_tree(tmp_path, log):
    """The worker must import the tree it is given, not the one its file lives in."""
    w = ab.Worker(fake_tree(tmp_path / "a", 1.0, "fake"), "A")
    try:
        assert w.ask(cmd="setup", shape="x")["ring_rows"] == 4096  # the fake layer's, not a real one
    finally:
        w.close()
