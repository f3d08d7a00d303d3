"""bench_layer.py's run of one shape: our layer's passes (mok_proto.bench.layer.ours), the torch
pipeline and the device schedule, then the same passes and fused settings at each emulated link
speed, where only the layer's RunConfig differs (its `link`); each part's rows, lines and verdicts
(mok_proto.bench.layer_rows) handed to `emit`. The emulation's inputs follow the routing spec
(emulation.emulated_inputs), and every row records it (emulation.row_fields)."""

from __future__ import annotations

from mok_proto.bench.emulation import EP, emulated_inputs, ring_rows, row_fields, schedule_at_ep64
from mok_proto.bench.layer import ours
from mok_proto.bench.layer_rows import link_report, shape_report
from mok_proto.bench.rows import git_sha
from mok_proto.bench.timeline_plot import timeline_path
from mok_proto.bench.torch_baselines import torch_pipeline


def run_shape(name: str, args, emit) -> tuple:
    """One shape, as bench_layer.py's arguments say (iters, warmup, settings: {pass: FusedKnobs},
    timeline: the template, bars, links: LinkModels with every_row, routing: a RoutingSpec):
    emit(report) for the part without the link, then for each link speed. Returns (the run without
    the link: layer.Measured, {link: its table rows})."""
    from mok_proto.config import get_shape
    from mok_proto.memory import layer_memory

    shape, data = emulated_inputs(name, args.routing)
    fields = row_fields(data)
    ring = ring_rows(getattr(args, "macrobatch_rows", None), fields["received_rows"])
    # the ring the layer runs with, and what the real EP=64 layout needs per rank (its default ring)
    fields.update(macrobatch_rows=ring, memory_bytes=layer_memory(get_shape(name), EP).total_bytes)
    num = len(data["topk_idx"])
    print(f"# {name}: N={shape.num_tokens} H={shape.hidden} I={shape.ffn} El={shape.num_experts // num} "
          f"K={shape.top_k}, routing {fields['routing']}: {fields['emulation']}, rank 0 receives "
          f"{fields['received_rows']} rows ...", flush=True)
    measured = ours(shape, data, args.iters, args.warmup, args.settings, timeline_path(args.timeline, name, git_sha()),
                    index={"bench": "bench_layer", "shape": name, "routing": fields["routing"]}, macrobatch_rows=ring)
    baseline = torch_pipeline(shape, data, args.iters, args.warmup)
    schedule = schedule_at_ep64(name, args.iters, args.warmup, args.routing)
    emit(shape_report(name, shape, measured, baseline, schedule, args.bars, fields))
    tables = {}
    for link in args.links:
        print(f"# {name}: with the emulated link, {link.gbps:g} GB/s ...", flush=True)
        got = ours(shape, data, args.iters, args.warmup, args.settings,
                   timeline_path(args.timeline, name, git_sha(), link),
                   index={"bench": "bench_layer_link", "shape": name, "routing": fields["routing"], **link.describe()},
                   link=link, macrobatch_rows=ring)
        report = link_report(name, shape, link, got, measured, args.bars, fields)
        emit(report)
        tables[link] = report.table
    return measured, tables
