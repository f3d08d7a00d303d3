"""python scripts/ab_layer.py --base REV_OR_DIR [--shapes kimi-k2.7,...] [--rounds 20] [--iters 10]
                            [--precision fp8] [--fused COMM:MINIBATCH[:CLAIM]]

The layer of this tree (B) against the layer of another source tree (A, --base: a git revision of
this checkout, exported with git archive, or a folder holding mok_proto/ and cuda/), in one
interleaved run on one GPU (mok_proto.bench.ab): a worker process per tree builds the staged EP=64
share of each shape (bench.emulation.staged_layer: uniform routing, seed 0, the tree's own
defaults; --precision fp8: its routed experts in FP8), captures the sequential forward and backward
as CUDA graphs (--fused: the fused passes, both plans built with those knobs, as bench_layer.py's
--fused), and the two are timed in alternation, --rounds rounds of --iters replays each (after
--warmup). Per shape and pass: A's and B's median of the per-round medians, and `ratio` = B / A,
the median of the per-round ratios (p20, p80); whether the two trees' results are bitwise equal
(`equal_to_base`); B's ring turns.

Checks (exit 1 when one fails, listed): every ratio at most --max-ratio (default 1.03: B within 3%
of A); the results bitwise equal (--allow-different-bits: report only, for a change that moves
bits on purpose); B runs one turn (nothing replayed: its ring holds every row) unless
--allow-turns. Exit 2: no GPU or a bad argument.
Results: JSON lines appended to results/ab_layer.jsonl (`base` records --base as given).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from mok_proto.bench import append_result, require_gpu
from mok_proto.bench.ab import Worker, interleaved, tree_of
from mok_proto.bench.cli import parser
from mok_proto.config import PAPER_SHAPES, PRECISIONS
from mok_proto.plan import FusedKnobs

ROOT = Path(__file__).resolve().parents[2]  # the repository: tree B


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--base", help="tree A (required): a git revision of this checkout or a folder")
    p.add_argument("--shapes", default=",".join(PAPER_SHAPES))
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-ratio", type=float, default=1.03)
    p.add_argument("--allow-different-bits", action="store_true")
    p.add_argument("--allow-turns", action="store_true")
    p.add_argument("--precision", default="bf16", choices=PRECISIONS, help="the routed experts' GEMMs")
    p.add_argument("--fused", default=None, metavar="COMM:MINIBATCH[:CLAIM]",
                   help="time the fused passes with these knobs (default: the sequential passes)")
    args = p.parse_args(argv)
    if args.fused is not None:
        try:
            FusedKnobs.parse(args.fused)
        except ValueError as e:
            p.error(f"--fused: {e}")
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in PAPER_SHAPES]
    if unknown or not shapes:
        p.error(f"--shapes: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(PAPER_SHAPES)}")
    if min(args.rounds, args.iters) < 1 or args.warmup < 0:
        p.error("--rounds and --iters must be at least 1, --warmup at least 0")
    args.shapes = shapes
    return args


def run(args) -> int:
    if not args.base:
        print("ab_layer.py: error: --base is required (the tree to compare against)", file=sys.stderr)
        return 2
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            base = tree_of(args.base, Path(tmp))
        except ValueError as e:
            print(f"ab_layer.py: error: {e}", file=sys.stderr)
            return 2
        # the rest of PYTHONPATH (carried packages), without any tree of mok_proto
        extra = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                if p and not (Path(p) / "mok_proto").is_dir())
        a, b = Worker(base, "base (A)", extra), Worker(ROOT, "this tree (B)", extra)
        try:
            print(f"# A: {args.base}, B: this tree; {args.precision} experts, "
                  f"{'the fused passes, knobs ' + args.fused if args.fused else 'the sequential passes'}")
            print(f"{'shape':<16} {'pass':<4} {'A ms':>8} {'B ms':>8} {'B/A':>6} {'p20':>6} {'p80':>6}  bits  turns")
            for name in args.shapes:
                print(f"# {name}: building both layers (compiles each tree's kernels the first time)", flush=True)
                setup = {"shape": name, **({"precision": args.precision} if args.precision != "bf16" else {}),
                         **({"fused": args.fused} if args.fused else {})}
                a.send(cmd="setup", **setup)  # both build (and compile) at once
                b.send(cmd="setup", **setup)
                da, db = a.answer(), b.answer()
                for pass_ in ("fwd", "bwd"):
                    res = interleaved(a, b, pass_, args.rounds, args.iters, args.warmup)
                    equal = da["digest"][pass_] == db["digest"][pass_]
                    row = {"shape": name, "pass": pass_, "base": args.base, "base_median_ms": res["a"]["median_ms"],
                           "median_ms": res["b"]["median_ms"], "ratio": res["ratio"], "ratio_p20": res["ratio_p20"],
                           "ratio_p80": res["ratio_p80"], "rounds": args.rounds, "iters": args.iters,
                           "equal_to_base": equal, "num_turns": db["num_turns"], "ring_rows": db["ring_rows"],
                           "max_ratio": args.max_ratio, "precision": args.precision,
                           "schedule": "fused" if args.fused else "sequential", "fused": args.fused}
                    append_result("ab_layer", row)
                    print(f"{name:<16} {pass_:<4} {res['a']['median_ms']:>8.3f} {res['b']['median_ms']:>8.3f} "
                          f"{res['ratio']:>6.3f} {res['ratio_p20']:>6.3f} {res['ratio_p80']:>6.3f}  "
                          f"{'same' if equal else 'DIFF'}  {db['num_turns']}", flush=True)
                    if res["ratio"] > args.max_ratio:
                        failures.append(f"{name} {pass_}: B/A {res['ratio']:.3f} > {args.max_ratio:g}")
                    if not equal and not args.allow_different_bits:
                        failures.append(f"{name} {pass_}: results differ from the base's")
                if db["num_turns"] != 1 and not args.allow_turns:
                    failures.append(f"{name}: this tree's ring runs {db['num_turns']} turns (something is replayed)")
        finally:
            a.close()
            b.close()
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    require_gpu("ab_layer.py")
    return run(args)

