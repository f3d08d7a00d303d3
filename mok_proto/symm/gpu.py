"""Pieces shared by the GPU symmetric-memory backends (virtual.py, nvshmem.py).

Kernel-facing contract of every GPU array:
  ptr_table  cupy uint64 [R]: device address of every rank's instance, usable by kernels launched from
             this process (virtual: slices of one allocation; nvshmem: nvshmem_ptr peer mappings)
  nbytes     per-rank instance size in bytes
  instance(r) cupy view of rank r's instance (shape, dtype)
The host interface (put_rows/get_rows/publish/quiet, Signals) is one rank's view and serves
conformance tests; kernels do their own loads, stores and flags through ptr_table.

cupy is imported lazily: importing this module never imports it.
"""

from __future__ import annotations

import operator

import numpy as np

from mok_proto.symm.base import Signals, SymmetricArray

FLAG_DTYPE = np.dtype(np.uint64)  # flags[kind, src]: one aligned 8-byte word per (kind, src)


def require_cupy(device: int | None = None, who: str = "a GPU symmetric heap"):
    """Import cupy and check that a CUDA device is usable; RuntimeError with the reason otherwise."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - any failure means no GPU path
        raise RuntimeError(f"{who} needs an NVIDIA GPU and cupy-cuda13x; cupy is not importable "
                           f"({type(e).__name__}: {e})") from e
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"{who} needs an NVIDIA GPU and cupy-cuda13x; no usable CUDA device ({e})") from e
    if count < 1:
        raise RuntimeError(f"{who} needs an NVIDIA GPU and cupy-cuda13x; no CUDA device visible")
    if device is not None and not 0 <= device < count:
        raise ValueError(f"{who}: device {device} out of range, {count} visible")
    return cupy


def norm_shape(name: str, shape) -> tuple:
    """Shape as a tuple of non-negative ints, at least 1-D; ValueError otherwise."""
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        if isinstance(shape, (str, bytes)):
            raise TypeError
        out = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise ValueError(f"symmetric array {name!r}: shape {shape!r} is not a tuple of ints") from None
    if not out or any(s < 0 for s in out):
        raise ValueError(f"symmetric array {name!r}: shape {out} must be at least 1-D with sizes >= 0")
    return out


def norm_dtype(name: str, dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.hasobject or dtype.itemsize == 0:
        raise ValueError(f"symmetric array {name!r}: dtype {dtype} cannot live in device memory")
    return dtype


class GpuSymmetricArray(SymmetricArray):
    """One symmetric buffer seen by `rank` (None: a world-level handle with no own instance).

    Subclasses set name, shape, dtype, rank, num_ranks, device, ptr_table, nbytes and implement
    instance() and complete().
    """

    name: str
    shape: tuple
    dtype: np.dtype
    rank: int | None
    num_ranks: int
    device: int
    ptr_table: object  # cupy.ndarray uint64 [R]
    nbytes: int

    def instance(self, rank: int):
        raise NotImplementedError

    def complete(self) -> None:
        """Complete every earlier device operation this caller issued (puts, stores)."""
        raise NotImplementedError

    @property
    def local(self):
        if self.rank is None:
            raise ValueError(f"{self.name}: a world-level handle has no single local instance; "
                             "use instance(r) or the rank view's array")
        return self.instance(self.rank)

    def _check_peer(self, peer) -> int:
        if not 0 <= int(peer) < self.num_ranks:
            raise IndexError(f"{self.name}: peer {peer} out of range [0, {self.num_ranks})")
        return int(peer)

    def _rows(self, rows):
        import cupy

        if type(rows).__module__.split(".")[0] == "cupy":
            rows = rows.get()  # the bounds check runs on the host
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.shape[0]):
            raise IndexError(f"{self.name}: rows out of range [0, {self.shape[0]})")
        return cupy.asarray(rows)

    def put_rows(self, peer, rows, values):
        import cupy

        with cupy.cuda.Device(self.device):
            target = self.instance(self._check_peer(peer))
            rows = self._rows(rows)
            if rows.size == 0:
                return
            values = cupy.asarray(values, dtype=self.dtype).reshape((rows.size,) + self.shape[1:])
            # NOTE: asynchronous on the current stream: complete only at complete() (signal/quiet/publish).
            target[rows] = values

    def get_rows(self, peer, rows):
        import cupy

        with cupy.cuda.Device(self.device):
            source = self.instance(self._check_peer(peer))
            out = source[self._rows(rows)]
            self.complete()  # complete on return, as the contract says
            return out

    def publish(self):
        import cupy

        with cupy.cuda.Device(self.device):
            self.complete()

    def quiet(self):
        self.publish()


class GpuSignals(Signals):
    """flags: a [num_kinds, R] uint64 symmetric array per rank; flags[kind, src] is raised by src.

    Kernels use `array.ptr_table` (element (kind, src) of rank p is at ptr_table[p] + 8*(kind*R + src)).
    The host path below is for conformance tests: it stores and reads flags with small copies.
    """

    def __init__(self, array: GpuSymmetricArray, rank: int | None):
        self.array, self.rank = array, rank
        self.name = array.name
        self.num_kinds, self.num_ranks = array.shape
        self.dtype = array.dtype

    def for_rank(self, rank: int) -> "GpuSignals":
        """The same flags seen by `rank` (virtual worlds, where every rank lives in this process)."""
        return GpuSignals(self.array.for_rank(rank), rank)

    def _check(self, kind, src):
        if not (0 <= kind < self.num_kinds and 0 <= src < self.num_ranks):
            raise IndexError(f"{self.name}: flag ({kind}, {src}) out of range")
        if self.rank is None:
            raise ValueError(f"{self.name}: a world-level handle has no rank; use for_rank(r)")

    def signal(self, peer, kind, epoch):
        import cupy

        self._check(kind, peer)
        if epoch < 0:
            raise ValueError(f"{self.name}: epoch {epoch} < 0 (flags are unsigned and only grow)")
        with cupy.cuda.Device(self.array.device):
            # NOTE: release. Every earlier put/store of this rank is complete before the flag store is
            # issued, so a peer that sees the flag also sees the rows.
            self.array.complete()
            self.array.instance(peer)[kind, self.rank] = epoch  # one aligned 8-byte store
            self.array.complete()

    def read(self, kind, src):
        import cupy

        self._check(kind, src)
        with cupy.cuda.Device(self.array.device):
            # NOTE: acquire. A device-to-host copy of one aligned word; whatever this rank launches after
            # it returns starts after the peer's completed stores, so it sees the rows.
            return int(self.array.instance(self.rank)[kind, src])
