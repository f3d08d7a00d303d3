"""The fused plans' knobs: how tile pairs go to clusters, their order, the pairs claimed at run time."""

from __future__ import annotations

# How a fused plan's tile pairs go to the 2-CTA clusters (`_assign_clusters`), by default per pass.
# Measured (H200, comm 0, minibatch 2048, fused replays interleaved with the sequential pass's):
# balanced made the backward 0.0 to 2.0% faster in 14 comparisons (13 faster, 1 equal; kimi and
# deepseek, five kernel variants: results/runs/e48bf6e and eb35161), the forward -0.5 to +0.9%.
ASSIGNMENTS = ("round_robin", "balanced")
DEFAULT_ASSIGN = {"fwd": "round_robin", "bwd": "balanced"}
# The order of one minibatch's tile pairs of one kind in a fused plan's global order: "row", row
# pair by row pair (columns fastest: the standalone grouped GEMM's order), or "col", column tile by
# column tile (row pairs fastest: the pairs that run at once share B, the weights' column panels).
RASTERS = ("row", "col")
DEFAULT_RASTER = "row"
# Tile pairs of a fused plan claimed at run time (`fused_forward`'s claim): "all" (every pair: MoK's
# ticket scheduler) or "tail" (the last TAIL_PAIRS_PER_CLUSTER pairs per cluster of the global
# order). Measured at 99c90df (results/runs/99c90df: one bench_layer run on the H200, comm 0,
# minibatch 2048, each setting interleaved with the sequential pass), x sequential for no pool /
# 264 pairs (the tail of 66 clusters) / every pair: forward kimi 0.97 / 0.97 / 0.99, glm 1.00 / 1.00 /
# 1.01, qwen 1.02 / 1.03 / 1.05, deepseek 1.01 / 1.02 / 1.02; backward 1.04 / 1.05 / 1.02, 1.06 / 1.07 /
# 1.05, 1.06 / 1.11 / 1.10, 1.05 / 1.08 / 1.05; all bitwise equal to the sequential pass. With these
# defaults, two more runs (b0e48a6, 249b630; README), the default against no pool: forward -0.4 to
# +2.1%, backward +0.1 to +3.7%.
DEFAULT_CLAIM = {"fwd": "all", "bwd": "tail"}
CLAIMS = ("all", "tail")  # the claims by name; any other is a number of tile pairs
TAIL_PAIRS_PER_CLUSTER = 4


def parse_claim(text: str):
    """A claim as typed on a command line (bench_layer.py --fused, sim --claim): digits -> an int,
    a name of CLAIMS as it is; ValueError otherwise."""
    if text.isdigit():
        return int(text)
    if text in CLAIMS:
        return text
    raise ValueError(f"claim must be an int >= 0 or one of {', '.join(CLAIMS)}, got {text!r}")
