"""The GPU layer's fused plans: a plan.fused_forward / fused_backward plan for a layer's RunConfig
and receive rows (GpuMoELayer.fused_forward_plan, fused_backward_plan; bench's plan workers), and
the plan of a ring's turns after the first (without the shared expert)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from mok_proto.plan.build import fused_backward, fused_forward
from mok_proto.plan.kinds import SEGMENT_ROWS
from mok_proto.plan.knobs import FusedKnobs

if TYPE_CHECKING:
    from mok_proto.config import RunConfig


def fused_plan(pass_: str, run: RunConfig, capacity: int, policy: dict, knobs: FusedKnobs, num_sms: int,
               check: bool = False):
    """A plan.fused_forward (pass_="fwd") or plan.fused_backward plan with `knobs` (plan.FusedKnobs)
    for a layer of `run` with `capacity` receive rows (rounded up to whole minibatches) and `num_sms`
    CTAs per launch rank; check=True also proves it (Plan.check, kept with the plan: a process can
    build and check plans for another, e.g. while that one runs the GPU)."""
    builders = {"fwd": fused_forward, "bwd": fused_backward}
    if pass_ not in builders:
        raise ValueError(f"pass_ must be 'fwd' or 'bwd', got {pass_!r}")
    if knobs.segment_rows not in (None, SEGMENT_ROWS):
        raise ValueError(f"segment_rows {knobs.segment_rows}: the GPU layer pads expert segments to {SEGMENT_ROWS} "
                         "(plan.SEGMENT_ROWS); another rule is the simulator's only")
    capacity_rows = -(-capacity // knobs.minibatch_rows) * knobs.minibatch_rows
    made = builders[pass_](run.shape, run.num_ranks, knobs, policy=policy, num_sms=num_sms, capacity_rows=capacity_rows)
    if check:
        made.check()
    return made


def without_shared(plan):
    """The fused plan of `plan`'s knobs for its shape without the shared expert (what a ring's turns
    after the first run). A claim of more pairs than the routed ones claims them all."""
    builder = {"fwd": fused_forward, "bwd": fused_backward}[plan.pass_]
    shape, knobs = dataclasses.replace(plan.shape, num_shared=0), plan.knobs
    build = lambda k: builder(shape, plan.num_ranks, k, policy=plan.policy, num_sms=plan.num_sms,  # noqa: E731
                              capacity_rows=plan.capacity_rows)
    if isinstance(knobs.claim, int) and knobs.claim > 0:
        probe = build(dataclasses.replace(knobs, claim="all"))  # every routed pair in the pool
        knobs = dataclasses.replace(knobs, claim=min(knobs.claim, probe.claim_pairs))
    return build(knobs)
