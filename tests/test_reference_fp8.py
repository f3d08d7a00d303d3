"""The FP8 layer reference (mok_proto/reference_fp8.py): its block-scaled GEMM, its quantization
points (against the layer restated in float64 on fake-quantized operands, each point switchable),
its accuracy against the float64 reference on the bf16 inputs, scale invariance, NaN and zeros."""

import dataclasses

import numpy as np
import pytest

from mok_proto import accuracy, fp8, reference, reference_fp8
from mok_proto.config import MoEShape
from mok_proto.problem import make_problem
from mok_proto.reference_fp8 import round_bf16 as bf16
from mok_proto.schedule import build_all_schedules, expert_slot_order
from mok_proto.validate import InputError

B = fp8.BLOCK


def shape_of(h=256, i=256, e=4, k=2, n=256, shared=1):
    return MoEShape("fp8test", hidden=h, ffn=i, num_experts=e, top_k=k, num_tokens=n, num_shared=shared)


def run_fp8(prob, shared_precision="bf16", slot_order=None, **wgrad) -> dict:
    out, cache = reference_fp8.forward(prob.flat("x"), prob.flat("topk_idx"), prob.flat("topk_weights"),
                                       prob.weights, shared_precision=shared_precision, slot_order=slot_order, **wgrad)
    return {"out": out, **reference_fp8.backward(prob.flat("dout"), cache)}


def quantized(rng, m, k, scale=1.0):
    return fp8.quantize_rows((rng.standard_normal((m, k)) * scale).astype(np.float32))


# ---------------------------------------------------------------------------------------------
# scaled_matmul
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (77, 256, 384), (256, 128, 1024)])
def test_scaled_matmul_within_2e3_of_float64_on_dequantized(m, n, k):
    rng = np.random.default_rng(m + k)
    a, b = quantized(rng, m, k), quantized(rng, n, k, scale=0.05)
    want = fp8.dequantize_rows(*a).astype(np.float64) @ fp8.dequantize_rows(*b).astype(np.float64).T
    got = reference_fp8.scaled_matmul(a, b)
    assert got.dtype == np.float32 and got.shape == (m, n)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < err <= 2e-3


def _libm_fmaf():
    import ctypes
    import ctypes.util

    fmaf = ctypes.CDLL(ctypes.util.find_library("m")).fmaf
    fmaf.restype, fmaf.argtypes = ctypes.c_float, [ctypes.c_float] * 3
    return lambda a, b, c: np.float32(fmaf(float(a), float(b), float(c)))


def test_fma32_rounds_once_as_libm_fmaf():
    fmaf = _libm_fmaf()
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(3000).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 30, 3000)
               for _ in range(3))
    c[::3] = -(a[::3] * b[::3])  # cancellation
    a = np.concatenate([a, np.float32([1 + 2 ** -23, 3e38, 1e-30, np.nan, 0.0])])
    b = np.concatenate([b, np.float32([1 - 2 ** -23, 10.0, 1e-15, 1.0, -1.0])])
    c = np.concatenate([c, np.float32([2 ** 24 + 2, 0.0, 1e-45, 1.0, 0.0])])
    got = reference_fp8.fma32(a, b, c)
    want = np.array([fmaf(*v) for v in zip(a, b, c)], np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # 2^24 + 3 - 2^-46: a float64 sum rounds onto the float32 tie 2^24 + 3 (then to even, 2^24 + 4)
    assert got[3000] == 2 ** 24 + 2 != np.float32(np.float64(a[3000]) * np.float64(b[3000]) + np.float64(c[3000]))


def test_scaled_matmul_is_the_stated_float32_expression():
    """C = fmaf(S, fl32(sa sb), C) per k-block, S the exact block sum rounded once."""
    fmaf = _libm_fmaf()
    rng = np.random.default_rng(1)
    a, b = quantized(rng, 3, 3 * B, scale=7.0), quantized(rng, 2, 3 * B, scale=1e-3)
    got = reference_fp8.scaled_matmul(a, b)
    da, db = fp8.decode_e4m3(a[0]).astype(np.float64), fp8.decode_e4m3(b[0]).astype(np.float64)
    for m in range(3):
        for n in range(2):
            c = np.float32(0)
            for kb in range(3):
                exact = sum(da[m, j] * db[n, j] for j in range(kb * B, (kb + 1) * B))  # exact: multiples of 2^-18
                c = fmaf(np.float32(exact), np.float32(a[1][m, kb] * b[1][n, kb]), c)
            assert got[m, n].view(np.uint32) == c.view(np.uint32), (m, n)


def test_scaled_matmul_bits_independent_of_row_split_and_k_split():
    rng = np.random.default_rng(2)
    a, b = quantized(rng, 300, 4 * B), quantized(rng, 256, 4 * B)
    whole = reference_fp8.scaled_matmul(a, b)
    rows = np.concatenate([reference_fp8.scaled_matmul((a[0][r], a[1][r]), b)
                           for r in (slice(0, 1), slice(1, 129), slice(129, 300))])
    assert np.array_equal(whole, rows)
    first = reference_fp8.scaled_matmul((a[0][:, :B], a[1][:, :1]), (b[0][:, :B], b[1][:, :1]))
    rest = reference_fp8.scaled_matmul((a[0][:, B:], a[1][:, 1:]), (b[0][:, B:], b[1][:, 1:]), acc=first)
    assert np.array_equal(whole, rest), "a k-loop continued from acc must give the bits of one call"
    assert not np.array_equal(whole, reference_fp8.scaled_matmul(a, b, acc=np.ones_like(whole)))


def test_scaled_matmul_nan_code_stays_in_its_row_and_refuses_bad_shapes():
    rng = np.random.default_rng(3)
    a, b = quantized(rng, 4, 2 * B), quantized(rng, 8, 2 * B)
    codes = a[0].copy()
    codes[2, B + 5] = fp8.NAN_CODE
    got, clean = reference_fp8.scaled_matmul((codes, a[1]), b), reference_fp8.scaled_matmul(a, b)
    assert np.isnan(got[2]).all() and np.array_equal(np.delete(got, 2, 0), np.delete(clean, 2, 0))
    with pytest.raises(InputError, match="scaled_matmul"):
        reference_fp8.scaled_matmul(a, (b[0][:, :B], b[1][:, :1]))


def test_weight_operand_and_quantize_columns_layouts():
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((256, 384)) * 0.05).astype(np.float32)
    wq = fp8.quantize_blocks(w)
    codes, scales = reference_fp8.weight_operand(wq, transpose=True)  # W^T [384, 256]
    assert np.array_equal(fp8.dequantize_rows(codes, scales), fp8.dequantize_blocks(*wq).T)
    codes, scales = reference_fp8.weight_operand(wq, transpose=False)
    assert np.array_equal(fp8.dequantize_rows(codes, scales), fp8.dequantize_blocks(*wq))
    a = rng.standard_normal((130, 256)).astype(np.float32)  # a partial last block of 2 rows
    codes, scales = reference_fp8.quantize_columns(a)
    assert codes.shape == (256, 256) and scales.shape == (256, 2)
    padded = np.concatenate([a, np.zeros((126, 256), np.float32)])
    want = fp8.quantize_rows(padded, transpose=True)
    assert np.array_equal(codes, want[0]) and np.array_equal(scales, want[1])
    assert not codes[:, 130:].any(), "the padding rows code to +0"


# ---------------------------------------------------------------------------------------------
# The quantization points: the layer restated in float64 on fake-quantized (dequantized) operands
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Points:
    """Which operands the restatement quantizes (all: the spec's table)."""
    x: bool = True  # xq before gate/up
    w: bool = True  # the weights, 128 x 128
    h: bool = True  # hq before down
    dy: bool = True  # dyq before down_bwd
    dgu: bool = True  # dgq, duq before gate_up_bwd
    wgrad: bool = True  # the weight gradients' transposed operands
    x_t_from_codes: bool = True  # x^T requantized from the dequantized xq (not from bf16 x)


def _fq_rows(a, on):
    return fp8.dequantize_rows(*fp8.quantize_rows(a)).astype(np.float64) if on else a.astype(np.float64)


def _fq_cols(a, on):
    if not on:
        return a.astype(np.float64)
    return fp8.dequantize_rows(*reference_fp8.quantize_columns(a)).T[:len(a)].astype(np.float64)


def restated(prob, q: Points) -> dict:
    """The routed layer (no shared expert) in float64 with the fake quantization `q`, bf16 storage
    where the GPU layer keeps it; experts' rows in slot order."""
    x, idx, tw = bf16(prob.flat("x")), prob.flat("topk_idx"), prob.flat("topk_weights").astype(np.float32)
    dout = bf16(prob.flat("dout"))
    w = {key: bf16(v) for key, v in prob.weights.items()}
    num_experts, top_k = w["w_gate"].shape[0], idx.shape[1]
    order, offsets = reference.group_slots_by_expert(idx, num_experts)
    y_slots, dx_slots = np.zeros((idx.size, x.shape[1])), np.zeros((idx.size, x.shape[1]))
    dy_slots = bf16(reference.scale_to_slots(dout, tw))
    grads = {key: np.zeros(w[key].shape) for key in ("w_gate", "w_up", "w_down")}
    for e in range(num_experts):
        slots = order[offsets[e]:offsets[e + 1]]
        wg, wu, wd = (fp8.dequantize_blocks(*fp8.quantize_blocks(w[key][e])).astype(np.float64) if q.w
                      else w[key][e].astype(np.float64) for key in ("w_gate", "w_up", "w_down"))
        xd = _fq_rows(x[slots // top_k], q.x)
        g, u = xd @ wg, xd @ wu
        h = bf16(reference.silu(g) * u)
        y_slots[slots] = bf16(_fq_rows(h, q.h) @ wd)
        dy = dy_slots[slots]
        dg, du = (bf16(v) for v in reference.swiglu_grad(_fq_rows(dy, q.dy) @ wd.T, bf16(g), bf16(u)))
        dx_slots[slots] = bf16(_fq_rows(dg, q.dgu) @ wg.T + _fq_rows(du, q.dgu) @ wu.T)
        xt = xd.astype(np.float32) if q.x_t_from_codes else x[slots // top_k]
        grads["w_down"][e] = _fq_cols(h, q.wgrad).T @ _fq_cols(dy, q.wgrad)
        grads["w_gate"][e] = _fq_cols(xt, q.wgrad).T @ _fq_cols(dg, q.wgrad)
        grads["w_up"][e] = _fq_cols(xt, q.wgrad).T @ _fq_cols(du, q.wgrad)
    return {"out": bf16(reference.weighted_sum(np.zeros(x.shape), y_slots, tw)),
            "x": bf16(reference.slot_sum(np.zeros(x.shape), dx_slots, top_k)),
            "topk_weights": reference.topk_weight_grad(dout, y_slots, top_k), **grads}


def test_quantization_points_are_the_spec_table():
    """reference_fp8 equals the restatement of the spec's table within fp32 rounding, and turning
    off any one quantization point in the restatement moves some array by far more: each point is
    where the table puts it, none is missing, none is extra."""
    prob = make_problem(shape_of(n=320, shared=0), 1, seed=11)  # ~160 rows an expert: two k-blocks of rows
    ref = run_fp8(prob)
    same = accuracy.error_table(ref, restated(prob, Points()))
    assert accuracy.worst(same)[1] <= 5e-4, same
    for point in dataclasses.fields(Points):
        moved = accuracy.error_table(ref, restated(prob, Points(**{point.name: False})))
        assert accuracy.worst(moved)[1] >= 1e-2, (point.name, moved)


# ---------------------------------------------------------------------------------------------
# Accuracy against the float64 reference on the bf16 inputs (the issue's metric)
# ---------------------------------------------------------------------------------------------
# What this recipe meets at the demo's input scales: each quantization adds ~0.026 (e4m3's step at
# 1x128 / 128x128 blocks); out and dx pass 4 of them (x, W, h, W), the weight gradients and d topk
# more (docs/design.md 5.7, docs/LOG.md). The issue's bar, 0.06, holds for out and x (shared bf16).
ISSUE_BAR = accuracy.ERR_REL_RMS_BOUND
RECIPE_BOUND = accuracy.ERR_REL_RMS_RECIPE
ACCURACY_SHAPES = [shape_of(), shape_of(h=512, i=256, e=8, n=512), shape_of(h=256, i=512, e=4, k=4, n=128)]


@pytest.mark.parametrize("shape", ACCURACY_SHAPES, ids=lambda s: f"H{s.hidden}-I{s.ffn}-E{s.num_experts}")
def test_accuracy_against_float64_on_bf16_inputs(shape):
    prob = make_problem(shape, 1, seed=0)
    table = accuracy.error_table(run_fp8(prob), prob.reference_results(bf16=True))
    for name, err in table.items():
        assert err["err_rel_rms"] <= RECIPE_BOUND and err["err_max"] <= 2 * RECIPE_BOUND, (name, err)
        if name.startswith("shared_"):  # the shared expert stays bf16
            assert err["err_rel_rms"] <= 5e-3, (name, err)
        else:
            assert err["err_rel_rms"] >= 0.02, f"{name}: {err} is bf16-sized: a quantization point is missing"
    for name in ("out", "x"):
        assert table[name]["err_rel_rms"] <= ISSUE_BAR, (name, table[name])


@pytest.mark.xfail(strict=True, reason="the recipe's weight gradients and d topk_weights measure 0.061-0.071 "
                   "err_rel_rms (docs/LOG.md 2026-12-06): the issue's 0.06 on every array is not met")
def test_issue_bar_on_every_array():
    prob = make_problem(ACCURACY_SHAPES[0], 1, seed=0)
    table = accuracy.error_table(run_fp8(prob), prob.reference_results(bf16=True))
    assert accuracy.worst(table)[1] <= ISSUE_BAR, table


def test_blocked_matmul_t_is_a_float64_gemm_rounded_per_block_and_split_invariant():
    rng = np.random.default_rng(4)
    a, b = bf16(rng.standard_normal((300, 64))), bf16(rng.standard_normal((300, 32)))
    whole = reference_fp8.blocked_matmul_t(a, b, np.zeros((64, 32), np.float32))
    assert whole.dtype == np.float32
    np.testing.assert_allclose(whole, a.astype(np.float64).T @ b, rtol=0, atol=4e-6 * np.abs(whole).max())
    runs = np.zeros((64, 32), np.float32)
    for lo, hi in ((0, B), (B, 3 * B), (3 * B, 300)):  # runs of whole blocks, the last one short
        runs = reference_fp8.blocked_matmul_t(a[lo:hi], b[lo:hi], runs)
    assert np.array_equal(whole, runs), "runs of whole blocks in order must give the bits of one run"
    one_block = (a[:B].astype(np.float64).T @ b[:B]).astype(np.float32)
    assert np.array_equal(reference_fp8.blocked_matmul_t(a[:B], b[:B], np.zeros_like(one_block)), one_block)
    # each block's exact sum is added to the fp32 accumulator with one rounding: 1 + (2^-24 + 2^-50) rounds up;
    # rounding the block's sum first (2^-24) or summing row by row in fp32 would tie to even, 1
    a, b = np.zeros((2 * B, 1), np.float32), np.zeros((2 * B, 1), np.float32)
    a[0], b[0], a[B], b[B], a[B + 1], b[B + 1] = 1, 1, 2.0 ** -12, 2.0 ** -12, 2.0 ** -25, 2.0 ** -25
    got = reference_fp8.blocked_matmul_t(a, b, np.zeros((1, 1), np.float32))
    assert got[0, 0] == np.float32(1 + 2.0 ** -23), got


@pytest.mark.parametrize("shape", ACCURACY_SHAPES, ids=lambda s: f"H{s.hidden}-I{s.ffn}-E{s.num_experts}")
def test_bf16_weight_gradients_meet_the_bar_and_move_only_the_weight_gradients(shape):
    """wgrad_precision bf16: the routed weight gradients from the bf16 rows (bf16 dispatch) are
    within the issue's 0.06 and below the fp8 ones'; from dequantized codes (fp8 dispatch) dWg,
    dWu lie between (x's forward quantization stays in them), dWd is the bf16 dispatch's; every
    other result is the fp8 weight gradients' bits."""
    prob = make_problem(shape, 1, seed=0)
    ref = prob.reference_results(bf16=True)
    f8 = run_fp8(prob)
    bf = run_fp8(prob, wgrad_precision="bf16", dispatch_dtype="bf16")
    deq = run_fp8(prob, wgrad_precision="bf16", dispatch_dtype="fp8")
    assert run_fp8(prob, wgrad_precision="fp8", dispatch_dtype="fp8")["w_gate"].tobytes() == f8["w_gate"].tobytes()
    for key in f8:
        if not key.startswith("w_"):
            assert np.array_equal(bf[key], f8[key]) and np.array_equal(deq[key], f8[key]), key
    assert np.array_equal(deq["w_down"], bf["w_down"])
    for key in ("w_gate", "w_up", "w_down"):
        e8, eb, ed = (accuracy.errors(r[key], ref[key])["err_rel_rms"] for r in (f8, bf, deq))
        assert eb <= ISSUE_BAR and eb < ed <= e8 - 0.005 if key != "w_down" else eb == ed <= min(ISSUE_BAR, e8 - 0.005), \
            (key, e8, eb, ed)


def test_shared_fp8_is_one_more_expert_and_costs_accuracy():
    prob = make_problem(shape_of(n=128), 1, seed=2)
    ref = prob.reference_results(bf16=True)
    bf, f8 = run_fp8(prob, "bf16"), run_fp8(prob, "fp8")
    for key in ("w_gate", "w_up", "w_down", "topk_weights"):  # the routed results do not see the shared expert
        assert np.array_equal(bf[key], f8[key]), key
    for key in ("shared_gate", "shared_up", "shared_down"):
        e_bf, e_f8 = accuracy.errors(bf[key], ref[key]), accuracy.errors(f8[key], ref[key])
        assert e_bf["err_rel_rms"] <= 5e-3 < 0.02 <= e_f8["err_rel_rms"] <= RECIPE_BOUND, (key, e_bf, e_f8)


# ---------------------------------------------------------------------------------------------
# Scale invariance (the quantizer scales per block), NaN and zeros
# ---------------------------------------------------------------------------------------------
def test_power_of_two_dout_scales_every_gradient_exactly_and_unscaled_quantization_breaks(monkeypatch):
    prob = make_problem(shape_of(n=128), 1, seed=3)
    base = run_fp8(prob)
    tiny = dataclasses.replace(prob, dout=prob.dout * np.float32(2.0 ** -14))
    got = run_fp8(tiny)
    for key in base:
        if key != "out":
            assert np.array_equal(got[key], base[key] * np.float32(2.0 ** -14)), key
    ref = tiny.reference_results(bf16=True)
    assert accuracy.worst(accuracy.error_table(got, ref))[1] <= RECIPE_BOUND
    monkeypatch.setattr(fp8, "block_scale", lambda amax, pow2=False: np.ones_like(np.asarray(amax, np.float32)))
    broken = accuracy.error_table(run_fp8(tiny), ref)
    for key in ("w_gate", "w_up", "w_down"):  # dy of ~2^-14 codes to zero without its scale
        assert broken[key]["err_rel_rms"] >= 0.5, (key, broken[key])


def test_zero_token_row_gives_zero_and_a_nan_stays_in_its_token_and_experts():
    prob = make_problem(shape_of(e=8, n=128), 1, seed=4)
    idx = prob.flat("topk_idx")
    clean = run_fp8(prob)
    zero, nan = 5, 17
    x = prob.x.copy()
    x[0, zero] = 0.0
    x[0, nan, 200] = np.nan
    got = run_fp8(dataclasses.replace(prob, x=x))
    assert not got["out"][zero].any() and not got["topk_weights"][zero].any(), "x = 0: out = 0, d w = <dout, 0>"
    assert np.isnan(got["out"][nan]).all()
    others = np.setdiff1d(np.arange(len(idx)), [zero, nan])
    assert np.array_equal(got["out"][others], clean["out"][others]), "the forward is row by row"
    hit = set(idx[nan].tolist())
    for e in range(8):
        assert np.isnan(got["w_gate"][e]).any() == (e in hit), e  # the NaN row's experts, no other


def test_slot_order_changes_only_weight_gradients_of_experts_over_one_block():
    prob = make_problem(shape_of(e=4, n=128), 2, seed=5, routing="one-expert")  # expert 0: 256 rows
    order = expert_slot_order(prob.topk_idx, 4)
    a, b = run_fp8(prob), run_fp8(prob, slot_order=order)
    for key in ("out", "x", "topk_weights"):
        assert np.array_equal(a[key], b[key]), key
    assert not np.array_equal(a["w_gate"][0], b["w_gate"][0])
    counts = np.bincount(prob.flat("topk_idx").reshape(-1), minlength=4)
    for e in np.flatnonzero(counts <= B):  # one scale block: its rows' order changes nothing
        assert np.array_equal(a["w_down"][e], b["w_down"][e]), e
    with pytest.raises(InputError, match="slot_order"):
        run_fp8(prob, slot_order=(order[0][::-1], order[1]))


def test_expert_slot_order_is_the_receive_layout():
    rng = np.random.default_rng(6)
    topk = np.stack([np.argsort(rng.random((7, 8)), axis=1)[:, :3] for _ in range(2)]).astype(np.int32)  # R=2, N=7
    order, offsets = expert_slot_order(topk, 8)
    rows = []
    for s in build_all_schedules(topk, 8, align=4):
        for start, count in zip(s.expert_offsets[:-1], s.tokens_per_expert):
            rows += list(s.src_rank[start:start + count] * 21 + s.src_slot[start:start + count])
    assert order.tolist() == rows and offsets[-1] == 42
    one = expert_slot_order(topk[:1], 8)
    want = reference.group_slots_by_expert(topk[0], 8)
    assert np.array_equal(one[0], want[0]) and np.array_equal(one[1], want[1])


def test_fp8_shapes_refused_in_one_line():
    prob = make_problem(shape_of(h=192, i=256, n=16), 1)
    with pytest.raises(InputError, match="H a multiple of 128"):
        run_fp8(prob)
    with pytest.raises(InputError, match="shared_precision"):
        run_fp8(make_problem(shape_of(n=16), 1), shared_precision="fp16")
