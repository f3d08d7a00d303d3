"""python scripts/sweep_overlap.py [--shapes kimi-k2.7,...] [--comm 0,4,8,16] [--minibatch 512,1024,2048,4096] [--assign round_robin|balanced] [--raster row|col]

Sweep the fused forward's knobs on the GPU: communication CTAs x minibatch rows, per shape, one
rank's share of EP=64 (mok_proto.bench.emulation: 2 virtual ranks, rank 0 timed).

Per shape: the sequential forward (graph replays, the reference time), then every grid point of
the fused forward (graph replays interleaved with the sequential forward's, median; its output
compared bitwise with the sequential one), a progress line per point with the time left; the
best point (the largest x sequential) timed again and its in-kernel timeline stored in
results/timelines/ (sweep_timeline_fused_fwd_<shape>_<git>.jsonl.gz + .png, a row in its index).
One JSON line per point appended to results/sweep_overlap.jsonl (keys: the stamp of
mok_proto.bench.rows, shape, comm_blocks, minibatch_rows, assign (--assign: the plans' tile
pairs to clusters, plan.ASSIGNMENTS), raster (--raster: their order,
plan.RASTERS), median_ms, sequential_ms (the sequential forward timed alone),
sequential_median_ms (interleaved with this point), speedup_vs_sequential (median of the
per-iteration ratios of the interleaved run), equal_to_sequential, bitwise_repeat), the file
notebooks/overlap_explorer.ipynb overlays on the simulated heatmap. No bars: bench_layer.py
judges. Exit status: 0, 1 if a point's output differs from the sequential one, 2 without a GPU.
"""

from __future__ import annotations

import sys
import time

from mok_proto.bench.cli import parser
from mok_proto.bench.emulation import emulated_shape, make_inputs, result_bytes, staged_layer
from mok_proto.bench.layer import best_row, fused
from mok_proto.config import PAPER_SHAPES
from mok_proto.plan import ASSIGNMENTS, RASTERS, FusedKnobs


def ints(text: str) -> tuple:
    return tuple(int(v) for v in text.split(","))


def main():
    p = parser(__doc__)
    p.add_argument("--shapes", default=",".join(PAPER_SHAPES))
    p.add_argument("--comm", type=ints, default=(0, 4, 8, 12, 16), help="communication CTAs (0: spare warps)")
    p.add_argument("--minibatch", type=ints, default=(512, 1024, 2048, 4096), help="minibatch rows (x256)")
    defaults = FusedKnobs.PASS_DEFAULTS["fwd"]
    p.add_argument("--assign", default=None, choices=ASSIGNMENTS,
                   help=f"the fused plans' tile pairs to clusters (default {defaults['assign']})")
    p.add_argument("--raster", default=None, choices=RASTERS,
                   help=f"the order of a minibatch's tile pairs (default {defaults['raster']})")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    try:
        grid = [FusedKnobs(c, m, assign=args.assign, raster=args.raster) for c in args.comm for m in args.minibatch]
    except ValueError as e:
        p.error(str(e))
    from mok_proto.bench import append_result, git_sha, require_gpu, summarize, time_stages

    require_gpu("sweep_overlap.py")
    import cupy

    shapes = args.shapes.split(",")
    bad, start, done, total = [], time.monotonic(), 0, len(grid) * len(shapes)
    for name in shapes:
        shape = emulated_shape(name)
        heap, layer = staged_layer(shape, make_inputs(shape))
        stream = cupy.cuda.Stream(non_blocking=True)
        graph = layer.capture(backward=False)
        with stream:
            seq = summarize(time_stages(lambda mark: (mark("run"), graph.launch(stream), mark(None)), args.iters,
                                        args.warmup)["run"])["median_ms"]
        stream.synchronize()
        layer.check()
        print(f"# {name}: sequential forward {seq:.3f} ms; {len(grid)} fused points", flush=True)
        rows = fused(layer, grid, result_bytes(layer, "fwd"), graph, args.iters, args.warmup, stream,
                     f"results/timelines/sweep_timeline_fused_fwd_{name}_{git_sha()}.jsonl", "fwd",
                     {"bench": "sweep_overlap", "shape": name})
        for row in rows:
            append_result("sweep_overlap", {"shape": name, "comm_blocks": row["comm_blocks"],
                                            "minibatch_rows": row["minibatch_tokens"], "sequential_ms": seq,
                                            **{k: v for k, v in row.items() if k not in ("comm_blocks",
                                                                                      "minibatch_tokens")}})
            if not row["equal_to_sequential"]:
                bad.append(f"{name} comm={row['comm_blocks']} minibatch={row['minibatch_tokens']}")
        done += len(grid)
        left = (time.monotonic() - start) / done * (total - done)
        best = best_row(rows)
        print(f"# {name}: best comm={best['comm_blocks']} minibatch={best['minibatch_tokens']} "
              f"{best['retimed_median_ms']:.3f} ms (x sequential {best['retimed_speedup_vs_sequential']:.2f}); "
              f"[{done}/{total}] ~{left:.0f} s left", flush=True)
        layer.close()
        heap.close()
    if bad:
        print(f"FAIL: fused output differs from sequential at {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
