"""The MoE layer with FP8 routed experts (precision="fp8"): the oracle of the FP8 passes.

Legend: N tokens, H hidden, I expert FFN, Is shared FFN, E experts, K top-k, B = 128 (the block),
n rows of one expert. "bf16 values": float32 arrays holding bf16-rounded values.

What it emulates exactly: what is stored in which format and where every quantization happens
(the rule of mok_proto/fp8.py). Its arithmetic is a float32 mirror of the kernels' (fp32
accumulators, the SwiGLU in fp32), not their bits: the GPU's sigmoid and the order of its
in-block sums differ.

Storage, as the BF16 GPU layer keeps it: bf16 x, weights, g, u, h, y, y slots, the shared
expert's output, out, dout, dy slots, dg, du, dx rows and slots, dx; fp32 topk_weights, their
gradient and every weight gradient. Each routed GEMM, block-scaled (`scaled_matmul`):

    gate/up      xq [n,H] (1xB)            x  W^T codes (BxB)      -> g, u (bf16); h = silu(g) u from fp32 g, u
    down         hq [n,I] (1xB, of bf16 h) x  Wd^T                 -> y (bf16)
    down_bwd     dyq [n,H] (1xB)           x  Wd                   -> dh (fp32) -> dg, du (bf16, from bf16 g, u)
    gate_up_bwd  [dgq | duq] [n,2I] (1xB)  x  [Wg | Wu]            -> dx (bf16)
    down_wgrad   h^T  [I,n] (Bx1)          x  dy^T [H,n] (Bx1)     -> dWd [I,H] (fp32)
    gate_up_wgrad x^T [H,n] (Bx1)          x  dg^T, du^T [I,n]     -> dWg, dWu [H,I] (fp32)

Every quantization reads a bf16 tensor, except x^T: it is requantized from the dequantized 1xB
codes of x (decode * scale, fp32), because with FP8 dispatch the expert owner never holds bf16 x;
the BF16 dispatch does the same, so the results do not depend on what the dispatch moved. The
weight gradients' K is the expert's rows in the order its owner holds them (`slot_order`), in
blocks of B rows from its first row, its last block zero-padded: which rows share a scale depends
on that order (the data path, row by row, does not). Weights are rounded to bf16 and quantized
once (BxB blocks, read in both orientations). The shared expert is bf16 (fp32 GEMMs of bf16
values) unless shared_precision="fp8": then it is one more expert, over the N token rows.

wgrad_precision="bf16" (Megatron's --no-fp8-wgrad): the routed weight gradients are fp32 GEMMs of
the bf16 values h, dy, dg, du and the x rows the expert owner holds (the dispatched bf16 rows, or
with FP8 dispatch its dequantized codes rounded to bf16), with no transposed quantization; then
dWg and dWu depend on the dispatch dtype.
"""

from __future__ import annotations

import numpy as np

from mok_proto import config, fp8, reference, validate
from mok_proto.validate import InputError

B = fp8.BLOCK
PRECISIONS = config.PRECISIONS


def round_bf16(a) -> np.ndarray:
    """float array -> float32 array of its bf16-rounded values (round to nearest even)."""
    return reference.round_bf16(np.asarray(a, np.float32))


# ---------------------------------------------------------------------------------------------
# The block-scaled GEMM (float32 mirror)
# ---------------------------------------------------------------------------------------------
def scaled_matmul(a, b, acc=None) -> np.ndarray:
    """a = (codes [M,K] uint8, scales [M,K/B]), b = (codes [N,K], scales [N,K/B]) -> C [M,N]
    float32, k-blocks kb = 0, 1, ... in order, each element as the kernels promote it:

        C = fma32(S_kb, fl32(sa[m,kb] * sb[n,kb]), C)          (C starts at acc, or 0)

    S_kb = the sum over the block of decode(A) decode(B), exact and then rounded to float32 once
    (every partial sum of e4m3 products is a multiple of 2^-18 below 2^25: float64 holds it
    whatever the order, so C depends on neither BLAS nor how the rows are split; the tensor cores'
    own in-block sum is less exact). A weight's BxB scales come in repeated over its B rows
    (weight_operand). acc: continue a k-loop (a weight gradient whose rows arrive in runs: runs in
    order give the bits of one call over all of them)."""
    (ca, sa), (cb, sb) = a, b
    m, k = ca.shape
    n = cb.shape[0]
    if cb.shape != (n, k) or sa.shape != (m, k // B) or sb.shape != (n, k // B) or k % B:
        raise InputError(f"scaled_matmul: A {ca.shape} / {sa.shape}, B {cb.shape} / {sb.shape}: want codes [M,K], "
                         f"[N,K] and scales [M,K/{B}], [N,K/{B}], K a multiple of {B}")
    nb = k // B
    da = _decode64(ca).reshape(m, nb, B).transpose(1, 0, 2)  # [nb, M, B]
    db = _decode64(cb).reshape(n, nb, B).transpose(1, 2, 0)  # [nb, B, N]
    sums = np.matmul(da, db).astype(np.float32)  # [nb, M, N]
    out = None if acc is None else np.array(acc, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for kb in range(nb):
            scale = np.asarray(sa[:, kb, None] * sb[None, :, kb], np.float32)
            if out is None:  # fma32(S, scale, +0): the exact float64 product plus +0 (-0 + +0 is +0), rounded once
                out = (sums[kb].astype(np.float64) * scale + 0.0).astype(np.float32)
            else:
                out = fma32(sums[kb], scale, out)
    return np.zeros((m, n), np.float32) if out is None else out


_DECODE64 = fp8.DECODE.astype(np.float64)


def _decode64(codes) -> np.ndarray:
    """fp8.decode_e4m3(codes) as float64 (exact), in one pass."""
    codes = np.asarray(codes)
    return _DECODE64[codes] if codes.dtype == np.uint8 else fp8.decode_e4m3(codes)


def fma32(a, b, c) -> np.ndarray:
    """fl32(a * b + c) with one rounding (IEEE fmaf, CUDA __fmaf_rn) of float32 arrays: the
    product is exact in float64, the sum is rounded to odd in float64 (its exact remainder from
    TwoSum), and a value rounded to odd with 29 bits to spare rounds to float32 as the exact one."""
    a, b, c = (np.asarray(v, np.float32) for v in (a, b, c))
    shape = np.broadcast_shapes(a.shape, b.shape, c.shape)  # every step writes arrays of it (no 0-d scalars)
    p, s, back, rest = (np.empty(shape) for _ in range(4))
    with np.errstate(invalid="ignore", over="ignore"):
        np.multiply(a, b, out=p, dtype=np.float64)
        np.add(p, c, out=s, dtype=np.float64)
        np.subtract(s, p, out=back)
        np.subtract(p, np.subtract(s, back, out=rest), out=rest)
        rest += np.subtract(c, back, out=back, dtype=np.float64)  # p + c - s, exactly (NaN where s is not finite)
        bits = s.view(np.int64)
        nudge = (np.abs(rest) > 0) & ((bits & 1) == 0)  # inexact and even: round to odd
        up = np.signbit(rest) == np.signbit(s)  # one ulp toward p + c: up in magnitude, else down
        np.add(bits, 1, out=bits, where=nudge & up)
        np.subtract(bits, 1, out=bits, where=nudge & ~up)
        return s.astype(np.float32)


def quantize_weights(weights: dict, keys) -> dict:
    """{key: (codes, scales)} of fp8.quantize_blocks(bf16 values of weights[key]) for `keys`
    ([..., R, C] each: the routed [E, H, I] / [E, I, H], the shared [H, Is] / [Is, H])."""
    return {key: fp8.quantize_blocks(round_bf16(weights[key])) for key in keys}


def weight_operand(wq, transpose: bool):
    """One weight (codes [R,C], scales [R/B,C/B]) as a B operand [N,K] of scaled_matmul: itself
    (N = R, K = C) or transposed (N = C, K = R), its BxB scales repeated over each block's rows."""
    codes, scales = wq
    if transpose:
        codes, scales = codes.T, scales.T
    return np.ascontiguousarray(codes), np.repeat(scales, B, axis=0)


def quantize_columns(a):
    """a [n,C] (rows of one expert, in order) -> fp8.quantize_rows(a, transpose=True) of `a`
    zero-padded to whole B-row blocks: codes [C, n'], scales [C, n'/B]."""
    pad = -a.shape[0] % B
    if pad:
        a = np.concatenate([a, np.zeros((pad, a.shape[1]), np.float32)])
    return fp8.quantize_rows(a, transpose=True)


def expert_weights(wq: dict, e, keys=validate.WEIGHT_KEYS) -> dict:
    """{"w_gate", "w_up", "w_down": (codes, scales)} of routed expert e (or the shared expert:
    e None, keys SHARED_KEYS)."""
    return {name: wq[key] if e is None else (wq[key][0][e], wq[key][1][e])
            for name, key in zip(validate.WEIGHT_KEYS, keys)}


# ---------------------------------------------------------------------------------------------
# One FP8 expert on a block of its rows (the reference and the CPU layer run these)
# ---------------------------------------------------------------------------------------------
def expert_forward(xq, wq: dict):
    """xq: the rows' x quantized 1xB (codes [n,H], scales [n,H/B]); wq: the expert's weights
    (_expert) -> (y [n,H], (g, u, h) [n,I]), bf16 values."""
    g32 = scaled_matmul(xq, weight_operand(wq["w_gate"], transpose=True))
    u32 = scaled_matmul(xq, weight_operand(wq["w_up"], transpose=True))
    h = round_bf16(reference.silu(g32) * u32)
    y = scaled_matmul(fp8.quantize_rows(h), weight_operand(wq["w_down"], transpose=True))
    return round_bf16(y), (round_bf16(g32), round_bf16(u32), h)


def expert_backward(dy, g, u, wq: dict):
    """dy [n,H], the forward's g, u [n,I] (bf16 values) -> (dx [n,H], dg, du [n,I]), bf16 values."""
    dh = scaled_matmul(fp8.quantize_rows(dy), weight_operand(wq["w_down"], transpose=False))
    dg, du = (round_bf16(v) for v in reference.swiglu_grad(dh, g, u))
    (cg, sg), (cu, su) = fp8.quantize_rows(dg), fp8.quantize_rows(du)
    (wg, swg), (wu, swu) = weight_operand(wq["w_gate"], False), weight_operand(wq["w_up"], False)
    dx = scaled_matmul((np.concatenate([cg, cu], 1), np.concatenate([sg, su], 1)),
                       (np.concatenate([wg, wu], 1), np.concatenate([swg, swu], 1)))
    return round_bf16(dx), dg, du


def add_weight_grads(grads: dict, xq, h, dy, dg, du):
    """Add a run of an expert's rows to its weight gradients {"w_gate", "w_up": [H,I], "w_down":
    [I,H]} (float32, in place), continuing their k-loops: a run is a whole number of B-row blocks
    unless it ends the expert's rows (runs in order give the bits of one run of all of them)."""
    xt = quantize_columns(fp8.dequantize_rows(*xq))
    ht, dyt, dgt, dut = (quantize_columns(v) for v in (h, dy, dg, du))
    grads["w_down"][...] = scaled_matmul(ht, dyt, acc=grads["w_down"])
    grads["w_gate"][...] = scaled_matmul(xt, dgt, acc=grads["w_gate"])
    grads["w_up"][...] = scaled_matmul(xt, dut, acc=grads["w_up"])


def blocked_matmul_t(a, b, acc) -> np.ndarray:
    """acc [M,N] (float32) + a^T b for a [n,M], b [n,N] (bf16 values): a bf16 weight gradient's
    float32 mirror, B-row blocks from the first row, each block's sum S exact in float64 (products
    of bf16 values, unless a block spans more than 2^30 in magnitude) and added as fl32(acc + S),
    so runs of whole blocks in order give the bits of one run."""
    acc = np.array(acc, np.float32)
    for lo in range(0, a.shape[0], B):
        s = a[lo:lo + B].astype(np.float64).T @ b[lo:lo + B].astype(np.float64)
        acc = (acc + s).astype(np.float32)
    return acc


def add_weight_grads_bf16(grads: dict, xw, h, dy, dg, du):
    """add_weight_grads with wgrad_precision "bf16": the same run of rows, no quantization; xw the
    x rows the expert owner holds in bf16 (wgrad_rows)."""
    grads["w_down"][...] = blocked_matmul_t(h, dy, grads["w_down"])
    grads["w_gate"][...] = blocked_matmul_t(xw, dg, grads["w_gate"])
    grads["w_up"][...] = blocked_matmul_t(xw, du, grads["w_up"])


def wgrad_rows(x_rows, xq, dispatch_dtype: str) -> np.ndarray:
    """The x rows a bf16 weight gradient reads (bf16 values): the dispatched bf16 rows, or with
    fp8 dispatch (the expert owner holds only codes) the dequantized codes rounded to bf16."""
    return round_bf16(fp8.dequantize_rows(*xq)) if dispatch_dtype == "fp8" else x_rows


# ---------------------------------------------------------------------------------------------
# The shared expert: bf16 (fp32 GEMMs of bf16 values) or one more FP8 expert
# ---------------------------------------------------------------------------------------------
def shared_forward(x, weights: dict, wq: dict | None):
    """x [N,H] bf16 values; weights: the bf16 values of shared_*; wq: their quantization
    (shared_precision fp8) or None (bf16) -> (base [N,H] bf16 values, saved)."""
    if wq is not None:
        xq = fp8.quantize_rows(x)
        y, (g, u, h) = expert_forward(xq, expert_weights(wq, None, validate.SHARED_KEYS))
        return y, (xq, g, u, h)
    g32, u32 = x @ weights["shared_gate"], x @ weights["shared_up"]
    h = round_bf16(reference.silu(g32) * u32)
    return round_bf16(h @ weights["shared_down"]), (x, round_bf16(g32), round_bf16(u32), h)


def shared_backward(dout, saved, weights: dict, wq: dict | None):
    """dout [N,H] bf16 values -> (dx [N,H] bf16 values, {"shared_gate", "shared_up", "shared_down"})."""
    if wq is not None:
        xq, g, u, h = saved
        dx, dg, du = expert_backward(dout, g, u, expert_weights(wq, None, validate.SHARED_KEYS))
        grads = {key: np.zeros(wq[key][0].shape, np.float32) for key in validate.SHARED_KEYS}
        add_weight_grads(dict(zip(validate.WEIGHT_KEYS, grads.values())), xq, h, dout, dg, du)
        return dx, grads
    x, g, u, h = saved
    dh = dout @ weights["shared_down"].T
    dg, du = (round_bf16(v) for v in reference.swiglu_grad(dh, g, u))
    dx = round_bf16(dg @ weights["shared_gate"].T + du @ weights["shared_up"].T)
    return dx, {"shared_gate": x.T @ dg, "shared_up": x.T @ du, "shared_down": h.T @ dout}


def check_precision(precision, name: str = "precision") -> str:
    if precision not in PRECISIONS:
        raise InputError(f"{name} must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def check_fp8_shape(hidden: int, ffn: int, shared_ffn: int | None) -> None:
    """InputError (one line) unless the FP8 layer's blocked dimensions are multiples of B."""
    dims = [("H", hidden), ("I", ffn)] + ([("Is", shared_ffn)] if shared_ffn is not None else [])
    for name, value in dims:
        if value % B:
            raise InputError(f"precision fp8 needs {name} a multiple of {B} (the quantization block), got {value}")


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------
def forward(x, topk_idx, topk_weights, weights, shared_precision: str = "bf16", slot_order=None,
            wgrad_precision: str = "fp8", dispatch_dtype: str = "bf16"):
    """x [N,H], topk_idx/topk_weights [N,K], weights (reference.WEIGHT_KEYS) -> (out [N,H], cache),
    the routed experts FP8. x and the weights are rounded to bf16 first (the layer's inputs).
    slot_order: (order [N*K], offsets [E+1]), every expert's slots in the order its weight
    gradients sum them (schedule.expert_slot_order: the distributed layer's receive rows); default
    reference.group_slots_by_expert (slots in increasing order, what one rank holds).
    wgrad_precision "bf16": the routed weight gradients from bf16 operands (add_weight_grads_bf16),
    whose x rows depend on dispatch_dtype (wgrad_rows); "fp8" reads neither from dispatch_dtype."""
    check_precision(shared_precision, "shared_precision")
    check_precision(wgrad_precision, "wgrad_precision")
    check_precision(dispatch_dtype, "dispatch_dtype")
    x, topk_idx, topk_weights, has_shared = reference.check_inputs(x, topk_idx, topk_weights, weights)
    num_tokens, top_k = topk_idx.shape
    num_experts, hidden, ffn = np.shape(weights["w_gate"])
    check_fp8_shape(hidden, ffn, np.shape(weights["shared_gate"])[1] if has_shared and shared_precision == "fp8"
                    else None)
    x = round_bf16(x)
    topk_weights = np.asarray(topk_weights, np.float32)
    w = {key: round_bf16(weights[key]) for key in reference.WEIGHT_KEYS if key in weights}
    wq = quantize_weights(w, validate.WEIGHT_KEYS)
    shared_wq = quantize_weights(w, validate.SHARED_KEYS) if has_shared and shared_precision == "fp8" else None
    if has_shared:
        base, shared_saved = shared_forward(x, w, shared_wq)
    else:
        base, shared_saved = np.zeros_like(x), None

    order, offsets = _slot_order(slot_order, topk_idx, num_experts)
    xq_tokens = fp8.quantize_rows(x)  # row by row: a row's codes are the same wherever it goes
    y_slots = np.zeros((num_tokens * top_k, hidden), np.float32)
    saved = {}
    for e in range(num_experts):
        slots = order[offsets[e]:offsets[e + 1]]
        if slots.size == 0:
            continue
        xq = (xq_tokens[0][slots // top_k], xq_tokens[1][slots // top_k])
        y_slots[slots], (g, u, h) = expert_forward(xq, expert_weights(wq, e))
        saved[e] = (xq if wgrad_precision == "fp8" else wgrad_rows(x[slots // top_k], xq, dispatch_dtype), g, u, h)
    out = round_bf16(reference.weighted_sum(base, y_slots, topk_weights))
    cache = dict(topk_idx=topk_idx, topk_weights=topk_weights, weights=w, wq=wq, shared_wq=shared_wq, order=order,
                 wgrad_precision=wgrad_precision,
                 offsets=offsets, saved=saved, shared_saved=shared_saved, y_slots=y_slots, hidden=hidden)
    return out, cache


def backward(dout, cache) -> dict:
    """dout [N,H] (rounded to bf16) -> gradients as reference.backward's: x (bf16 values),
    topk_weights, w_gate, w_up, w_down (+ shared_*), float32."""
    if not hasattr(cache, "keys") or "wq" not in cache:
        raise InputError("backward: cache must be the cache returned by reference_fp8.forward()")
    topk_idx, wq, order, offsets = cache["topk_idx"], cache["wq"], cache["order"], cache["offsets"]
    num_tokens, top_k = topk_idx.shape
    dout = round_bf16(validate.check_array(dout, "dout", (num_tokens, cache["hidden"]), "NH", kind="f"))
    dy_slots = round_bf16(reference.scale_to_slots(dout, cache["topk_weights"]))  # [N*K, H]
    dx_slots = np.zeros_like(dy_slots)
    grads = {key: np.zeros(wq[key][0].shape, np.float32) for key in validate.WEIGHT_KEYS}
    add = add_weight_grads if cache["wgrad_precision"] == "fp8" else add_weight_grads_bf16
    for e, (xw, g, u, h) in cache["saved"].items():  # xw: xq, or the bf16 weight gradients' x rows
        slots = order[offsets[e]:offsets[e + 1]]
        dy = dy_slots[slots]
        dx_slots[slots], dg, du = expert_backward(dy, g, u, expert_weights(wq, e))
        add({key: grads[key][e] for key in validate.WEIGHT_KEYS}, xw, h, dy, dg, du)
    if cache["shared_saved"] is not None:
        base, shared_grads = shared_backward(dout, cache["shared_saved"], cache["weights"], cache["shared_wq"])
        grads.update(shared_grads)
    else:
        base = np.zeros_like(dout)
    grads["x"] = round_bf16(reference.slot_sum(base, dx_slots, top_k))
    grads["topk_weights"] = reference.topk_weight_grad(dout, cache["y_slots"], top_k)
    return grads


def _slot_order(slot_order, topk_idx, num_experts):
    """(order, offsets) checked: every slot once, expert e's slots routed to e."""
    if slot_order is None:
        order, offsets = reference.group_slots_by_expert(topk_idx, num_experts)
        return order, offsets.astype(np.int64)
    order, offsets = (np.asarray(a, np.int64) for a in slot_order)
    flat = topk_idx.reshape(-1)
    ok = (offsets.shape == (num_experts + 1,) and offsets[0] == 0 and offsets[-1] == flat.size
          and np.array_equal(np.sort(order), np.arange(flat.size))
          and np.array_equal(flat[order], np.repeat(np.arange(num_experts), np.diff(offsets))))
    if not ok:
        raise InputError(f"slot_order must be (order [{flat.size}], offsets [{num_experts + 1}]): every slot once, "
                         "expert e's slots (routed to e) at order[offsets[e]:offsets[e+1]]")
    return order, offsets
