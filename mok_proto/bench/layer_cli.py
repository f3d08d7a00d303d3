"""python scripts/bench_layer.py [--shapes kimi-k2.7,...] [--iters 20] [--warmup 5] [--sweep] [--link-gbps 368,900] [--routing hot:0.25] [--precision fp8 [--dispatch-dtype bf16,fp8] [--wgrad-precision fp8,bf16]]

One rank's share of an EP=64 MoE layer on one GPU: our GPU layer against the unfused PyTorch
pipeline (../shared/anchors: index_select dispatch, torch._grouped_mm experts, autograd backward),
forward and backward, on the same inputs, in one run.

The EP=64 share, emulated on one GPU (mok_proto.bench.emulation): 2 virtual ranks with El = E/64
experts each (E' = 2 El), N = 2048 tokens per rank, uniform random top-K routing: rank 0 then
receives the ~N*K rows an EP=64 rank receives, for the same El experts, and computes the same
FLOPs. Rank 1 stands for the peers: one full round of both ranks stages everything rank 0 reads
from peers (their token rows, routing, receive-row map, result rows, output-gradient slots), then
rank 0's flags from rank 1 are raised to the largest epoch, and only rank 0's kernels run in the
timed region. Ours is timed as CUDA-graph replays of the forward and of the backward (the layer
has no host readback, so that is how it runs in training); torch runs eagerly, exactly as the
anchor defines it: the dispatch source holds all 64 ranks' token rows and requires grad,
gradients accumulate across the timed iterations (ours are stored, as MoK's first macrobatch
does), and its backward is t(forward + backward) - t(forward under no_grad). Column `x 2n` (bwd
rows) is the speedup against a lighter variant measured in the same run (a 2 N-row dispatch
source, the backward timed by events around autograd.backward alone); the bar applies to the
anchor's definition. One event pair per iteration, median (p20, p80). Also: the stage-by-stage
breakdown of our passes (eager, event per stage), whether two runs are bitwise equal, the max
error against torch. FLOPs as MoK counts them: forward 6 (N + N K) H I, backward twice that.

The fused forward (one persistent launch of a plan.fused_forward plan, cuda/fused.cuh) is timed
the same way for each (communication CTAs, minibatch rows) setting (--sweep: a grid of them, a
progress line each), its replays interleaved with the sequential forward's (the SM clock moves
under the power cap within one pass's time: x sequential is the median of the per-iteration
ratios; `sequential_median_ms` is the sequential pass of that interleaved run), its output
compared bitwise with the sequential forward of the same run (`equal_to_sequential`); the best
setting per shape (the largest x sequential: best_row) is timed once more and judged on that,
and its timeline written under results/timelines/ (JSON lines + PNG, a row in its index). The
fused backward likewise (its gradients compared bitwise with the sequential backward's). --assign,
--raster, --token-grads, --scale: the fused plans' options (recorded in each fused row).
--directions times other transfer-direction policies too, after every shape's MoK rows
(sequential, and fused at the settings best for MoK's forward or backward; outputs compared
bitwise with that policy's sequential layer; rows in results/bench_layer_directions.jsonl, not
judged by the bars).
`schedule_ms` is the device schedule of one rank at the real EP=64 (64 virtual ranks, the
all-gathered routing staged, graph replays), checked against schedule.py.

--routing uniform | zipf:ALPHA | hot:FRACTION (mok_proto.routing; default uniform, the emulation
above): rank 0 receives, per local expert, the rows rank 0 of the real EP=64 layout drawn under the
spec receives (hot:F: a fraction F of the first choices of all 64 N tokens on rank 0's experts,
about (64 F + K - 1) N rows); as one peer's N tokens cannot send that many, W = 1 + P virtual
ranks, P the fewest whose tokens carry them (mok_proto.bench.emulation.emulated_topk), all staged
and frozen alike, the layer sized for the routing's exact receive rows. Every row records
`routing`, `emulation` (its virtual ranks) and `received_rows` (rank 0's); under a skewed routing
the FLOPs count rank 0's received rows for N K. The device schedule runs under the same routing.

--link-gbps G[,G...]: each shape runs again with an emulated link of G GB/s per direction
(mok_proto.link.LinkModel, round trip --link-latency-us; every row rank 0 receives or sends back
pays it, every_row), the same passes and fused settings as without it (the same functions, the
layer's RunConfig with the link): its rows (sequential and fused, no torch: its pipeline crosses
no link) go to results/bench_layer_link.jsonl with `link_gbps`, every result checked bitwise
against the run without the link (`equal_to_no_link`), each fused row with its
`overlap_efficiency` (mok_proto.bench.layer_rows), its timelines indexed as bench_layer_link,
and a table per link speed after every shape.

--precision fp8 [--dispatch-dtype bf16|fp8]: the routed experts in block-scaled e4m3 (RunConfig
precision, dispatch_dtype; `--dispatch-dtype bf16,fp8`: one layer each, timed one after the
other against the same torch pipelines); the fused settings run fused_forward_fp8 and
fused_backward_fp8 (its routed weight gradients after the kernel: rows record routed_wgrads false;
--directions is refused). Every row records `precision` and `dispatch_dtype` (its layer's; the torch
rows, recorded once, the first layer's). The BF16 torch pipeline stays `speedup_vs_torch`'s baseline; the
torch FP8 pipeline (mok_proto.bench.torch_fp8: torch._scaled_grouped_mm, row-wise scales) is a
second, forward only (a `torch_fp8` row, `speedup_vs_torch_fp8`, `torch_fp8_note` says why). Each
sequential row's `err_rel_rms`, `err_max` (the worst of the pass's arrays, `errors` per array) are
against the BF16 layer on the same inputs (`err_reference`), and judged by err_rel_rms <= 0.08
(mok_proto.accuracy.ERR_REL_RMS_RECIPE) instead of the max error against torch. Its fused passes
are judged by layer_rows.FP8_BARS (the FP8 layer's: x the BF16 torch pipeline, the forward x the
torch FP8 one too; x sequential printed, not judged; with --link-gbps the link's bars as in a BF16 run).
`--wgrad-precision bf16` (or `fp8,bf16`: one layer each, after each dispatch dtype's): the routed
weight gradients from bf16 operands (RunConfig.wgrad_precision); rows record `wgrad_precision`.

Bars: --bar KEY=VALUE (--help lists them with their defaults); checks: bitwise repeat, fused equal
to sequential, the error against torch, the schedule equal to schedule.py.
Exit status: 0 all met, 1 a bar or a check failed (listed), 2 no GPU/torch or a bad argument.
Results: JSON lines appended to results/bench_layer.jsonl (without the link: `link_gbps` null).
"""

from __future__ import annotations

import dataclasses
import sys

from mok_proto.bench.cli import add_bar_option, add_routing_option, parse_bars, parser
from mok_proto.bench.emulation import check_ring_option, emulated_inputs
from mok_proto.bench.layer import best_row, directions_rows
from mok_proto.bench.layer_rows import BARS, FP8_BARS, HEADER, link_table
from mok_proto.bench.layer_run import run_shape
from mok_proto.bench.settings import DEFAULT_FUSED, SCALE, SWEEP, TOKEN_GRADS, direction_policies, parse_settings
from mok_proto.config import PAPER_SHAPES, PRECISIONS
from mok_proto.link import DEFAULT_LATENCY_US, LinkModel
from mok_proto.plan import ASSIGNMENTS, RASTERS, SEGMENT_ROWS, FusedKnobs


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--shapes", default=",".join(PAPER_SHAPES))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="time the fused passes over communication CTAs x "
                   f"minibatch rows {SWEEP} (default: {DEFAULT_FUSED})")
    p.add_argument("--fused", default=None, help="fused settings to time, COMM:MINIBATCH[:CLAIM][,...] (e.g. "
                   "8:1024,0:2048:264,0:2048:all; CLAIM: tile pairs claimed at run time, an int, all or tail: "
                   "plan.fused_forward)")
    p.add_argument("--no-fused", action="store_true", help="sequential and torch rows only")
    defaults = FusedKnobs.PASS_DEFAULTS
    p.add_argument("--assign", default=None, choices=ASSIGNMENTS, help="the fused plans' tile pairs to clusters "
                   f"(default {defaults['fwd']['assign']} forward, {defaults['bwd']['assign']} backward; recorded in "
                   "the fused rows as `assign`)")
    p.add_argument("--raster", default=None, choices=RASTERS, help="the order of a minibatch's tile pairs in the "
                   f"fused plans (default {defaults['fwd']['raster']}; recorded in the fused rows as `raster`)")
    p.add_argument("--token-grads", default="default", choices=tuple(TOKEN_GRADS),
                   help="the fused backward's slot sum and d topk_weights: inside the kernel, after it, or the "
                        "plan's default (inside whenever the reverse-dispatch is pushed inside)")
    p.add_argument("--scale", default="default", choices=tuple(SCALE),
                   help="the fused backward's dy_slots = w * dout: inside the kernel, before it, or the plan's "
                        "default (inside whenever the reverse-combine is pulled inside)")
    p.add_argument("--directions", default="mok", help="transfer directions: 'mok', 'all' (the four "
                   "(incoming, outgoing) pairs, the backward mirroring the forward) or dispatch:combine:rev_combine:"
                   "rev_dispatch,... (e.g. push:pull:push:pull). Policies other than MoK's, after every shape's MoK "
                   "rows, time the sequential layer and the fused settings that were best for MoK's forward or "
                   "backward (communicating CTAs 0 where the policy moves nothing inside the kernel; no torch, no "
                   "timeline) into results/bench_layer_directions.jsonl; their outputs must equal their sequential "
                   "layer's")
    p.add_argument("--link-gbps", default=None, metavar="G[,G...]",
                   help="also run each shape with an emulated link of G GB/s per direction (module doc)")
    p.add_argument("--link-latency-us", type=float, default=DEFAULT_LATENCY_US,
                   help="the emulated link's round trip (mok_proto.link)")
    p.add_argument("--timeline", default="results/timelines/timeline_fused_{link}{pass_}_{shape}_{git}.jsonl",
                   help="where the best fused setting's timeline goes ({pass_}, {shape}, {git} are replaced, {link} "
                        "by '' without the link and link<G>_ with it; '' = none); in results/timelines/ it is stored "
                        "gzipped with its row in the index there")
    add_routing_option(p, "rank 0 the timed rank of EP=64")
    p.add_argument("--macrobatch-rows", default=None, metavar="M|Fx",
                   help=f"the layer's ring: M receive rows (a multiple of {SEGMENT_ROWS}), or F x rank 0's received rows "
                        f"(e.g. 0.25x, rounded down to whole {SEGMENT_ROWS}-row segments); default: a ring that holds every row. "
                        "With several turns the backward replays the forward of the turns it did not keep "
                        "(rows: replay_ms); the fused backward then runs its scale and token gradients outside "
                        "the kernel")
    p.add_argument("--precision", default="bf16", choices=PRECISIONS,
                   help="the routed experts' GEMMs (module doc)")
    p.add_argument("--dispatch-dtype", default="bf16", metavar="bf16|fp8[,...]",
                   help="with --precision fp8, what the dispatch moves: bf16 rows, or e4m3 codes and scales; "
                        "bf16,fp8 times both layers in one run, against the same torch pipelines")
    p.add_argument("--wgrad-precision", default=None, metavar="fp8|bf16[,...]",
                   help="with --precision fp8, the routed weight gradients' (default fp8); fp8,bf16 times both")
    fp8_only = {key: bar for key, bar in FP8_BARS.items() if BARS.get(key) is not bar}
    add_bar_option(p, BARS, "With --precision fp8 (the FP8 layer's bars): " + "; ".join(
        f"{key}={bar.value:g} ({bar.what})" for key, bar in fp8_only.items()) + "; " + " and ".join(
        sorted(set(BARS) - set(FP8_BARS))) + " are not judged; the other bars as above")
    args = p.parse_args(argv)
    try:
        args.others = direction_policies(args.directions)[1:]
        args.dispatch_dtypes = list(dict.fromkeys(d.strip() for d in args.dispatch_dtype.split(",")))
        for dtype in args.dispatch_dtypes:
            if dtype not in PRECISIONS:
                raise ValueError(f"--dispatch-dtype: {dtype!r} is not one of {', '.join(PRECISIONS)}")
        if args.precision == "bf16" and args.dispatch_dtypes != ["bf16"]:
            raise ValueError("--dispatch-dtype fp8 needs --precision fp8")
        args.wgrad_precisions = [None]
        if args.wgrad_precision is not None:
            args.wgrad_precisions = list(dict.fromkeys(w.strip() for w in args.wgrad_precision.split(",")))
            for wgrad in args.wgrad_precisions:
                if wgrad not in PRECISIONS:
                    raise ValueError(f"--wgrad-precision: {wgrad!r} is not one of {', '.join(PRECISIONS)}")
            if args.precision != "fp8":
                raise ValueError("--wgrad-precision needs --precision fp8")
        if args.precision == "fp8" and args.others:
            raise ValueError("--directions: with --precision fp8 only 'mok' (the other policies' rows are BF16)")
        chosen = parse_settings(args.fused) if args.fused else None
        forward = [dataclasses.replace(k, assign=args.assign, raster=args.raster)
                   for k in (() if args.no_fused else SWEEP if args.sweep else chosen or DEFAULT_FUSED)]
        backward = [dataclasses.replace(k, token_grads=TOKEN_GRADS[args.token_grads], scale=SCALE[args.scale])
                    for k in forward]
        args.settings = {"fwd": forward, "bwd": backward}
        if args.precision == "fp8":
            args.bars = parse_bars(args.bar, FP8_BARS, dict.fromkeys(
                set(BARS) - set(FP8_BARS), "with --precision fp8 fused x sequential is printed, not judged"))
        else:
            args.bars = parse_bars(args.bar, BARS)
        args.links = []
        for item in [] if args.link_gbps is None else args.link_gbps.split(","):
            try:
                gbps = float(item)
            except ValueError:
                raise ValueError(f"--link-gbps: {item!r} is not a number of GB/s") from None
            try:
                args.links.append(LinkModel(gbps, args.link_latency_us, every_row=True))
            except ValueError as e:
                raise ValueError(f"--link-gbps, --link-latency-us: {e}") from None
        args.links = list(dict.fromkeys(args.links))  # each link speed once
        if args.links and args.timeline and "{link}" not in args.timeline:
            raise ValueError("--timeline: with --link-gbps the template needs {link} (or '' for no timeline)")
        if args.macrobatch_rows is not None:
            check_ring_option(args.macrobatch_rows)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from mok_proto.bench import append_result, require_gpu
    from mok_proto.bench.ceilings import DENSE_N, dense_matmul_tflops, of_dense

    require_gpu("bench_layer.py", need_torch=True)
    failed, best_settings, link_lines = [], {}, {link: [] for link in args.links}
    dense = dense_matmul_tflops()

    def emit(report) -> None:
        for line in report.lines:
            print(line, flush=True)
        for file, row in report.rows:
            append_result(file, of_dense(row, row.get("tflops"), dense))
        failed.extend(report.failed)

    print(f"# dense {DENSE_N}^3 BF16 torch.matmul: {dense:.0f} TFLOP/s (every row's fraction_of_dense)", flush=True)
    print(HEADER, flush=True)
    for name in args.shapes.split(","):
        measured, tables = run_shape(name, args, emit)
        for link, lines in tables.items():
            link_lines[link] += lines
        best_settings[name] = tuple(dict.fromkeys(  # the other policies: the default token_grads and scale
            FusedKnobs(r["comm_blocks"], r["minibatch_tokens"], claim=r["claim"], assign=args.assign,
                       raster=args.raster) for rows in measured.fused_rows.values() if rows for r in [best_row(rows)]))
    for link, lines in link_lines.items():
        print("\n".join(link_table(link, lines)), flush=True)
    for name in args.shapes.split(",") if args.others else ():  # after every shape's MoK rows are recorded
        shape, data = emulated_inputs(name, args.routing)
        for policy in args.others:
            failed += directions_rows(name, shape, data, policy, best_settings[name], args.iters, args.warmup)
    if failed:
        print(f"FAIL: {len(failed)} rows miss a bar or a check: {', '.join(failed)}", file=sys.stderr)
        return 1
    print("all bars met")
    return 0

