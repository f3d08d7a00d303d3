"""The kernel features a measurement depends on, as the fields its results row records: who moves
the fused kernel's rows on a communicating CTA (`comm_mover`), how its counter waits spin
(`wait_spin`), how the backward's scale reads its rows (`scale_traffic`). The benchmarks stamp
every new row with the current kernels' values; the simulator tells older measurements apart by
them (mok_proto.sim.params). Edit here when a kernel changes one.

Rows may carry the fields of experimental compile-time variants (VARIANT_FIELDS: the one the
kernels have now, FP8_VARIANT_ENV, and those they once had): such a row measured an experiment,
unless its value is the one the default kernels adopted (ADOPTED); docs/LOG.md has what each was."""

import os
import sys

from mok_proto.abi import CONST
from mok_proto.exitcodes import EXIT_BAD_ARGUMENT

CURRENT = {"comm_mover": "warps", "wait_spin": "backoff", "scale_traffic": "stream"}
# The experimental variant the kernels have now, off by default: $MOK_FP8_VARIANT, a mask of
# cuda/gemm_fp8.cuh's bits (kernels/gemm_fp8.py builds it); a run with it on records `fp8_variant`.
FP8_VARIANT_ENV = "MOK_FP8_VARIANT"
FP8_VARIANTS = CONST["kFp8Variants"]
VARIANT_FIELDS = ("gemm_variant", "fused_variant", "fp8_mainloop", "fp8_variant")
# The variants that became the default code: the standalone BF16 GEMMs' banded tile order
# (gemm_variant 1), the FP8 GEMMs' lean main loop (fp8_mainloop 3).
ADOPTED = {"gemm_variant": 1, "fp8_mainloop": 3}


def is_experimental(row: dict) -> bool:
    """Whether a results row (or a timeline's index row) measured a kernel that is not today's
    default: a nonzero VARIANT_FIELDS field, or for an ADOPTED field any recorded value but the
    adopted one (0 there was the code the adopted variant replaced)."""
    return any(row[f] != ADOPTED[f] if f in ADOPTED and f in row else bool(row.get(f)) for f in VARIANT_FIELDS)


def fp8_variant() -> int:
    """$MOK_FP8_VARIANT as a mask (0 when unset or empty); ValueError when it is not one."""
    text = os.environ.get(FP8_VARIANT_ENV, "").strip() or "0"
    if not text.isdigit() or int(text) >= FP8_VARIANTS:
        raise ValueError(f"{FP8_VARIANT_ENV}={text!r}: expected an integer 0 to {FP8_VARIANTS - 1}")
    return int(text)


def at_import(read) -> int:
    """read() (a knob reader above) for a kernels module's import: a bad value ends the process with
    one line on stderr and exit 2 (a bad argument), not a traceback."""
    try:
        return read()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_ARGUMENT) from None


def kernel_features() -> dict:
    """The current kernels' features (a copy: rows may be edited), with the experimental variant the
    process runs (`fp8_variant`, when on)."""
    variant = at_import(fp8_variant)
    return {**CURRENT, **({"fp8_variant": variant} if variant else {})}
