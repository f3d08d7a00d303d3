"""The fused plans' knobs (build.fused_forward / fused_backward) as one frozen object, `FusedKnobs`:
every knob's default, their checks, the pass's defaults (`resolved`), the command line's
COMM:MINIBATCH[:CLAIM] (`parse`) and the fields of a results row (`describe`). Vary a setting
with dataclasses.replace."""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass
from typing import ClassVar

from mok_proto.plan.kinds import BM, PAIR_ROWS, PASS_KINDS, PASSES, SEGMENT_ROWS, inside_kernel
from mok_proto.validate import check_int

# How tile pairs go to the 2-CTA clusters (build._assign_clusters): "balanced" prices the pairs on
# the expected rows and deals the pairs past them round robin; "balanced_all" prices every pair (those
# past the expected rows as free), so under skewed routing their real work piles onto few clusters.
ASSIGNMENTS = ("round_robin", "balanced", "balanced_all")
# The order of one minibatch's tile pairs of one kind in a fused plan's global order: "row", row
# pair by row pair (columns fastest: the standalone grouped GEMM's order), or "col", column tile by
# column tile (row pairs fastest: the pairs that run at once share B, the weights' column panels).
RASTERS = ("row", "col")
# Tile pairs claimed at run time, by name: "all" (every pair: MoK's ticket scheduler) or "tail" (the
# last TAIL_PAIRS_PER_CLUSTER pairs per cluster of the global order); any other claim is a number of pairs.
CLAIMS = ("all", "tail")
TAIL_PAIRS_PER_CLUSTER = 4


def parse_claim(text: str):
    """A claim as typed on a command line (bench_layer.py --fused, sim --claim): digits -> an int,
    a name of CLAIMS as it is; ValueError otherwise."""
    if text.isdigit():
        return int(text)
    if text in CLAIMS:
        return text
    raise ValueError(f"claim must be an int >= 0 or one of {', '.join(CLAIMS)}, got {text!r}")


@dataclass(frozen=True)
class FusedKnobs:
    """The knobs of a fused plan (what each does: build.fused_forward / fused_backward). None
    means the default: `resolved` fills in the pass's (PASS_DEFAULTS) and the policy's. One
    object serves both passes: ring_minibatches is the forward's only, token_grads, scale and
    routed_wgrads the backward's only (the other pass's `resolved` drops them)."""

    comm_blocks: int = 0  # CTAs set aside to communicate; 0: every CTA computes, its spare warps move rows
    minibatch_rows: int = 1024  # receive rows per minibatch, a multiple of PAIR_ROWS
    _: KW_ONLY
    ring_minibatches: int | None = None  # forward: minibatches the buffers hold (None: every one, no ring turns)
    lookahead: int | None = None  # minibatch m + lookahead's first GEMM before m's second (None: 1, 0 for a ring of 1)
    assign: str | None = None  # ASSIGNMENTS
    raster: str | None = None  # RASTERS
    spread_from: int | None = None  # outgoing transfers of minibatches >= this one on every CTA (None: none)
    claim: int | str | None = None  # tile pairs claimed at run time: a count or a name of CLAIMS
    token_grads: bool | None = None  # backward: the token gradients inside the kernel (None: if its outgoing is)
    scale: bool | None = None  # backward: dy_slots = w * dout inside the kernel (None: if its incoming is)
    # backward: the routed experts' weight-gradient tiles inside the kernel (None: True); False: after
    # it (the FP8 layer runs them there, with their operands' transposed quantizations)
    routed_wgrads: bool | None = None
    # The expert segments' padding the plan's cost model assumes (None: SEGMENT_ROWS, the GPU layer's
    # schedule; another multiple of BM only for the simulator: a what-if, or a rule a results row recorded).
    segment_rows: int | None = None

    # The defaults that differ by pass, chosen on measurements (docs/LOG.md): balanced clusters in
    # the backward (its weight-gradient tiles cost unlike its data-gradient tiles), round robin in
    # the forward, where both ran alike; the forward claims every pair, the backward the tail.
    PASS_DEFAULTS: ClassVar[dict] = {"fwd": {"assign": "round_robin", "raster": "row", "claim": "all"},
                                     "bwd": {"assign": "balanced", "raster": "row", "claim": "tail"}}

    def __post_init__(self):
        check_int(self.comm_blocks, "comm_blocks", minimum=0)
        minibatch_rows = check_int(self.minibatch_rows, "minibatch_rows")
        if minibatch_rows < PAIR_ROWS or minibatch_rows % PAIR_ROWS:
            raise ValueError(f"minibatch_rows must be a multiple of {PAIR_ROWS} (plan.PAIR_ROWS, a cluster's tile "
                             f"pair), got {minibatch_rows}")
        if self.segment_rows is not None and check_int(self.segment_rows, "segment_rows", minimum=BM) % BM:
            raise ValueError(f"segment_rows must be a multiple of {BM} (plan.BM, a row tile), got {self.segment_rows}")
        for name, minimum in (("ring_minibatches", 1), ("lookahead", None), ("spread_from", None)):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, minimum=minimum)
        for name, choices in (("assign", ASSIGNMENTS), ("raster", RASTERS)):
            if getattr(self, name) not in (None, *choices):
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if self.claim is not None and not (isinstance(self.claim, str) and self.claim in CLAIMS):
            check_int(self.claim, "claim (an int, 'all' or 'tail')", minimum=0)
        for name in ("token_grads", "scale", "routed_wgrads"):
            if not (getattr(self, name) is None or isinstance(getattr(self, name), bool)):
                raise ValueError(f"{name} must be None, True or False, got {getattr(self, name)!r}")

    def resolved(self, pass_: str, policy: dict, num_minibatches: int | None = None) -> FusedKnobs:
        """These knobs as a `pass_` plan under `policy` runs them: every None replaced by its default
        (PASS_DEFAULTS, the policy's), the other pass's knobs dropped (None), and ValueError for a
        knob the policy rules out. With num_minibatches (the plan's), also the ring (at most every
        minibatch) and the lookahead, and their checks."""
        if pass_ not in PASSES:
            raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
        k = PASS_KINDS[pass_]
        comm_in, comm_out = inside_kernel(pass_, policy)
        if self.comm_blocks and not (comm_in or comm_out):
            raise ValueError(f"policy {policy} moves no rows inside the kernel: comm_blocks must be 0")
        token_grads = scale = ring = routed_wgrads = None
        if pass_ == "bwd":
            routed_wgrads = True if self.routed_wgrads is None else self.routed_wgrads
            token_grads = comm_out if self.token_grads is None else self.token_grads
            if token_grads and not comm_out:
                raise ValueError(f"token_grads runs the backward's slot sum inside the kernel: it needs the backward "
                                 f"with {k.out_op} push (inside the kernel), got the {pass_} with {policy}")
            scale = comm_in if self.scale is None else self.scale
            if scale and not comm_in:
                raise ValueError(f"scale runs the backward's dy_slots = w * dout inside the kernel: it needs the "
                                 f"backward with {k.in_op} pull (inside the kernel), got the {pass_} with {policy}")
        else:
            ring = self.ring_minibatches
        lookahead, num_mb = self.lookahead, num_minibatches
        if num_mb is not None:
            ring = min(ring or num_mb, max(num_mb, 1))  # a ring of every minibatch never turns
            if ring < num_mb and not (comm_in and comm_out):
                raise ValueError(f"a ring of {ring} < {num_mb} minibatches needs {k.in_op} pull and {k.out_op} push "
                                 f"(both inside the kernel), got {policy}")
            spread = self.spread_from
            if not (spread is None or self.comm_blocks and comm_out and 0 <= spread < num_mb):
                raise ValueError(f"spread_from ({spread}) needs communicating CTAs, the {k.out_op} inside the kernel "
                                 f"(push) and a minibatch in [0, {num_mb})")
            lookahead = min(1, max(ring - 1, 0)) if lookahead is None else lookahead
            if not 0 <= lookahead <= max(ring - 1, 0):
                raise ValueError(f"lookahead must be in [0, ring - 1 = {ring - 1}] (minibatch m + lookahead may need "
                                 f"m's ring slot), got {lookahead}")
        defaults = self.PASS_DEFAULTS[pass_]
        return dataclasses.replace(
            self, ring_minibatches=ring, lookahead=lookahead, token_grads=token_grads, scale=scale,
            routed_wgrads=routed_wgrads, segment_rows=self.segment_rows or SEGMENT_ROWS,
            **{name: defaults[name] if getattr(self, name) is None else getattr(self, name) for name in defaults})

    def claim_pairs(self, num_pairs: int, num_clusters: int) -> int:
        """The tile pairs claimed at run time of a plan's num_pairs over num_clusters clusters (a
        resolved claim: a count or a name of CLAIMS)."""
        if self.claim == "all":
            return num_pairs
        if self.claim == "tail":
            return min(num_pairs, TAIL_PAIRS_PER_CLUSTER * num_clusters)
        if not 0 <= self.claim <= num_pairs:
            raise ValueError(f"claim must be in [0, {num_pairs}] (the plan's tile pairs), got {self.claim}")
        return self.claim

    def describe(self, pass_: str, policy: dict) -> dict:
        """The fields a results row records of a `pass_` plan built with these knobs (flat,
        JSON-able): comm_blocks, minibatch_tokens, assign, raster and segment_rows as the plan ran
        them, claim as given (None: the pass's default; the row adds the plan's claim_pairs), the backward's
        token_grads and scale as it ran them, routed_wgrads where False, and ring_minibatches, lookahead,
        spread_from where set."""
        ran = self.resolved(pass_, policy)
        row = {"comm_blocks": self.comm_blocks, "minibatch_tokens": self.minibatch_rows, "assign": ran.assign,
               "raster": ran.raster, "claim": self.claim, "segment_rows": ran.segment_rows}
        for name in ("ring_minibatches", "lookahead", "spread_from", "token_grads", "scale"):
            if getattr(ran, name) is not None:
                row[name] = getattr(ran, name)
        if ran.routed_wgrads is False:
            row["routed_wgrads"] = False
        return row

    @classmethod
    def from_row(cls, row: dict) -> FusedKnobs:
        """The knobs of a results row's fused plan (the fields `describe` wrote): they build that plan
        again with the row's pass, policy and grid."""
        names = ("assign", "raster", "claim", "ring_minibatches", "lookahead", "spread_from", "token_grads", "scale",
                 "segment_rows", "routed_wgrads")
        return cls(row["comm_blocks"], row["minibatch_tokens"], **{k: row[k] for k in names if row.get(k) is not None})

    @classmethod
    def parse(cls, text: str) -> FusedKnobs:
        """COMM:MINIBATCH[:CLAIM] as typed on a command line (CLAIM: parse_claim; left out: the
        pass's default) -> FusedKnobs; ValueError otherwise."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or not all(v.isdigit() for v in parts[:2]):
            raise ValueError(f"{text!r} is not COMM:MINIBATCH or COMM:MINIBATCH:CLAIM (CLAIM an int, all or tail)")
        return cls(int(parts[0]), int(parts[1]), claim=parse_claim(parts[2]) if len(parts) == 3 else None)
