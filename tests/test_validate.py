"""Input checks (mok_proto/validate.py) and the API edges they give the reference and the schedule:
every error names the argument and what was expected; empty batches give empty results."""

import numpy as np
import pytest

from mok_proto import reference, validate
from mok_proto.schedule import build_all_schedules, build_pull_schedule

N, H, I, E, K = 5, 6, 4, 8, 3


def inputs(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, H))
    idx = np.array([rng.permutation(E)[:K] for _ in range(n)], np.int32).reshape(n, K)
    wts = rng.uniform(0.1, 1.0, (n, K))
    weights = {"w_gate": rng.standard_normal((E, H, I)), "w_up": rng.standard_normal((E, H, I)),
               "w_down": rng.standard_normal((E, I, H)), "shared_gate": rng.standard_normal((H, 3)),
               "shared_up": rng.standard_normal((H, 3)), "shared_down": rng.standard_normal((3, H))}
    return x, idx, wts, weights


# ----------------------------------------------------------------------------
# The checks themselves
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("value,word", [(True, "bool"), (2.0, "float"), ("3", "str"), (None, "NoneType")])
def test_check_int_refuses_non_integers(value, word):
    with pytest.raises(validate.InputError, match=f"count must be an integer, got {word}"):
        validate.check_int(value, "count")


def test_check_int_range_and_numpy_ints():
    assert validate.check_int(np.int64(3), "n", minimum=1, maximum=3) == 3
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        validate.check_int(0, "n", minimum=1)
    with pytest.raises(ValueError, match="n must be <= 3, got 4"):
        validate.check_int(4, "n", maximum=3)


def test_input_error_is_a_value_error_and_a_type_error():
    for kind in (ValueError, TypeError):
        with pytest.raises(kind):
            validate.check_int("x", "n")


def test_check_array_names_the_argument_and_the_expected_shape():
    with pytest.raises(ValueError, match=r"x must be \[N=5,H\], got shape \(4, 6\)"):
        validate.check_array(np.zeros((4, 6)), "x", (5, None), "NH")
    with pytest.raises(TypeError, match="x must have a floating dtype, got int64"):
        validate.check_array(np.zeros((5, 6), np.int64), "x", (5, None), "NH", kind="f")
    assert validate.check_array([[1.0, 2.0]], "x", (1, 2), "NH", kind="f").shape == (1, 2)


@pytest.mark.parametrize("bad,word", [("abc", "str"), ({"a": 1}, "dict"), ([[1, 2], [3]], "ragged")])
def test_as_array_refuses_what_is_not_an_array(bad, word):
    with pytest.raises(validate.InputError, match=word):
        validate.as_array(bad, "x")


def test_check_routing():
    good = np.array([[0, 3, 7], [7, 1, 2]])
    assert validate.check_routing(good, E) is good
    with pytest.raises(ValueError, match="topk_idx: a token chooses the same expert twice"):
        validate.check_routing(np.array([[0, 3, 3]]), E)
    validate.check_routing(np.array([[0, 3, 3]]), E, distinct=False)  # the schedule's placement allows it
    with pytest.raises(ValueError, match="topk_idx: K=3 choices per token, more than the E=2 experts"):
        validate.check_routing(np.array([[0, 1, 0]]), 2)
    with pytest.raises(ValueError, match=r"values must lie in \[0, num_experts=8\), got min -1, max 7"):
        validate.check_routing(np.array([[-1, 7]]), E)
    with pytest.raises(TypeError, match="topk_idx must have an integer dtype, got float64"):
        validate.check_routing(np.array([[0.0, 1.0]]), E)


# ----------------------------------------------------------------------------
# Edges of the reference and the schedule
# ----------------------------------------------------------------------------
def test_empty_batch_is_consistent_across_route_forward_backward_schedule():
    x, idx, wts, weights = inputs(n=0)
    topk_idx, topk_weights = reference.route(x, np.ones((H, E)), K)
    assert topk_idx.shape == topk_weights.shape == (0, K)
    out, cache = reference.forward(x, idx, wts, weights)
    assert out.shape == (0, H)
    grads = reference.backward(np.zeros((0, H)), cache)
    assert grads["x"].shape == (0, H) and grads["topk_weights"].shape == (0, K)
    assert not grads["w_gate"].any() and grads["w_gate"].shape == (E, H, I)
    (sched,) = build_all_schedules(np.zeros((1, 0, K), np.int32), E)
    assert sched.num_slots == 0 and sched.dst_rank.shape == (0,)


def test_route_rejects_non_finite_logits():
    x, _, _, _ = inputs()
    x[2, 1] = np.nan
    with pytest.raises(ValueError, match="route: the router logits x @ w_router must be finite"):
        reference.route(x, np.ones((H, E)), K)


@pytest.mark.parametrize("k,word", [(True, "bool"), (2.5, "float"), (0, ">= 1"), (E + 1, f"<= {E}")])
def test_route_refuses_bad_k(k, word):
    x, _, _, _ = inputs()
    with pytest.raises(ValueError, match=f"route: k must be.*{word}"):
        reference.route(x, np.ones((H, E)), k)


def test_forward_refuses_what_route_cannot_produce():
    x, idx, wts, weights = inputs()
    dup = idx.copy()
    dup[1, 2] = dup[1, 0]
    with pytest.raises(ValueError, match="topk_idx: a token chooses the same expert twice"):
        reference.forward(x, dup, wts, weights)
    wide = np.tile(np.arange(E), (N, 2))  # K = 2E: more choices than experts
    with pytest.raises(ValueError, match=f"topk_idx: K={2 * E} choices per token, more than the E={E} experts"):
        reference.forward(x, wide, np.ones(wide.shape), weights)
    with pytest.raises(ValueError, match=r"topk_idx must be \[N,K\] with K >= 1"):
        reference.forward(x, idx[:, :0], wts[:, :0], weights)
    bad_w = wts.copy()
    bad_w[0, 0] = np.inf
    with pytest.raises(ValueError, match="topk_weights must be finite"):
        reference.forward(x, idx, bad_w, weights)


def test_forward_converts_lists_to_arrays():
    x, idx, wts, weights = inputs()
    want, _ = reference.forward(x, idx, wts, weights, dtype="float64")
    got, _ = reference.forward(x.tolist(), idx.tolist(), wts.tolist(),
                               {key: w.tolist() for key, w in weights.items()}, dtype="float64")
    np.testing.assert_array_equal(got, want)


def test_forward_two_dimensional_w_gate_is_named():
    x, idx, wts, weights = inputs()
    weights["w_gate"] = weights["w_gate"][0]
    with pytest.raises(ValueError, match=r"weights\['w_gate'\] must be \[E,H=6,I\], got shape \(6, 4\)"):
        reference.forward(x, idx, wts, weights)


def test_forward_weights_not_a_dict():
    x, idx, wts, weights = inputs()
    with pytest.raises(TypeError, match="weights must be a dict of arrays"):
        reference.forward(x, idx, wts, list(weights.values()))


def test_backward_needs_the_forward_cache_and_a_matching_dout():
    x, idx, wts, weights = inputs()
    out, cache = reference.forward(x, idx, wts, weights)
    with pytest.raises(ValueError, match="backward: cache must be the cache returned by forward.*missing x"):
        reference.backward(out, {})
    with pytest.raises(ValueError, match=r"dout must be \[N=5,H=6\], got shape \(5, 5\)"):
        reference.backward(out[:, :-1], cache)
    assert reference.backward(out.tolist(), cache)["x"].shape == (N, H)


def test_schedule_rejects_bool_rank_and_align():
    topk = np.zeros((2, 3, 1), np.int32)
    with pytest.raises(ValueError, match="rank must be an integer, got bool"):
        build_pull_schedule(topk, 4, True)
    with pytest.raises(ValueError, match="align must be an integer, got bool"):
        build_pull_schedule(topk, 4, 0, align=True)
