"""The kernel features a measurement depends on, as the fields its results row records: who moves
the fused kernel's rows on a communicating CTA (`comm_mover`), how its counter waits spin
(`wait_spin`), how the backward's scale reads its rows (`scale_traffic`). The benchmarks stamp
every new row with the current kernels' values; the simulator tells older measurements apart by
them (mok_proto.sim.params). Edit here when a kernel changes one. A run with an experimental
standalone GEMM variant ($MOK_GEMM_VARIANT, kernels/gemm.py) also records `gemm_variant`."""

import os

CURRENT = {"comm_mover": "warps", "wait_spin": "backoff", "scale_traffic": "stream"}
GEMM_VARIANT_ENV = "MOK_GEMM_VARIANT"
GEMM_VARIANTS = 8  # masks 0 .. 7 of cuda/gemm.cuh's MOK_GEMM_VARIANT bits


def gemm_variant() -> int:
    """$MOK_GEMM_VARIANT as a mask (0 when unset or empty); ValueError when it is not one."""
    text = os.environ.get(GEMM_VARIANT_ENV, "").strip() or "0"
    if not text.isdigit() or int(text) >= GEMM_VARIANTS:
        raise ValueError(f"{GEMM_VARIANT_ENV}={text!r}: expected an integer 0 to {GEMM_VARIANTS - 1}")
    return int(text)


def kernel_features() -> dict:
    """The current kernels' features (a copy: rows may be edited)."""
    variant = gemm_variant()
    return {**CURRENT, "gemm_variant": variant} if variant else dict(CURRENT)
