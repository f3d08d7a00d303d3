"""The GPU layer's memory, stated (mok_proto.memory): the formula is the sum of the buffers the
layer allocates, ring rows scale only the ring, the default ring fits an 80 GB H100 at EP = 64 (and
the worst case would not without it), the CLI and the README's columns."""

import json

import pytest

from mok_proto import memory
from mok_proto import plan as P
from mok_proto.config import PAPER_SHAPES, MoEShape, RunConfig, get_shape
from mok_proto.layer import gpu, layout
from mok_proto.results import report
from mok_proto.schedule import max_receive_slots

S = P.SEGMENT_ROWS
TILE = get_shape("tile")
KIMI = get_shape("kimi-k2.7")


SHAPES = [get_shape(n) for n in PAPER_SHAPES] + [TILE, get_shape("tiny"),
                                                 MoEShape("noshared", 512, 256, 16, 3, 100, num_shared=0),
                                                 MoEShape("wide", 256, 512, 8, 2, 1500, shared_ffn=768)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_the_formula_is_the_sum_of_the_layout(shape):
    for ranks in (1, 2, shape.num_experts // 2):
        worst = memory.worst_capacity(shape, ranks)
        for capacity in (worst, worst // 3 + 1):
            top = -(-capacity // S) * S
            for ring in {capacity, S, top, max(S, top - S)}:
                mem = memory.layer_memory(shape, ranks, capacity, ring)
                symmetric = layout.layer_layout(RunConfig(shape, ranks), capacity, ring)
                assert [b.name for b in mem.buffers if b.symmetric] == list(symmetric)
                assert mem.symmetric_bytes == sum(layout.nbytes(*v) for v in symmetric.values())
                assert mem.formula_bytes() == mem.by_role(), (shape.name, ranks, capacity, ring)
                assert sum(mem.formula_bytes().values()) == mem.total_bytes


def test_what_the_layer_allocates_is_its_memory():
    # symmetric_bytes is what GpuMoELayer allocates (tests/test_bench_layer_mpi.py), and memory() states it
    for name, ranks, capacity in (("deepseek-v4-pro", 2, 3 * S), ("tile", 4, 1000)):
        run = RunConfig(get_shape(name), ranks)
        whole = -(-capacity // S) * S  # the ring that holds every row, in whole segments
        mem = memory.layer_memory(run.shape, ranks, capacity, whole)
        assert mem.symmetric_bytes == gpu.symmetric_bytes(run, capacity)
        layer = object.__new__(gpu.GpuMoELayer)  # no GPU: only the fields memory() reads
        layer.shape, layer.run, layer.capacity, layer.ring_rows = run.shape, run, capacity, whole
        assert layer.memory() == mem
        ring = memory.layer_memory(run.shape, ranks, capacity, S)  # a ring of several turns
        assert ring.symmetric_bytes == gpu.symmetric_bytes(run, capacity, S) < mem.symmetric_bytes
        layer.ring_rows = S
        assert layer.memory() == ring
        assert mem.private_bytes == memory.PRIVATE["error"][0][0] * 8 > 0


def test_ring_rows_scale_only_the_ring_buffers_and_capacity_only_the_index():
    shape, ranks = get_shape("glm-5.2"), 8
    worst = memory.worst_capacity(shape, ranks)
    one, four = (memory.layer_memory(shape, ranks, worst, m) for m in (S, 4 * S))
    changed = {a.name for a, b in zip(one.buffers, four.buffers) if a.bytes != b.bytes} - {"turn_sched"}
    assert changed == set(layout.RING_BUFFERS) == {b.name for b in one.buffers if b.role == "ring"}
    for a, b in zip(one.buffers, four.buffers):
        if a.name == "turn_sched":  # each turn's segments: int32 [T, 2, El], T = ceil(C / M)
            assert (a.bytes, b.bytes) == (8 * -(-worst // S) * shape.num_experts // ranks,
                                          8 * -(-worst // (4 * S)) * shape.num_experts // ranks)
            continue
        assert b.bytes == (4 * a.bytes if a.name in changed else a.bytes)
    row_values = sum(a.shape[1] for a in one.buffers if a.name in changed)
    assert row_values == 4 * shape.hidden + 5 * shape.ffn  # 4H + 5I bf16 values a ring row
    small = memory.layer_memory(shape, ranks, worst // 2, S)
    changed = {a.name for a, b in zip(one.buffers, small.buffers) if a.bytes != b.bytes}
    assert changed == {"sched", "turn_sched"} == {b.name for b in one.buffers if b.role == "index"}


def test_every_buffer_has_a_role():
    mem = memory.layer_memory(KIMI, 64)
    assert {b.role for b in mem.buffers} == set(layout.ROLES)
    assert set(layout.BUFFER_ROLE) <= {b.name for b in mem.buffers}  # no role for a buffer that went away
    assert {b.name for b in mem.buffers if b.role == "weights"} == set(layout.WEIGHTS)
    assert all(b.dtype == "float32" for b in mem.buffers if b.role == "gradients")


@pytest.mark.parametrize("name", PAPER_SHAPES)
def test_every_paper_shape_fits_an_h100_at_ep64_with_the_default_ring(name):
    shape = get_shape(name)
    mem = memory.layer_memory(shape, 64)
    budget = memory.DEFAULT_FRACTION * memory.H100_FREE_BYTES
    roles = mem.by_role()
    assert mem.total_bytes <= budget and roles["weights"] > 0 and roles["gradients"] == 2 * roles["weights"]
    assert mem.capacity == max_receive_slots(shape.num_tokens, shape.top_k, 64, shape.num_experts // 64, S)
    assert mem.macrobatch_rows % S == 0
    if mem.macrobatch_rows < mem.capacity:  # the largest ring that fits: one segment more would not
        bigger = memory.layer_memory(shape, 64, macrobatch_rows=mem.macrobatch_rows + S)
        assert bigger.total_bytes > budget


def test_the_worst_case_needs_the_ring_at_ep64():
    mem = memory.layer_memory(KIMI, 64)
    whole = memory.layer_memory(KIMI, 64, macrobatch_rows=mem.capacity)
    assert mem.macrobatch_rows < mem.capacity
    assert whole.total_bytes > memory.H100_FREE_BYTES  # more than the whole GPU, weights aside
    assert whole.by_role()["ring"] > memory.DEFAULT_FRACTION * memory.H100_FREE_BYTES - 3 * memory.GB
    # at EP = 8 the worst case fits, and the ring holds every row
    eight = memory.layer_memory(KIMI, 8)
    assert eight.macrobatch_rows >= eight.capacity


def test_default_ring_follows_the_free_memory_and_names_a_shortfall():
    full = memory.default_macrobatch_rows(KIMI, 64)
    half = memory.default_macrobatch_rows(KIMI, 64, free_bytes=memory.H100_FREE_BYTES // 2)
    assert S <= half < full and half % S == 0
    assert memory.default_macrobatch_rows(KIMI, 64, capacity=1000) == -(-1000 // S) * S  # the capacity rounded up
    with pytest.raises(ValueError, match=rf"kimi-k2.7 at R=64: .* one segment \({S} rows\).* short by"):
        memory.default_macrobatch_rows(KIMI, 64, free_bytes=2 * 10**9)
    for bad in ({"fraction": 0}, {"fraction": 1.5}, {"free_bytes": 0}, {"capacity": 0}, {"capacity": 1 << 40}):
        with pytest.raises(ValueError):
            memory.default_macrobatch_rows(KIMI, 64, **bad)


@pytest.mark.parametrize("ring", [S // 2, S + 1, 2_000_000, 0])
def test_a_ring_off_the_rule_is_refused(ring):
    with pytest.raises(ValueError, match="macrobatch_rows"):
        memory.layer_memory(KIMI, 64, 1_000_000, ring)


def test_formula_text_names_every_symbol():
    text = memory.layer_memory(KIMI, 64).formula()
    head = text.splitlines()[0]
    for symbol in ("N", "H", "I", "Is", "K", "R", "El", "C", "M"):
        assert f" {symbol}=" in head or f"({symbol}=" in head, symbol
    assert "2 M (4H + 5I)" in text and "4 (2C + 2El + 1)" in text and "total" in text


def test_cli(capsys):
    assert memory.main(["--shape", "glm-5.2", "--ep", "8"]) == 0
    out = capsys.readouterr().out
    assert "recv_dy" in out and "2 M (4H + 5I)" in out and "fits in 0.9 x" in out
    assert memory.main(["--shape", "kimi-k2.7", "--ep", "64", "--macrobatch-rows", str(4 * S)]) == 0
    assert f"M={4 * S} rows" in capsys.readouterr().out
    for args in (["--ep", "7"], ["--free-gb", "2"], ["--macrobatch-rows", "100"], ["--free-gb", "-1"],
                 ["--shape", "nope"]):
        with pytest.raises(SystemExit) as e:
            memory.main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "error:" in err, args


def test_status_table_states_the_memory_at_the_real_layouts(tmp_path):
    row = {"time": "2026-12-03T10:00:00+00:00", "git": "abc", "gpu": "NVIDIA H200", "shape": "kimi-k2.7",
           "pass": "fwd", "median_ms": 1.0}
    rows = [dict(row, schedule="torch", median_ms=3.0), dict(row, schedule="sequential", median_ms=2.0),
            dict(row, schedule="fused", speedup_vs_sequential=2.0)]
    (tmp_path / "bench_layer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = report.status_table(tmp_path)
    assert table.splitlines()[0].endswith("| GB/rank EP=64 | GB/rank EP=8 |")
    want = [f"{memory.layer_memory(KIMI, ep).total_bytes / memory.GB:.1f}" for ep in (64, 8)]
    assert f"| kimi-k2.7 | 1.000 ms (sequential 2.000) | 3.00 x torch (3.000 ms) | 2.00 | - | {want[0]} | {want[1]} |" \
        in table


def test_the_layer_default_ring_comes_from_the_free_memory(monkeypatch):
    """GpuMoELayer's default ring on virtual ranks: what fits 0.9 of the free device memory split
    over the ranks (every row when the worst case fits); under NVSHMEM every row (None)."""
    import sys
    from types import SimpleNamespace

    free = {"bytes": 0}
    pool = 10**10  # what CuPy's pool holds free counts as free too
    fake = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(memGetInfo=lambda: (free["bytes"] - pool, 0))),
                           get_default_memory_pool=lambda: SimpleNamespace(free_bytes=lambda: pool))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    run = RunConfig(KIMI, 64)
    worst = memory.worst_capacity(KIMI, 64)
    free["bytes"] = 2 * 80 * 10**9  # two ranks' worth of an 80 GB card: one rank gets 80 GB
    two = SimpleNamespace(backend="virtual", num_ranks=2)
    ring = gpu.default_ring_rows(two, run, None)
    assert ring == memory.default_macrobatch_rows(KIMI, 64, free_bytes=80 * 10**9) < worst  # kimi at EP=64: a ring
    free["bytes"] = 4 * 80 * 10**9  # the same per rank with 4 ranks on a card 2x as large
    assert gpu.default_ring_rows(SimpleNamespace(backend="virtual", num_ranks=4), run, None) == ring
    free["bytes"] = 10**12
    assert gpu.default_ring_rows(two, run, None) >= worst  # the worst case fits: one turn
    assert gpu.default_ring_rows(SimpleNamespace(backend="nvshmem", num_ranks=2), run, None) is None
