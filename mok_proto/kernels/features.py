"""The kernel features a measurement depends on, as the fields its results row records: who moves
the fused kernel's rows on a communicating CTA (`comm_mover`), how its counter waits spin
(`wait_spin`), how the backward's scale reads its rows (`scale_traffic`). The benchmarks stamp
every new row with the current kernels' values; the simulator tells older measurements apart by
them (mok_proto.sim.params). Edit here when a kernel changes one. A run with an experimental
standalone GEMM variant ($MOK_GEMM_VARIANT, kernels/gemm.py) also records `gemm_variant`, one with an
experimental fused-kernel variant ($MOK_FUSED_VARIANT, kernels/fused.py) `fused_variant`."""

import os

CURRENT = {"comm_mover": "warps", "wait_spin": "backoff", "scale_traffic": "stream"}
GEMM_VARIANT_ENV = "MOK_GEMM_VARIANT"
GEMM_VARIANTS = 8  # masks 0 .. 7 of cuda/gemm.cuh's MOK_GEMM_VARIANT bits
FUSED_VARIANT_ENV = "MOK_FUSED_VARIANT"
FUSED_VARIANTS = 8  # masks 0 .. 7 of cuda/fused.cuh's MOK_FUSED_VARIANT bits
FP8_MAINLOOP_ENV = "MOK_FP8_MAINLOOP"
FP8_MAINLOOPS = 4  # main loops 0 .. 3 of cuda/gemm_fp8.cuh (bench_gemm's FP8 rows record `fp8_mainloop`)


def _mask(env: str, count: int) -> int:
    """$env as a mask below `count` (0 when unset or empty); ValueError when it is not one."""
    text = os.environ.get(env, "").strip() or "0"
    if not text.isdigit() or int(text) >= count:
        raise ValueError(f"{env}={text!r}: expected an integer 0 to {count - 1}")
    return int(text)


def gemm_variant() -> int:
    """$MOK_GEMM_VARIANT as a mask (0 when unset or empty); ValueError when it is not one."""
    return _mask(GEMM_VARIANT_ENV, GEMM_VARIANTS)


def fused_variant() -> int:
    """$MOK_FUSED_VARIANT as a mask (0 when unset or empty); ValueError when it is not one."""
    return _mask(FUSED_VARIANT_ENV, FUSED_VARIANTS)


def fp8_mainloop() -> int:
    """$MOK_FP8_MAINLOOP as a main loop number (0 when unset or empty); ValueError when it is not one."""
    return _mask(FP8_MAINLOOP_ENV, FP8_MAINLOOPS)


def kernel_features() -> dict:
    """The current kernels' features (a copy: rows may be edited)."""
    variants = {"gemm_variant": gemm_variant(), "fused_variant": fused_variant()}
    return {**CURRENT, **{name: mask for name, mask in variants.items() if mask}}
