"""python scripts/bench_layer.py [--shapes kimi-k2.7,...] [--iters 20] [--warmup 5] [--sweep] [--link-gbps 368,900] [--routing hot:0.25] [--precision fp8 [--dispatch-dtype bf16,fp8] [--wgrad-precision fp8,bf16]]

One rank's share of an EP=64 MoE layer on one GPU: our layer against the unfused PyTorch pipeline,
forward and backward, sequential and fused (the command line: mok_proto.bench.layer_cli, whose doc
--help prints)."""

import sys

from mok_proto.bench.layer_cli import main

if __name__ == "__main__":
    sys.exit(main())
