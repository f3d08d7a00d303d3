"""The GPU layer's sequential passes (mok_proto/layer/gpu.py) as the simulator predicts them, stage
by stage, for bench_layer's emulation: one rank's share of EP=64 on one GPU (2 virtual ranks, El
= E/64 experts each, N tokens per rank, uniform routing; rank 0 timed, rank 1 staged).

Shape legend: N tokens/rank, H hidden, K top-k, El local experts.

The sequential plan (`plan.sequential`) has one plan stage per GEMM, per row transfer and per
epilogue; the layer's stages (the names bench_layer times, `enqueue_forward` /
`enqueue_backward`) are unions of plan stages plus what the plan does not hold, added from first
principles:

* kernels the plan has no task for (begin_round, the routing all-gather and the three schedule
  launches; a push's wait_peers; a pull's raise_flag + wait_peers): one launch each, no work
  (their bytes are below 1 MB);
* token kernels outside the plan (scale_to_slots before the backward's reverse-combine,
  topk_weight_grad after the slot sum): one launch + their bytes (`GpuParams.token_kernel_ns`, as the plan's epilogues).

On one GPU every "remote" row lives in the same HBM, so the load is all local (a row transfer is
an HBM copy), and rank 1's flags are raised before the timed region, so a wait costs its launch
only (`one_gpu`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mok_proto import plan as plans
from mok_proto import results
from mok_proto.config import MOK_POLICY, MoEShape
from mok_proto.plan import CounterKind, TaskKind
from mok_proto.sim.model import ELEM_BYTES, Load, routed_load, simulate
from mok_proto.sim.params import GpuParams

EMULATED_RANKS = 2

# layer stage -> (the plan task kinds it runs, kernels outside the plan, token-kernel bytes [read, write]
# as multiples of N H elements), in enqueue order. Kernel counts follow enqueue_forward/_backward
# under MOK_POLICY (dispatch pull, combine push, rev_combine pull, rev_dispatch push).
LAYER_STAGES = {
    "fwd": {
        "schedule": ((), 5, (0, 0)),  # begin_round, allgather_routing, count, scan, place
        "shared": ((TaskKind.SHARED_GATE_UP, TaskKind.SHARED_DOWN), 0, (0, 0)),
        "dispatch": ((TaskKind.DISPATCH,), 0, (0, 0)),
        "experts": ((TaskKind.GATE_UP, TaskKind.DOWN), 0, (0, 0)),
        "combine": ((TaskKind.COMBINE,), 1, (0, 0)),  # + wait_peers
        "weighted_sum": ((TaskKind.WEIGHTED_SUM,), 0, (0, 0)),
    },
    "bwd": {
        "scale": ((), 2, (1, "K")),  # begin_round, scale_to_slots: reads dout, writes K slot rows
        "shared": ((TaskKind.SHARED_DOWN_BWD, TaskKind.SHARED_GATE_UP_BWD, TaskKind.SHARED_DOWN_WGRAD,
                    TaskKind.SHARED_GATE_UP_WGRAD), 0, (0, 0)),
        "rev_combine": ((TaskKind.REV_COMBINE,), 2, (0, 0)),  # + raise_flag, wait_peers
        "experts": ((TaskKind.DOWN_BWD, TaskKind.GATE_UP_BWD), 0, (0, 0)),
        "rev_dispatch": ((TaskKind.REV_DISPATCH,), 1, (0, 0)),  # + wait_peers
        "wgrad": ((TaskKind.DOWN_WGRAD, TaskKind.GATE_UP_WGRAD), 0, (0, 0)),
        "token_grads": ((TaskKind.SLOT_SUM,), 1, ("K+1", 0)),  # + topk_weight_grad: dout + K slot rows
    },
}


def one_gpu(gpu: GpuParams, results_dir=results.RESULTS_DIR) -> GpuParams:
    """`gpu` as bench_layer runs it: virtual ranks on one GPU. A kernel boundary costs an empty
    launch as measured on one GPU (bench_comm's 4-byte-row weighted-sum stage: one launch, eager,
    median over its newest one-GPU run); peers' flags are raised ahead, so no fence and no signal
    wait. (A pull still pays `rtt_ns`, an NVLink round trip, where HBM's latency is shorter: at
    most 1 us of a ~100 us stage.)"""
    rows = [r for r in results.newest(results.load("bench_comm", results_dir), group_by=("backend",))
            if r["backend"] == "virtual"]
    if not rows:
        raise ValueError("no one-GPU bench_comm rows: the per-launch cost is unknown")
    launch = float(np.median([r["signal_stages"]["weighted_sum"]["median_ms"] for r in rows])) * 1e6
    return dataclasses.replace(gpu, name=gpu.name + " 1 GPU", launch_ns=launch, fence_ns=0.0,
                               signal_ns_per_peer=0.0)


def emulated_load(shape: MoEShape, seed: int = 0) -> Load:
    """Rank 0's receive rows under uniform routing over 2 ranks, for both ranks (rank 1 only
    stands for the peers: it never makes rank 0 wait), every row local (one HBM)."""
    load = routed_load(shape, EMULATED_RANKS, seed)
    both = lambda a: np.repeat(a[:1], EMULATED_RANKS, axis=0)  # noqa: E731
    return Load(both(load.tokens_per_expert), both(load.expert_offsets), np.ones(EMULATED_RANKS))


def _token_bytes(shape: MoEShape, rows) -> float:
    k = shape.top_k
    factor = {0: 0, 1: 1, "K": k, "K+1": k + 1}[rows]
    return factor * shape.num_tokens * shape.hidden * ELEM_BYTES


def sequential_stages_ns(shape: MoEShape, pass_: str, gpu: GpuParams, seed: int = 0) -> dict:
    """{layer stage: predicted ns} of rank 0 for the sequential layer on `gpu` (use `one_gpu(h200)`
    for bench_layer's emulation), plus "total" (their sum: the stages run back to back)."""
    p = plans.sequential(shape, EMULATED_RANKS, pass_=pass_, policy=MOK_POLICY, num_sms=gpu.num_sms)
    result = simulate(p, gpu, emulated_load(shape, seed))
    # Plan stage s ends when its last task on rank 0 ends; its time runs from the previous
    # stage's end (its launch, any wait, its work).
    t = p.tasks
    stage_of_task = p.counters["index"][t["signal_counter"][:, 0]]
    assert np.all(p.counters["kind"][t["signal_counter"][:, 0]] == int(CounterKind.STAGE_DONE))
    num_stages = int(stage_of_task.max()) + 1
    ends = np.array([result.end_ns[stage_of_task == s, 0].max() for s in range(num_stages)])
    stage_ns = np.diff(ends, prepend=0.0)
    kinds_of_stage = [set(t["kind"][stage_of_task == s].tolist()) for s in range(num_stages)]
    out = {}
    for name, (kinds, launches, (reads, writes)) in LAYER_STAGES[pass_].items():
        sel = [s for s in range(num_stages) if kinds_of_stage[s] <= {int(k) for k in kinds}]
        ns = float(stage_ns[sel].sum()) if kinds else 0.0
        ns += launches * gpu.launch_ns
        ns += gpu.token_kernel_ns(_token_bytes(shape, reads), _token_bytes(shape, writes))
        out[name] = ns
    out["total"] = sum(out.values())
    return out
