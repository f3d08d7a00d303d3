"""Accuracy of a low-precision result against a float64 reference, per array.

    err_rel_rms = ||got - ref||_2 / ||ref||_2
    err_max     = max |got - ref| / max |ref|

A result with a non-finite value, or a nonzero result against an all-zero reference, has error
inf: NaN never compares as small. Both are 0 for two empty or two all-zero arrays.
"""

from __future__ import annotations

import numpy as np

# The aim for an FP8 layer: three quantization steps of ~3% each, added in quadrature. The output
# and dx meet it; the weight gradients and d topk_weights pass more quantizations (design.md 5.7).
ERR_REL_RMS_BOUND = 0.06
# What the block-scaled e4m3 recipe meets on every array: what FP8 results are judged at.
ERR_REL_RMS_RECIPE = 0.08


def errors(got, ref) -> dict:
    """{"err_rel_rms": ..., "err_max": ...} of `got` against `ref` (same shape)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"errors: shapes differ, {got.shape} vs {ref.shape}")
    if not (np.isfinite(got).all() and np.isfinite(ref).all()):
        return {"err_rel_rms": float("inf"), "err_max": float("inf")}
    diff = got - ref
    return {"err_rel_rms": _ratio(np.sqrt((diff * diff).sum()), np.sqrt((ref * ref).sum())),
            "err_max": _ratio(np.abs(diff).max(initial=0.0), np.abs(ref).max(initial=0.0))}


def error_table(got: dict, ref: dict) -> dict:
    """{name: errors(got[name], ref[name])} over the names of `ref` (all must be in `got`)."""
    missing = sorted(set(ref) - set(got))
    if missing:
        raise ValueError(f"error_table: no result for {', '.join(missing)}")
    return {name: errors(got[name], ref[name]) for name in ref}


def worst(table: dict, key: str = "err_rel_rms") -> tuple:
    """(name, value) of the largest `key` in an error_table."""
    name = max(table, key=lambda n: table[n][key])
    return name, table[name][key]


def _ratio(num: float, den: float) -> float:
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / den)
