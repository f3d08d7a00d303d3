"""The one segment-alignment rule (plan.SEGMENT_ROWS): every consumer of the rule reads the one
constant (the GPU layer's schedule align and receive capacity, the fused knobs, the cost model,
the simulator's fused padding, the memory's worst case and ring)."""

from types import SimpleNamespace

import numpy as np
import pytest

from mok_proto import memory
from mok_proto import plan as P
from mok_proto.config import MOK_POLICY, RunConfig, ep_share, get_shape
from mok_proto.layer import cpu, gpu, gpu_base
from mok_proto.plan import cost, knobs
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
    "fused knobs": (knobs, lambda mp, s: _knobs_take(s) and not _knobs_take(s // 2) and not _knobs_take(s + s // 2)),
    "plan cost": (cost, lambda mp, s: P.expected_rows(TILE, 1, 1 << 30) == 48 * s
                  and P.default_capacity(TILE, 1, s) == 48 * s  # a segment per expert
                  and P.default_capacity(KIMI, 64, s) == -(-(20480 + 6 * s // 2) // s) * s),  # 1.25 N K + El S / 2
    "sim plan_align": (sim_model, lambda mp, s: sim_model.plan_align(_fused_plan()) == s),
    "sim fused load": (sim_fused, lambda mp, s: not np.any(sim_fused.emulated_load(ep_share("qwen3.5-397b"))
                                                           .expert_offsets % s)),
    "cpu layer": (cpu, lambda mp, s: _cpu_layer_align() == s),
    "memory": (memory, lambda mp, s: memory.worst_capacity(KIMI, 64) == max_receive_slots(2048, 8, 64, 6, s)
               and memory.default_macrobatch_rows(KIMI, 64) % s == 0),
}


def test_every_consumer_uses_segment_rows(monkeypatch):
    """Nothing changes: today's rule is a cluster's tile pair, and the GPU layer's schedule align,
    the receive capacity, the knobs' check, the cost model's padding, the simulator's fused padding
    and the memory's worst case all equal plan.SEGMENT_ROWS."""
    assert S == P.PAIR_ROWS == 256
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
