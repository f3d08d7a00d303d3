"""The one segment-alignment rule (plan.SEGMENT_ROWS): every consumer of the rule reads the one
constant (the GPU layer's schedule align and receive capacity, the fused knobs, the cost model,
the simulator's fused padding, the memory's worst case and ring)."""

from types import SimpleNamespace

import numpy as np
import pytest

from mok_proto import memory
from mok_proto import plan as P
from mok_proto.config import MOK_POLICY, MoEShape, RunConfig, ep_share, get_shape
from mok_proto.layer import cpu, gpu, gpu_base
from mok_proto.plan import cost, knobs
from mok_proto.layer.layout import whole_ring
from mok_proto.schedule import max_receive_slots
from mok_proto.sim import fused as sim_fused
from mok_proto.sim import layer as sim_layer
from mok_proto.sim import model as sim_model

S = P.SEGMENT_ROWS
TILE = get_shape("tile")  # 48 experts, N K = 64 x 4: ~5 rows each, one segment of padding each at R = 1
KIMI = get_shape("kimi-k2.7")


class _Stop(Exception):
    pass


def _layer_align(monkeypatch) -> int:
    """The schedule align GpuMoELayer gives its round (recorded where the round sizes its worst case)."""
    seen = []

    def record(num_tokens, top_k, num_ranks, num_local, align):
        seen.append(align)
        raise _Stop

    monkeypatch.setattr(gpu_base, "max_receive_slots", record)
    with pytest.raises(_Stop):
        gpu.GpuMoELayer(SimpleNamespace(num_ranks=2), RunConfig(TILE, 2))
    return seen[0]


def _one_row_capacity() -> int:
    """receive_capacity of a routing that sends one row to one expert: one padded segment."""
    topk = np.array([[[0]], [[3]]], np.int32)  # R = 2, N = 1, K = 1, E = 4: rank 0 gets one row, rank 1 one
    return gpu.receive_capacity(topk, 4)


def _fused_plan():
    return P.fused_forward(TILE, 2, P.FusedKnobs(2, 512), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)


def _knobs_take(rows: int) -> bool:
    try:
        P.FusedKnobs(0, rows)
    except ValueError:
        return False
    return True


def _cpu_layer_align() -> int:
    """The segment align (and so the ring's unit) of a CPU layer built with the defaults."""
    heap = SimpleNamespace(num_ranks=1, rank=0, signals=lambda name, kinds: None,
                           alloc=lambda name, shape, dtype: SimpleNamespace(local=np.zeros(shape, dtype)))
    shape = get_shape("tiny")
    weights = {"w_gate": np.zeros((12, 16, 8)), "w_up": np.zeros((12, 16, 8)), "w_down": np.zeros((12, 8, 16))}
    layer = cpu.CpuMoELayer(heap, RunConfig(shape, 1), weights)
    assert layer.macrobatch_rows % layer.align == 0
    return layer.align


# consumer: (the module whose SEGMENT_ROWS it reads, does its output follow a rule of s rows?)
CONSUMERS = {
    "gpu layer": (gpu, lambda mp, s: _layer_align(mp) == s and _one_row_capacity() == s),
    "plan cost": (cost, lambda mp, s: P.expected_rows(TILE, 1, 1 << 30) == 48 * s
                  and P.default_capacity(TILE, 1, s) == 48 * s  # a segment per expert
                  and P.default_capacity(KIMI, 64, s) == -(-(20480 + 6 * s // 2) // s) * s),  # 1.25 N K + El S / 2
    # a fused plan's knobs resolve their segment rule (FusedKnobs.segment_rows), which the sim pads to
    "fused knobs -> sim plan_align": (knobs, lambda mp, s: sim_model.plan_align(_fused_plan()) == s
                                      and _fused_plan().knobs.describe("fwd", MOK_POLICY)["segment_rows"] == s),
    "sim fused load": (sim_fused, lambda mp, s: not np.any(sim_fused.emulated_load(ep_share("qwen3.5-397b"))
                                                           .expert_offsets % s)),
    "cpu layer": (cpu, lambda mp, s: _cpu_layer_align() == s),
    "memory": (memory, lambda mp, s: memory.worst_capacity(KIMI, 64) == max_receive_slots(2048, 8, 64, 6, s)
               and memory.default_macrobatch_rows(KIMI, 64) % s == 0),
}


def test_every_consumer_uses_segment_rows(monkeypatch):
    """The rule is one row tile (an FP8 scale block too), and the GPU layer's schedule align, the
    receive capacity, the cost model's padding, the simulator's fused padding and the memory's
    worst case all equal plan.SEGMENT_ROWS."""
    assert S == P.BM == 128 and P.PAIR_ROWS == 2 * S
    for name, (_, follows) in CONSUMERS.items():
        assert follows(monkeypatch, S), name
    # the simulator's sequential model keeps one row tile (plan_align's docstring says why)
    assert sim_model.plan_align(P.sequential(TILE, 2, policy=MOK_POLICY, num_sms=8)) == P.BM


@pytest.mark.parametrize("name", CONSUMERS)
def test_a_consumer_follows_a_changed_segment_rows(monkeypatch, name):
    """Doubling the constant where a consumer reads it moves that consumer: one that used its own
    literal (256, PAIR_ROWS) would stay put."""
    module, follows = CONSUMERS[name]
    other = 2 * S
    if name == "sim fused load":  # the load must tell the two rules apart
        assert np.any(sim_layer.emulated_load(ep_share("qwen3.5-397b"), align=S).expert_offsets % other)
    assert follows(monkeypatch, S) and not follows(monkeypatch, other)
    monkeypatch.setattr(module, "SEGMENT_ROWS", other)
    assert follows(monkeypatch, other)


def test_minibatches_are_whole_tile_pairs(monkeypatch):
    """A fused plan's minibatch holds whole tile pairs (plan.PAIR_ROWS), whatever the segment rule:
    a pair split over two minibatches would wait for one and read the other's rows."""
    assert _knobs_take(P.PAIR_ROWS) and _knobs_take(4 * P.PAIR_ROWS)
    assert not _knobs_take(S) and not _knobs_take(P.PAIR_ROWS + S)
    monkeypatch.setattr(knobs, "PAIR_ROWS", 2 * P.PAIR_ROWS)
    assert not _knobs_take(P.PAIR_ROWS) and _knobs_take(2 * P.PAIR_ROWS)


def test_a_plan_costed_for_another_segment_rule():
    """FusedKnobs.segment_rows (the simulator's what-if, an older measurement's rule): the plan's cost
    model and the simulator's padding follow it, the results row records it, and the GPU layer, whose
    schedule pads to SEGMENT_ROWS, refuses it."""
    other = P.FusedKnobs(2, 512, segment_rows=2 * S)
    plan = P.fused_backward(TILE, 2, other, policy=MOK_POLICY, num_sms=8)
    assert sim_model.plan_align(plan) == 2 * S
    assert plan.capacity_rows == P.default_capacity(TILE, 2, 512, segment_rows=2 * S) > P.default_capacity(TILE, 2, 512)
    row = other.describe("bwd", MOK_POLICY)
    assert row["segment_rows"] == 2 * S and P.FusedKnobs.from_row(row).segment_rows == 2 * S
    with pytest.raises(ValueError, match="segment_rows"):
        gpu.fused_plan("bwd", RunConfig(TILE, 2), 1024, MOK_POLICY, other, 8)
    assert gpu.fused_plan("bwd", RunConfig(TILE, 2), 1024, MOK_POLICY, P.FusedKnobs(2, 512), 8).knobs.segment_rows == S
    for bad in (S // 2, S + 1, 0):
        with pytest.raises(ValueError, match="segment_rows"):
            P.FusedKnobs(2, 512, segment_rows=bad)


def _program(name: str):
    """tests/mpi_programs/<name>.py as a module (its sibling imports resolved), for its setup only."""
    import importlib.util
    import sys
    from pathlib import Path

    programs = Path(__file__).parent / "mpi_programs"
    sys.path.insert(0, str(programs))
    try:
        spec = importlib.util.spec_from_file_location(name, programs / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(programs))
    return module


def _pair_kinds(topk, num_experts: int) -> set:
    """How the tile pairs of every rank's receive rows (schedule padded to SEGMENT_ROWS) fall: "one"
    (both tiles one expert's), "two" (two experts': the fused kernel loads B per CTA, no multicast),
    "tail" (the second tile past the last row: a duplicate)."""
    from mok_proto.schedule import build_all_schedules

    kinds = set()
    for sched in build_all_schedules(topk, num_experts, align=S):
        offsets = np.asarray(sched.expert_offsets)
        end = max((o + t for o, t in zip(offsets[:-1], sched.tokens_per_expert) if t), default=0)
        for pair_row in range(0, int(end), P.PAIR_ROWS):
            if pair_row + S >= end:
                kinds.add("tail")
            else:
                first, second = (np.searchsorted(offsets, r, side="right") - 1 for r in (pair_row, pair_row + S))
                kinds.add("one" if first == second else "two")
    return kinds


def test_the_gpu_fused_cases_run_pairs_of_two_experts():
    """The GPU checks of fused == sequential (tests/mpi_programs/check_fused_layer.py's CASES) route so
    that some tile pair holds two experts' tiles and some pair's second tile lies past the rows: both
    paths of cuda/fused.cuh tile_for are compared with the standalone kernels' bits."""
    from mok_proto.problem import make_problem

    cases = _program("check_fused_layer")
    seen = set()
    for num_ranks in (1, 2, 4, 8):
        for case_id, (h, i, e, k, n, shared, routing) in enumerate(cases.CASES.values()):
            shape = MoEShape("case", hidden=h, ffn=i, num_experts=e, top_k=k, num_tokens=n, num_shared=shared)
            seen |= _pair_kinds(make_problem(shape, num_ranks, seed=11 + case_id, routing=routing).topk_idx, e)
    assert {"one", "two", "tail"} <= seen, seen


def test_every_setting_of_the_fused_checks_builds_its_plan():
    """Every forward and backward knob setting of tests/mpi_programs/check_fused_layer.py builds its
    plan for every case on 1, 2, 4, 8 ranks under MoK's policy, with the capacity the layer gives
    them (the worst case in whole segments): a setting the segment rule makes impossible (too few
    minibatches for its lookahead, a claim past the pairs) fails here, not on the GPU."""
    cases = _program("check_fused_layer")
    built = 0
    for num_ranks in (1, 2, 4, 8):
        num_sms = 2 * max(1, 66 // num_ranks)  # an H100's resident clusters, shared by the launch ranks
        for h, i, e, k, n, shared, _ in cases.CASES.values():
            run = RunConfig(MoEShape("case", hidden=h, ffn=i, num_experts=e, top_k=k, num_tokens=n, num_shared=shared),
                            num_ranks)
            rows = whole_ring(max_receive_slots(n, k, num_ranks, e // num_ranks, S))
            for comm, minibatch, ring, lookahead, more in cases.knob_settings(num_sms):
                knobs = P.FusedKnobs(comm, minibatch, ring_minibatches=ring, lookahead=lookahead, **more)
                gpu.fused_plan("fwd", run, rows, MOK_POLICY, knobs, num_sms)
                built += 1
            for comm, minibatch, more in cases.BACKWARD_KNOBS:
                gpu.fused_plan("bwd", run, rows, MOK_POLICY, P.FusedKnobs(comm, minibatch, **more), num_sms)
                built += 1
    assert built == 4 * len(cases.CASES) * (len(cases.knob_settings(8)) + len(cases.BACKWARD_KNOBS))


def test_the_fused_launch_refuses_a_minibatch_of_part_of_a_pair():
    """A plan whose minibatches are not whole tile pairs (built around FusedKnobs' check) is refused
    before anything reaches the GPU: the kernel's ring shift and tile pairs assume whole pairs."""
    import dataclasses

    from mok_proto.kernels.fused import FusedPass

    plan = _fused_plan()
    with pytest.raises(ValueError, match="whole tile pairs"):
        FusedPass(dataclasses.replace(plan, minibatch_rows=plan.minibatch_rows + S), 2)


def _turn_pair_kinds(offsets, counts, ring_rows: int) -> set:
    """_pair_kinds of each turn's segments as cuda/comm.cuh turn_segments gives them (receive rows
    [t M, (t + 1) M), each expert's part of them from ring row 0), as the fused kernel's tile_for
    names them: "two" where a pair's tiles hold two experts' real rows."""
    offsets, counts = np.asarray(offsets[:-1]), np.asarray(counts)
    kinds = set()
    for lo in range(0, int(offsets[-1] + counts[-1]), ring_rows):
        a = np.maximum(lo, offsets)
        b = np.minimum(lo + ring_rows, offsets + counts)
        t_off, t_cnt = np.minimum(a, lo + ring_rows) - lo, np.maximum(b - a, 0)
        end = int(t_off[-1] + t_cnt[-1])
        for pair_row in range(0, end, P.PAIR_ROWS):
            tiles = [r for r in (pair_row, pair_row + S) if r < end]
            groups = {int(np.searchsorted(t_off, r, side="right") - 1) for r in tiles}
            kinds.add("two" if len(groups) == 2 else "one")
    return kinds


def test_the_gpu_ring_check_runs_pairs_of_two_experts():
    """tests/mpi_programs/check_gpu_ring.py's worst-case routing puts two experts into one tile pair
    on rank 0, with every row in one turn and inside a turn of its quarter ring: the fused passes
    once a turn exercise the loads without multicast on turn-relative segments."""
    from mok_proto.schedule import build_pull_schedule

    ring = _program("check_gpu_ring")
    for num_ranks in (2, 4, 8):
        shape, prob = ring.worst_case_problem(num_ranks)
        sched = build_pull_schedule(prob.topk_idx, shape.num_experts, 0, align=S)
        assert sched.num_slots <= ring.RANK0_ROWS + 3 * S
        for ring_rows in (sched.num_slots, ring.RANK0_ROWS // 4):
            assert "two" in _turn_pair_kinds(sched.expert_offsets, sched.tokens_per_expert, ring_rows), \
                (num_ranks, ring_rows)
