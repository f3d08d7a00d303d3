"""bench_layer.py's run of one shape: our layer's passes (mok_proto.bench.layer.ours), the torch
pipeline and the device schedule, then the same passes and fused settings at each emulated link
speed, where only the layer's RunConfig differs (its `link`); each part's rows, lines and verdicts
(mok_proto.bench.layer_rows) handed to `emit`. The emulation's inputs follow the routing spec
(emulation.emulated_inputs), and every row records it (emulation.row_fields). With precision fp8
the layer runs FP8 routed experts, and the run adds the torch FP8 pipeline (torch_fp8) and the
BF16 layer's results on the same inputs, the reference of its errors (fp8_run)."""

from __future__ import annotations

import dataclasses

from mok_proto.bench.emulation import EP, emulated_inputs, ring_rows, row_fields, schedule_at_ep64
from mok_proto.bench.layer import layer_results, ours
from mok_proto.bench.layer_rows import Fp8Run, link_report, shape_report
from mok_proto.bench.rows import git_sha
from mok_proto.bench.timeline_plot import timeline_path
from mok_proto.bench.torch_baselines import torch_pipeline
from mok_proto.bench.torch_fp8 import backward_note, torch_fp8_pipeline

REFERENCE_NAME = "bf16 layer, same inputs and run"  # what an FP8 run's err_rel_rms and err_max are against


def run_shape(name: str, args, emit) -> tuple:
    """One shape, as bench_layer.py's arguments say (iters, warmup, settings: {pass: FusedKnobs},
    timeline: the template, bars, links: LinkModels with every_row, routing: a RoutingSpec, precision,
    dispatch_dtypes, wgrad_precisions: the RunConfig's, each pair's layer in turn):
    emit(report) for the part without the link, then for each link speed, per layer. Returns
    (the last layer's run without the link: layer.Measured, {link: its table rows, every layer's})."""
    from mok_proto.config import get_shape
    from mok_proto.memory import layer_memory

    shape, data = emulated_inputs(name, args.routing)
    fields = row_fields(data)
    ring = ring_rows(getattr(args, "macrobatch_rows", None), fields["received_rows"])
    fields["macrobatch_rows"] = ring  # the ring the layer runs with
    num = len(data["topk_idx"])
    print(f"# {name}: N={shape.num_tokens} H={shape.hidden} I={shape.ffn} El={shape.num_experts // num} "
          f"K={shape.top_k}, routing {fields['routing']}: {fields['emulation']}, rank 0 receives "
          f"{fields['received_rows']} rows ...", flush=True)
    baseline = fp8 = schedule = None
    tables = {link: [] for link in args.links}
    # each (dispatch dtype, weight-gradient precision)'s layer in turn (an FP8 run may time several);
    # the baselines once, after the first, and their rows recorded once
    dtypes, wgrads = args.dispatch_dtypes, getattr(args, "wgrad_precisions", [None])
    stem, jsonl = (args.timeline.removesuffix(".jsonl"), ".jsonl" if args.timeline.endswith(".jsonl") else "")
    for dtype, wgrad in ((d, w) for d in dtypes for w in wgrads):
        parts = [f"{dtype} dispatch"] * (len(dtypes) > 1) + [f"{wgrad} wgrad"] * (len(wgrads) > 1)
        tag = f" ({', '.join(parts)})" if parts else ""
        if tag:
            print(f"# {name}: the layer with {', '.join(parts)} ...", flush=True)
        run = {"precision": args.precision, "dispatch_dtype": dtype, "wgrad_precision": wgrad}
        # what this layer's real EP=64 layout needs per rank (its default ring)
        layer_fields = {**fields, "memory_bytes": layer_memory(get_shape(name), EP, **run).total_bytes}
        # the rows and timelines of an FP8 layer name it
        fp8_index = {k: v for k, v in run.items() if v is not None} if args.precision == "fp8" else {}
        # with several layers each one's timelines get their own names (also outside results/timelines)
        suffix = "".join(f"_{p.replace(' ', '-')}" for p in parts)
        template = f"{stem}{suffix}{jsonl}" if tag and args.timeline else args.timeline
        measured = ours(shape, data, args.iters, args.warmup, args.settings,
                        timeline_path(template, name, git_sha()),
                        index={"bench": "bench_layer", "shape": name, "routing": fields["routing"], **fp8_index},
                        macrobatch_rows=ring, **run)
        first = baseline is None
        if first:
            baseline = torch_pipeline(shape, data, args.iters, args.warmup)
            fp8 = fp8_run(shape, data, args, ring, dtype) if args.precision == "fp8" else None
            schedule = schedule_at_ep64(name, args.iters, args.warmup, args.routing)
        if fp8 is not None:
            fp8 = dataclasses.replace(fp8, dispatch_dtype=dtype, wgrad_precision=wgrad or "fp8")
        report = shape_report(name, shape, measured, baseline, schedule, args.bars, layer_fields, fp8)
        if not first:
            report.rows = [(f, r) for f, r in report.rows if r["schedule"] not in ("torch", "torch_fp8")]
        report.failed = [f + tag for f in report.failed]
        emit(report)
        for link in args.links:
            print(f"# {name}: with the emulated link, {link.gbps:g} GB/s{tag} ...", flush=True)
            got = ours(shape, data, args.iters, args.warmup, args.settings,
                       timeline_path(template, name, git_sha(), link),
                       index={"bench": "bench_layer_link", "shape": name, "routing": fields["routing"], **fp8_index,
                              **link.describe()},
                       link=link, macrobatch_rows=ring, **run)
            report = link_report(name, shape, link, got, measured, args.bars, {**layer_fields, **fp8_index})
            report.failed = [f + tag for f in report.failed]
            emit(report)
            tables[link] += [f"# {', '.join(parts)}"] * bool(tag) + report.table
    return measured, tables


def fp8_run(shape, data, args, ring, dispatch_dtype: str) -> Fp8Run:
    """An FP8 run's additions (layer_rows.Fp8Run): the torch FP8 pipeline's forward, and the BF16
    layer's results on the same inputs and ring (its errors' reference: a float64 reference of rank
    0's share would cost more than the run)."""
    stats, why = torch_fp8_pipeline(shape, data, args.iters, args.warmup)
    note = why if stats is None else backward_note()
    reference = layer_results(shape, data, ring)
    return Fp8Run(args.precision, dispatch_dtype, stats, note, reference, REFERENCE_NAME)
