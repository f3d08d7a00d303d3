"""The kernel features a measurement depends on, as the fields its results row records: who moves
the fused kernel's rows on a communicating CTA (`comm_mover`), how its counter waits spin
(`wait_spin`), how the backward's scale reads its rows (`scale_traffic`). The benchmarks stamp
every new row with the current kernels' values; the simulator tells older measurements apart by
them (mok_proto.sim.params). Edit here when a kernel changes one. A run with an experimental
standalone GEMM variant ($MOK_GEMM_VARIANT, kernels/gemm.py) also records `gemm_variant`, one with an
experimental fused-kernel variant ($MOK_FUSED_VARIANT, kernels/fused.py) `fused_variant`."""

import os
import sys

from mok_proto.abi import CONST
from mok_proto.exitcodes import EXIT_BAD_ARGUMENT

CURRENT = {"comm_mover": "warps", "wait_spin": "backoff", "scale_traffic": "stream"}
GEMM_VARIANT_ENV = "MOK_GEMM_VARIANT"
GEMM_VARIANTS = CONST["kGemmVariants"]  # masks of cuda/gemm.cuh's MOK_GEMM_VARIANT bits
FUSED_VARIANT_ENV = "MOK_FUSED_VARIANT"
FUSED_VARIANTS = CONST["kFusedVariants"]  # masks of cuda/fused.cuh's MOK_FUSED_VARIANT bits
FP8_MAINLOOP_ENV = "MOK_FP8_MAINLOOP"
FP8_MAINLOOPS = CONST["kFp8Mainloops"]  # main loops of cuda/gemm_fp8.cuh (bench_gemm's FP8 rows record `fp8_mainloop`)
# The row fields of the experimental variants: a row with one of them nonzero measured a kernel that
# is not the default one (results.load leaves such rows out unless asked).
VARIANT_FIELDS = ("gemm_variant", "fused_variant", "fp8_mainloop")


def is_experimental(row: dict) -> bool:
    """Whether a results row (or a timeline's index row) measured an experimental kernel variant (a
    nonzero VARIANT_FIELDS field), not the default kernels."""
    return any(row.get(f) for f in VARIANT_FIELDS)


def _mask(env: str, count: int) -> int:
    """$env as a mask below `count` (0 when unset or empty); ValueError when it is not one."""
    text = os.environ.get(env, "").strip() or "0"
    if not text.isdigit() or int(text) >= count:
        raise ValueError(f"{env}={text!r}: expected an integer 0 to {count - 1}")
    return int(text)


def at_import(read) -> int:
    """read() (a knob reader below) for a kernels module's import: a bad value ends the process with
    one line on stderr and exit 2 (a bad argument), not a traceback."""
    try:
        return read()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_ARGUMENT) from None


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
    """The current kernels' features (a copy: rows may be edited), with the experimental variants the
    process runs (VARIANT_FIELDS, nonzero ones only)."""
    variants = {"gemm_variant": at_import(gemm_variant), "fused_variant": at_import(fused_variant),
                "fp8_mainloop": at_import(fp8_mainloop)}
    return {**CURRENT, **{name: mask for name, mask in variants.items() if mask}}
