"""Tests of mok_proto.reference (and mok_proto.problem) against independent, deliberately naive code.

Legend: N tokens, H hidden, I expert FFN, Is shared FFN, E experts, K top-k, R ranks.
Every reference test runs under an `xp` fixture: numpy here, cupy on a GPU (marked `gpu`, skipped
with a reason when cupy or a device is missing). Oracles and checks always run in NumPy float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mok_proto import reference
from mok_proto.config import MoEShape
from mok_proto.problem import make_problem

GRAD_KEYS = ("x", "topk_weights", "w_gate", "w_up", "w_down")
SHARED_KEYS = ("shared_gate", "shared_up", "shared_down")


# ----------------------------------------------------------------------------
# The array module under test
# ----------------------------------------------------------------------------
def _cupy_or_skip():
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any import failure means no GPU path
        pytest.skip(f"cupy is not importable ({type(e).__name__})")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device visible")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no usable CUDA device ({e})")
    return cupy


@pytest.fixture(params=[pytest.param("numpy", id="numpy"),
                        pytest.param("cupy", id="cupy", marks=pytest.mark.gpu)])
def xp(request):
    return np if request.param == "numpy" else _cupy_or_skip()


def to_np(a):
    """Any array (numpy or cupy) -> numpy."""
    if type(a).__module__.split(".")[0] == "cupy":
        return a.get()
    return np.asarray(a)


def to_xp(xp, tree):
    if isinstance(tree, dict):
        return {k: to_xp(xp, v) for k, v in tree.items()}
    return xp.asarray(tree)


# ----------------------------------------------------------------------------
# Inputs (NumPy, float64)
# ----------------------------------------------------------------------------
def random_idx(rng, n, e, k):
    """[N,K] distinct experts per token."""
    return np.stack([rng.permutation(e)[:k] for _ in range(n)]).astype(np.int32).reshape(n, k)


def make_inputs(seed, n, h, i, e, k, shared_ffn=None, idx=None):
    """x, topk_idx, topk_weights, weights, dout -- all float64 numpy (idx int32)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h))
    if idx is None:
        idx = random_idx(rng, n, e, k)
    idx = np.asarray(idx, np.int32)
    wts = rng.uniform(0.1, 1.0, idx.shape)
    wts /= wts.sum(axis=1, keepdims=True)
    weights = {
        "w_gate": rng.standard_normal((e, h, i)) * h ** -0.5,
        "w_up": rng.standard_normal((e, h, i)) * h ** -0.5,
        "w_down": rng.standard_normal((e, i, h)) * i ** -0.5,
    }
    if shared_ffn:
        s = shared_ffn
        weights["shared_gate"] = rng.standard_normal((h, s)) * h ** -0.5
        weights["shared_up"] = rng.standard_normal((h, s)) * h ** -0.5
        weights["shared_down"] = rng.standard_normal((s, h)) * s ** -0.5
    dout = rng.standard_normal((n, h))
    return x, idx, wts, weights, dout


# ----------------------------------------------------------------------------
# Independent naive oracles
# ----------------------------------------------------------------------------
def naive_silu(g):
    return g / (1.0 + np.exp(-g))


def naive_expert(xt, wg, wu, wd):
    """One token vector [H] through one SwiGLU expert, float64."""
    hid = np.zeros(wg.shape[1])
    for c in range(wg.shape[1]):
        g = float(np.dot(xt, wg[:, c]))
        u = float(np.dot(xt, wu[:, c]))
        hid[c] = naive_silu(g) * u
    out = np.zeros(wd.shape[1])
    for c in range(wd.shape[0]):
        out += hid[c] * wd[c]
    return out


def naive_forward(x, idx, wts, weights):
    x = np.asarray(x, np.float64)
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    n, k = idx.shape
    out = np.zeros_like(x)
    for t in range(n):
        acc = np.zeros(x.shape[1])
        if "shared_gate" in w:
            acc += naive_expert(x[t], w["shared_gate"], w["shared_up"], w["shared_down"])
        for j in range(k):
            e = int(idx[t, j])
            acc += float(wts[t, j]) * naive_expert(x[t], w["w_gate"][e], w["w_up"][e], w["w_down"][e])
        out[t] = acc
    return out


def naive_route(x, w_router, k, score):
    """(idx [N,K], weights [N,K]) in float64, ranking by (-score, expert index)."""
    logits = np.asarray(x, np.float64) @ np.asarray(w_router, np.float64)
    idx = np.zeros((x.shape[0], k), np.int64)
    wts = np.zeros((x.shape[0], k))
    gaps = np.zeros(x.shape[0])
    for t in range(x.shape[0]):
        row = logits[t]
        if score == "softmax":
            ex = [math.exp(v - row.max()) for v in row]
            sc = [v / sum(ex) for v in ex]
        else:
            sc = [1.0 / (1.0 + math.exp(-v)) for v in row]
        ranked = sorted(range(len(sc)), key=lambda e: (-sc[e], e))
        idx[t] = ranked[:k]
        chosen = [sc[e] for e in ranked[:k]]
        wts[t] = [c / sum(chosen) for c in chosen]
        ordered = [sc[e] for e in ranked]
        gaps[t] = min(ordered[a] - ordered[a + 1] for a in range(len(ordered) - 1)) if len(ordered) > 1 else 1.0
    return idx, wts, gaps


def scalar_loss(out, dout):
    return float(np.sum(to_np(out) * dout))


# ----------------------------------------------------------------------------
# 1. Forward vs the naive per-token loop (float64)
# ----------------------------------------------------------------------------
FWD_CASES = [
    # (seed, N, H, I, E, K, Is)
    (0, 5, 8, 6, 4, 2, None),
    (1, 5, 8, 6, 4, 2, 5),
    (2, 7, 12, 4, 6, 3, 4),
    (3, 1, 6, 3, 3, 3, None),
    (4, 9, 5, 7, 8, 1, 6),
    (5, 6, 4, 4, 5, 5, 3),
]


@pytest.mark.parametrize("seed,n,h,i,e,k,s", FWD_CASES)
def test_forward_matches_naive_loop(xp, seed, n, h, i, e, k, s):
    x, idx, wts, weights, _ = make_inputs(seed, n, h, i, e, k, shared_ffn=s)
    out, _ = reference.forward(xp.asarray(x), xp.asarray(idx), xp.asarray(wts), to_xp(xp, weights),
                               dtype="float64")
    out = to_np(out)
    want = naive_forward(x, idx, wts, weights)
    assert out.dtype == np.float64 and out.shape == (n, h)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_forward_naive_oracle_is_not_trivial():
    """Guard the oracle: changing one weight must change the naive output (so the comparison bites)."""
    x, idx, wts, weights, _ = make_inputs(0, 4, 6, 5, 4, 2, shared_ffn=3)
    base = naive_forward(x, idx, wts, weights)
    assert np.abs(base).max() > 1e-3
    for key in ("w_down", "shared_down"):
        w2 = dict(weights)
        w2[key] = weights[key] * 1.5
        assert np.abs(naive_forward(x, idx, wts, w2) - base).max() > 1e-6


@pytest.mark.parametrize("shared", [False, True])
def test_forward_special_routings_match_naive(xp, shared):
    """One expert in every token, and an unused expert (repeated ids are refused: see section 6)."""
    n, h, i, e, k = 6, 7, 5, 5, 3
    idx = np.array([[0, 2, 1], [2, 0, 1], [0, 1, 3], [3, 1, 0], [1, 0, 2], [0, 3, 2]], np.int32)  # 4 unused
    x, idx, wts, weights, _ = make_inputs(11, n, h, i, e, k, shared_ffn=4 if shared else None, idx=idx)
    out, _ = reference.forward(xp.asarray(x), xp.asarray(idx), xp.asarray(wts), to_xp(xp, weights),
                               dtype="float64")
    want = naive_forward(x, idx, wts, weights)
    np.testing.assert_allclose(to_np(out), want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_zero_weights_give_shared_only(xp):
    x, idx, wts, weights, _ = make_inputs(3, 4, 6, 5, 4, 2, shared_ffn=3)
    out, _ = reference.forward(xp.asarray(x), xp.asarray(idx), xp.asarray(np.zeros_like(wts)),
                               to_xp(xp, weights), dtype="float64")
    shared = {k: weights[k] for k in ("shared_gate", "shared_up", "shared_down")}
    want = np.stack([naive_expert(x[t], shared["shared_gate"], shared["shared_up"], shared["shared_down"])
                     for t in range(4)])
    np.testing.assert_allclose(to_np(out), want, rtol=1e-12, atol=1e-13)


# ----------------------------------------------------------------------------
# Token-side helpers and the expert block against loops
# ----------------------------------------------------------------------------
def test_slot_helpers_match_loops(xp):
    rng = np.random.default_rng(7)
    n, k, h = 5, 3, 4
    base = rng.standard_normal((n, h))
    slots = rng.standard_normal((n * k, h))
    wts = rng.standard_normal((n, k))
    dout = rng.standard_normal((n, h))

    ws = to_np(reference.weighted_sum(xp.asarray(base), xp.asarray(slots), xp.asarray(wts)))
    ss = to_np(reference.slot_sum(xp.asarray(base), xp.asarray(slots), k))
    sc = to_np(reference.scale_to_slots(xp.asarray(dout), xp.asarray(wts)))
    tg = to_np(reference.topk_weight_grad(xp.asarray(dout), xp.asarray(slots), k))
    for t in range(n):
        want_ws, want_ss = base[t].copy(), base[t].copy()
        for j in range(k):
            want_ws = want_ws + wts[t, j] * slots[t * k + j]
            want_ss = want_ss + slots[t * k + j]
            np.testing.assert_allclose(sc[t * k + j], wts[t, j] * dout[t], rtol=0, atol=0)
            assert tg[t, j] == pytest.approx(sum(dout[t, c] * slots[t * k + j, c] for c in range(h)),
                                             rel=1e-13, abs=1e-14)
        np.testing.assert_allclose(ws[t], want_ws, rtol=1e-14, atol=1e-14)
        np.testing.assert_allclose(ss[t], want_ss, rtol=1e-14, atol=1e-14)
    assert sc.shape == (n * k, h) and tg.shape == (n, k)
    # base is not modified in place
    ws_base = xp.asarray(base)
    reference.weighted_sum(ws_base, xp.asarray(slots), xp.asarray(wts))
    reference.slot_sum(ws_base, xp.asarray(slots), k)
    np.testing.assert_array_equal(to_np(ws_base), base)


def test_expert_forward_and_backward_match_naive(xp):
    rng = np.random.default_rng(8)
    n, h, i = 4, 6, 5
    x = rng.standard_normal((n, h))
    wg, wu, wd = (rng.standard_normal((h, i)) * 0.4, rng.standard_normal((h, i)) * 0.4,
                  rng.standard_normal((i, h)) * 0.4)
    dy = rng.standard_normal((n, h))
    y, saved = reference.expert_forward(*(xp.asarray(a) for a in (x, wg, wu, wd)))
    want = np.stack([naive_expert(x[t], wg, wu, wd) for t in range(n)])
    np.testing.assert_allclose(to_np(y), want, rtol=1e-12, atol=1e-13)
    grads = [to_np(g) for g in reference.expert_backward(xp.asarray(dy), saved,
                                                           *(xp.asarray(a) for a in (wg, wu, wd)))]
    arrays = [x, wg, wu, wd]
    eps = 1e-6

    def loss(arrs):
        return float(sum(np.dot(dy[t], naive_expert(arrs[0][t], *arrs[1:])) for t in range(n)))

    for which, grad in enumerate(grads):
        assert grad.shape == arrays[which].shape
        for flat in range(arrays[which].size):
            plus = [a.copy() for a in arrays]
            minus = [a.copy() for a in arrays]
            plus[which].flat[flat] += eps
            minus[which].flat[flat] -= eps
            fd = (loss(plus) - loss(minus)) / (2 * eps)
            assert grad.flat[flat] == pytest.approx(fd, rel=1e-6, abs=1e-8), (which, flat)


def test_sigmoid_silu_values(xp):
    g = np.array([-1000.0, -30.0, -1.0, 0.0, 0.5, 2.0, 30.0, 1000.0])
    sig = to_np(reference.sigmoid(xp.asarray(g)))
    assert np.all(np.isfinite(sig))
    want = np.array([0.0 if v < -700 else 1.0 / (1.0 + math.exp(-v)) for v in g])
    # The tanh form is accurate to ~eps absolutely (not relatively in the far negative tail).
    np.testing.assert_allclose(sig, want, rtol=1e-14, atol=2e-16)
    assert np.all((sig >= 0) & (sig <= 1))
    silu = to_np(reference.silu(xp.asarray(g)))
    assert np.all(np.abs(silu - g * want) <= 1e-14 * np.abs(g * want) + 2e-16 * np.abs(g))


# ----------------------------------------------------------------------------
# 2. Finite-difference gradient checks (float64)
# ----------------------------------------------------------------------------
def _grad_case(name):
    """(seed, N, H, I, E, K, Is, idx or None)."""
    if name == "random_shared":
        return 21, 6, 7, 5, 4, 2, 4, None
    if name == "no_shared":
        return 22, 6, 7, 5, 4, 2, None, None
    if name == "unused_expert":  # expert 4 receives nothing
        idx = np.array([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]], np.int32)
        return 23, 5, 6, 4, 5, 2, 3, idx
    if name == "all_on_one_expert":  # K=1, every token on expert 2
        return 24, 5, 6, 4, 4, 1, 3, np.full((5, 1), 2, np.int32)
    if name == "first_choice_one_expert":  # choice 0 is expert 0 for everyone
        idx = np.array([[0, 1], [0, 2], [0, 3], [0, 1]], np.int32)
        return 25, 4, 6, 4, 4, 2, None, idx
    if name == "single_token":
        return 26, 1, 6, 4, 5, 3, 3, None
    if name == "k_equals_e":
        return 27, 4, 6, 4, 3, 3, 3, None
    if name == "k_equals_e_no_shared":
        return 28, 3, 5, 3, 4, 4, None, None
    raise KeyError(name)


GRAD_CASES = ["random_shared", "no_shared", "unused_expert", "all_on_one_expert",
              "first_choice_one_expert", "single_token", "k_equals_e", "k_equals_e_no_shared"]


def _fd_check(xp, x, idx, wts, weights, dout, grads, samples=14, seed=0, eps=1e-6):
    """Central differences of L = sum(out * dout) at a random subset of entries of every gradient."""
    rng = np.random.default_rng(seed)
    inputs = {"x": x, "topk_weights": wts, **weights}

    def loss(inp):
        w = {kk: v for kk, v in inp.items() if kk not in ("x", "topk_weights")}
        out, _ = reference.forward(xp.asarray(inp["x"]), xp.asarray(idx), xp.asarray(inp["topk_weights"]),
                                   to_xp(xp, w), dtype="float64")
        return scalar_loss(out, dout)

    for key, arr in inputs.items():
        grad = grads[key]
        assert grad.shape == arr.shape, key
        picks = rng.choice(arr.size, size=min(samples, arr.size), replace=False)
        scale = max(1.0, float(np.abs(grad).max()))
        for flat in picks:
            plus = dict(inputs)
            minus = dict(inputs)
            plus[key] = arr.copy()
            minus[key] = arr.copy()
            plus[key].flat[flat] += eps
            minus[key].flat[flat] -= eps
            fd = (loss(plus) - loss(minus)) / (2 * eps)
            an = float(grad.flat[flat])
            assert abs(fd - an) <= 1e-6 * max(abs(an), 1e-2 * scale), (key, int(flat), an, fd)


@pytest.mark.parametrize("case", GRAD_CASES)
def test_backward_finite_differences(xp, case):
    seed, n, h, i, e, k, s, idx = _grad_case(case)
    x, idx, wts, weights, dout = make_inputs(seed, n, h, i, e, k, shared_ffn=s, idx=idx)
    out, cache = reference.forward(xp.asarray(x), xp.asarray(idx), xp.asarray(wts), to_xp(xp, weights),
                                   dtype="float64")
    grads = {kk: to_np(v) for kk, v in reference.backward(xp.asarray(dout), cache).items()}
    expected_keys = set(GRAD_KEYS) | (set(SHARED_KEYS) if s else set())
    assert set(grads) == expected_keys
    for kk, v in grads.items():
        assert v.dtype == np.float64, kk
        assert np.all(np.isfinite(v)), kk
    _fd_check(xp, x, idx, wts, weights, dout, grads, seed=seed)

    used = set(int(v) for v in idx.ravel())
    for ex in range(e):
        for kk in ("w_gate", "w_up", "w_down"):
            if ex in used:
                assert np.abs(grads[kk][ex]).max() > 0, (kk, ex)
            else:  # an expert that receives no token gets exactly zero
                assert np.all(grads[kk][ex] == 0.0), (kk, ex)
    if case == "unused_expert":
        assert 4 not in used


def test_backward_unused_experts_grad_exactly_zero_and_fd(xp):
    """Every sampled entry of an idle expert: analytic 0, finite difference 0 too."""
    n, h, i, e, k = 4, 5, 3, 6, 2
    idx = np.array([[1, 3], [3, 1], [1, 3], [3, 1]], np.int32)  # experts 0, 2, 4, 5 idle
    x, idx, wts, weights, dout = make_inputs(31, n, h, i, e, k, shared_ffn=None, idx=idx)
    _, cache = reference.forward(xp.asarray(x), xp.asarray(idx), xp.asarray(wts), to_xp(xp, weights),
                                 dtype="float64")
    grads = {kk: to_np(v) for kk, v in reference.backward(xp.asarray(dout), cache).items()}
    for ex in (0, 2, 4, 5):
        for kk in ("w_gate", "w_up", "w_down"):
            assert np.all(grads[kk][ex] == 0.0)
    _fd_check(xp, x, idx, wts, weights, dout, grads, samples=20, seed=1)


def test_backward_is_linear_in_dout(xp):
    x, idx, wts, weights, dout = make_inputs(41, 5, 6, 4, 4, 2, shared_ffn=3)
    _, cache = reference.forward(xp.asarray(x), xp.asarray(idx), xp.asarray(wts), to_xp(xp, weights),
                                 dtype="float64")
    g1 = reference.backward(xp.asarray(dout), cache)
    g2 = reference.backward(xp.asarray(2.0 * dout), cache)
    g0 = reference.backward(xp.asarray(np.zeros_like(dout)), cache)
    for kk in g1:
        np.testing.assert_allclose(to_np(g2[kk]), 2.0 * to_np(g1[kk]), rtol=1e-13, atol=1e-15)
        assert np.all(to_np(g0[kk]) == 0.0)


def test_backward_bad_dout_shape(xp):
    x, idx, wts, weights, dout = make_inputs(42, 4, 6, 4, 4, 2)
    _, cache = reference.forward(xp.asarray(x), xp.asarray(idx), xp.asarray(wts), to_xp(xp, weights))
    with pytest.raises(ValueError, match="dout"):
        reference.backward(xp.asarray(dout[:-1]), cache)
    with pytest.raises(ValueError, match="dout"):
        reference.backward(xp.asarray(dout.T), cache)


# ----------------------------------------------------------------------------
# 3. dtypes
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_float32_default_and_agreement(xp, seed):
    n, h, i, e, k = 16, 32, 16, 6, 2
    x, idx, wts, weights, dout = make_inputs(seed, n, h, i, e, k, shared_ffn=8)
    args = (xp.asarray(x), xp.asarray(idx), xp.asarray(wts), to_xp(xp, weights))
    out32, cache32 = reference.forward(*args)
    out64, cache64 = reference.forward(*args, dtype="float64")
    assert to_np(out32).dtype == np.float32
    assert to_np(out64).dtype == np.float64
    eps32 = float(np.finfo(np.float32).eps)
    tol = 64 * eps32 * math.sqrt(h + i)  # accumulation over H then I terms, values O(1)
    o32, o64 = to_np(out32).astype(np.float64), to_np(out64)
    assert np.abs(o32 - o64).max() <= tol * max(1.0, np.abs(o64).max())
    assert np.abs(o32 - o64).max() > 0  # really computed in float32

    g32 = reference.backward(xp.asarray(dout), cache32)
    g64 = reference.backward(xp.asarray(dout), cache64)
    assert set(g32) == set(g64)
    for kk in g32:
        a, b = to_np(g32[kk]), to_np(g64[kk])
        assert a.dtype == np.float32 and b.dtype == np.float64, kk
        assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max()), kk


def test_float32_inputs_upcast_by_float64(xp):
    """float32 inputs, dtype='float64': the same as float64 inputs holding those float32 values."""
    x, idx, wts, weights, _ = make_inputs(3, 5, 6, 4, 4, 2, shared_ffn=3)
    f32 = {kk: v.astype(np.float32) for kk, v in weights.items()}
    out_a, _ = reference.forward(xp.asarray(x.astype(np.float32)), xp.asarray(idx),
                                 xp.asarray(wts.astype(np.float32)), to_xp(xp, f32), dtype="float64")
    out_b, _ = reference.forward(xp.asarray(x.astype(np.float32).astype(np.float64)), xp.asarray(idx),
                                 xp.asarray(wts.astype(np.float32).astype(np.float64)),
                                 to_xp(xp, {kk: v.astype(np.float64) for kk, v in f32.items()}),
                                 dtype="float64")
    assert to_np(out_a).dtype == np.float64
    np.testing.assert_array_equal(to_np(out_a), to_np(out_b))


@pytest.mark.parametrize("dtype", ["float16", "int32", "bfloat", "complex128", np.float16])
def test_bad_dtype_raises(xp, dtype):
    x, idx, wts, weights, _ = make_inputs(0, 3, 4, 3, 3, 2)
    with pytest.raises((ValueError, TypeError)) as info:
        reference.forward(xp.asarray(x), xp.asarray(idx), xp.asarray(wts), to_xp(xp, weights), dtype=dtype)
    if dtype != "bfloat":  # an unknown name is numpy's TypeError; a known wrong dtype must be ValueError
        assert issubclass(info.type, ValueError)
        assert "dtype" in str(info.value)


def test_dtype_accepts_numpy_dtypes(xp):
    x, idx, wts, weights, _ = make_inputs(0, 3, 4, 3, 3, 2)
    args = (xp.asarray(x), xp.asarray(idx), xp.asarray(wts), to_xp(xp, weights))
    assert to_np(reference.forward(*args, dtype=np.float64)[0]).dtype == np.float64
    assert to_np(reference.forward(*args, dtype=np.float32)[0]).dtype == np.float32


# ----------------------------------------------------------------------------
# 4. Bitwise reproducibility
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bitwise_reproducible(xp, dtype):
    x, idx, wts, weights, dout = make_inputs(51, 20, 24, 12, 6, 3, shared_ffn=10)

    def run():
        # fresh copies each time, so nothing can hide behind object identity
        out, cache = reference.forward(xp.asarray(x.copy()), xp.asarray(idx.copy()), xp.asarray(wts.copy()),
                                       to_xp(xp, {kk: v.copy() for kk, v in weights.items()}), dtype=dtype)
        grads = reference.backward(xp.asarray(dout.copy()), cache)
        return to_np(out), {kk: to_np(v) for kk, v in grads.items()}

    out1, g1 = run()
    out2, g2 = run()
    assert out1.tobytes() == out2.tobytes()
    assert set(g1) == set(g2)
    for kk in g1:
        assert g1[kk].dtype == g2[kk].dtype
        assert g1[kk].tobytes() == g2[kk].tobytes(), kk


def test_forward_does_not_mutate_inputs(xp):
    x, idx, wts, weights, dout = make_inputs(52, 6, 8, 4, 4, 2, shared_ffn=3)
    xa, ia, wa = xp.asarray(x), xp.asarray(idx), xp.asarray(wts)
    wd = to_xp(xp, weights)
    _, cache = reference.forward(xa, ia, wa, wd, dtype="float64")
    reference.backward(xp.asarray(dout), cache)
    np.testing.assert_array_equal(to_np(xa), x)
    np.testing.assert_array_equal(to_np(ia), idx)
    np.testing.assert_array_equal(to_np(wa), wts)
    for kk in weights:
        np.testing.assert_array_equal(to_np(wd[kk]), weights[kk])


# ----------------------------------------------------------------------------
# 5. route
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("seed,n,h,e,k", [(0, 16, 8, 6, 2), (1, 9, 12, 10, 4), (2, 5, 4, 3, 3), (3, 7, 6, 5, 1)])
def test_route_matches_naive(xp, score, seed, n, h, e, k):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h)).astype(np.float32)
    w_router = (rng.standard_normal((h, e)) * h ** -0.5).astype(np.float32)
    idx, wts = reference.route(xp.asarray(x), xp.asarray(w_router), k, score=score)
    idx, wts = to_np(idx), to_np(wts)
    assert idx.dtype == np.int32 and wts.dtype == np.float32
    assert idx.shape == (n, k) and wts.shape == (n, k)
    want_idx, want_wts, gaps = naive_route(x, w_router, k, score)
    checked = 0
    for t in range(n):
        assert len(set(idx[t].tolist())) == k
        if gaps[t] > 1e-4:  # far from a float32 near-tie: ranking must agree exactly
            np.testing.assert_array_equal(idx[t], want_idx[t])
            np.testing.assert_allclose(wts[t], want_wts[t], rtol=2e-5, atol=1e-6)
            checked += 1
    assert checked >= n // 2
    np.testing.assert_allclose(wts.astype(np.float64).sum(axis=1), 1.0, rtol=0, atol=1e-6)
    assert np.all(wts > 0)
    # descending weights (scores ranked high to low)
    assert np.all(np.diff(wts.astype(np.float64), axis=1) <= 1e-7)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_route_exact_ties_lower_index_first(xp, score):
    # Small integer values: logits are exact, so identical columns give bit-identical scores.
    w_router = np.array([[1.0, 3.0, 2.0, 3.0, 0.0, 2.0],
                         [0.0, 1.0, 1.0, 1.0, 0.0, 1.0]], np.float32)  # columns 1==3, 2==5
    x = np.array([[1.0, 1.0],  # logits 1, 4, 3, 4, 0, 3
                  [0.0, 0.0],  # all zero -> full tie
                  [-1.0, 0.0]], np.float32)  # logits -1,-3,-2,-3, 0,-2
    idx, wts = reference.route(xp.asarray(x), xp.asarray(w_router), 4, score=score)
    idx, wts = to_np(idx), to_np(wts)
    np.testing.assert_array_equal(idx[0], [1, 3, 2, 5])
    np.testing.assert_array_equal(idx[1], [0, 1, 2, 3])
    np.testing.assert_array_equal(idx[2], [4, 0, 2, 5])
    assert wts[0, 0] == wts[0, 1] and wts[0, 2] == wts[0, 3]
    np.testing.assert_allclose(wts[1], 0.25, rtol=1e-6)
    assert wts[2, 2] == wts[2, 3]
    # k = E on a full tie: identity order
    idx_all, wts_all = reference.route(xp.asarray(x[1:2]), xp.asarray(w_router), 6, score=score)
    np.testing.assert_array_equal(to_np(idx_all)[0], np.arange(6))
    np.testing.assert_allclose(to_np(wts_all)[0], 1.0 / 6, rtol=1e-6)


def test_route_float64_inputs_still_int32_float32(xp):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 3))
    w_router = rng.standard_normal((3, 5))
    idx, wts = reference.route(xp.asarray(x), xp.asarray(w_router), 2)
    assert to_np(idx).dtype == np.int32 and to_np(wts).dtype == np.float32
    # default score is softmax
    idx_s, wts_s = reference.route(xp.asarray(x), xp.asarray(w_router), 2, score="softmax")
    np.testing.assert_array_equal(to_np(idx), to_np(idx_s))
    np.testing.assert_array_equal(to_np(wts), to_np(wts_s))


def test_route_softmax_and_sigmoid_differ_in_weights(xp):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    w = rng.standard_normal((4, 5)).astype(np.float32)
    _, a = reference.route(xp.asarray(x), xp.asarray(w), 3, score="softmax")
    _, b = reference.route(xp.asarray(x), xp.asarray(w), 3, score="sigmoid")
    assert np.abs(to_np(a) - to_np(b)).max() > 1e-3


@pytest.mark.parametrize("k", [0, -1, 6, 100])
def test_route_bad_k(xp, k):
    x = np.ones((3, 4), np.float32)
    w = np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match="k"):
        reference.route(xp.asarray(x), xp.asarray(w), k)


@pytest.mark.parametrize("score", ["relu", "Softmax", "", None, "top"])
def test_route_bad_score(xp, score):
    x = np.ones((3, 4), np.float32)
    w = np.ones((4, 5), np.float32)
    with pytest.raises(ValueError, match="score"):
        reference.route(xp.asarray(x), xp.asarray(w), 2, score=score)


@pytest.mark.parametrize("xshape,wshape", [((3, 4), (5, 6)), ((4,), (4, 6)), ((3, 4), (4,)),
                                           ((2, 3, 4), (4, 6)), ((3, 4), (4, 6, 1)), ((3, 4), (6, 4))])
def test_route_mismatched_shapes(xp, xshape, wshape):
    x = np.ones(xshape, np.float32)
    w = np.ones(wshape, np.float32)
    with pytest.raises(ValueError):
        reference.route(xp.asarray(x), xp.asarray(w), 2)


# ----------------------------------------------------------------------------
# 6. Input validation of forward
# ----------------------------------------------------------------------------
N_, H_, I_, E_, K_, S_ = 4, 6, 5, 4, 2, 3


def _good():
    return make_inputs(61, N_, H_, I_, E_, K_, shared_ffn=S_)


def _mutations():
    """name -> function(x, idx, wts, weights) -> new (x, idx, wts, weights) that must be rejected."""
    def m_x1d(x, i, w, ws): return x[0], i, w, ws
    def m_x3d(x, i, w, ws): return x[None], i, w, ws
    def m_idx_rows(x, i, w, ws): return x, i[:-1], w[:-1], ws
    def m_idx_1d(x, i, w, ws): return x, i[:, 0], w[:, 0], ws
    def m_wts_shape(x, i, w, ws): return x, i, w[:, :1], ws
    def m_wts_rows(x, i, w, ws): return x, i, w[:-1], ws
    def m_idx_neg(x, i, w, ws):
        i = i.copy(); i[1, 1] = -1; return x, i, w, ws  # noqa: E702
    def m_idx_big(x, i, w, ws):
        i = i.copy(); i[2, 0] = E_; return x, i, w, ws  # noqa: E702

    def with_weight(key, value):
        def m(x, i, w, ws):
            ws = dict(ws)
            if value is None:
                del ws[key]
            else:
                ws[key] = value(ws[key])
            return x, i, w, ws
        return m

    def drop(*keys):
        def m(x, i, w, ws):
            return x, i, w, {k: v for k, v in ws.items() if k not in keys}
        return m

    return {
        "x_1d": m_x1d, "x_3d": m_x3d, "idx_rows": m_idx_rows, "idx_1d": m_idx_1d,
        "wts_cols": m_wts_shape, "wts_rows": m_wts_rows, "idx_negative": m_idx_neg, "idx_eq_E": m_idx_big,
        "missing_w_gate": with_weight("w_gate", None),
        "missing_w_up": with_weight("w_up", None),
        "missing_w_down": with_weight("w_down", None),
        "w_gate_H": with_weight("w_gate", lambda a: a[:, :-1]),
        "w_up_I": with_weight("w_up", lambda a: a[:, :, :-1]),
        "w_up_E": with_weight("w_up", lambda a: a[:-1]),
        "w_down_T": with_weight("w_down", lambda a: np.swapaxes(a, 1, 2)),
        "w_down_E": with_weight("w_down", lambda a: a[:-1]),
        "w_gate_2d": with_weight("w_gate", lambda a: a[0]),
        "only_shared_gate": drop("shared_up", "shared_down"),
        "no_shared_down": drop("shared_down"),
        "no_shared_gate": drop("shared_gate"),
        "shared_gate_H": with_weight("shared_gate", lambda a: a[:-1]),
        "shared_up_Is": with_weight("shared_up", lambda a: a[:, :-1]),
        "shared_down_T": with_weight("shared_down", lambda a: a.T),
        "shared_down_Is": with_weight("shared_down", lambda a: a[:-1]),
        "shared_gate_1d": with_weight("shared_gate", lambda a: a[:, 0]),
    }


MUTATIONS = _mutations()


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_forward_rejects_bad_inputs(xp, name):
    x, idx, wts, weights, _ = _good()
    x2, idx2, wts2, weights2 = MUTATIONS[name](x, idx, wts, weights)
    with pytest.raises(ValueError):
        reference.forward(xp.asarray(x2), xp.asarray(idx2), xp.asarray(wts2), to_xp(xp, weights2))


def test_forward_good_inputs_accepted(xp):
    """The unmutated inputs of the validation table are fine (so each rejection is the mutation's)."""
    x, idx, wts, weights, _ = _good()
    out, _ = reference.forward(xp.asarray(x), xp.asarray(idx), xp.asarray(wts), to_xp(xp, weights))
    assert to_np(out).shape == (N_, H_)
    no_shared = {k: v for k, v in weights.items() if not k.startswith("shared_")}
    out, _ = reference.forward(xp.asarray(x), xp.asarray(idx), xp.asarray(wts), to_xp(xp, no_shared))
    assert to_np(out).shape == (N_, H_)
    # boundary expert indices 0 and E-1 are valid
    idx2 = idx.copy()
    idx2[0] = [0, E_ - 1]
    reference.forward(xp.asarray(x), xp.asarray(idx2), xp.asarray(wts), to_xp(xp, weights))


@pytest.mark.parametrize("name", ["idx_negative", "idx_eq_E", "only_shared_gate", "missing_w_up"])
def test_forward_rejection_messages(xp, name):
    x, idx, wts, weights, _ = _good()
    x2, idx2, wts2, weights2 = MUTATIONS[name](x, idx, wts, weights)
    word = {"idx_negative": "topk_idx", "idx_eq_E": "topk_idx", "only_shared_gate": "shared",
            "missing_w_up": "w_up"}[name]
    with pytest.raises(ValueError, match=word):
        reference.forward(xp.asarray(x2), xp.asarray(idx2), xp.asarray(wts2), to_xp(xp, weights2))


# ----------------------------------------------------------------------------
# 7. make_problem
# ----------------------------------------------------------------------------
def _arrays(p):
    return {"x": p.x, "topk_idx": p.topk_idx, "topk_weights": p.topk_weights, "dout": p.dout,
            **{"w." + k: v for k, v in p.weights.items()}}


SMALL = MoEShape("t", hidden=8, ffn=4, num_experts=8, top_k=3, num_tokens=5)
SMALL_NOSH = MoEShape("t0", hidden=8, ffn=4, num_experts=6, top_k=2, num_tokens=4, num_shared=0)
SMALL_IS = MoEShape("t1", hidden=8, ffn=4, num_experts=4, top_k=1, num_tokens=3, shared_ffn=6)


@pytest.mark.parametrize("routing", ["random", "one-expert", "skewed"])
@pytest.mark.parametrize("shape,ranks", [(SMALL, 2), (SMALL_NOSH, 3), (SMALL_IS, 1), (SMALL, 4)])
def test_make_problem_deterministic_and_valid(shape, ranks, routing):
    a = make_problem(shape, ranks, seed=3, routing=routing)
    b = make_problem(shape, ranks, seed=3, routing=routing)
    c = make_problem(shape, ranks, seed=4, routing=routing)
    arr_a, arr_b, arr_c = _arrays(a), _arrays(b), _arrays(c)
    assert set(arr_a) == set(arr_b) == set(arr_c)
    for kk in arr_a:
        assert arr_a[kk].dtype == arr_b[kk].dtype
        assert arr_a[kk].tobytes() == arr_b[kk].tobytes(), kk
    differ = ("x", "dout", "w.w_gate", "w.w_up", "w.w_down") + (("topk_weights",) if shape.top_k > 1 else ())
    for kk in differ:
        assert arr_a[kk].tobytes() != arr_c[kk].tobytes(), kk
    if routing != "one-expert" or shape.top_k > 1:
        assert arr_a["topk_idx"].tobytes() != arr_c["topk_idx"].tobytes()

    n, h, i, e, k = shape.num_tokens, shape.hidden, shape.ffn, shape.num_experts, shape.top_k
    assert a.num_ranks == ranks
    assert a.x.shape == (ranks, n, h) and a.dout.shape == (ranks, n, h)
    assert a.topk_idx.shape == (ranks, n, k) and a.topk_idx.dtype == np.int32
    assert a.topk_weights.shape == (ranks, n, k) and a.topk_weights.dtype == np.float32
    assert a.x.dtype == np.float32
    assert a.weights["w_gate"].shape == (e, h, i) and a.weights["w_up"].shape == (e, h, i)
    assert a.weights["w_down"].shape == (e, i, h)
    if shape.num_shared:
        s = shape.shared_ffn_size
        assert a.weights["shared_gate"].shape == (h, s) and a.weights["shared_up"].shape == (h, s)
        assert a.weights["shared_down"].shape == (s, h)
    else:
        assert not any(kk.startswith("shared_") for kk in a.weights)
    idx = a.topk_idx.reshape(-1, k)
    assert idx.min() >= 0 and idx.max() < e
    for row in idx:
        assert len(set(row.tolist())) == k  # distinct experts per token
    np.testing.assert_allclose(a.topk_weights.astype(np.float64).sum(axis=2), 1.0, atol=1e-6)
    assert np.all(a.topk_weights > 0)
    if routing == "one-expert":
        assert np.all(a.topk_idx[..., 0] == 0)
        assert np.all(a.topk_idx[..., 1:] != 0)
    # flat: all ranks' tokens in one batch, rank-major
    np.testing.assert_array_equal(a.flat("x"), a.x.reshape(ranks * n, h))
    np.testing.assert_array_equal(a.flat("topk_idx")[n * (ranks - 1):], a.topk_idx[ranks - 1])
    # the problem runs through the reference
    out, _ = reference.forward(a.flat("x"), a.flat("topk_idx"), a.flat("topk_weights"), a.weights)
    assert out.shape == (ranks * n, h) and np.all(np.isfinite(out))


def test_make_problem_random_routing_is_the_router():
    """'random' routing uses route(): its weights are renormalized softmax scores, ranked high to low."""
    p = make_problem(SMALL, 2, seed=9)
    w = p.topk_weights.reshape(-1, SMALL.top_k).astype(np.float64)
    assert np.all(np.diff(w, axis=1) <= 1e-7)


def test_make_problem_float64():
    p = make_problem(SMALL, 2, seed=1, dtype="float64")
    assert p.x.dtype == np.float64 and p.dout.dtype == np.float64
    assert all(v.dtype == np.float64 for v in p.weights.values())
    assert p.topk_idx.dtype == np.int32


def test_make_problem_skewed_is_skewed():
    shape = MoEShape("sk", hidden=16, ffn=4, num_experts=16, top_k=2, num_tokens=64, num_shared=0)
    hot = max(1, shape.num_experts // 8)
    frac = {}
    for routing in ("random", "skewed"):
        p = make_problem(shape, 2, seed=0, routing=routing)
        frac[routing] = float(np.mean(p.topk_idx < hot))
    uniform = hot / shape.num_experts
    assert frac["skewed"] > 2 * uniform
    assert frac["skewed"] > frac["random"]


def test_make_problem_one_expert_k1():
    shape = MoEShape("k1", hidden=4, ffn=2, num_experts=4, top_k=1, num_tokens=5)
    p = make_problem(shape, 2, seed=0, routing="one-expert")
    assert p.topk_idx.shape == (2, 5, 1) and np.all(p.topk_idx == 0)
    assert p.topk_idx.dtype == np.int32


@pytest.mark.parametrize("routing", ["uniform", "", "Random", "one_expert", None])
def test_make_problem_bad_routing(routing):
    with pytest.raises(ValueError, match="routing"):
        make_problem(SMALL, 2, seed=0, routing=routing)


@pytest.mark.parametrize("shape,ranks", [(SMALL, 1), (SMALL, 2), (SMALL, 4), (SMALL, 8), (SMALL_NOSH, 3)])
def test_local_weights_slices(shape, ranks):
    p = make_problem(shape, ranks, seed=2)
    el = shape.num_experts // ranks
    seen = []
    for rank in range(ranks):
        local = p.local_weights(rank)
        for kk in ("w_gate", "w_up", "w_down"):
            assert local[kk].shape[0] == el
            np.testing.assert_array_equal(local[kk], p.weights[kk][rank * el:(rank + 1) * el])
        seen.append(local["w_gate"])
        shared_keys = {kk for kk in p.weights if kk.startswith("shared_")}
        assert set(local) == {"w_gate", "w_up", "w_down"} | shared_keys
        for kk in shared_keys:
            np.testing.assert_array_equal(local[kk], p.weights[kk])
    np.testing.assert_array_equal(np.concatenate(seen), p.weights["w_gate"])
