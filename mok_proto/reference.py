"""The MoE layer in plain array code: the oracle every distributed path and kernel is held to.

Legend: N tokens, H hidden, I expert FFN, Is shared FFN, E experts, K top-k.
A "slot" is s = t*K + j: token t's j-th choice. Routed results live in slot buffers [N*K, H].

    out[t] = shared(x[t]) + sum_{j=0..K-1} w[t,j] * expert_{idx[t,j]}(x[t])      (j in order)
    expert(x) = (silu(x Wg) * (x Wu)) Wd

Written against an array module `xp` (numpy here, cupy on a GPU): every function takes the
module of its first array. Summation orders are fixed (per expert: slots in increasing
order; per token: shared first, then j = 0..K-1), so results reproduce bit for bit.
"""

from __future__ import annotations

import numpy as np

from mok_proto import validate
from mok_proto.validate import InputError, array_module  # noqa: F401 - array_module is part of this API

WEIGHT_KEYS = validate.WEIGHT_KEYS + validate.SHARED_KEYS
SCORES = ("softmax", "sigmoid")


def _dtype(dtype):
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise InputError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if dt not in (np.float32, np.float64):
        raise InputError(f"dtype must be float32 or float64, got {dt}")
    return dt


def sigmoid(x):
    xp = array_module(x)
    return 0.5 * (xp.tanh(0.5 * x) + 1.0)  # no overflow for large |x|


def silu(x):
    return x * sigmoid(x)


# ---------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------
def route(x, w_router, k, score="softmax"):
    """Top-k routing. x [N,H], w_router [H,E] -> (topk_idx [N,K] int32, topk_weights [N,K] float32).

    Experts are ranked by score (ties: lower index first); weights are the chosen scores
    renormalized to sum to 1 per token. N = 0 gives empty [0,K] results; non-finite logits raise.
    """
    x = validate.check_array(x, "route: x", (None, None), "NH", kind="fiu")
    w_router = validate.check_array(w_router, "route: w_router", (x.shape[1], None), "HE", kind="fiu")
    xp = array_module(x)
    num_experts = w_router.shape[1]
    k = validate.check_int(k, "route: k", minimum=1, maximum=num_experts)
    if score not in SCORES:
        raise InputError(f"route: score must be one of {SCORES}, got {score!r}")
    logits = x.astype(xp.float32) @ w_router.astype(xp.float32)  # [N, E]
    validate.check_finite(logits, "route: the router logits x @ w_router")
    if score == "softmax":
        e = xp.exp(logits - logits.max(axis=1, keepdims=True))
        scores = e / e.sum(axis=1, keepdims=True)
    else:
        scores = sigmoid(logits)
    topk_idx = xp.argsort(-scores, axis=1, kind="stable")[:, :k].astype(xp.int32)  # [N, K]
    chosen = xp.take_along_axis(scores, topk_idx, axis=1)
    topk_weights = (chosen / chosen.sum(axis=1, keepdims=True)).astype(xp.float32)
    return topk_idx, topk_weights


# ---------------------------------------------------------------------------------------------
# One SwiGLU expert on a block of rows (shared by the reference and every distributed path)
# ---------------------------------------------------------------------------------------------
def expert_hidden(x, w_gate, w_up):
    """x [n,H] -> (g, u, h) [n,I]: the gate/up GEMMs and SwiGLU, h = silu(g) * u."""
    g = x @ w_gate
    u = x @ w_up
    return g, u, silu(g) * u


def expert_forward(x, w_gate, w_up, w_down):
    """x [n,H] -> y [n,H]; saved = (x, g, u, h) for the backward."""
    g, u, h = expert_hidden(x, w_gate, w_up)
    return h @ w_down, (x, g, u, h)


def swiglu_grad(dh, g, u):
    """The SwiGLU backward: dh [n,I] (d loss / d h, h = silu(g) * u) -> (dg, du) [n,I]."""
    sig = sigmoid(g)
    du = dh * (g * sig)
    dg = dh * u * (sig * (1.0 + g * (1.0 - sig)))  # d silu(g) / dg
    return dg, du


def expert_backward(dy, saved, w_gate, w_up, w_down):
    """dy [n,H] -> (dx [n,H], dw_gate [H,I], dw_up [H,I], dw_down [I,H])."""
    x, g, u, h = saved
    dh = dy @ w_down.T  # [n, I]
    dw_down = h.T @ dy
    dg, du = swiglu_grad(dh, g, u)
    dw_gate = x.T @ dg
    dw_up = x.T @ du
    dx = dg @ w_gate.T + du @ w_up.T
    return dx, dw_gate, dw_up, dw_down


# ---------------------------------------------------------------------------------------------
# Token-side steps of combine and its backward (fixed order; shared with the distributed layer)
# ---------------------------------------------------------------------------------------------
def weighted_sum(base, y_slots, topk_weights):
    """out[t] = base[t] + sum_j w[t,j] * y_slots[t*K+j], j in increasing order. base [N,H]."""
    num_tokens, top_k = topk_weights.shape
    y = y_slots.reshape(num_tokens, top_k, base.shape[1])  # [N, K, H]
    out = base.copy()
    for j in range(top_k):
        out += topk_weights[:, j, None] * y[:, j]
    return out


def slot_sum(base, slots, top_k):
    """out[t] = base[t] + sum_j slots[t*K+j], j in increasing order."""
    s = slots.reshape(base.shape[0], top_k, base.shape[1])
    out = base.copy()
    for j in range(top_k):
        out += s[:, j]
    return out


def scale_to_slots(dout, topk_weights):
    """dy_slots[t*K+j] = w[t,j] * dout[t]: what each expert receives in the backward. [N*K, H]."""
    return (topk_weights[:, :, None] * dout[:, None, :]).reshape(-1, dout.shape[1])


def topk_weight_grad(dout, y_slots, top_k):
    """d out / d w[t,j] = <dout[t], y_slots[t*K+j]>. [N, K]."""
    y = y_slots.reshape(dout.shape[0], top_k, dout.shape[1])
    return (dout[:, None, :] * y).sum(axis=2)


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------
def check_inputs(x, topk_idx, topk_weights, weights):
    """-> (x, topk_idx, topk_weights, has_shared), lists converted; InputError naming the argument."""
    x = validate.check_array(x, "x", (None, None), "NH", kind="f")
    has_shared = validate.check_weights(weights, hidden=x.shape[1])
    num_experts = validate.as_array(weights["w_gate"], "weights['w_gate']").shape[0]
    x, topk_idx, topk_weights = validate.check_layer_inputs(x, topk_idx, topk_weights, num_experts)
    return x, topk_idx, topk_weights, has_shared


def group_slots_by_expert(topk_idx, num_experts):
    """(slots sorted by expert then slot [N*K], expert offsets [E+1]) -- the reference's row order."""
    xp = array_module(topk_idx)
    flat = topk_idx.reshape(-1)
    order = xp.argsort(flat, kind="stable")
    counts = xp.bincount(flat, minlength=num_experts)
    offsets = xp.concatenate([xp.zeros(1, counts.dtype), xp.cumsum(counts)])
    return order, offsets


def forward(x, topk_idx, topk_weights, weights, dtype="float32"):
    """x [N,H], topk_idx/topk_weights [N,K], weights (see WEIGHT_KEYS) -> (out [N,H], cache)."""
    dt = _dtype(dtype)
    x, topk_idx, topk_weights, has_shared = check_inputs(x, topk_idx, topk_weights, weights)
    xp = array_module(x)
    x = x.astype(dt)
    w = {key: xp.asarray(weights[key]).astype(dt) for key in WEIGHT_KEYS if key in weights}
    topk_weights = topk_weights.astype(dt)
    num_tokens, top_k = topk_idx.shape
    num_experts = w["w_gate"].shape[0]

    if has_shared:
        base, shared_saved = expert_forward(x, w["shared_gate"], w["shared_up"], w["shared_down"])
    else:
        base, shared_saved = xp.zeros_like(x), None

    order, offsets = group_slots_by_expert(topk_idx, num_experts)
    y_slots = xp.zeros((num_tokens * top_k, x.shape[1]), dt)  # [N*K, H]
    saved = {}
    for e in range(num_experts):
        slots = order[int(offsets[e]):int(offsets[e + 1])]
        if slots.size == 0:
            continue
        y, saved[e] = expert_forward(x[slots // top_k], w["w_gate"][e], w["w_up"][e], w["w_down"][e])
        y_slots[slots] = y

    out = weighted_sum(base, y_slots, topk_weights)
    cache = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, weights=w, order=order,
                 offsets=offsets, saved=saved, shared_saved=shared_saved, y_slots=y_slots)
    return out, cache


_CACHE_KEYS = ("x", "topk_idx", "topk_weights", "weights", "order", "offsets", "saved", "shared_saved", "y_slots")


def backward(dout, cache):
    """dout [N,H] -> dict of gradients: x, topk_weights, w_gate, w_up, w_down (+ shared_*)."""
    missing = [key for key in _CACHE_KEYS if not hasattr(cache, "keys") or key not in cache]
    if missing:
        raise InputError(f"backward: cache must be the cache returned by forward() (missing {', '.join(missing)})")
    x, w, top_k = cache["x"], cache["weights"], cache["topk_idx"].shape[1]
    dout = validate.check_array(dout, "dout", x.shape, "NH", kind="f")
    xp = array_module(dout)
    dout = dout.astype(x.dtype)
    order, offsets = cache["order"], cache["offsets"]

    dy_slots = scale_to_slots(dout, cache["topk_weights"])  # [N*K, H]
    dx_slots = xp.zeros_like(dy_slots)
    grads = {key: xp.zeros_like(w[key]) for key in ("w_gate", "w_up", "w_down")}
    for e, saved in cache["saved"].items():
        slots = order[int(offsets[e]):int(offsets[e + 1])]
        dx_slots[slots], grads["w_gate"][e], grads["w_up"][e], grads["w_down"][e] = expert_backward(
            dy_slots[slots], saved, w["w_gate"][e], w["w_up"][e], w["w_down"][e])

    if cache["shared_saved"] is not None:
        base, grads["shared_gate"], grads["shared_up"], grads["shared_down"] = expert_backward(
            dout, cache["shared_saved"], w["shared_gate"], w["shared_up"], w["shared_down"])
    else:
        base = xp.zeros_like(x)
    grads["x"] = slot_sum(base, dx_slots, top_k)
    grads["topk_weights"] = topk_weight_grad(dout, cache["y_slots"], top_k)
    return grads


# ---------------------------------------------------------------------------------------------
# The communication round with a stand-in expert (the oracle of the GPU round's kernels)
# ---------------------------------------------------------------------------------------------
def stand_in_round(x_all, topk_idx_all, topk_w_all, scale, base_all=None):
    """What one communication round with the stand-in expert y = scale[e] * x must produce, in
    float32 with the kernels' rounding order (one product per element, then weighted_sum).
    x_all [R,N,H], topk_idx_all/topk_w_all [R,N,K], scale [E], base_all [R,N,H] -> out [R,N,H]."""
    num_ranks, n, k = topk_idx_all.shape
    out = np.empty(x_all.shape, np.float32)
    for r in range(num_ranks):
        y_slots = (x_all[r][:, None, :] * scale[topk_idx_all[r]][:, :, None]).astype(np.float32)  # [N,K,H]
        base = np.zeros_like(x_all[r]) if base_all is None else base_all[r]
        out[r] = weighted_sum(base, y_slots.reshape(n * k, -1), topk_w_all[r])
    return out


# ---------------------------------------------------------------------------------------------
# bf16 <-> float32 (round to nearest even), for NumPy or CuPy arrays: the GPU layer's storage
# format, bf16 values carried as their 16 bits in uint16 arrays
# ---------------------------------------------------------------------------------------------
def to_bf16(a):
    xp = array_module(a)
    bits = xp.ascontiguousarray(a, dtype=xp.float32).view(xp.uint32)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) >> 16
    return rounded.astype(xp.uint16)


def from_bf16(a):
    xp = array_module(a)
    return (xp.ascontiguousarray(a).view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)


def round_bf16(a):
    """float array -> float32 array of its bf16-rounded values: from_bf16(to_bf16(a)) in one buffer."""
    xp = array_module(a)
    bits = xp.ascontiguousarray(a, dtype=xp.float32).view(xp.uint32)
    rounded = bits >> 16
    rounded &= xp.uint32(1)
    rounded += xp.uint32(0x7FFF)
    rounded += bits
    rounded &= xp.uint32(0xFFFF0000)  # the low 16 bits cleared: to_bf16's bits back in a float32
    return rounded.view(xp.float32)


#
