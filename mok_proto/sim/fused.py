"""The fused passes (cuda/fused.cuh executing a `plan.fused_forward` / `plan.fused_backward` plan)
against their measured in-kernel timelines (results/timelines/, found through its index:
`results.timeline_index`), written by scripts/bench_layer.py for one EP=64 rank's share on one GPU
(2 virtual ranks, rank 0 traced: the emulation of sim/layer.py), times in ns from the first task's
start.

Shape legend: N tokens/rank, H hidden, K top-k, MB minibatch rows, C communicating CTAs.

* `timeline_plan`: the plan a timeline ran (the pass from its task kinds), rebuilt from its records
  (CTAs, communicating CTAs, minibatch rows, capacity, ring, which transfers ran inside,
  spread_from) and checked task by task against them, so the simulated and the measured records of
  one plan correspond one to one;
* `calibrate` (called by sim/calibrate.py): the in-kernel copy costs and the movers' token-task rates,
  each from the tasks of the one timeline of the set's GPU whose index row says sim_calibrates=<key>
  (FUSED_CALIBRATION; a key without one for that GPU: another set's fields, sim.gpus): a communicating CTA's copy rate per byte (the warp movers) and a task's fixed
  cost, the same two of the retired bulk-copy ring (per row), the spare warps' (per byte, from a
  comm_blocks == 0 timeline of a kernel whose counter waits back off), and the read and write rates of
  the fused backward's token-side tasks. The combine tasks (the same copies the other way), the GEMM
  tiles, the compute end, the kernel end and every other timeline stay predictions;
* `simulate_timeline`: the simulated timeline of the plan a measured one ran;
* `pass_ns`: the fused layer's forward pass as bench_layer times it (graph replays: the schedule's
  launches, the kernel, the flag, the wait and the weighted sum); `fused_pass_ns` either pass, with
  the knobs of a results row and bench_layer's emulated link (--link-gbps).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools

import numpy as np

from mok_proto import plan as plans
from mok_proto import results
from mok_proto.bench.emulation import UNIFORM_CAPACITY
from mok_proto.config import MOK_POLICY, MoEShape, ep_share
from mok_proto.link import LinkModel
from mok_proto.plan import BM, SEGMENT_ROWS, TaskKind
from mok_proto.routing import UNIFORM, RoutingSpec
from mok_proto.sim import gpus, layer
from mok_proto.sim.model import (ELEM_BYTES, MOVER_KIND_IDS, SimResult, fused_chunk_rows, plan_align, simulate,
                                 token_task_bytes)
from mok_proto.sim.params import GpuParams, kernel_of, spare_warps_spun

EP = layer.EP  # bench_layer emulates one rank of EP=64
BENCH_CAPACITY = UNIFORM_CAPACITY  # scripts/bench_layer.py sizes the layer for 1.15 N K receive rows (uniform)
KEY = ("block", "kind", "minibatch", "row_tile", "col_tile")  # what identifies a task in a record
# sim_calibrates key of a timeline's index row -> (its tasks fitted, the GpuParams fields they fit)
FUSED_CALIBRATION = {
    "fused": ("dispatch", ("comm_cta_gbs", "comm_task_ns")),  # communicating CTAs, the warp movers
    "fused_bulk": ("dispatch", ("bulk_row_ns", "bulk_task_ns")),  # communicating CTAs, the bulk ring
    "fused_spare": ("dispatch", ("spare_cta_gbs", "spare_task_ns")),  # spare warps (comm_blocks == 0)
    "fused_token": ("scale, slot_sum", ("token_read_gbs", "token_write_gbs")),  # the backward's token tasks
}


def emulated_load(shape: MoEShape, seed: int = 0, routing: RoutingSpec = UNIFORM, ep: int = EP,
                  align: int | None = None):
    """sim/layer.py's emulated load with a fused plan's padding (align: model.plan_align of the
    plan; None: SEGMENT_ROWS, the GPU layer's)."""
    return layer.emulated_load(shape, seed, align=align or SEGMENT_ROWS, routing=routing, ep=ep)


def _fused_plan(pass_: str, shape: MoEShape, num_ranks: int, knobs: plans.FusedKnobs, policy: tuple, num_sms: int,
                capacity_rows: int) -> plans.Plan:
    """plan.fused_forward / fused_backward, built once per arguments (policy: its items; knobs as
    the pass resolves them, so a default given or left out is one plan) for the timelines and passes
    simulated here: the same plans recur across runs, and a plan's proof is kept per object
    (Plan.check). The plans are shared: read them, never change them."""
    if knobs.routed_wgrads is False:
        raise ValueError("the simulator prices a fused backward with its routed weight gradients inside the kernel "
                         "(routed_wgrads=False: the FP8 layer's, which it does not model)")
    try:  # with its capacity: the ring and lookahead too, as the build resolves them (a default is one plan)
        resolved = knobs.resolved(pass_, dict(policy), capacity_rows // knobs.minibatch_rows if capacity_rows else None)
    except ValueError:  # (the build raises it, after its own checks)
        resolved = knobs.resolved(pass_, dict(policy))
    return _built_plan(pass_, shape, num_ranks, resolved, policy, num_sms, capacity_rows)


@functools.lru_cache(maxsize=128)
def _built_plan(pass_, shape, num_ranks, knobs, policy, num_sms, capacity_rows) -> plans.Plan:
    make = plans.fused_forward if pass_ == "fwd" else plans.fused_backward
    return make(shape, num_ranks, knobs, policy=dict(policy), num_sms=num_sms, capacity_rows=capacity_rows)


def timeline_pass(records: np.ndarray) -> str:
    """The pass ("fwd" or "bwd") of a fused timeline's records, from its task kinds."""
    bwd = plans.PASS_KINDS["bwd"]
    return "bwd" if np.isin(records["kind"], [int(bwd.first), int(bwd.comm_in), int(bwd.comm_out)]).any() else "fwd"


def timeline_plan(records: np.ndarray, shape: MoEShape, num_ranks: int = layer.EMULATED_RANKS,
                  prefer=None) -> plans.Plan:
    """The fused_forward (or, from a backward's records, fused_backward) plan whose tasks the
    records (in the plan's task order, as bench_layer writes them) are: CTAs, communicating CTAs
    (0: the chunks ride on compute CTAs), minibatch rows, capacity, ring, the transfers and (backward)
    the token gradients inside from the records; the GEMM order (`lookahead`, where the plan has it) and the tile pairs'
    clusters (`assign`) and their order (`raster`) the first that match; the claimed pool (`claim`)
    from the records' `claimed` rows, which match the plan's pool task by task but not by CTA (a
    pair's CTA is the one that claimed it). Communicating CTAs are below the first CTA with a table
    GEMM task (with none, below the first that ran a claimed one: wrong if that cluster claimed
    nothing, and then no plan matches). prefer: the timeline's index row (or any mapping), whose
    `assign` and `raster` are tried first (they do not change what the simulator predicts of the
    plan). Raises ValueError if no plan matches task by task. The knobs found are kept: the same
    tasks searched again with the same arguments build (or take) that plan at once."""
    pass_ = timeline_pass(records)
    k = plans.PASS_KINDS[pass_]
    kind = records["kind"]
    comm = np.isin(kind, MOVER_KIND_IDS)
    if not len(records) or comm.all():
        raise ValueError(f"a fused {pass_} timeline needs GEMM tasks")
    num_mb = int(records["minibatch"].max()) + 1
    tiles_per_mb = (int(records["row_tile"][kind == int(k.first)].max()) + 1) // num_mb
    minibatch_rows = tiles_per_mb * BM
    incoming, outgoing = (kind == int(k.comm_in)), (kind == int(k.comm_out))
    policy = dict(MOK_POLICY, **{k.in_op: "pull" if incoming.any() else "push",
                                 k.out_op: "push" if outgoing.any() else "pull"})
    ring = num_mb
    if incoming.any() and outgoing.any():  # incoming chunks of the first communicating CTA before its first outgoing
        moves = incoming | outgoing
        order = kind[moves & (records["block"] == records["block"][moves][0])]
        ring = int(np.argmax(order == int(k.comm_out)))
    # The claimed pairs (plan claim: the plan's last tasks, block num_sms) are recorded with the CTA
    # that claimed them
    pooled = records["claimed"]
    if pooled.sum() % 2 or np.any(comm & pooled):
        raise ValueError("the timeline's claimed tasks are not tile pairs")
    gemm_blocks = records["block"][~comm & ~pooled] if (~comm & ~pooled).any() else records["block"][~comm]
    comm_blocks = int(gemm_blocks.min()) // 2 * 2
    fields = dict(policy=policy, num_sms=int(records["block"].max()) + 1, capacity_rows=num_mb * minibatch_rows)
    knobs = dict(comm_blocks=comm_blocks, minibatch_rows=minibatch_rows, claim=int(pooled.sum()) // 2,
                 segment_rows=(prefer or {}).get("segment_rows"))
    spread = outgoing & (records["block"] >= comm_blocks) if comm_blocks else np.zeros_like(outgoing)
    if spread.any():  # outgoing chunks on compute CTAs: the spread minibatches (plan spread_from)
        knobs["spread_from"] = int(records["minibatch"][spread].min())
    if pass_ == "fwd":  # (a ring of every minibatch is the default: None, the plan the passes' defaults build)
        knobs["ring_minibatches"] = None if ring == num_mb else ring
    else:  # the token gradients and the scale inside the kernel (older timelines: outside it)
        knobs["token_grads"] = bool((kind == int(k.epilogue)).any())
        knobs["scale"] = bool((kind == int(TaskKind.SCALE)).any())
    make = plans.fused_forward if pass_ == "fwd" else plans.fused_backward
    tried = []
    preferred = dict(prefer or {})
    first = lambda choices, name: sorted(choices, key=lambda c: c != preferred.get(name))  # noqa: E731

    def plan_of(order, assign, raster):
        return _fused_plan(pass_, shape, num_ranks, plans.FusedKnobs(**knobs, **order, assign=assign, raster=raster),
                           tuple(fields["policy"].items()), fields["num_sms"], fields["capacity_rows"])

    def matches(plan):
        return (len(plan.tasks) == len(records) and np.array_equal(plan.tasks["block"] == plan.pool_block, pooled)
                and all(np.array_equal(plan.tasks[k][~pooled], records[k][~pooled]) if k == "block" else
                        np.array_equal(plan.tasks[k], records[k]) for k in KEY))
    # the same tasks searched again (another copy of a timeline, or its times edited): the knobs found
    searched = (hashlib.sha1(b"".join(np.ascontiguousarray(records[k]).tobytes() for k in KEY + ("claimed",))).digest(),
                len(records), shape, num_ranks, *(preferred.get(k) for k in ("assign", "raster", "segment_rows")))
    if searched in _FOUND and matches(plan := plan_of(*_FOUND[searched])):
        return plan
    for order in ({},) + tuple({"lookahead": a} for a in range(ring)):
        for assign, raster in itertools.product(first(plans.ASSIGNMENTS, "assign"), first(plans.RASTERS, "raster")):
            try:
                plan = plan_of(order, assign, raster)
            except ValueError as e:
                tried.append(f"{order or 'defaults'}, {assign}, {raster}: {e}")
                continue
            if matches(plan):
                _FOUND[searched] = (order, assign, raster)
                return plan
            tried.append(f"{order or 'defaults'}: {plan.describe()}")
    raise ValueError(f"the timeline's tasks are not those of any {make.__name__} plan tried: " + "; ".join(tried))


_FOUND: dict = {}  # timeline_plan's searches that matched: (the records' tasks, the arguments) -> the knobs


def calibration_timelines(key: str, results_dir=results.RESULTS_DIR, measured_on: str = "h200") -> list[dict]:
    """The index rows (mok_proto.results.timeline_index, with their `path`) of the timelines measured on
    measured_on's GPU (gpus.SPECS) that say sim_calibrates=key (FUSED_CALIBRATION)."""
    return gpus.rows_on(results.timeline_index(results_dir, sim_calibrates=key), measured_on)


def calibration_timeline(key: str, results_dir=results.RESULTS_DIR, measured_on: str = "h200") -> dict:
    """The index row of the one timeline of measured_on's GPU that says sim_calibrates=key
    (`calibration_timelines`). Raises ValueError without exactly one."""
    found = calibration_timelines(key, results_dir, measured_on)
    if len(found) != 1:
        raise ValueError(f"{len(found)} {gpus.spec(measured_on).match} timelines in "
                         f"{results.timelines_dir(results_dir)} say sim_calibrates={key!r}: the fused kernel's "
                         "calibration needs one")
    return found[0]


def calibrate(gpu: GpuParams, results_dir=results.RESULTS_DIR, measured_on: str = "h200",
              carried_from: GpuParams | None = None) -> GpuParams:
    """`gpu` with the in-kernel copy costs fitted on dispatch tasks (`_fit_dispatch`): comm_task_ns
    + bytes / comm_cta_gbs on the communicating CTAs (warp movers) of the timeline that
    sim_calibrates "fused", bulk_task_ns + rows x bulk_row_ns on those (bulk ring) of "fused_bulk",
    and spare_task_ns + bytes / spare_cta_gbs on the spare warps of "fused_spare"; token_read_gbs and
    token_write_gbs on the token-side tasks of "fused_token" (`_fit_token`). Each from the timeline
    of measured_on's GPU (`calibration_timeline`); a key with no such timeline takes its fields from
    carried_from (None: ValueError, `calibration_timeline`'s)."""
    fields = {}
    for key, (_, names) in FUSED_CALIBRATION.items():
        if carried_from is not None and not calibration_timelines(key, results_dir, measured_on):
            fields.update({name: getattr(carried_from, name) for name in names})
        else:
            fields.update(_FITS[key](calibration_timeline(key, results_dir, measured_on)))
    return dataclasses.replace(gpu, **fields)


def _fit_movers(entry: dict, mover: str, task: str, rate: str, per_byte: bool = True) -> dict:
    """The fields `task` (fixed ns per task) and `rate` of a timeline's dispatch tasks (`_fit_dispatch`):
    per byte (GB/s per CTA) or per row (ns)."""
    (fixed, row_ns), row_bytes = _fit_dispatch(entry, mover)
    return {task: fixed, rate: row_bytes / row_ns if per_byte else row_ns}


_FITS = {  # sim_calibrates key -> its index row -> the fields it fits (FUSED_CALIBRATION)
    "fused": lambda entry: _fit_movers(entry, "warps", "comm_task_ns", "comm_cta_gbs"),
    "fused_bulk": lambda entry: _fit_movers(entry, "bulk", "bulk_task_ns", "bulk_row_ns", per_byte=False),
    "fused_spare": lambda entry: _fit_movers(entry, "spare", "spare_task_ns", "spare_cta_gbs"),
    "fused_token": lambda entry: dict(zip(("token_read_gbs", "token_write_gbs"), _fit_token(entry))),
}


def _fit_token(entry: dict) -> tuple[float, float]:
    """(read, write) GB/s per CTA of a fused backward timeline's token-side tasks (SCALE, SLOT_SUM, on
    the spare warps of a comm_blocks == 0 plan; entry: its index row): duration = bytes read / read
    rate + bytes written / write rate (model.token_task_bytes), least squares over every such task;
    the two kinds mix reads and writes differently (a scale task writes K rows per row read, a
    token-gradient task reads 2K + 1 (+ 1) rows per row written), which fixes both rates. With every
    tile full (16 tokens: the calibration timeline's) there are two distinct byte counts for two
    unknowns, so the fit reproduces each kind's mean exactly and does not test the read/write split
    (the other shapes' tasks do: sim --validate). A task's bar starts when its wait is met
    (trace.py), so its duration is its work."""
    path = entry["path"]
    records = results.load_timeline(path)
    shape = ep_share(entry["shape"], EP)
    plan = timeline_plan(records, shape, prefer=entry)
    if plan.pass_ != "bwd" or plan.comm_blocks or not (plan.scale and plan.token_grads):
        raise ValueError(f"{path.name}: the token-task calibration needs a comm_blocks == 0 fused backward with its "
                         f"scale and token gradients inside, got {plan.describe()}")
    cols, durations = [], []
    for kind in (TaskKind.SCALE, TaskKind.SLOT_SUM):
        sel = records["kind"] == int(kind)
        cols.append(np.stack(token_task_bytes(shape, kind, records["row_tile"][sel]), axis=1))
        durations.append(records["end_ns"][sel] - records["start_ns"][sel])
    (ns_per_read, ns_per_write), *_ = np.linalg.lstsq(np.concatenate(cols), np.concatenate(durations).astype(np.float64),
                                                      rcond=None)
    if ns_per_read <= 0 or ns_per_write <= 0:
        raise ValueError(f"{path.name}: the token tasks' fit gave no positive rates "
                         f"({ns_per_read:.3g}, {ns_per_write:.3g} ns per byte)")
    return 1.0 / float(ns_per_read), 1.0 / float(ns_per_write)


def _fit_dispatch(entry: dict, mover: str) -> tuple[tuple[float, float], int]:
    """((fixed ns per task, ns per row), row bytes) of a timeline's dispatch tasks (entry: its index
    row): duration = fixed + rows x per row, least squares over every dispatch task, its rows those
    the simulator gives it (model.fused_chunk_rows on the emulated load: full chunks of MB / C rows,
    the partial chunk of the last used minibatch, empty chunks past the padded rows). A dispatch
    chunk of a full ring waits for nothing, so its bar is its copy. One timeline has one row size,
    so its ns per row is also a rate per byte (row bytes / ns per row: the warp movers'
    comm_cta_gbs, the spare warps' spare_cta_gbs). mover: what the timeline must have run
    (params.COMM_MOVERS, or "spare": comm_blocks == 0, the spare warps of compute CTAs move the
    chunks); a communicating CTA's mover is the entry's comm_mover. A spare-warp timeline must come
    from a kernel whose counter waits back off (wait_spin): the model stands for that kernel, and
    with the acquire spin the spare warps' passes ran slower (params.spare_warps_spun)."""
    path = entry["path"]
    records = results.load_timeline(path)
    shape = ep_share(entry["shape"], EP)
    plan = timeline_plan(records, shape, prefer=entry)
    kernel = kernel_of(entry)
    ran = "spare" if plan.comm_blocks == 0 else kernel["comm_mover"]
    if ran != mover:
        raise ValueError(f"{path.name}: comm_blocks={plan.comm_blocks} with comm_mover {kernel['comm_mover']!r} ran "
                         f"the {ran} movers, but this calibration needs the {mover} ones")
    if mover == "spare" and spare_warps_spun(entry, plan.comm_blocks, plan.spread_from):
        raise ValueError(f"{path.name}: its kernel ran the {kernel['wait_spin']} spin, "
                         "but the spare warps' calibration needs one whose counter waits back off")
    _, used = fused_chunk_rows(plan, emulated_load(shape, align=plan_align(plan)))
    sel = records["kind"] == int(TaskKind.DISPATCH)
    rows = used[records["minibatch"][sel], records["row_tile"][sel], 0].astype(np.float64)
    dur = records["end_ns"][sel] - records["start_ns"][sel]
    (fixed, row_ns), *_ = np.linalg.lstsq(np.stack([np.ones_like(rows), rows], axis=1), dur, rcond=None)
    return (float(fixed), float(row_ns)), shape.hidden * ELEM_BYTES


def describe_calibration(gpu: GpuParams) -> str:
    """What `calibrate` fitted, with the timelines' tasks it used (by their sim_calibrates key)."""
    return (f"comm_cta_gbs {gpu.comm_cta_gbs:.1f} GB/s per CTA and comm_task_ns {gpu.comm_task_ns / 1e3:.2f} us "
            f"(fused: dispatch tasks); bulk ring bulk_row_ns {gpu.bulk_row_ns:.0f} ns per row per CTA and "
            f"bulk_task_ns {gpu.bulk_task_ns / 1e3:.2f} us (fused_bulk: dispatch tasks); spare warps {gpu.spare_cta_gbs:.2f} GB/s per CTA "
            f"and {gpu.spare_task_ns / 1e3:.2f} us per task (fused_spare: dispatch tasks); "
            f"token tasks {gpu.token_read_gbs:.2f} GB/s read and {gpu.token_write_gbs:.2f} GB/s written per CTA "
            f"(fused_token: scale and slot_sum tasks)")


def simulate_timeline(records: np.ndarray, shape: MoEShape, gpu: GpuParams,
                      kernel=None) -> tuple[plans.Plan, SimResult]:
    """The plan a measured timeline ran, simulated as bench_layer runs it (`layer.one_gpu(gpu)` on
    the emulated load); its records: `result.records(0)`. kernel: the timeline's index row (or
    any mapping of its kernel features, params.kernel_of), to simulate the kernel it ran
    (GpuParams.recorded_at); None: gpu's own."""
    plan = timeline_plan(records, shape, prefer=kernel)
    gpu = gpu if kernel is None else gpu.recorded_at(kernel)
    return plan, simulate(plan, layer.one_gpu(gpu), emulated_load(shape, align=plan_align(plan)))


def pass_ns(shape: MoEShape, gpu: GpuParams, comm_blocks: int, minibatch_rows: int, num_sms: int,
            claim=0, segment_rows: int | None = None) -> float:
    """The fused forward pass as bench_layer times it (`fused_pass_ns`, no link) with these knobs;
    claim, segment_rows: the plan's (plan.FusedKnobs; claim 0: no pool, static tables)."""
    knobs = plans.FusedKnobs(comm_blocks, minibatch_rows, claim=claim, segment_rows=segment_rows)
    return fused_pass_ns(shape, gpu, "fwd", knobs, num_sms)


def fused_pass_ns(shape: MoEShape, gpu: GpuParams, pass_: str, knobs: plans.FusedKnobs, num_sms: int,
                  link: LinkModel | None = None, routing: RoutingSpec = UNIFORM, ep: int = EP) -> float:
    """A fused pass as bench_layer times it (graph replays) on `gpu` (h200), with the plan `knobs`
    build (MoK's directions, bench_layer's capacity) and its transfers paying `link` (an emulated
    link, mok_proto.link.LinkModel) if one is given, rank 0 routed by `routing` (layer.emulation;
    ep: the real layout's ranks): the forward's schedule kernels (sim/layer.py's forward
    "schedule" stage), then the simulated pass (the forward: the counters' memset, the kernel, the
    flag and the wait, the weighted sum; the backward from its round's start). Computed once per
    arguments (gpu by its fields)."""
    key = (shape, repr(gpu), pass_, knobs, num_sms, link, routing, ep)
    if key not in _PASS_NS:
        rows = knobs.minibatch_rows
        wide, num, need = layer.emulation(shape, routing, 0, ep, knobs.segment_rows)
        need = need or int(BENCH_CAPACITY * shape.num_tokens * shape.top_k)
        capacity = -(-need // rows) * rows
        plan = _fused_plan(pass_, wide, num, knobs, tuple(MOK_POLICY.items()), num_sms, capacity)
        one = layer.one_gpu(gpu)
        outside = 0.0
        if pass_ == "fwd":
            schedule = layer.LAYER_STAGES["fwd"]["schedule"]
            outside = schedule.kernels * one.launch_ns
            if link is not None:
                outside += schedule.signals * link.latency_ns
        if len(_PASS_NS) >= 512:
            _PASS_NS.clear()
        load = emulated_load(shape, routing=routing, ep=ep, align=plan_align(plan))
        _PASS_NS[key] = outside + simulate(plan, one, load, link=link).time_ns
    return _PASS_NS[key]


_PASS_NS: dict = {}  # fused_pass_ns's results: (its arguments, gpu by its repr) -> ns


def measured_grid(shape_name: str, gpu: GpuParams, comm_blocks=(0, 8, 12, 16), minibatches=(512, 1024, 2048, 4096),
                  results_dir=results.RESULTS_DIR, measured_on: str = "h200"):
    """The fused forward pass on measured_on's GPU (gpus.SPECS) over communication CTAs x minibatch rows
    for one shape: (simulated ms [len(comm_blocks), len(minibatches)], {(comm, minibatch): measured ms}).
    The measured points are the newest run's fused forward rows for that shape among bench_layer's
    compared rows (layer.compared_rows) and sweep_overlap.jsonl (scripts/sweep_overlap.py) of that GPU; points off the grid
    are dropped, and so are points with communicating CTAs measured on the retired bulk-copy ring
    (comm_mover "bulk": not the kernel `gpu` simulates), points whose spare warps ran the retired
    acquire spin (params.spare_warps_spun), and points of another tile-pair order than the default
    raster (the simulator prices both orders alike). The grid is simulated with the segment rule
    those points ran with (their `segment_rows`; none: SEGMENT_ROWS)."""
    shape = ep_share(shape_name, EP)
    raster = plans.FusedKnobs.PASS_DEFAULTS["fwd"]["raster"]
    rows = []
    for mb_key, found in (("minibatch_tokens", layer.compared_rows(results_dir, measured_on=measured_on)),
                          ("minibatch_rows", gpus.rows_on(results.load("sweep_overlap", results_dir), measured_on))):
        rows += [dict(r, minibatch=r[mb_key]) for r in found if r.get("shape") == shape_name
                 and r.get("schedule", "fused") == "fused" and r.get("pass", "fwd") == "fwd"
                 and not (r.get("comm_blocks") and kernel_of(r)["comm_mover"] == "bulk")
                 and not spare_warps_spun(r, r.get("comm_blocks"), r.get("spread_from"))
                 and r.get("raster", raster) == raster]
    measured, newest = {}, results.newest(rows)
    for r in newest:
        key = (r["comm_blocks"], r["minibatch"])
        if key[0] in comm_blocks and key[1] in minibatches:
            measured[key] = r["median_ms"]
    rule = newest[0].get("segment_rows") if newest else None
    sim_ms = np.array([[pass_ns(shape, gpu, c, m, gpu.num_sms, segment_rows=rule) / 1e6 for m in minibatches]
                       for c in comm_blocks])
    return sim_ms, measured


def fused_gemm_rows(shape_name: str, results_dir=results.RESULTS_DIR, measured_on: str = "h200") -> list[dict]:
    """The rows `fit_fused_gemm` fits on: the fused rows (both passes, every setting) of the newest
    run of shape_name among bench_layer's compared rows of measured_on's GPU (no link: those are
    bench_layer_link's), less the rows of params.spare_warps_spun."""
    rows = [r for r in layer.compared_rows(results_dir, measured_on=measured_on) if r["shape"] == shape_name]
    newest = results.newest(rows)
    return [r for r in newest if r["schedule"] == "fused"
            and not spare_warps_spun(r, r["comm_blocks"], r.get("spread_from"))]


def fit_fused_gemm(gpu: GpuParams, shape_name: str, results_dir=results.RESULTS_DIR,
                   measured_on: str = "h200") -> GpuParams:
    """`gpu` with fused_gemm such that the simulated fused passes of `fused_gemm_rows` take, in sum,
    their measured time: a fixed point of f <- f x simulated(f) / measured (the passes are mostly
    GEMM tiles, so a few steps settle it). ValueError without rows."""
    rows = fused_gemm_rows(shape_name, results_dir, measured_on)
    if not rows:
        raise ValueError(f"no fused bench_layer rows of {shape_name} on an {gpus.spec(measured_on).match}: the "
                         f"fused_gemm fit needs them (python scripts/bench_layer.py --shapes {shape_name})")
    measured = sum(r["median_ms"] for r in rows) * 1e6
    factor = 1.0
    for _ in range(4):
        trial = dataclasses.replace(gpu, fused_gemm=factor)
        simulated = sum(fused_pass_ns(ep_share(r["shape"], r["ep"]), trial.recorded_at(r), r["pass"],
                                      plans.FusedKnobs.from_row(r), r["num_sms"]) for r in rows)
        factor *= simulated / measured
    if abs(simulated / measured - 1.0) > 1e-3:
        raise ValueError(f"the fused_gemm fit on {shape_name} did not settle: simulated / measured "
                         f"{simulated / measured:.4f} after the last step")
    return dataclasses.replace(gpu, fused_gemm=factor)
