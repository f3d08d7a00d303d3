"""Input checks, in one place, for the reference, the schedule, the config and every layer.

Legend: N tokens, H hidden, I expert FFN, Is shared FFN, E experts, K top-k, R ranks.
Every error is an InputError (a ValueError and a TypeError) that names the argument and the
expected shape or type. Array checks work on any array module (NumPy, CuPy): shapes and
dtypes are metadata; value checks (range, duplicates, finiteness) reduce on the array's own
device and read back one scalar, so a GPU caller pays one small readback per check.
Imports nothing of the project (the reference and the schedule depend on it).
"""

from __future__ import annotations

import operator

import numpy as np

WEIGHT_KEYS = ("w_gate", "w_up", "w_down")  # routed experts
SHARED_KEYS = ("shared_gate", "shared_up", "shared_down")  # the optional shared expert


class InputError(ValueError, TypeError):
    """A bad argument: the message names it and what was expected."""


def check_int(value, name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer (Python or NumPy; never a bool or a float) in [minimum, maximum] -> int."""
    if isinstance(value, (bool, np.bool_)):
        raise InputError(f"{name} must be an integer, got bool {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise InputError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if minimum is not None and value < minimum:
        raise InputError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InputError(f"{name} must be <= {maximum}, got {value}")
    return value


def as_array(a, name: str):
    """An array of any module as it is; a list, tuple or scalar becomes a NumPy array."""
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return a
    if isinstance(a, (list, tuple, int, float, np.generic)) and not isinstance(a, bool):
        try:
            return np.asarray(a)
        except ValueError as e:  # ragged nesting
            raise InputError(f"{name} must be a rectangular array, got a ragged {type(a).__name__}: {e}") from None
    raise InputError(f"{name} must be an array (numpy or cupy), got {type(a).__name__}")


def _fmt(shape, legend) -> str:
    return "[" + ",".join(f"{leg}={s}" if s is not None else leg for leg, s in zip(legend, shape)) + "]"


def check_array(a, name: str, shape, legend: str | None = None, kind: str | None = None):
    """`a` (converted by as_array) with len(shape) dims; an int in `shape` must match, None is free.
    legend: one letter per dim for the message ("NH" -> [N=5,H]); kind: dtype kinds allowed
    ("f" float, "iu" integer, "fiu" numeric)."""
    a = as_array(a, name)
    legend = legend or "?" * len(shape)
    want = _fmt(shape, legend)
    if a.ndim != len(shape) or any(s is not None and s != got for s, got in zip(shape, a.shape)):
        raise InputError(f"{name} must be {want}, got shape {tuple(a.shape)}")
    if kind is not None and a.dtype.kind not in kind and not (a.size == 0 and a.dtype.kind in "fiub"):
        names = {"f": "floating", "iu": "integer", "fiu": "numeric"}.get(kind, kind)
        raise InputError(f"{name} must have a {names} dtype, got {a.dtype}")
    return a


def check_finite(a, name: str) -> None:
    xp = array_module(a)
    if a.size and not bool(xp.isfinite(a).all()):
        raise InputError(f"{name} must be finite: it holds NaN or inf")


def check_routing(topk_idx, num_experts, name: str = "topk_idx", distinct: bool = True):
    """Expert ids [..., K]: integers in [0, E); with distinct=True (what `route` produces) also
    K <= E and no expert twice in one token. Returns the array (as_array'd)."""
    num_experts = check_int(num_experts, "num_experts", minimum=1)
    topk_idx = as_array(topk_idx, name)
    if topk_idx.dtype.kind not in "iu" and topk_idx.size:
        raise InputError(f"{name} must have an integer dtype, got {topk_idx.dtype}")
    if topk_idx.size:
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < 0 or hi >= num_experts:
            raise InputError(f"{name} values must lie in [0, num_experts={num_experts}), got min {lo}, max {hi}")
    if distinct and topk_idx.ndim:
        top_k = topk_idx.shape[-1]
        if top_k > num_experts:
            raise InputError(f"{name}: K={top_k} choices per token, more than the E={num_experts} experts")
        if topk_idx.size and top_k > 1:
            xp = array_module(topk_idx)
            ordered = xp.sort(topk_idx, axis=-1)
            if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
                raise InputError(f"{name}: a token chooses the same expert twice (each token's K ids must differ)")
    return topk_idx


def check_weights(weights, hidden: int | None = None, num_experts: int | None = None) -> bool:
    """Expert weights: w_gate/w_up [E,H,I], w_down [E,I,H], optionally all of shared_gate/
    shared_up [H,Is], shared_down [Is,H]. Returns whether the shared expert is present."""
    if not hasattr(weights, "keys"):
        raise InputError(f"weights must be a dict of arrays ({', '.join(WEIGHT_KEYS + SHARED_KEYS)}), "
                        f"got {type(weights).__name__}")
    for key in WEIGHT_KEYS:
        if key not in weights:
            raise InputError(f"weights: missing {key!r} (need {', '.join(WEIGHT_KEYS)})")
    w_gate = check_array(weights["w_gate"], "weights['w_gate']", (num_experts, hidden, None), "EHI", kind="f")
    num_experts, hidden, ffn = w_gate.shape
    check_array(weights["w_up"], "weights['w_up']", (num_experts, hidden, ffn), "EHI", kind="f")
    check_array(weights["w_down"], "weights['w_down']", (num_experts, ffn, hidden), "EIH", kind="f")
    shared = [key for key in SHARED_KEYS if key in weights]
    if shared and len(shared) != len(SHARED_KEYS):
        raise InputError(f"weights: give all of shared_gate/shared_up/shared_down or none, got {shared}")
    if shared:
        gate = check_array(weights["shared_gate"], "weights['shared_gate']", (hidden, None), "HI", kind="f")
        s_ffn = gate.shape[1]
        check_array(weights["shared_up"], "weights['shared_up']", (hidden, s_ffn), "HI", kind="f")
        check_array(weights["shared_down"], "weights['shared_down']", (s_ffn, hidden), "IH", kind="f")
    return bool(shared)


def check_layer_inputs(x, topk_idx, topk_weights, num_experts: int, num_tokens: int | None = None,
                       hidden: int | None = None, top_k: int | None = None):
    """One layer's inputs: x [N,H] float, topk_idx [N,K] distinct ids in [0,E), topk_weights [N,K]
    finite floats. None sizes are taken from the arrays. Returns the three (as_array'd)."""
    x = check_array(x, "x", (num_tokens, hidden), "NH", kind="f")
    topk_idx = check_array(topk_idx, "topk_idx", (x.shape[0], top_k), "NK")
    if topk_idx.shape[1] < 1:
        raise InputError(f"topk_idx must be [N,K] with K >= 1, got shape {tuple(topk_idx.shape)}")
    topk_idx = check_routing(topk_idx, num_experts)
    topk_weights = check_array(topk_weights, "topk_weights", tuple(topk_idx.shape), "NK", kind="f")
    check_finite(topk_weights, "topk_weights")
    return x, topk_idx, topk_weights


def array_module(a):
    """numpy or cupy, whichever owns `a` (cupy is never imported here otherwise)."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np
