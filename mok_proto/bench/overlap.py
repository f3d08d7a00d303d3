"""What a fused pass could gain over the sequential one: the overlap ceiling from the sequential
pass's stages."""

from __future__ import annotations

# The overlap ceiling of a fused pass (an upper estimate), from the sequential pass's eager stage
# medians: total / (GEMM stages + the stages that stay outside the fused kernel), i.e. the speed-up
# over sequential if the fused kernel hid every transfer and launch gap and its GEMM tiles ran as
# fast as the standalone launches. Eager stages include per-launch gaps that the sequential graph
# no longer pays, so the ceiling against the graph-timed sequential pass is somewhat lower.
GEMM_STAGES = {"fwd": ("shared", "experts"), "bwd": ("shared", "experts", "wgrad")}
OUTSIDE_STAGES = {"fwd": ("schedule", "weighted_sum"), "bwd": ("scale", "token_grads")}


def overlap_ceiling(stages: dict, pass_: str, inside=()) -> float | None:
    """Upper estimate of a fused pass's speed-up over sequential (see GEMM_STAGES); `inside`: the
    OUTSIDE_STAGES a backward plan runs inside its kernel (plan.scale: "scale", plan.token_grads:
    "token_grads"), which it may hide too. None for a pass through a ring of several turns: its
    stages are the turns (layer/gpu_ring.py), each transfers and GEMMs together."""
    outside = tuple(k for k in OUTSIDE_STAGES[pass_] if k not in inside)
    if "turns" in stages or any(k.startswith("turn.") for k in stages):
        return None
    return stages["total"] / sum(stages[k] for k in GEMM_STAGES[pass_] + outside)


def stages_inside(row: dict) -> tuple:
    """The OUTSIDE_STAGES a fused row's plan ran inside its kernel (its `scale`, `token_grads`)."""
    return tuple(stage for stage in ("scale", "token_grads") if row.get(stage))
