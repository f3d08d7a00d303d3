"""What scripts/bench_layer_mpi.py computes without a GPU (its library: mok_proto.bench's mpi_args,
mpi_problem, plan_workers, digests, mpi_layer, mpi_report, ranks): its inputs, sizes, plans, digests,
comparisons, verdicts and table; and the script's refusals (exit 2) where CuPy / a GPU is missing."""

import importlib.util
import json
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, rank_env
from mok_proto.plan import check as plan_check
from mok_proto.bench import digest, mpi_layer
from mok_proto.bench.digests import compare_digests, describe_comparison, write_digests
from mok_proto.bench.mpi_args import parse_args
from mok_proto.bench.mpi_layer import policies_to_time, push_pull, sequential_part
from mok_proto.bench.mpi_problem import MARGIN_BYTES, Problem, crossing_bytes, make_routing
from mok_proto.bench.mpi_report import judge, print_table
from mok_proto.bench.plan_workers import start_plans
from mok_proto.bench.ranks import Ranks, gpu_sharing, implied_no_torch, run_shape
from mok_proto.config import MOK_POLICY, MoEShape, RunConfig, get_shape
from mok_proto.layer import gpu_base
from mok_proto.layer.gpu import GpuMoELayer, fused_plan, receive_capacity, symmetric_bytes
from mok_proto.plan import PAIR_ROWS, SEGMENT_ROWS, FusedKnobs

SCRIPT = ROOT / "scripts" / "bench_layer_mpi.py"


def run_script(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          env=rank_env(), timeout=120)


@pytest.mark.parametrize("args", [[], ["--single", "2"], ["--shapes", "tile", "--iters", "1"]])
def test_without_cupy_exit_2_in_one_line(args):
    if importlib.util.find_spec("cupy"):
        pytest.skip("cupy is installed here: whether the script runs depends on the GPU")
    proc = run_script(*args)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("error: bench_layer_mpi.py") and "needs" in lines[0] and "GPU" in lines[0]


@pytest.mark.parametrize("args,message", [
    (["--shapes", "nope"], "unknown preset 'nope'"),
    (["--fused", "8"], "--fused: expected COMM:MINIBATCH"),
    (["--iters", "0"], "--iters must be >= 1, got 0"),
    (["--single", "0"], "--single must be >= 1, got 0"),
    (["--compare", "no/such/digests.json"], "--compare: no file no/such/digests.json"),
])
def test_bad_arguments_exit_2_before_anything_runs(args, message):
    proc = run_script(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_arguments_parsed():
    args = parse_args(["--shapes", "tile, glm-5.2", "--fused", "0:1024,8:2048", "--tokens", "256"])
    assert args.shapes == ["tile", "glm-5.2"] and args.fused == [(0, 1024), (8, 2048)] and args.tokens == 256
    assert parse_args([]).fused == [(0, 1024), (0, 2048)] and parse_args(["--fused", ""]).fused == []


def test_routing_is_deterministic_and_valid():
    shape = get_shape("qwen3.5-397b").with_tokens(64)
    topk, w = make_routing(shape, 2, seed=3)
    again, w_again = make_routing(shape, 2, seed=3)
    other, _ = make_routing(shape, 2, seed=4)
    assert np.array_equal(topk, again) and np.array_equal(w, w_again) and not np.array_equal(topk, other)
    assert topk.shape == (2, 64, shape.top_k) and topk.dtype == np.int32 and w.dtype == np.float32
    assert ((topk >= 0) & (topk < shape.num_experts)).all()
    assert all(len(set(row)) == shape.top_k for row in topk.reshape(-1, shape.top_k))  # distinct experts
    np.testing.assert_allclose(w.sum(axis=2), 1.0, rtol=1e-6)


def test_skewed_routing_is_the_spec_over_the_real_ranks():
    """--routing applies to bench_layer_mpi's own R ranks, rank 0 the hot one; uniform keeps its draws."""
    from mok_proto.routing import UNIFORM, RoutingSpec

    shape = get_shape("qwen3.5-397b").with_tokens(256)
    assert all(np.array_equal(a, b) for a, b in zip(make_routing(shape, 4, 3), make_routing(shape, 4, 3, UNIFORM)))
    topk, w = make_routing(shape, 4, 3, RoutingSpec.parse("hot:0.5"))
    assert all(np.array_equal(a, b) for a, b in zip((topk, w), make_routing(shape, 4, 3, RoutingSpec("hot", 0.5))))
    el = shape.num_experts // 4
    assert (topk[..., 0] < el).mean() == 0.5  # half of all 4 N first choices on rank 0's experts
    assert all(len(set(row)) == shape.top_k for row in topk.reshape(-1, shape.top_k))
    np.testing.assert_allclose(w.sum(axis=2), 1.0, rtol=1e-6)
    prob = Problem("tile", 64, 2, seed=0, routing=RoutingSpec.parse("hot:1"))
    assert prob.config()["routing"] == "hot:1" and Problem("tile", 64, 2, seed=0).config()["routing"] == "uniform"
    assert (prob.topk[..., 0] < 24).all() and prob.capacity == receive_capacity(prob.topk, 48)
    assert parse_args([]).routing == UNIFORM and parse_args(["--routing", "hot:1"]).routing == RoutingSpec("hot", 1.0)


def test_crossing_bytes_counts_the_busiest_direction():
    # R=2, E=4 (El=2), N=2, K=2: rank 0 sends 3 rows to rank 1, rank 1 sends 1 row to rank 0.
    topk = np.array([[[0, 2], [3, 2]], [[1, 3], [2, 3]]], np.int32)
    assert crossing_bytes(topk, 4, hidden=8) == 3 * 8 * 2


def test_receive_capacity_is_the_device_schedules_padded_rows():
    # R=2, E=4 (El=2), K=1: expert 0 gets 300 rows, expert 1 one row, expert 3 the rest (211); each
    # expert's rows padded to SEGMENT_ROWS (128): rank 0 needs 384 + 128, rank 1 0 + 256 rows
    topk = np.array([0] * 300 + [1] + [3] * 211, np.int32).reshape(2, 256, 1)
    assert receive_capacity(topk, 4) == 3 * SEGMENT_ROWS + SEGMENT_ROWS
    assert receive_capacity(np.full((2, 4, 1), 3, np.int32), 4) == SEGMENT_ROWS  # rank 0 receives nothing


class _Recorder:
    """A heap that records what a layer allocates and refuses to go further (no GPU needed)."""

    def __init__(self, num_ranks):
        self.num_ranks, self.launch_ranks, self.allocated = num_ranks, [0], {}

    def alloc(self, name, shape, dtype):
        self.allocated[name] = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return object()


class _Allocated(Exception):
    pass


@pytest.mark.parametrize("name,num_ranks", [("deepseek-v4-pro", 2), ("tile", 4)])
def test_symmetric_bytes_is_what_the_layer_allocates(monkeypatch, name, num_ranks):
    def stop(*args):
        raise _Allocated

    monkeypatch.setattr(gpu_base, "ErrorRecord", stop)  # called right after the allocations
    shape = get_shape(name)
    run, capacity = RunConfig(shape, num_ranks), 3 * PAIR_ROWS
    for shared, cap, ring in ((1, capacity, None), (0, capacity, None), (1, 1000, None), (1, 1000, PAIR_ROWS)):
        run = RunConfig(MoEShape(shape.name, shape.hidden, shape.ffn, shape.num_experts, shape.top_k,
                                 shape.num_tokens, num_shared=shared), num_ranks)
        heap = _Recorder(num_ranks)
        with pytest.raises(_Allocated):  # a capacity off the segment rule: its ring rounds up to whole segments
            GpuMoELayer(heap, run, capacity=cap, name="t", macrobatch_rows=ring)
        assert sum(heap.allocated.values()) == symmetric_bytes(run, cap, ring), (shared, cap, ring)
    el = shape.num_experts // num_ranks  # the bulk: bf16 weights and their fp32 gradients
    assert symmetric_bytes(run, capacity) > 3 * el * shape.hidden * shape.ffn * (2 + 4)


def test_a_proved_plan_stays_proved_through_pickling(monkeypatch):
    run = RunConfig(get_shape("tile"), 2)
    made = fused_plan("bwd", run, 2 * PAIR_ROWS, dict(MOK_POLICY), FusedKnobs(0, PAIR_ROWS), num_sms=8, check=True)
    copy = pickle.loads(pickle.dumps(made))

    def fail(*args):
        raise AssertionError("check() ran again")

    monkeypatch.setattr(plan_check, "_check_structure", fail)
    copy.check()  # what a helper process proved is not proved again
    assert np.array_equal(copy.tasks, made.tasks) and copy.shape == made.shape
    fresh = fused_plan("bwd", run, 2 * PAIR_ROWS, dict(MOK_POLICY), FusedKnobs(0, PAIR_ROWS), num_sms=8)
    with pytest.raises(AssertionError, match="ran again"):
        fresh.check()


def test_plans_come_back_proved_from_helper_processes():
    problems = [Problem("tile", 64, 2, seed=0)]
    pool, jobs = start_plans(problems, [(0, PAIR_ROWS)], {"fwd": 8, "bwd": 8}, workers=2)
    try:
        got = {key: job.get(300) for key, (root, job) in jobs.items()}
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    assert set(got) == {("tile", "fwd", 0, PAIR_ROWS), ("tile", "bwd", 0, PAIR_ROWS)}
    for (_, pass_, _, _), made in got.items():
        want = fused_plan(pass_, problems[0].run, problems[0].capacity, dict(MOK_POLICY), FusedKnobs(0, PAIR_ROWS),
                          num_sms=8)
        assert made.pass_ == pass_ and made.__dict__.get("_checked") and np.array_equal(made.tasks, want.tasks)


def test_digest_sees_every_bit_and_only_the_bits():
    rng = np.random.default_rng(0)
    a = {"w": rng.standard_normal((3, 1000, 37)).astype(np.float32), "x": rng.integers(0, 2 ** 16, 77, dtype=np.uint16)}
    base = digest(a)
    assert digest({k: v.copy() for k, v in a.items()}) == base
    assert digest(a, chunk_rows=1) == base  # the chunking does not matter
    for key, index in (("w", (2, 999, 36)), ("w", (0, 0, 0)), ("x", (76,))):
        b = {k: v.copy() for k, v in a.items()}
        b[key].view(np.uint8 if key == "x" else np.uint32)[index] ^= 1  # one bit
        assert digest(b) != base, (key, index)
    assert digest({"w": a["w"].reshape(1000, 3, 37), "x": a["x"]}) != base  # the shape counts
    assert digest({"v": a["w"], "x": a["x"]}) != base  # and the name


def _entry(capacity=512, digests=("a", "b")):
    return {"config": {"shape": "tile", "ranks": 2, "tokens_per_rank": 64, "seed": 0, "capacity": capacity},
            "per_rank": {str(r): {"out": d, "grads": d} for r, d in enumerate(digests)}}


def test_compare_digests_either_way(tmp_path):
    path = tmp_path / "digests_single.json"
    write_digests(path, "single", 2, {"tile": _entry(), "glm-5.2": {"config": {}, "skipped": "too big"}})
    got = compare_digests({"tile": _entry(), "glm-5.2": _entry()}, path, "mpi")
    assert got["tile"]["equal"] is True and describe_comparison(got["tile"]) == "equal"
    assert got["glm-5.2"]["equal"] is None and "too big" in got["glm-5.2"]["why"] and got["glm-5.2"]["skipped"]
    differs = compare_digests({"tile": _entry(digests=("a", "c"))}, path, "mpi")["tile"]
    assert differs["equal"] is False and describe_comparison(differs) == "DIFFERS on ranks 1"
    other = compare_digests({"tile": _entry(capacity=768)}, path, "mpi")["tile"]
    assert other["equal"] is None and "capacity 768 vs 512" in other["why"]
    assert compare_digests({"tile": _entry()}, path, "single")["tile"]["equal"] is None  # same mode
    # a file from before configs held the routing ran uniform routing
    hot = _entry()
    hot["config"]["routing"] = "hot:0.25"
    other = compare_digests({"tile": hot}, path, "mpi")["tile"]
    assert other["equal"] is None and "routing hot:0.25 vs uniform" in other["why"]
    hot["config"]["routing"] = "uniform"
    assert compare_digests({"tile": hot}, path, "mpi")["tile"]["equal"] is True
    assert json.loads(path.read_text())["mode"] == "single"


def _row(torch_ms=(3.0, 9.0), fused_ms=(1.5, 6.0), equal=True):
    stage = {"median_ms": 0.5, "p20_ms": 0.4, "p80_ms": 0.6, "iters": 10}
    stages = {label: {"fwd": {"dispatch": {**stage, "median_ms": 0.50 + i / 100}, "combine": stage},
                      "bwd": {"rev_combine": stage, "rev_dispatch": stage}}
              for i, label in enumerate(policies_to_time())}
    return {"shape": "tile", "ranks": 2,
            "ours": {"sequential": {p: {**stage, "median_ms": 2 * m} for p, m in zip(("fwd", "bwd"), fused_ms)},
                     "fused": {p: [{**stage, "median_ms": m, "comm_blocks": 0, "minibatch_rows": 1024},
                                   {**stage, "median_ms": m * 1.1, "comm_blocks": 0, "minibatch_rows": 2048}]
                               for p, m in zip(("fwd", "bwd"), fused_ms)}},
            "torch": {"fwd": {**stage, "median_ms": torch_ms[0]}, "bwd_median_ms": torch_ms[1]},
            "bitwise": {"equal_to_mok_sequential": {"mok": True, "fused fwd 0:1024": equal}, "all": equal},
            "push_pull": push_pull(stages, 100_000_000, 400.0)}


def test_push_pull_overhead_is_the_stage_beyond_the_bytes_at_link_rate():
    got = _row()["push_pull"]
    assert set(got) == {"dispatch", "combine", "rev_combine", "rev_dispatch"}
    pull = got["dispatch"]["pull"]  # MoK's dispatch: the "mok" policy's stage (0.50 ms)
    assert pull["policy"] == "mok" and pull["stage_ms"] == pytest.approx(0.50)
    assert pull["overhead_ms"] == pytest.approx(0.50 - 0.25) and pull["pct_link"] == pytest.approx(50.0)
    assert got["dispatch"]["push"]["policy"] == "dispatch=push" and got["dispatch"]["push"]["stage_ms"] > 0.50
    assert push_pull({"mok": {"fwd": {"dispatch": {"median_ms": 1.0}, "combine": {"median_ms": 1.0}},
                                    "bwd": {"rev_combine": {"median_ms": 1.0}, "rev_dispatch": {"median_ms": 1.0}}}},
                           100, float("nan"))["dispatch"]["pull"]["overhead_ms"] == 1.0  # no link: all overhead


def test_judge_bars_and_checks(capsys):
    row = _row()
    assert judge(row) == [] and row["met"]
    assert row["speedup"]["fused_fwd_vs_torch"] == pytest.approx(2.0) and row["speedup"]["fused_bwd_vs_torch"] == 1.5
    slow = _row(torch_ms=(2.0, 8.0))
    assert judge(slow) == ["fused fwd 1.33x torch < 1.5x", "fused bwd 1.33x torch < 1.4x"]
    assert "not bitwise equal to MoK's sequential: fused fwd 0:1024" in judge(_row(equal=False))
    differs = {**_row(), "bitwise_vs_single": {"equal": False, "ranks": {"0": True, "1": False}}}
    assert judge(differs) == ["differs from the single-process run"]
    # a comparison that did not happen fails, unless the other run skipped the shape by choice
    lost = {**_row(), "bitwise_vs_single": {"equal": None, "skipped": False, "why": "tile not in d.json"}}
    assert judge(lost) == ["not compared with the single-process run (tile not in d.json)"]
    assert judge({**_row(), "bitwise_vs_single": {"equal": None, "skipped": True, "why": "too big"}}) == []
    wrong = _row()
    wrong["torch"]["max_rel_err_vs_ours"] = {"out": 0.2, "x": 0.01}  # a baseline that is not the same layer
    assert judge(wrong)[0].startswith("the torch layer differs from ours")
    failed = {**_row(), "errors": [{"phase": "torch", "ranks": {"1": "MemoryError: x"}}]}
    del failed["torch"]
    assert judge(failed) == ["torch failed", "fused fwd vs torch not measured", "fused bwd vs torch not measured"]
    assert judge({"shape": "x", "skipped": "too big"}) == ["skipped (too big)"]
    print_table([row, slow, failed, differs, {"shape": "x", "skipped": "too big"}],
                      {"nvshmem_pull_gbs": 400.0, "nccl_a2a_gbs": 300.0}, "d.json", None)
    out = capsys.readouterr().out
    assert "tile" in out and "2.00" in out and "NO" not in out.split("\n")[2] and "skipped: too big" in out
    assert "DIFFERS on ranks 1" in out and "dispatch" in out


def test_ranks_sharing_a_gpu_run_without_torch():
    """NCCL refuses two ranks on one GPU (the first run, 2 processes on one H200, aborted there):
    every rank counts the ranks per GPU from the same allgather and then runs as --no-torch."""
    assert gpu_sharing(["0000:3c", "0000:3c"]) == 2 and gpu_sharing(["a", "b", "a"]) == 2
    assert gpu_sharing(["a", "b", "c"]) == 1
    args = parse_args([])
    assert implied_no_torch(args, 4, 1) is None and not args.no_torch
    note = implied_no_torch(args, 2, 2)
    assert args.no_torch and "NCCL" in note and "not those of 2 GPUs" in note
    assert implied_no_torch(parse_args(["--no-torch"]), 2, 2) is None  # asked for: nothing to say


def test_run_shape_budgets_a_layer_per_rank_on_the_gpu(monkeypatch):
    """Two 81.6 GB layers on one H200 once went to NVSHMEM, whose heap growth failed and ended the
    job: run_shape skips a shape whose layers (one per rank on the GPU, each with its margin) do
    not fit, with the reason, before allocating anything."""
    import types

    freed = []
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(get_default_memory_pool=lambda: types.SimpleNamespace(
        free_all_blocks=lambda: freed.append(1))))
    shape = types.SimpleNamespace(num_tokens=2048, hidden=7168, ffn=3072, num_experts=384, top_k=6)
    prob = types.SimpleNamespace(name="deepseek", shape=shape, num_ranks=2, capacity=1, layer_bytes=60 << 30,
                                 config=lambda: {"shape": "deepseek"}, array_names=lambda: [])

    class FakeRanks:
        lead, num_ranks = True, 2

        def __init__(self, per_gpu, free):
            self.per_gpu, self.free, self.phases = per_gpu, free, []

        def say(self, text):
            pass

        def free_bytes(self):
            return self.free

        def phase(self, row, name, fn):
            self.phases.append(name)
            return False, None  # the allocation "failed": nothing else to run

        def release(self, row, names):
            pass

    margin = MARGIN_BYTES
    fits_one = FakeRanks(1, (60 << 30) + margin)
    row, _ = run_shape(fits_one, prob, None, 0, {}, "sequential", {}, lambda layer, row: None)
    assert "skipped" not in row and fits_one.phases == ["allocate and fill (sequential)"]
    shared = FakeRanks(2, (60 << 30) + margin)  # the same GPU, two ranks: 120 GB + 2 margins needed
    row, _ = run_shape(shared, prob, None, 0, {}, "sequential", {}, lambda layer, row: None)
    assert shared.phases == [] and "x 2 ranks on one GPU" in row["skipped"]
    held = FakeRanks(2, 2 * margin)  # what the heaps hold counts: they reuse it
    row, _ = run_shape(held, prob, None, 120 << 30, {}, "sequential", {}, lambda layer, row: None)
    assert "skipped" not in row and held.phases == ["allocate and fill (sequential)"]


def test_sequential_part_runs_no_torch_layer_without_torch(monkeypatch):
    calls = []
    monkeypatch.setattr(mpi_layer, "run_sequential", lambda *a: {"fwd": 1.0})
    monkeypatch.setattr(mpi_layer, "run_torch", lambda *a: calls.append("torch"))
    ranks = type("R", (), {"say": lambda self, text: None})()
    sequential_part(ranks, None, None, parse_args(["--no-torch"]), {})
    assert calls == []
    sequential_part(ranks, None, None, parse_args([]), {})
    assert calls == ["torch"]


def test_judge_without_torch_checks_bits_but_not_bars(capsys):
    """--no-torch (or ranks sharing a GPU): no torch row, the speed bars are not judged, the bitwise
    checks are; the fused passes' speed-up over the sequential is still recorded and printed."""
    row = {k: v for k, v in _row(fused_ms=(1.5, 6.0)).items() if k != "torch"}
    assert judge(dict(row)) == ["fused fwd vs torch not measured", "fused bwd vs torch not measured"]
    assert judge(row, bars=False) == [] and row["met"] and row["bars_judged"] is False
    assert row["speedup"] == {"fused_fwd_vs_sequential": 2.0, "fused_bwd_vs_sequential": 2.0}
    skipped = {"shape": "x", "skipped": "too big"}
    assert judge(skipped, bars=False) == ["skipped (too big)"] and skipped["bars_judged"] is False
    unequal = {k: v for k, v in _row(equal=False).items() if k != "torch"}
    assert judge(unequal, bars=False) == ["not bitwise equal to MoK's sequential: fused fwd 0:1024"]
    no_fused = {**row, "ours": {"sequential": row["ours"]["sequential"], "fused": {}}}
    assert judge(no_fused, bars=False) == ["fused fwd not measured", "fused bwd not measured"]
    print_table([row], {"nvshmem_pull_gbs": 400.0, "nccl_a2a_gbs": None}, "d.json", None, bars=False)
    lines = capsys.readouterr().out.split("\n")
    header, cells = lines[1], lines[2]
    line = cells.split()
    assert line[0] == "tile" and line[1] == "-" and line[4] == "-" and line[5] == "2.00" and line[10] == "2.00"
    # every column's right edge in the row is its header's (right-aligned numbers under their names)
    ends = [m.end() for m in re.finditer(r"x torch|x seq|\S+", header.split("  bitwise")[0])][1:]
    assert len(ends) == 10 and [m.end() for m in re.finditer(r"\S+", cells.split("  yes")[0])][1:] == ends
    assert "x seq" in header and "bars not judged" in lines[3]
    assert parse_args(["--no-torch"]).no_torch and not parse_args([]).no_torch


class _Comm:
    """Rank 0 of a 2-rank world whose peer reports `peer` in every allgather, or the values of
    `answers` in its first allgathers and then what this rank reports (no MPI needed)."""

    rank, size = 0, 2

    def __init__(self, peer=None, answers=()):
        self.peer, self.answers, self.calls = peer, list(answers), []

    def allgather(self, value):
        self.calls.append("allgather")
        if isinstance(value, int):  # watchdog.resync_arrivals agreeing on the barrier count
            return [value, value]
        if self.answers:
            return [value, self.answers.pop(0)]
        return [value, self.peer if self.peer is not None else value]

    def bcast(self, value, root):
        self.calls.append(f"bcast from {root}")
        return value if root == 0 else (None, "TimeoutError: peer's plan")

    def Isend(self, buf, dest, tag):
        self.calls.append("marker")
        return type("Request", (), {"Wait": lambda self: None})()

    def Recv(self, buf, source, tag):
        buf[0][0] = -1  # the peer's marker (watchdog.RESYNC_MARKER: no stale token)

    def py2f(self):
        return id(self)


class _Heap:
    def __init__(self, names):
        self.arrays, self.freed = {name: object() for name in names}, []

    def free(self, array):
        name = next(n for n, a in self.arrays.items() if a is array)
        self.freed.append(name)
        del self.arrays[name]


def test_a_phase_fails_on_every_rank_when_one_rank_failed():
    row = {}
    ranks = Ranks(_Comm(peer="MemoryError: x"), None)
    assert ranks.phase(row, "torch", lambda: 3) == (False, None)  # it worked here, not on the peer
    assert row["errors"] == [{"phase": "torch", "ranks": {"1": "MemoryError: x"}}]
    assert ranks.comm.calls == ["allgather", "marker", "allgather"]  # agreed, then the barriers resynchronized
    ok = Ranks(_Comm(), None)
    assert ok.phase(row, "fine", lambda: 3) == (True, 3) and ok.comm.calls == ["allgather"]


def test_a_shared_value_comes_from_its_root_and_its_failure_is_everyones():
    row = {}
    ranks = Ranks(_Comm(), None)
    assert ranks.shared(row, "plan", lambda: "made here", root=0) == (True, "made here")
    assert ranks.shared(row, "plan", lambda: pytest.fail("not the prover"), root=1) == (False, None)
    assert row["errors"] == [{"phase": "plan", "ranks": {"1": "TimeoutError: peer's plan"}}]


def test_release_frees_what_every_rank_holds_and_forgets_the_rest():
    names = ["s.a", "s.b", "s.c"]
    heap = _Heap(["other", "s.a", "s.b", "s.c"])
    # the peer failed before allocating s.c: it reports only s.a, s.b (then agrees with this rank)
    ranks = Ranks(_Comm(answers=[["s.a", "s.b"]]), heap)
    row = {}
    ranks.release(row, names)
    assert heap.freed == ["s.a", "s.b"] and list(heap.arrays) == ["other"]  # s.c forgotten, not freed
    assert not row.get("errors")  # the frees succeeded on both ranks


def test_plans_are_split_over_the_ranks():
    problems = [Problem("tile", 64, 2, seed=0)]
    pool, jobs = start_plans(problems, [(0, PAIR_ROWS), (0, 2 * PAIR_ROWS)], {"fwd": 8, "bwd": 8},
                                   workers=1, rank=4, num_ranks=5)
    assert pool is None  # plan i on rank i % 5: rank 4 proves none of the 4 (no helper processes)
    assert [root for root, _ in jobs.values()] == [0, 1, 2, 3] and all(job is None for _, job in jobs.values())
    assert list(jobs) == [("tile", p, 0, m) for p in ("fwd", "bwd") for m in (PAIR_ROWS, 2 * PAIR_ROWS)]
