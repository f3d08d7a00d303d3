"""The arguments of the R-process benchmark (scripts/bench_layer_mpi.py)."""

from __future__ import annotations

from pathlib import Path

from mok_proto.bench.cli import add_bar_option, add_routing_option, parse_bars, parser
from mok_proto.bench.mpi_report import BARS
from mok_proto.bench.rows import RESULTS_DIR
from mok_proto.config import PAPER_SHAPES, get_shape
from mok_proto.plan import FusedKnobs

FUSED_SETTINGS = "0:1024,0:2048"  # (communication CTAs, minibatch rows) of the fused passes


def parse_args(argv=None, doc: str | None = None):
    """scripts/bench_layer_mpi.py's arguments, checked (a bad one: one line, exit 2); `doc`: what
    --help prints first (the script's docstring)."""
    p = parser(doc)
    p.add_argument("--shapes", default=",".join(PAPER_SHAPES))
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: the shape's, 2048)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--single", type=int, default=None, metavar="R",
                   help="one process, one GPU, R virtual ranks: digests of the sequential layer only")
    p.add_argument("--fused", default=FUSED_SETTINGS, help="fused settings COMM:MINIBATCH[,...] ('' = none)")
    p.add_argument("--no-torch", action="store_true",
                   help="our layer only: no torch + NCCL layer and no NCCL link ceiling, so the bars are not judged "
                        "(the bitwise checks are). Implied when ranks share a GPU (NCCL refuses that)")
    p.add_argument("--plan-workers", type=int, default=3,
                   help="helper processes per rank proving fused plans (a large backward plan: ~1-2 min, ~20 GB RAM)")
    p.add_argument("--plan-timeout", type=float, default=300.0, help="seconds to wait for one fused plan")
    p.add_argument("--results-dir", default=None, help="JSON lines and digests go here (default results/x<R>)")
    p.add_argument("--digests-out", default=None, help="this run's digests (default <results-dir>/digests_<mode>.json)")
    p.add_argument("--compare", default=None, help="digests file of the other mode to compare with")
    add_routing_option(p, "over the R ranks, rank 0 the timed one")
    add_bar_option(p, BARS)
    args = p.parse_args(argv)
    try:
        args.shapes = [name.strip() for name in args.shapes.split(",") if name.strip()]
        if not args.shapes:
            raise ValueError("--shapes: no shape given")
        for name in args.shapes:
            get_shape(name)
        items = [item.split(":") for item in args.fused.split(",") if item.strip()]
        if any(len(item) != 2 or not all(v.strip().isdigit() for v in item) or int(item[1]) <= 0 for item in items):
            raise ValueError("--fused: expected COMM:MINIBATCH[,...] with COMM >= 0, MINIBATCH > 0")
        args.fused = [tuple(int(v) for v in item) for item in items]
        try:
            [FusedKnobs(*item) for item in args.fused]  # the fused plans' own checks of the two knobs
        except ValueError as e:
            raise ValueError(f"--fused: {e}") from None
        args.bars = parse_bars(args.bar, BARS)
        for name, value, low in (("--iters", args.iters, 1), ("--warmup", args.warmup, 0),
                                 ("--plan-workers", args.plan_workers, 1), ("--tokens", args.tokens, 1),
                                 ("--single", args.single, 1)):
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if args.compare and not Path(args.compare).is_file():
            raise ValueError(f"--compare: no file {args.compare}")
    except ValueError as e:
        p.error(str(e))
    return args


def results_dir(args, num_ranks: int) -> Path:
    return Path(args.results_dir) if args.results_dir else RESULTS_DIR / f"x{num_ranks}"
