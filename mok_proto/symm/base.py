"""Symmetric memory: the one interface the protocol is written on.

Every rank allocates the same buffers (collectively, same shape and dtype); a rank may then
store rows into a peer's instance (`put_rows`), load rows from it (`get_rows`) and raise or
wait on flags (`Signals`). Backends:
  cpu      -- MPI RMA windows (mok_proto.symm.mpi), one process per rank under mpirun
  nvshmem  -- NVSHMEM symmetric heap through nvshmem4py (GPU)
  virtual  -- W ranks as slices of one GPU allocation in one process (GPU)
GPU backends additionally expose a device table of peer base addresses for kernels.

Memory-ordering contract (what the layer relies on):
  * `put_rows` may complete lazily; `Signals.signal(peer, ...)` first completes every earlier
    put of this rank to `peer` (quiet), then raises the flag: a flag is a release.
  * `Signals.wait` is an acquire: after it returns, rows put by that peer before its signal are
    visible in `local`.
  * `publish()` makes this rank's own stores into `local` visible to peers' `get_rows`; it must
    precede the signal that tells peers the rows are ready.
  * Flags carry epochs that only grow; nothing is ever reset between rounds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from mok_proto.errors import CapacityError, SymmTimeoutError  # noqa: F401 - part of this interface


class SymmetricArray(ABC):
    """One symmetric buffer of shape [rows, ...]; `local` is this rank's instance."""

    name: str
    local: object

    @abstractmethod
    def put_rows(self, peer: int, rows, values) -> None:
        """peer's local[rows] = values (complete at the next signal to peer, or quiet())."""

    @abstractmethod
    def get_rows(self, peer: int, rows):
        """Return peer's local[rows]; complete when it returns."""

    @abstractmethod
    def publish(self) -> None:
        """Make this rank's stores to `local` visible to peers."""

    @abstractmethod
    def quiet(self) -> None:
        """Complete every outstanding put of this rank on this array."""


class Signals(ABC):
    """A [num_kinds, R] table of epoch flags per rank: flags[kind, src] is raised by rank src."""

    @abstractmethod
    def signal(self, peer: int, kind: int, epoch: int) -> None:
        """Set peer's flags[kind, my rank] = epoch, after all my earlier puts to peer (release)."""

    @abstractmethod
    def read(self, kind: int, src: int) -> int:
        """Atomically read my flags[kind, src]."""

    def wait(self, kind: int, src: int, epoch: int, timeout_s: float, op: str) -> None:
        """Spin until my flags[kind, src] >= epoch (acquire); SymmTimeoutError after timeout_s."""
        import time

        deadline = time.monotonic() + timeout_s
        spins = 0
        while True:
            seen = self.read(kind, src)
            if seen >= epoch:
                self.acquired()
                return
            spins += 1
            if time.monotonic() > deadline:
                raise SymmTimeoutError(op, self.rank, src, epoch, seen, timeout_s)
            if spins > 64:
                time.sleep(1e-5)

    def acquired(self) -> None:
        """Hook after a successful wait (e.g. a memory sync)."""


class SymmetricHeap(ABC):
    """One rank's handle on symmetric memory. alloc() is collective."""

    rank: int
    num_ranks: int
    backend: str

    @abstractmethod
    def alloc(self, name: str, shape, dtype) -> SymmetricArray:
        ...

    @abstractmethod
    def signals(self, name: str, num_kinds: int) -> Signals:
        ...

    def free(self, array: SymmetricArray) -> None:
        """Release one array before close() (collective where the backend needs it)."""
        raise NotImplementedError(f"{type(self).__name__} frees its arrays only at close()")

    @abstractmethod
    def barrier(self) -> None:
        ...

    @abstractmethod
    def close(self) -> None:
        ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
