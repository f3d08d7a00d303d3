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

WEIGHT_KEYS = ("w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down")
SCORES = ("softmax", "sigmoid")


def array_module(a):
    """numpy or cupy, whichever owns `a` (cupy is never imported here)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def _dtype(dtype):
    dt = np.dtype(dtype)
    if dt not in (np.float32, np.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dt}")
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
    renormalized to sum to 1 per token.
    """
    xp = array_module(x)
    if x.ndim != 2 or w_router.ndim != 2 or x.shape[1] != w_router.shape[0]:
        raise ValueError(f"route: x [N,H] and w_router [H,E] do not match: {x.shape} vs {w_router.shape}")
    num_experts = w_router.shape[1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"route: k must be in [1, {num_experts}], got {k}")
    if score not in SCORES:
        raise ValueError(f"route: score must be one of {SCORES}, got {score!r}")
    logits = x.astype(xp.float32) @ w_router.astype(xp.float32)  # [N, E]
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
def expert_forward(x, w_gate, w_up, w_down):
    """x [n,H] -> y [n,H]; saved = (x, g, u, h) for the backward."""
    g = x @ w_gate  # [n, I]
    u = x @ w_up  # [n, I]
    h = silu(g) * u  # [n, I]
    return h @ w_down, (x, g, u, h)


def expert_backward(dy, saved, w_gate, w_up, w_down):
    """dy [n,H] -> (dx [n,H], dw_gate [H,I], dw_up [H,I], dw_down [I,H])."""
    x, g, u, h = saved
    dh = dy @ w_down.T  # [n, I]
    dw_down = h.T @ dy
    sig = sigmoid(g)
    du = dh * (g * sig)
    dg = dh * u * (sig * (1.0 + g * (1.0 - sig)))  # d silu(g) / dg
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
    y = y_slots.reshape(num_tokens, top_k, -1)  # [N, K, H]
    out = base.copy()
    for j in range(top_k):
        out += topk_weights[:, j, None] * y[:, j]
    return out


def slot_sum(base, slots, top_k):
    """out[t] = base[t] + sum_j slots[t*K+j], j in increasing order."""
    s = slots.reshape(base.shape[0], top_k, -1)
    out = base.copy()
    for j in range(top_k):
        out += s[:, j]
    return out


def scale_to_slots(dout, topk_weights):
    """dy_slots[t*K+j] = w[t,j] * dout[t]: what each expert receives in the backward. [N*K, H]."""
    return (topk_weights[:, :, None] * dout[:, None, :]).reshape(-1, dout.shape[1])


def topk_weight_grad(dout, y_slots, top_k):
    """d out / d w[t,j] = <dout[t], y_slots[t*K+j]>. [N, K]."""
    y = y_slots.reshape(dout.shape[0], top_k, -1)
    return (dout[:, None, :] * y).sum(axis=2)


# ---------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------
def _check_inputs(x, topk_idx, topk_weights, weights):
    if x.ndim != 2:
        raise ValueError(f"x must be [N,H], got shape {x.shape}")
    num_tokens, hidden = x.shape
    if topk_idx.ndim != 2 or topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx must be [N={num_tokens},K], got shape {topk_idx.shape}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights must match topk_idx {topk_idx.shape}, got {topk_weights.shape}")
    for key in ("w_gate", "w_up", "w_down"):
        if key not in weights:
            raise ValueError(f"weights: missing {key!r}")
    num_experts, h, ffn = weights["w_gate"].shape
    if h != hidden or weights["w_up"].shape != (num_experts, hidden, ffn) \
            or weights["w_down"].shape != (num_experts, ffn, hidden):
        raise ValueError(f"weights: expected w_gate/w_up [E,{hidden},I], w_down [E,I,{hidden}], got "
                         f"{weights['w_gate'].shape}, {weights['w_up'].shape}, {weights['w_down'].shape}")
    shared = [key for key in WEIGHT_KEYS[3:] if key in weights]
    if shared and len(shared) != 3:
        raise ValueError(f"weights: give all of shared_gate/shared_up/shared_down or none, got {shared}")
    if shared:
        if any(weights[key].ndim != 2 for key in shared):
            raise ValueError("weights: shared_gate/shared_up must be [H,Is] and shared_down [Is,H]")
        s_ffn = weights["shared_gate"].shape[1]
        if weights["shared_gate"].shape != (hidden, s_ffn) or weights["shared_up"].shape != (hidden, s_ffn) \
                or weights["shared_down"].shape != (s_ffn, hidden):
            raise ValueError("weights: shared_gate/shared_up must be [H,Is] and shared_down [Is,H]")
    if topk_idx.dtype.kind not in "iu":
        raise ValueError(f"topk_idx must be integers, got {topk_idx.dtype}")
    if topk_idx.size and (int(topk_idx.min()) < 0 or int(topk_idx.max()) >= num_experts):
        raise ValueError(f"topk_idx values must be in [0, {num_experts})")
    return bool(shared)


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
    xp = array_module(x)
    dt = _dtype(dtype)
    has_shared = _check_inputs(x, topk_idx, topk_weights, weights)
    x = x.astype(dt)
    w = {key: weights[key].astype(dt) for key in WEIGHT_KEYS if key in weights}
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


def backward(dout, cache):
    """dout [N,H] -> dict of gradients: x, topk_weights, w_gate, w_up, w_down (+ shared_*)."""
    xp = array_module(dout)
    x, w, top_k = cache["x"], cache["weights"], cache["topk_idx"].shape[1]
    if dout.shape != x.shape:
        raise ValueError(f"dout must have the shape of x {x.shape}, got {dout.shape}")
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
