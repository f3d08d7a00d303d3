"""Simulator: the H200 rows of --validate hold (and fail when a calibration is off by 2x), the
load matches the schedule, the model responds to what it models, and it is fast."""

import time

import numpy as np
import pytest

from mok_proto import plan as P
from mok_proto import schedule, sim, trace
from mok_proto.config import MOK_POLICY, get_shape
from mok_proto.sim import validate

KIMI = get_shape("kimi-k2.7")


@pytest.fixture(scope="module")
def h200():
    return sim.h200()


def test_validate_h200_rows_within_bar(h200):
    rows = validate.h200_rows(h200)
    judged = [r for r in rows if not r.calibration]
    assert len(judged) >= 40  # GEMMs, one-GPU and 2 x H200 stages
    bad = [(r.quantity, round(r.error * 100, 1)) for r in judged if not r.ok(validate.H200_TOLERANCE)]
    assert not bad


@pytest.mark.parametrize("factors,group", [
    (dict(tile_tflops_per_sm=2.0), "h200 gemm"),
    (dict(link_gbs=0.5), "h200 comm 2 x H200"),
    (dict(hbm_write_gbs=0.5, hbm_read_gbs=0.5), "h200 comm 1 GPU"),
])
def test_validate_fails_when_calibration_is_off(h200, factors, group):
    rows = [r for r in validate.h200_rows(h200.scaled(**factors)) if r.group == group]
    assert any(not r.ok(validate.H200_TOLERANCE) for r in rows)


def test_cli_validate_prints_every_row():
    from mok_proto.sim.__main__ import main
    assert main(["--validate", "--h200-only"]) == 0


def test_load_matches_schedule():
    shape = get_shape("medium")
    load = sim.routed_load(shape, 4, seed=1)
    rng = np.random.default_rng(0)
    # the same counts through the schedule: rebuild a routing with these counts is hard, so
    # check the placement formula on a routing the schedule builds itself
    topk = np.stack([np.argsort(rng.random((shape.num_tokens, shape.num_experts)), axis=1)[:, :shape.top_k]
                     for _ in range(4)])
    scheds = schedule.build_all_schedules(topk, shape.num_experts, align=P.BM)
    el = shape.num_experts // 4
    counts = np.bincount(topk.reshape(-1), minlength=shape.num_experts).reshape(4, el)
    offsets = np.concatenate([np.zeros((4, 1), np.int64), np.cumsum(-(-counts // P.BM) * P.BM, axis=1)], axis=1)
    assert np.array_equal(offsets, np.stack([s.expert_offsets for s in scheds]))
    assert load.tokens_per_expert.sum() == 4 * shape.num_tokens * shape.top_k
    assert np.all(load.expert_offsets[:, -1] % P.BM == 0)


def test_model_responds(h200):
    gb = sim.gb300_nvl72(h200)
    fwd = dict(pass_="fwd", policy=MOK_POLICY, num_sms=gb.num_sms)
    fused = sim.simulate(P.fixed_split(KIMI, 64, 40, 2048, **fwd), gb)
    seq = sim.simulate(P.sequential(KIMI, 64, **fwd), gb)
    assert fused.time_ns < seq.time_ns  # overlap helps
    slow_link = sim.simulate(P.fixed_split(KIMI, 64, 40, 2048, **fwd), gb.scaled(link_gbs=0.25))
    assert slow_link.time_ns > fused.time_ns
    push = dict(MOK_POLICY, dispatch="push")
    pushed = sim.simulate(P.fixed_split(KIMI, 64, 40, 2048, pass_="fwd", policy=push, num_sms=gb.num_sms), gb)
    def first_gate_up_ns(result):
        return result.start_ns[result.plan.tasks["kind"] == int(P.TaskKind.GATE_UP)].min()
    # a pushed dispatch waits for 63 peers' signals (the shared expert hides part of it)
    assert first_gate_up_ns(pushed) > first_gate_up_ns(fused) + 10e3
    load = sim.routed_load(KIMI, 64, skew=0.3)
    capacity = -(-int(load.expert_offsets[:, -1].max()) // 2048) * 2048
    skewed = sim.simulate(P.fixed_split(KIMI, 64, 40, 2048, capacity_rows=capacity, **fwd), gb, load)
    assert skewed.time_ns > fused.time_ns  # the hottest rank decides


def test_ep64_kimi_forward_is_fast(h200):
    gb = sim.gb300_nvl72(h200)
    t0 = time.perf_counter()
    p = P.fixed_split(KIMI, 64, 40, 2048, pass_="fwd", policy=MOK_POLICY, num_sms=gb.num_sms)
    result = sim.simulate(p, gb)
    assert time.perf_counter() - t0 < 2.0
    rec = result.records()
    assert rec.dtype == trace.TRACE_DTYPE and len(rec) == len(p.tasks)
    assert np.all(rec["end_ns"] >= rec["start_ns"])
    # in-order per CTA: a CTA's tasks do not overlap
    for b in (0, 100):
        r = rec[rec["block"] == b]
        assert np.all(r["start_ns"][1:] >= r["end_ns"][:-1] - 1e-6)
