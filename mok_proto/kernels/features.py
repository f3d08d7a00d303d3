"""The kernel features a measurement depends on, as the fields its results row records: who moves
the fused kernel's rows on a communicating CTA (`comm_mover`), how its counter waits spin
(`wait_spin`), how the backward's scale reads its rows (`scale_traffic`). The benchmarks stamp
every new row with the current kernels' values; the simulator tells older measurements apart by
them (mok_proto.sim.params). Edit here when a kernel changes one."""

CURRENT = {"comm_mover": "warps", "wait_spin": "backoff", "scale_traffic": "stream"}


def kernel_features() -> dict:
    """The current kernels' features (a copy: rows may be edited)."""
    return dict(CURRENT)
