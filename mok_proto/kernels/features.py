"""The kernel features a measurement depends on, as the fields its results row records: who moves
the fused kernel's rows on a communicating CTA (`comm_mover`), how its counter waits spin
(`wait_spin`), how the backward's scale reads its rows (`scale_traffic`). The benchmarks stamp
every new row with the current kernels' values; the simulator tells older measurements apart by
them (mok_proto.sim.params). Edit here when a kernel changes one.

Rows may carry the fields of experimental compile-time variants the kernels once had
(VARIANT_FIELDS): such a row measured an experiment, unless its value is the one the default
kernels adopted (ADOPTED); docs/LOG.md has what each was."""

CURRENT = {"comm_mover": "warps", "wait_spin": "backoff", "scale_traffic": "stream"}
VARIANT_FIELDS = ("gemm_variant", "fused_variant", "fp8_mainloop", "fp8_variant")
# The variants that became the default code: the standalone BF16 GEMMs' banded tile order
# (gemm_variant 1), the FP8 GEMMs' lean main loop (fp8_mainloop 3). fp8_variant's masks (turns,
# banded tiles) were measured and dropped.
ADOPTED = {"gemm_variant": 1, "fp8_mainloop": 3}


def is_experimental(row: dict) -> bool:
    """Whether a results row (or a timeline's index row) measured a kernel that is not today's
    default: a nonzero VARIANT_FIELDS field, or for an ADOPTED field any recorded value but the
    adopted one (0 there was the code the adopted variant replaced)."""
    return any(row[f] != ADOPTED[f] if f in ADOPTED and f in row else bool(row.get(f)) for f in VARIANT_FIELDS)


def kernel_features() -> dict:
    """The current kernels' features (a copy: rows may be edited)."""
    return dict(CURRENT)
