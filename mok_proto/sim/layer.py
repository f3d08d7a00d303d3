"""The GPU layer's sequential passes (mok_proto/layer/gpu.py) as the simulator predicts them, stage
by stage, for bench_layer's emulation: one rank's share of EP=64 on one GPU (2 virtual ranks, El
= E/64 experts each, N tokens per rank, uniform routing; rank 0 timed, rank 1 staged). Under a
skewed routing spec (mok_proto.routing) the emulation bench_layer runs: W virtual ranks, rank 0
receiving what rank 0 of the real layout drawn under the spec receives (`emulation`).

Shape legend: N tokens/rank, H hidden, K top-k, El local experts.

The sequential plan (`plan.sequential`) has one plan stage per GEMM, per row transfer and per
epilogue; the layer's stages (the names bench_layer times, `enqueue_forward` /
`enqueue_backward`) are unions of plan stages plus what the plan does not hold, added from first
principles:

* kernels the plan has no task for (begin_round, the routing all-gather and the three schedule
  launches; a push's wait_peers; a pull's raise_flag + wait_peers): a kernel boundary each, no
  work (their bytes are below 1 MB);
* token kernels outside the plan (scale_to_slots before the backward's reverse-combine,
  topk_weight_grad after the slot sum): a kernel boundary + their bytes at the rate of their
  access pattern (`GpuParams.token_kernel_ns`).

bench_layer times every stage with the GPU busy (each timed pass runs beside the other one, its
launches queued ahead), so a kernel boundary costs what a queued kernel with little work costs
the GPU (`GpuParams.busy_kernel_ns`), not a host launch. On one GPU every "remote" row lives in
the same HBM, so the load is all local (a row transfer is an HBM row copy), and rank 1's flags
are raised before the timed region, so a wait costs its kernel boundary only (`one_gpu`).

Calibration (`calibrate`, called by sim/calibrate.py): the stages named in LAYER_CALIBRATION of ONE
shape, measured on the set's GPU (`compared_rows`' measured_on, sim.gpus), fit three parameters; every other stage, and every stage of the other shapes, stays a
prediction that --validate judges.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np

from mok_proto import plan as plans
from mok_proto import results
from mok_proto.bench.emulation import emulated_topk
from mok_proto.config import MOK_POLICY, MoEShape, ep_share
from mok_proto.link import LinkModel
from mok_proto.plan import BM, SEGMENT_ROWS, CounterKind, TaskKind
from mok_proto.routing import UNIFORM, RoutingSpec
from mok_proto.sim import gpus
from mok_proto.sim.model import (SCALE_TO_SLOTS, TOPK_WEIGHT_GRAD, Load, load_from_topk, routed_load, simulate,
                                 token_kernel_ns)
from mok_proto.sim.params import GpuParams

EMULATED_RANKS = 2  # under uniform routing
EP = 64  # the real layout bench_layer emulates one rank of
LINK_RESULTS = "bench_layer_link"  # bench_layer.py --link-gbps's rows (bench.layer_rows.LINK_FILE)


class LayerStage(NamedTuple):
    kinds: tuple  # the plan task kinds it runs (one plan stage, one kernel, each)
    kernels: int = 0  # kernels outside the plan: a kernel boundary each
    token: tuple = ()  # of those, the ones with HBM traffic: (traffic, reads, writes) in N H elements (model)
    signals: int = 0  # of those, the ones that raise a flag: a round trip each under a link (a push of the plan
    # pays its own flag's: model.simulate)


# layer stage -> LayerStage, in enqueue order. Kernel counts follow enqueue_forward/_backward under
# MOK_POLICY (dispatch pull, combine push, rev_combine pull, rev_dispatch push).
LAYER_STAGES = {
    "fwd": {
        "schedule": LayerStage((), 5, signals=2),  # begin_round, allgather_routing, count, scan, place (flags:
        # the all-gather's and the placement's)
        "shared": LayerStage((TaskKind.SHARED_GATE_UP, TaskKind.SHARED_DOWN)),
        "dispatch": LayerStage((TaskKind.DISPATCH,)),
        "experts": LayerStage((TaskKind.GATE_UP, TaskKind.DOWN)),
        "combine": LayerStage((TaskKind.COMBINE,), 1),  # + wait_peers
        "weighted_sum": LayerStage((TaskKind.WEIGHTED_SUM,)),
    },
    "bwd": {
        # begin_round, scale_to_slots (reads dout, writes K slot rows)
        "scale": LayerStage((), 2, (SCALE_TO_SLOTS,)),
        "shared": LayerStage((TaskKind.SHARED_DOWN_BWD, TaskKind.SHARED_GATE_UP_BWD, TaskKind.SHARED_DOWN_WGRAD,
                              TaskKind.SHARED_GATE_UP_WGRAD)),
        "rev_combine": LayerStage((TaskKind.REV_COMBINE,), 2, signals=1),  # + raise_flag, wait_peers
        "experts": LayerStage((TaskKind.DOWN_BWD, TaskKind.GATE_UP_BWD)),
        "rev_dispatch": LayerStage((TaskKind.REV_DISPATCH,), 1),  # + wait_peers
        "wgrad": LayerStage((TaskKind.DOWN_WGRAD, TaskKind.GATE_UP_WGRAD)),
        # + topk_weight_grad: reads dout and K slot rows
        "token_grads": LayerStage((TaskKind.SLOT_SUM,), 1, (TOPK_WEIGHT_GRAD,)),
    },
}

# GpuParams field -> the (pass, stage) rows of the calibration shape it is fitted on (`calibrate`;
# why these stages: docs/design.md). Each is judged by the same stages of the other shapes and by
# the stages that hold the same kernels (the flag kernels, the slot sum, the shared expert's GEMMs).
LAYER_CALIBRATION = {
    "busy_kernel_ns": (("fwd", "schedule"),),  # five kernels that move < 1 MB: boundaries only
    "sum_slots_efficiency": (("fwd", "weighted_sum"),),  # the only kernel of its stage: a token sum
    "sustained_gemm": (("fwd", "experts"), ("bwd", "experts"), ("bwd", "wgrad")),  # routed GEMMs only
}


def compared_rows(results_dir=results.RESULTS_DIR, bench: str = "bench_layer", measured_on: str = "h200") -> list[dict]:
    """bench_layer's rows (bench: its results file's name) the simulator compares with set
    `measured_on`'s parameters: those measured on its GPU (gpus.SPECS; a row without `gpu` counts as
    an H200), under MoK's transfer directions (a row with another `policy` is not), uniform routing
    (a row without `routing` is) and BF16 routed experts (the model's GEMM rates; a row without
    `precision` is), of runs not marked `sim_left_out` (a field that says why), by time."""
    return [r for r in gpus.rows_on(results.load(bench, results_dir), measured_on)
            if "sim_left_out" not in r and r.get("precision", "bf16") == "bf16"
            and r.get("policy", MOK_POLICY) == MOK_POLICY and r.get("routing", str(UNIFORM)) == str(UNIFORM)]


def link_rows(results_dir=results.RESULTS_DIR, measured_on: str = "h200") -> list[dict]:
    """bench_layer.py --link-gbps's rows (results/<LINK_RESULTS>.jsonl) the simulator compares with:
    `compared_rows` of measured_on's GPU, the newest run of each shape and link."""
    rows = compared_rows(results_dir, LINK_RESULTS, measured_on)
    return results.newest(rows, group_by=("shape", "link_gbps", "link_latency_us", "link_every_row"))


def measured_rows(results_dir=results.RESULTS_DIR, measured_on: str = "h200") -> list[dict]:
    """bench_layer's sequential rows: the newest run of each shape among `compared_rows` of
    measured_on's GPU (runs told apart by their git stamp and start time, `results.newest`)."""
    rows = results.newest(compared_rows(results_dir, measured_on=measured_on), group_by=("shape", "schedule"))
    return [r for r in rows if r["schedule"] == "sequential"]


def one_gpu(gpu: GpuParams) -> GpuParams:
    """`gpu` as bench_layer runs it: virtual ranks on one GPU, every stage timed with its
    launches queued ahead of the GPU, so a kernel boundary costs `busy_kernel_ns`; peers' flags are
    raised ahead, so no fence and no signal wait. (A pull still pays `rtt_ns`, an NVLink round
    trip, where HBM's latency is shorter: small against a stage's copy.)"""
    return dataclasses.replace(gpu, name=gpu.name + " 1 GPU", launch_ns=gpu.busy_kernel_ns, fence_ns=0.0,
                               signal_ns_per_peer=0.0)


@functools.lru_cache(maxsize=16)
def emulation(shape: MoEShape, routing: RoutingSpec = UNIFORM, seed: int = 0,
              ep: int = EP, align: int | None = None) -> tuple[MoEShape, int, int | None]:
    """bench_layer's emulation of `shape` (one EP=ep rank's share, ep_share: E' = 2 El) under
    `routing`: (its shape, E' = W El; its W virtual ranks; the receive rows its layer and plans are
    sized for: the routing's largest need, segments padded to `align` (None: SEGMENT_ROWS), None
    under uniform routing: the plans' defaults, today's 2 ranks)."""
    if routing.is_uniform:
        return shape, EMULATED_RANKS, None
    topk = _emulated_topk(shape, routing, seed, ep)
    wide = dataclasses.replace(shape, num_experts=len(topk) * (shape.num_experts // EMULATED_RANKS))
    need = load_from_topk(topk, wide.num_experts, align or SEGMENT_ROWS).expert_offsets[:, -1].max()
    return wide, len(topk), int(need)


@functools.lru_cache(maxsize=8)
def _emulated_topk(shape: MoEShape, routing: RoutingSpec, seed: int, ep: int) -> np.ndarray:
    """emulation.emulated_topk of the paper shape `shape` shares (read only)."""
    paper = dataclasses.replace(shape, num_experts=shape.num_experts // EMULATED_RANKS * ep)
    return emulated_topk(paper, routing, seed, ep)


def emulated_load(shape: MoEShape, seed: int = 0, align: int = BM, routing: RoutingSpec = UNIFORM,
                  ep: int = EP) -> Load:
    """Rank 0's receive rows, for every virtual rank of the emulation (the peers only stand for
    the other ranks: they never make rank 0 wait), every row local (one HBM); expert segments
    padded to `align` rows (model.plan_align). Uniform routing: uniform over 2 ranks; else rank 0
    of the real layout under `routing` (`emulation`: W ranks)."""
    if routing.is_uniform:
        num, load = EMULATED_RANKS, routed_load(shape, EMULATED_RANKS, seed, align=align)
    else:
        topk = _emulated_topk(shape, routing, seed, ep)
        num = len(topk)
        load = load_from_topk(topk, num * (shape.num_experts // EMULATED_RANKS), align)
    every = lambda a: np.repeat(a[:1], num, axis=0)  # noqa: E731
    return Load(every(load.tokens_per_expert), every(load.expert_offsets), np.ones(num))


@functools.lru_cache(maxsize=32)
def _sequential_plan(shape: MoEShape, pass_: str, num_sms: int, num_ranks: int = EMULATED_RANKS,
                     capacity_rows: int | None = None) -> plans.Plan:
    """The emulation's sequential plan, built (and proved) once; shared: read it, never change it."""
    return plans.sequential(shape, num_ranks, pass_=pass_, policy=MOK_POLICY, num_sms=num_sms,
                            capacity_rows=capacity_rows)


def sequential_stage_parts(shape: MoEShape, pass_: str, gpu: GpuParams, seed: int = 0,
                           link: LinkModel | None = None, routing: RoutingSpec = UNIFORM, ep: int = EP) -> dict:
    """{layer stage: (kernels, work ns)} of rank 0 for the sequential layer on `gpu` (use
    `one_gpu(h200)` for bench_layer's emulation), its transfers paying `link` if one is given (an
    emulated link, mok_proto.link.LinkModel; its flags' round trips are work), rank 0 routed by
    `routing` (`emulation`; ep: the real layout's ranks): the stage takes kernels x gpu.launch_ns +
    work. Computed once per arguments (gpu by its fields); each call returns its own dict."""
    key = (shape, pass_, repr(gpu), seed, link, routing, ep)
    if key not in _STAGE_PARTS:
        if len(_STAGE_PARTS) >= 256:
            _STAGE_PARTS.clear()
        _STAGE_PARTS[key] = _stage_parts(shape, pass_, gpu, seed, link, routing, ep)
    return dict(_STAGE_PARTS[key])


_STAGE_PARTS: dict = {}  # sequential_stage_parts' results by its arguments


def _stage_parts(shape: MoEShape, pass_: str, gpu: GpuParams, seed: int, link: LinkModel | None,
                 routing: RoutingSpec, ep: int) -> dict:
    wide, num, need = emulation(shape, routing, seed, ep)
    p = _sequential_plan(wide, pass_, gpu.num_sms, num, need)
    result = simulate(p, gpu, emulated_load(shape, seed, routing=routing, ep=ep), link=link)
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
    for name, stage in LAYER_STAGES[pass_].items():
        sel = [s for s in range(num_stages) if stage.kinds and kinds_of_stage[s] <= {int(k) for k in stage.kinds}]
        work = float(stage_ns[sel].sum()) - len(sel) * gpu.launch_ns  # one launch per plan stage
        work += sum(token_kernel_ns(shape, gpu, kernel) for kernel in stage.token)
        if link is not None:
            work += stage.signals * link.latency_ns
        out[name] = (len(sel) + stage.kernels, work)
    return out


def sequential_stages_ns(shape: MoEShape, pass_: str, gpu: GpuParams, seed: int = 0,
                         link: LinkModel | None = None, routing: RoutingSpec = UNIFORM, ep: int = EP) -> dict:
    """{layer stage: predicted ns} of rank 0 for the sequential layer on `gpu` (use `one_gpu(h200)`
    for bench_layer's emulation; link, routing, ep: sequential_stage_parts'), plus "total" (their
    sum: the stages run back to back)."""
    out = {name: kernels * gpu.launch_ns + work
           for name, (kernels, work) in sequential_stage_parts(shape, pass_, gpu, seed, link, routing, ep).items()}
    out["total"] = sum(out.values())
    return out


def calibrate(gpu: GpuParams, shape_name: str, results_dir=results.RESULTS_DIR, measured_on: str = "h200") -> GpuParams:
    """`gpu` with the three parameters LAYER_CALIBRATION names, fitted on the newest compared
    bench_layer rows of shape_name measured on measured_on's GPU (both passes, `measured_rows`). Each stage is kernels x busy_kernel_ns + work
    (sequential_stage_parts), in this order:

    * busy_kernel_ns = the forward schedule stage / its 5 kernels (the model gives them no work);
    * sum_slots_efficiency = the weighted sum's traffic time at a copy's traffic rate / (its
      stage - one boundary): the kernel's traffic rate as a fraction of a copy's;
    * sustained_gemm = sum of the routed GEMM stages' isolated-rate work (bench_gemm's tile rates)
      / sum of (their stages - their boundaries): the same tiles under back-to-back load.
    """
    measured = {r["pass"]: r for r in measured_rows(results_dir, measured_on) if r["shape"] == shape_name}
    if set(measured) != set(plans.PASSES):
        raise ValueError(f"no bench_layer sequential rows of {shape_name} on an {gpus.spec(measured_on).match} for "
                         "both passes: the sustained-load calibration needs them")
    one = one_gpu(dataclasses.replace(gpu, sustained_gemm=1.0, sum_slots_efficiency=1.0, busy_kernel_ns=0.0))
    parts = {p: sequential_stage_parts(ep_share(shape_name, r["ep"]), p, one) for p, r in measured.items()}

    def ms(pass_, stage):
        return measured[pass_]["stages_ms"][stage] * 1e6

    (pass_, stage), = LAYER_CALIBRATION["busy_kernel_ns"]
    kernels, work = parts[pass_][stage]
    assert work == 0.0, "the schedule stage must be kernel boundaries only"
    kernel_ns = ms(pass_, stage) / kernels

    def rate_factor(field):  # predicted work at factor 1 / (measured - kernel boundaries), over its rows
        kernels_work = np.array([parts[p][s] for p, s in LAYER_CALIBRATION[field]])
        measured_ns = sum(ms(p, s) for p, s in LAYER_CALIBRATION[field]) - kernels_work[:, 0].sum() * kernel_ns
        return float(kernels_work[:, 1].sum() / measured_ns)

    return dataclasses.replace(gpu, busy_kernel_ns=kernel_ns, sum_slots_efficiency=rate_factor("sum_slots_efficiency"),
                               sustained_gemm=rate_factor("sustained_gemm"))


def describe_calibration(gpu: GpuParams) -> str:
    """What `calibrate` fitted, with the stages it used."""
    rows = {name: ", ".join(f"{p} {s}" for p, s in stages) for name, stages in LAYER_CALIBRATION.items()}
    return (f"busy_kernel_ns {gpu.busy_kernel_ns / 1e3:.2f} us ({rows['busy_kernel_ns']}), "
            f"sum_slots_efficiency {gpu.sum_slots_efficiency:.3f} ({rows['sum_slots_efficiency']}), "
            f"sustained_gemm {gpu.sustained_gemm:.3f} ({rows['sustained_gemm']})")
