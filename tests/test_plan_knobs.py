"""The fused plans' knobs (plan.FusedKnobs): defaults per pass, checks, the command line's form,
the fields of a results row."""

import dataclasses

import pytest

from mok_proto import plan as P
from mok_proto.config import MOK_POLICY, get_shape

TILE = get_shape("tile")
OUTSIDE = {"dispatch": "push", "combine": "pull", "rev_combine": "push", "rev_dispatch": "pull"}  # nothing inside


def test_defaults_resolve_per_pass_and_policy():
    knobs = P.FusedKnobs()
    assert (knobs.comm_blocks, knobs.minibatch_rows) == (0, 1024)
    fwd, bwd = knobs.resolved("fwd", MOK_POLICY), knobs.resolved("bwd", MOK_POLICY)
    assert (fwd.assign, fwd.raster, fwd.claim) == ("round_robin", "row", "all")
    assert (bwd.assign, bwd.raster, bwd.claim) == ("balanced", "row", "tail")
    # the backward runs the token gradients and the scale inside when its transfers are inside, the
    # routed weight gradients inside; the forward has none of these
    assert (bwd.token_grads, bwd.scale, bwd.routed_wgrads) == (True, True, True)
    assert (fwd.token_grads, fwd.scale, fwd.routed_wgrads) == (None, None, None)
    outside = knobs.resolved("bwd", OUTSIDE)
    assert (outside.token_grads, outside.scale) == (False, False)
    # the given knobs win over the defaults; a resolved object resolves to itself
    chosen = P.FusedKnobs(assign="balanced", raster="col", claim=3).resolved("fwd", MOK_POLICY)
    assert (chosen.assign, chosen.raster, chosen.claim) == ("balanced", "col", 3)
    assert fwd.resolved("fwd", MOK_POLICY) == fwd


def test_one_object_serves_both_passes():
    # the forward drops the backward's knobs and the other way round
    knobs = P.FusedKnobs(2, 256, ring_minibatches=2, token_grads=False, scale=False)
    fwd, bwd = knobs.resolved("fwd", MOK_POLICY, 4), knobs.resolved("bwd", MOK_POLICY, 4)
    assert (fwd.ring_minibatches, fwd.token_grads, fwd.scale) == (2, None, None)
    assert (bwd.ring_minibatches, bwd.token_grads, bwd.scale) == (4, False, False)  # the ring: every minibatch
    f = P.fused_forward(TILE, 2, knobs, policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    b = P.fused_backward(TILE, 2, knobs, policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    assert (f.ring_minibatches, f.token_grads, f.scale) == (2, False, False)
    assert (b.ring_minibatches, b.token_grads, b.scale) == (4, False, False)
    # with the minibatch count: the lookahead's default (1; 0 with a ring of one)
    assert fwd.lookahead == 1 and P.FusedKnobs(ring_minibatches=1).resolved("fwd", MOK_POLICY, 4).lookahead == 0


@pytest.mark.parametrize("fields,match", [
    ({"comm_blocks": -2}, "comm_blocks must be >= 0"),
    ({"minibatch_rows": 128}, "minibatch_rows must be a multiple of 256"),
    ({"minibatch_rows": 0}, "minibatch_rows must be a multiple of 256"),
    ({"ring_minibatches": 0}, "ring_minibatches must be >= 1"),
    ({"lookahead": 1.5}, "lookahead must be an integer"),
    ({"assign": "greedy"}, "assign must be one of round_robin, balanced"),
    ({"raster": "diagonal"}, "raster must be one of row, col"),
    ({"claim": -1}, "claim .* must be >= 0"),
    ({"claim": "most"}, "claim .* must be an integer"),
    ({"spread_from": "1"}, "spread_from must be an integer"),
    ({"token_grads": 1}, "token_grads must be None, True or False"),
    ({"routed_wgrads": "no"}, "routed_wgrads must be None, True or False"),
])
def test_bad_knobs_are_refused_where_they_are_made(fields, match):
    with pytest.raises(ValueError, match=match):
        P.FusedKnobs(**fields)


def test_knobs_the_policy_rules_out():
    with pytest.raises(ValueError, match="comm_blocks must be 0"):
        P.FusedKnobs(2, 256).resolved("fwd", OUTSIDE)
    with pytest.raises(ValueError, match="token_grads"):
        P.FusedKnobs(token_grads=True).resolved("bwd", OUTSIDE)
    with pytest.raises(ValueError, match="scale"):
        P.FusedKnobs(scale=True).resolved("bwd", OUTSIDE)
    with pytest.raises(ValueError, match="pass must be one of"):
        P.FusedKnobs().resolved("sideways", MOK_POLICY)


def test_claim_pairs_of_a_plan():
    fwd, bwd = (P.FusedKnobs().resolved(pass_, MOK_POLICY) for pass_ in P.PASSES)
    assert fwd.claim_pairs(100, 10) == 100 and bwd.claim_pairs(100, 10) == P.TAIL_PAIRS_PER_CLUSTER * 10
    assert bwd.claim_pairs(20, 10) == 20 and P.FusedKnobs(claim=7).claim_pairs(100, 10) == 7
    with pytest.raises(ValueError, match=r"claim must be in \[0, 5\]"):
        P.FusedKnobs(claim=7).claim_pairs(5, 10)


def test_parse_the_command_line_form():
    assert P.FusedKnobs.parse("8:1024") == P.FusedKnobs(8, 1024)
    assert P.FusedKnobs.parse("0:2048:264") == P.FusedKnobs(0, 2048, claim=264)
    assert P.FusedKnobs.parse("0:512:tail") == P.FusedKnobs(0, 512, claim="tail")
    for bad in ("0", "a:2048", "0:2048:1:2", "-2:2048"):
        with pytest.raises(ValueError, match="is not COMM:MINIBATCH"):
            P.FusedKnobs.parse(bad)
    with pytest.raises(ValueError, match="claim must be"):
        P.FusedKnobs.parse("0:2048:some")
    with pytest.raises(ValueError, match="multiple of 256"):
        P.FusedKnobs.parse("0:100")
    varied = dataclasses.replace(P.FusedKnobs.parse("8:1024"), raster="col")  # a variation
    assert (varied.comm_blocks, varied.minibatch_rows, varied.raster) == (8, 1024, "col")


def test_describe_gives_the_fields_of_a_results_row():
    # bench_layer.py's fused rows: the knobs as the plan ran them, the claim as given
    fwd = P.FusedKnobs(8, 2048).describe("fwd", MOK_POLICY)
    assert fwd == {"comm_blocks": 8, "minibatch_tokens": 2048, "assign": "round_robin", "raster": "row", "claim": None,
                   "segment_rows": P.SEGMENT_ROWS}
    bwd = P.FusedKnobs(0, 2048, claim="all", scale=False).describe("bwd", MOK_POLICY)
    assert bwd == {"comm_blocks": 0, "minibatch_tokens": 2048, "assign": "balanced", "raster": "row", "claim": "all",
                   "segment_rows": P.SEGMENT_ROWS, "token_grads": True, "scale": False}
    # the optional knobs where set
    assert P.FusedKnobs(8, 256, spread_from=1, lookahead=0).describe("fwd", MOK_POLICY)["spread_from"] == 1
    plan = P.fused_backward(TILE, 2, P.FusedKnobs(0, 256, claim="all", scale=False), policy=MOK_POLICY, num_sms=8,
                            capacity_rows=1024)
    row = P.FusedKnobs(0, 256, claim="all", scale=False).describe("bwd", MOK_POLICY)
    assert (row["assign"], row["raster"], row["token_grads"], row["scale"]) == (plan.assign, plan.raster,
                                                                               plan.token_grads, plan.scale)


@pytest.mark.parametrize("pass_,knobs", [
    ("fwd", P.FusedKnobs(8, 2048)), ("fwd", P.FusedKnobs(8, 256, spread_from=1, lookahead=0, claim=3, raster="col")),
    ("fwd", P.FusedKnobs(0, 512, ring_minibatches=2)), ("bwd", P.FusedKnobs(0, 2048, claim="all", scale=False)),
    ("bwd", P.FusedKnobs(12, 1024, assign="round_robin", token_grads=False)),
    ("bwd", P.FusedKnobs(0, 1024, routed_wgrads=False))])
def test_from_row_builds_the_plan_a_row_ran(pass_, knobs):
    # sim --validate rebuilds a fused row's plan from its fields: the same knobs as the pass ran them
    row = knobs.describe(pass_, MOK_POLICY)
    again = P.FusedKnobs.from_row({**row, "num_sms": 132, "claim_pairs": 7, "median_ms": 1.0})
    assert again.resolved(pass_, MOK_POLICY) == knobs.resolved(pass_, MOK_POLICY)
    assert again.describe(pass_, MOK_POLICY) == row
