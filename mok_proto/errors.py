"""The exceptions every layer raises for protocol and kernel failures (one definition; the
symmetric-memory backends, the kernel wrappers and the layers all import them from here)."""

from __future__ import annotations


class SymmTimeoutError(RuntimeError):
    """A bounded wait expired: which operator, which rank waited, for which peer."""

    def __init__(self, op: str, rank: int, peer: int, expected: int, seen: int, timeout_s: float):
        self.op, self.rank, self.peer, self.expected, self.seen = op, rank, peer, expected, seen
        super().__init__(f"{op}: rank {rank} waited {timeout_s:g} s for peer {peer} "
                         f"(flag {seen} < epoch {expected}); is that rank alive and in the same round?")


class CapacityError(RuntimeError):
    """A fixed-capacity buffer would overflow; nothing was written."""


class KernelTimeoutError(RuntimeError):
    """A wait inside one kernel (not on a peer) expired: a kernel bug, reported instead of a hang."""
