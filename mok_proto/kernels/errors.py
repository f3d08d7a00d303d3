"""The one error record every kernel writes (struct ErrorRecord, cuda/abi.cuh) and its host side.

A kernel that gives up on a wait, or finds a buffer too small, records the first failure in the
record it was given (atomicCAS on `code`) and ends; nothing hangs. `ErrorRecord.check()` is the
only host readback: it synchronizes and raises the matching exception from mok_proto.errors,
naming the operator from the one Op enum. Every wrapper launches with a record: the caller's, or
the wrapper's own per-launch-site record, which it returns so that the caller can check it.
"""

from __future__ import annotations

import numpy as np

from mok_proto import abi
from mok_proto.errors import CapacityError, KernelTimeoutError, SymmTimeoutError

GEMM_OPS = frozenset(abi.OP[name] for name in ("kOpGemmLoad", "kOpGemmMma", "kOpGemmAux"))


def describe(fields: dict, timeout_s: float | None = None) -> Exception | None:
    """The exception an error record's fields stand for (None: no error)."""
    code, op = fields["code"], fields["op"]
    what = abi.OP.text(op)
    if code == abi.ERROR_CODE["kErrNone"]:
        return None
    if code == abi.ERROR_CODE["kErrTimeout"] and (op in GEMM_OPS or op == abi.OP["kOpQuantColumns"]):
        # a wait on a kernel's own barrier, timed out after timeout_s
        after = f" after {timeout_s:g} s" if timeout_s is not None else ""
        where = f"(block {fields['block']}, thread {fields['thread']}, barrier parity {fields['expected']})"
        if op in GEMM_OPS:
            return KernelTimeoutError(
                f"{what} of grouped GEMM {abi.GEMM_PROBLEM.text(fields['detail'])} timed out{after} {where}")
        return KernelTimeoutError(f"{what} timed out{after}: its rows never landed in shared memory {where}")
    if code == abi.ERROR_CODE["kErrTimeout"] and op == abi.OP["kOpFusedWait"]:
        # the fused kernel's waits on its own counters run kFusedLocalTimeoutFactor x the timeout
        factor = abi.CONST["kFusedLocalTimeoutFactor"]
        after = f" after {factor * timeout_s:g} s" if timeout_s is not None else ""
        return KernelTimeoutError(
            f"{what} timed out{after} on rank {fields['rank']}: task {fields['detail']} of the plan waited for "
            f"counter {fields['peer']} to reach {fields['expected']}, saw {fields['seen']} (block {fields['block']})")
    if code == abi.ERROR_CODE["kErrTimeout"] and op == abi.OP["kOpFusedClaim"]:
        # the claim hand-off waits as long as the fused kernel's GEMM stages (kernels.fused.gemm_timeout_ns)
        return KernelTimeoutError(
            f"{what} timed out: ticket {fields['detail']} of the cluster of block {fields['block']} (thread "
            f"{fields['thread']}, barrier parity {fields['expected']}) was not handed over in time")
    if code == abi.ERROR_CODE["kErrTimeout"]:
        return SymmTimeoutError(what, fields["rank"], fields["peer"], fields["expected"], fields["seen"],
                                timeout_s if timeout_s is not None else float("nan"))
    if code == abi.ERROR_CODE["kErrCapacity"] and op == abi.OP["kOpWeightedSum"]:
        # A token owner's weighted sum found slots whose expert owner placed no receive row (that
        # owner's schedule overflowed and reported it in its own record)
        return CapacityError(f"{what}: receive buffer overflow on rank {fields['peer']} (seen by rank "
                             f"{fields['rank']}: {fields['seen']} of its {fields['expected']} slots got no expert "
                             f"result)")
    if code == abi.ERROR_CODE["kErrCapacity"]:
        return CapacityError(f"{what}: receive buffer overflow on rank {fields['rank']}: needs {fields['peer']} "
                             f"rows, capacity is {fields['expected']}")
    return RuntimeError(f"unknown device error code {code} (op {what})")


class ErrorRecord:
    """One device ErrorRecord. `timeout_s`: the bound of the waits that report into it (for the
    message). Pass `record.ptr` (or the record itself to a wrapper) to a kernel."""

    def __init__(self, timeout_s: float | None = None):
        import cupy

        self.words = cupy.zeros(abi.ERROR_RECORD.nbytes // 8, dtype=np.uint64)
        self.timeout_s = timeout_s

    @property
    def ptr(self) -> int:
        return self.words.data.ptr

    def read(self) -> dict:
        """The record's fields (synchronizes with the current stream)."""
        return abi.ERROR_RECORD.unpack(self.words.get())

    def check(self) -> None:
        """Synchronize the device and raise what the record holds (nothing if it is clear). The
        record keeps the error: later launches given it skip their work until `clear()`."""
        import cupy

        cupy.cuda.Device().synchronize()
        error = describe(self.read(), self.timeout_s)
        if error is not None:
            raise error

    def clear(self) -> None:
        """Forget a recorded error (stream-ordered: launches enqueued after this see a clear record)."""
        self.words.fill(0)
