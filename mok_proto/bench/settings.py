"""What bench_layer.py times: the fused settings (plan.FusedKnobs: communication CTAs, minibatch rows,
claim, ...), the fused backward's options, and the transfer-direction policies."""

from __future__ import annotations

import dataclasses

from mok_proto.config import DIRECTIONS, MOK_POLICY, OPERATORS
from mok_proto.plan import FusedKnobs, inside_kernel

# --token-grads, --scale: plan.fused_backward's token_grads, scale (None: the plan's default)
TOKEN_GRADS = {"default": None, "inside": True, "after": False}
SCALE = {"default": None, "inside": True, "before": False}
# The fused settings (communication CTAs, minibatch rows) timed without --sweep; 0 CTAs: every CTA's
# spare warps move rows
DEFAULT_FUSED = tuple(FusedKnobs(c, 2048) for c in (0, 8, 12, 16))
SWEEP = tuple(FusedKnobs(c, m) for c in (0, 4, 8, 12, 16) for m in (512, 1024, 2048, 4096))


def direction_policies(spec: str) -> list[dict]:
    """The policies `--directions` names: "mok" (MoK's only), "all" (MoK's, then the three other
    (incoming, outgoing) pairs, the backward mirroring the forward: reverse-combine as dispatch,
    reverse-dispatch as combine), or policies as dispatch:combine:rev_combine:rev_dispatch
    directions, comma-separated (e.g. push:pull:push:pull). MoK's comes first, always."""
    if spec == "mok":
        return [dict(MOK_POLICY)]
    if spec == "all":
        pairs = [(a, b) for a in DIRECTIONS for b in DIRECTIONS]
        found = [dict(dispatch=a, combine=b, rev_combine=a, rev_dispatch=b) for a, b in pairs]
    else:
        found = []
        for item in spec.split(","):
            dirs = item.split(":")
            if len(dirs) != len(OPERATORS) or not set(dirs) <= set(DIRECTIONS):
                raise ValueError(f"--directions: {item!r} is not {':'.join(OPERATORS)} with each one of {DIRECTIONS}")
            found.append(dict(zip(OPERATORS, dirs)))
    unique = {tuple(p[op] for op in OPERATORS): p for p in found if p != MOK_POLICY}
    return [dict(MOK_POLICY)] + list(unique.values())


def fused_settings_for(policy: dict, settings) -> dict:
    """{pass: `settings` (FusedKnobs) as a fused plan of that pass takes them under `policy`}: where
    no transfer of the pass runs inside the kernel, communicating CTAs become 0 (every CTA computes;
    plan.fused_* refuses communicating CTAs there), duplicates dropped."""
    return {pass_: tuple(dict.fromkeys(k if any(inside_kernel(pass_, policy)) else dataclasses.replace(k, comm_blocks=0)
                                       for k in settings)) for pass_ in ("fwd", "bwd")}


def parse_settings(text: str) -> tuple:
    """--fused: COMM:MINIBATCH[:CLAIM],... -> (FusedKnobs, ...) (FusedKnobs.parse)."""
    try:
        return tuple(FusedKnobs.parse(item) for item in text.split(","))
    except ValueError as e:
        raise ValueError(f"--fused: {e}") from None
