"""CPU symmetric memory over MPI-3 RMA windows: one process per rank under mpirun.

Each symmetric array is one `MPI.Win.Allocate` window, opened for passive-target access to all
ranks for its whole life (`Lock_all`). Mapping of the contract in base.py:
  put_rows  -> MPI_Put with an indexed-block target datatype (one call per peer)
  get_rows  -> MPI_Get + MPI_Win_flush (complete on return)
  quiet     -> MPI_Win_flush_all;  publish -> MPI_Win_sync
  signal    -> flush(peer) on every data window, then MPI_Accumulate(REPLACE) + flush
  read      -> MPI_Fetch_and_op(NO_OP) on my own window + flush (atomic, drives progress)
  barrier   -> flush, then watchdog.arrival_barrier (bounded: PeerTimeoutError names who is missing)
Window creation and freeing block until every rank takes part: each is preceded by a bounded
arrival barrier (every peer alive) and runs under the process watchdog's deadline, if one runs.
After an error inside `with MpiHeap(...)`, the heap skips its collective teardown: the job must end.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from mok_proto.symm import watchdog
from mok_proto.symm.base import Signals, SymmetricArray, SymmetricHeap


def _window(heap: "MpiHeap", name: str, num_items: int, dtype: np.dtype):
    op = f"window creation ({name})"
    watchdog.arrival_barrier(heap.comm, op, heap.timeout_s)
    with watchdog.guard(op):
        win = MPI.Win.Allocate(max(1, num_items) * dtype.itemsize, dtype.itemsize, comm=heap.comm)
    local = np.frombuffer(win.tomemory(), dtype=dtype, count=num_items)
    local[...] = 0
    win.Lock_all(MPI.MODE_NOCHECK)
    win.Sync()
    # NOTE: no peer may touch this window before every rank zeroed its instance
    watchdog.arrival_barrier(heap.comm, op, heap.timeout_s)
    return win, local


def _free(win, name: str):
    win.Unlock_all()
    with watchdog.guard(f"window freeing ({name})"):
        win.Free()


class MpiArray(SymmetricArray):
    def __init__(self, heap: "MpiHeap", name: str, shape, dtype):
        self.heap, self.name = heap, name
        self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        self.row_items = int(np.prod(self.shape[1:], dtype=np.int64))
        self.win, flat = _window(heap, name, int(np.prod(self.shape, dtype=np.int64)), self.dtype)
        self.local = flat.reshape(self.shape)
        self.mpi_type = from_numpy_dtype(self.dtype)

    def _rows_type(self, rows):
        displacements = (np.asarray(rows, dtype=np.int64) * self.row_items).tolist()
        return self.mpi_type.Create_indexed_block(self.row_items, displacements).Commit()

    def _check_rows(self, rows):
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.shape[0]):
            raise IndexError(f"{self.name}: rows out of range [0, {self.shape[0]})")
        return rows

    def put_rows(self, peer, rows, values):
        rows = self._check_rows(rows)
        # Exactly one row of values per row index (a wrong size is an error, never a short or long copy).
        values = np.ascontiguousarray(values, dtype=self.dtype).reshape((rows.size,) + self.shape[1:])
        if rows.size == 0:
            return
        if peer == self.heap.rank:
            self.local[rows] = values
            return
        target = self._rows_type(rows)
        self.win.Put([values, rows.size * self.row_items, self.mpi_type], peer, target=(0, 1, target))
        # NOTE: MPI may read `values` until the flush: keep it alive in `pending` until then.
        self.heap.pending.setdefault((self, peer), []).append(values)
        target.Free()

    def get_rows(self, peer, rows):
        rows = self._check_rows(rows)
        if peer == self.heap.rank or rows.size == 0:
            return self.local[rows].copy()
        out = np.empty((rows.size,) + self.shape[1:], self.dtype)
        target = self._rows_type(rows)
        self.win.Get([out, rows.size * self.row_items, self.mpi_type], peer, target=(0, 1, target))
        self.win.Flush(peer)
        target.Free()
        return out

    def publish(self):
        self.win.Sync()

    def quiet(self):
        self.win.Flush_all()
        for key in [key for key in self.heap.pending if key[0] is self]:
            del self.heap.pending[key]

    def free(self):
        _free(self.win, self.name)


class MpiSignals(Signals):
    def __init__(self, heap: "MpiHeap", name: str, num_kinds: int):
        self.heap, self.name, self.rank = heap, name, heap.rank
        self.num_kinds, self.num_ranks = num_kinds, heap.num_ranks
        self.win, self.local = _window(heap, name, num_kinds * heap.num_ranks, np.dtype(np.int64))
        self._one = np.zeros(1, np.int64)
        self._res = np.zeros(1, np.int64)

    def _disp(self, kind, src):
        if not (0 <= kind < self.num_kinds and 0 <= src < self.num_ranks):
            raise IndexError(f"{self.name}: flag ({kind}, {src}) out of range")
        return kind * self.num_ranks + src

    def signal(self, peer, kind, epoch):
        self.heap.complete_puts_to(peer)
        self._one[0] = epoch
        self.win.Accumulate([self._one, MPI.INT64_T], peer, target=(self._disp(kind, self.rank), 1, MPI.INT64_T),
                            op=MPI.REPLACE)
        self.win.Flush(peer)

    def read(self, kind, src):
        self.win.Fetch_and_op([self._one, MPI.INT64_T], [self._res, MPI.INT64_T], self.rank,
                              self._disp(kind, src), op=MPI.NO_OP)
        self.win.Flush(self.rank)
        return int(self._res[0])

    def acquired(self):
        self.heap.sync_all()

    def free(self):
        _free(self.win, self.name)


class MpiHeap(SymmetricHeap):
    backend = "cpu"

    def __init__(self, comm=None, timeout_s: float = 30.0):
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.timeout_s = float(timeout_s)  # bound of every collective (barrier, window creation/freeing)
        self.rank, self.num_ranks = self.comm.rank, self.comm.size
        self.arrays: dict[str, MpiArray] = {}
        self.flags: dict[str, MpiSignals] = {}
        self.pending: dict = {}  # (array, peer) -> origin buffers of puts not yet flushed

    def alloc(self, name, shape, dtype):
        if name in self.arrays:
            raise ValueError(f"symmetric array {name!r} already allocated")
        self.arrays[name] = MpiArray(self, name, shape, dtype)
        return self.arrays[name]

    def signals(self, name, num_kinds):
        if name in self.flags:
            raise ValueError(f"signals {name!r} already allocated")
        self.flags[name] = MpiSignals(self, name, num_kinds)
        return self.flags[name]

    def complete_puts_to(self, peer):
        for array, p in [key for key in self.pending if key[1] == peer]:
            array.win.Flush(p)
            del self.pending[(array, p)]

    def sync_all(self):
        for array in self.arrays.values():
            array.win.Sync()

    def barrier(self):
        for array, peer in self.pending:
            array.win.Flush(peer)
        self.pending.clear()
        watchdog.arrival_barrier(self.comm, "barrier", self.timeout_s)

    def close(self):
        if self.arrays is None:
            return
        self.barrier()
        for obj in list(self.arrays.values()) + list(self.flags.values()):
            obj.free()
        self.arrays = self.flags = None

    def __exit__(self, exc_type, *rest):
        if exc_type is not None:
            # NOTE: a failed rank skips the collective teardown (peers may be stuck or elsewhere):
            # the caller reports the error and ends the job (the demo: MPI_Abort).
            self.arrays = self.flags = None
            return
        self.close()
