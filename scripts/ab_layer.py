"""python scripts/ab_layer.py --base REV_OR_DIR [--shapes kimi-k2.7,...] [--rounds 20] [--iters 10]

A/B of the sequential layer between this tree and another in one interleaved run on one GPU
(the command line: mok_proto.bench.ab_cli, whose doc --help prints)."""

import sys

from mok_proto.bench.ab_cli import main

if __name__ == "__main__":
    sys.exit(main())
