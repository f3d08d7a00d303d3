"""Real NVSHMEM symmetric memory through nvshmem4py: one process per rank (PE) under mpirun.

    heap = NvshmemHeap()                  # MPI.COMM_WORLD; binds device rank % device_count
    a = heap.alloc("x", (rows, H), "float32")
    a.ptr_table[p]                        # nvshmem_ptr of a on PE p (own PE: the local address)

Several processes on one GPU (NVSHMEM's MPG mode) is the normal test case: there NVSHMEM forbids
team collectives, so this module uses only MPI barriers. NVLink multicast (NVLS) is never used:
NVSHMEM_DISABLE_NVLS=1 is set before init unless the caller set it.
Host collectives are bounded by `timeout_s` (mok_proto.symm.watchdog): barriers are arrival
barriers (PeerTimeoutError names the missing peers); NVSHMEM init, allocation, freeing and
finalize are preceded by one and run under the process watchdog's deadline, if one runs.

Mapping of the contract in base.py (host path, for conformance tests):
  put_rows / get_rows -> cupy scatter / gather kernels through the peer mapping (get_peer_array)
  quiet / publish     -> device synchronize
  signal              -> device synchronize, then store the epoch into the peer's flags[kind, me]
  read                -> readback of my own flag word
"""

from __future__ import annotations

import os

import numpy as np

from mok_proto.symm import watchdog
from mok_proto.symm.base import SymmetricHeap
from mok_proto.symm.gpu import (FLAG_DTYPE, GpuSignals, GpuSymmetricArray, norm_dtype, norm_shape,
                                require_cupy)

_OPEN = []  # the NvshmemHeap of this process while it is open (NVSHMEM is initialised once per process)


class NvshmemArray(GpuSymmetricArray):
    def __init__(self, heap: "NvshmemHeap", name, shape, dtype):
        import cupy
        import nvshmem.core as nvshmem

        self.heap, self.name, self.rank = heap, name, heap.rank
        self.shape, self.dtype = shape, dtype
        self.num_ranks, self.device = heap.num_ranks, heap.device
        count = int(np.prod(shape, dtype=np.int64))
        self.nbytes = count * dtype.itemsize
        # nvshmem_malloc(0) may return NULL: allocate at least one element, view `count` of them.
        with watchdog.guard(f"nvshmem allocation ({name})"):
            self._owner = nvshmem.array((max(count, 1),), dtype=dtype)
        self._owner.fill(0)
        self._instances = []
        for peer in range(self.num_ranks):
            if peer == self.rank:  # (get_peer_array on my own PE would add a reference free_array never drops)
                flat = self._owner
            else:
                try:
                    flat = nvshmem.get_peer_array(self._owner, peer)
                except Exception as e:  # noqa: BLE001
                    raise RuntimeError(f"{name}: PE {peer} is not load/store reachable from PE {self.rank} "
                                       f"(nvshmem_ptr failed: {e}); this backend needs P2P-mapped peers") from e
            self._instances.append(flat[:count].reshape(shape))
        self.ptr_table = cupy.asarray(np.array([inst.data.ptr for inst in self._instances], np.uint64))
        # NOTE: every PE's zero fill is complete before any peer may store into its instance.
        cupy.cuda.runtime.deviceSynchronize()
        watchdog.arrival_barrier(heap.comm, f"nvshmem allocation ({name})", heap.timeout_s)

    def instance(self, rank):
        return self._instances[self._check_peer(rank)]

    def complete(self):
        import cupy

        cupy.cuda.runtime.deviceSynchronize()

    def free(self):
        import nvshmem.core as nvshmem

        self._instances = []  # peer mappings first: they belong to the allocation freed next
        self.ptr_table = None
        with watchdog.guard(f"nvshmem freeing ({self.name})"):
            nvshmem.free_array(self._owner)  # collective: every PE frees in the same order
        self._owner = None


class NvshmemHeap(SymmetricHeap):
    backend = "nvshmem"

    def __init__(self, comm=None, timeout_s: float = 30.0):
        cupy = require_cupy(who="NvshmemHeap")
        try:
            import nvshmem.core as nvshmem
            try:
                from cuda.core import Device
            except ImportError:  # older cuda-core
                from cuda.core.experimental import Device
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"NvshmemHeap needs nvshmem4py (nvshmem4py-cu13) and cuda-core: "
                               f"{type(e).__name__}: {e}") from e
        from mpi4py import MPI

        if _OPEN:
            raise RuntimeError("NvshmemHeap: one heap per process at a time (close the open one first)")
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")  # NOTE: never NVLink multicast here
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.timeout_s = float(timeout_s)
        self.device = self.comm.rank % cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(self.device).use()
        self._cuda_device = Device(self.device)
        self._cuda_device.set_current()
        watchdog.arrival_barrier(self.comm, "nvshmem init", self.timeout_s)
        with watchdog.guard("nvshmem init"):
            nvshmem.init(device=self._cuda_device, mpi_comm=self.comm, initializer_method="emulated_mpi")
        self.rank, self.num_ranks = int(nvshmem.my_pe()), int(nvshmem.n_pes())
        if (self.rank, self.num_ranks) != (self.comm.rank, self.comm.size):
            raise RuntimeError(f"NVSHMEM PE {self.rank}/{self.num_ranks} != MPI rank "
                               f"{self.comm.rank}/{self.comm.size}")
        self.launch_ranks = [self.rank]
        self.arrays: dict[str, NvshmemArray] = {}
        self.flags: dict[str, GpuSignals] = {}
        self._closed = False
        _OPEN.append(self)

    def _alloc(self, name, shape, dtype) -> NvshmemArray:
        if self._closed:
            raise RuntimeError("NvshmemHeap is closed")
        if name in self.arrays:
            raise ValueError(f"symmetric array {name!r} already allocated")
        # Collective sanity: every PE allocates the same thing in the same order (NVSHMEM requires it).
        watchdog.arrival_barrier(self.comm, f"nvshmem allocation ({name})", self.timeout_s)
        with watchdog.guard(f"nvshmem allocation ({name})"):
            specs = self.comm.allgather((name, shape, dtype.str))
        if any(spec != specs[0] for spec in specs):
            raise ValueError(f"symmetric array {name!r}: ranks disagree on (name, shape, dtype): {specs}")
        self.arrays[name] = NvshmemArray(self, name, shape, dtype)
        return self.arrays[name]

    def alloc(self, name, shape, dtype) -> NvshmemArray:
        return self._alloc(name, norm_shape(name, shape), norm_dtype(name, dtype))

    def free(self, array: NvshmemArray) -> None:
        """Release one array; collective: every PE frees the same arrays in the same order."""
        if self.arrays.get(array.name) is not array:
            raise ValueError(f"symmetric array {array.name!r} is not allocated here")
        self.barrier()  # NOTE: no peer may still load from or store into it
        del self.arrays[array.name]
        array.free()

    def signals(self, name, num_kinds) -> GpuSignals:
        if name in self.flags:
            raise ValueError(f"signals {name!r} already allocated")
        if isinstance(num_kinds, bool) or not isinstance(num_kinds, (int, np.integer)) or num_kinds < 1:
            raise ValueError(f"signals {name!r}: num_kinds must be an int >= 1, got {num_kinds!r}")
        array = self._alloc(f"signals/{name}", (int(num_kinds), self.num_ranks), FLAG_DTYPE)
        self.flags[name] = GpuSignals(array, self.rank)
        return self.flags[name]

    def barrier(self):
        import cupy

        # NOTE: my device work (puts into peers included) is complete before I arrive.
        cupy.cuda.runtime.deviceSynchronize()
        watchdog.arrival_barrier(self.comm, "barrier", self.timeout_s)

    def close(self):
        if self._closed:
            return
        import nvshmem.core as nvshmem

        self.barrier()
        self._closed = True
        for array in self.arrays.values():  # same order on every PE (alloc order, checked collectively)
            array.free()
        self.arrays.clear()
        self.flags.clear()
        with watchdog.guard("nvshmem finalize"):
            nvshmem.finalize()
        _OPEN.remove(self)

    def __exit__(self, exc_type, *rest):
        if exc_type is not None:
            # A failed rank skips the collective teardown (peers may be elsewhere): the process exits
            # with the error and mpirun takes the job down.
            self._closed = True
            return
        self.close()
