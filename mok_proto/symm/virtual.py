"""Virtual ranks: W ranks in ONE process, each symmetric array one GPU allocation of W slices.

    world = VirtualWorld(W)                    # the heap kernels use: launch_ranks = [0..W)
    a = world.alloc("x", (rows, H), "float32") # a.ptr_table[r] = base + r * a.stride_bytes
    world.rank_view(r)                         # rank r's host SymmetricHeap (one thread per rank)
    world.run_threads(fn)                      # fn(world.rank_view(r)) in W threads

Each rank's instance starts on a 256-byte boundary (the per-rank stride is padded). One kernel
launch covers every rank: a kernel that spun on a flag raised by another block of the SAME launch
would need all its blocks co-resident; the round's kernels (cuda/comm.cuh) only wait for flags of
earlier launches, so they do not.
The host path (rank views) exists for conformance tests: alloc/signals/barrier are collective
among the W threads, like alloc is collective among processes elsewhere.
"""

from __future__ import annotations

import copy
import threading

import numpy as np

from mok_proto.symm.base import SymmetricHeap
from mok_proto.symm.gpu import (FLAG_DTYPE, GpuSignals, GpuSymmetricArray, norm_dtype, norm_shape,
                                require_cupy)

ALIGN = 256  # bytes between the starts of consecutive ranks' instances are a multiple of this


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


class VirtualArray(GpuSymmetricArray):
    def __init__(self, world: "VirtualWorld", name, shape, dtype):
        import cupy

        self.world, self.name, self.rank = world, name, None
        self.shape, self.dtype = shape, dtype
        self.num_ranks, self.device = world.num_ranks, world.device
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.stride_bytes = -(-max(self.nbytes, 1) // ALIGN) * ALIGN
        with cupy.cuda.Device(self.device):
            # One allocation (pool blocks are 512-byte aligned; the slack covers any other allocator).
            self._raw = cupy.zeros(self.num_ranks * self.stride_bytes + ALIGN, dtype=cupy.uint8)
            skip = -int(self._raw.data.ptr) % ALIGN
            # [W, *shape] over it; rank r's instance is stacked[r] (a C-contiguous view).
            self.stacked = cupy.ndarray((self.num_ranks,) + shape, dtype, memptr=self._raw[skip:].data,
                                        strides=(self.stride_bytes,) + _c_strides(shape, dtype.itemsize))
            base = int(self.stacked.data.ptr)
            self.ptr_table = cupy.asarray(
                np.array([base + r * self.stride_bytes for r in range(self.num_ranks)], np.uint64))
            # NOTE: the zero fill (and table upload) is complete before any thread, on any stream, sees it.
            cupy.cuda.Device(self.device).synchronize()

    def for_rank(self, rank: int) -> "VirtualArray":
        """The same array seen by `rank` (shares the allocation)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"{self.name}: rank {rank} out of range [0, {self.num_ranks})")
        view = copy.copy(self)
        view.rank = rank
        return view

    def instance(self, rank):
        return self.stacked[self._check_peer(rank)]

    def complete(self):
        import cupy

        cupy.cuda.get_current_stream().synchronize()


class VirtualWorld(SymmetricHeap):
    """W virtual ranks on one GPU. `rank` is None: kernels cover `launch_ranks` in one launch."""

    backend = "virtual"
    rank = None

    def __init__(self, num_ranks: int, device: int = 0, barrier_timeout_s: float = 300.0):
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
            raise ValueError(f"VirtualWorld: number of ranks must be an int >= 1, got {num_ranks!r}")
        require_cupy(device, who="VirtualWorld")
        self.num_ranks, self.device = int(num_ranks), int(device)
        self.launch_ranks = list(range(self.num_ranks))
        self.arrays: dict[str, VirtualArray] = {}
        self._lock = threading.RLock()
        self._barrier = threading.Barrier(self.num_ranks, timeout=barrier_timeout_s)
        self._views: dict[int, VirtualRankHeap] = {}
        self._closed = False

    def _check_open(self):
        if self._closed:
            raise RuntimeError("VirtualWorld is closed")

    def alloc(self, name, shape, dtype) -> VirtualArray:
        shape, dtype = norm_shape(name, shape), norm_dtype(name, dtype)
        with self._lock:
            self._check_open()
            if name in self.arrays:
                raise ValueError(f"symmetric array {name!r} already allocated")
            self.arrays[name] = VirtualArray(self, name, shape, dtype)
            return self.arrays[name]

    def free(self, array: VirtualArray) -> None:
        """Release one array (its memory returns to CuPy's pool once no view of it is held)."""
        import cupy

        with self._lock:
            if self.arrays.get(array.name) is not array:
                raise ValueError(f"symmetric array {array.name!r} is not allocated here")
            cupy.cuda.Device(self.device).synchronize()  # no launch may still use it
            del self.arrays[array.name]

    def signals(self, name, num_kinds) -> GpuSignals:
        return GpuSignals(self.alloc(_flags_name(name), _flags_shape(name, num_kinds, self.num_ranks),
                                     FLAG_DTYPE), None)

    def rank_view(self, rank: int) -> "VirtualRankHeap":
        """Rank `rank`'s host heap (the same object on every call)."""
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.num_ranks:
            raise ValueError(f"VirtualWorld: rank {rank!r} out of range [0, {self.num_ranks})")
        with self._lock:
            return self._views.setdefault(int(rank), VirtualRankHeap(self, int(rank)))

    def barrier(self):
        import cupy

        cupy.cuda.Device(self.device).synchronize()

    def thread_barrier(self):
        """The W rank threads meet here (threading.BrokenBarrierError once a rank failed)."""
        self._barrier.wait()

    def abort(self):
        """Break the thread barrier so every rank thread stuck in a collective fails fast."""
        self._barrier.abort()

    def run_threads(self, fn, timeout_s: float | None = None) -> list:
        """Run fn(rank_view(r)) in W threads; return their results or raise the first real error."""
        import cupy

        results, errors = [None] * self.num_ranks, [None] * self.num_ranks

        def body(rank):
            try:
                with cupy.cuda.Device(self.device):
                    results[rank] = fn(self.rank_view(rank))
            except BaseException as e:  # noqa: BLE001 - reported below, with the rank
                errors[rank] = e
                self.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"virtual-rank-{r}", daemon=True)
                   for r in range(self.num_ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        if any(t.is_alive() for t in threads):
            self.abort()
            raise TimeoutError(f"virtual ranks {[r for r, t in enumerate(threads) if t.is_alive()]} "
                               f"still running after {timeout_s} s")
        # A rank's own failure first; BrokenBarrierError only says that some other rank failed.
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        failed.sort(key=lambda item: isinstance(item[1], threading.BrokenBarrierError))
        if failed:
            rank, error = failed[0]
            if hasattr(error, "add_note"):
                error.add_note(f"(in virtual rank {rank} of {self.num_ranks})")
            raise error
        return results

    def close(self):
        import cupy

        with self._lock:
            if self._closed:
                return
            self._closed = True
            cupy.cuda.Device(self.device).synchronize()
            self.arrays.clear()  # memory returns to cupy's pool once no view is held


class VirtualRankHeap(SymmetricHeap):
    """Rank r's host view of a VirtualWorld; alloc/signals/barrier are collective among the W threads."""

    backend = "virtual"

    def __init__(self, world: VirtualWorld, rank: int):
        self.world, self.rank, self.num_ranks = world, rank, world.num_ranks
        self.launch_ranks = [rank]  # host path only: kernels should be launched on the world
        self.device = world.device
        self._mine: set[str] = set()
        self._closed = False

    def _collective(self, name, shape, dtype) -> VirtualArray:
        shape, dtype = norm_shape(name, shape), norm_dtype(name, dtype)
        if name in self._mine:
            raise ValueError(f"symmetric array {name!r} already allocated by rank {self.rank}")
        self._mine.add(name)
        world = self.world
        with world._lock:
            array = world.arrays.get(name)
            if array is None:  # the first rank to arrive creates it for everyone
                array = world.alloc(name, shape, dtype)
        # NOTE: collective: no rank stores into the array before every rank holds it (it is zeroed).
        world.thread_barrier()
        if (array.shape, array.dtype) != (shape, dtype):
            raise ValueError(f"symmetric array {name!r}: rank {self.rank} asked for {shape} {dtype}, "
                             f"but it was allocated as {array.shape} {array.dtype}")
        return array.for_rank(self.rank)

    def alloc(self, name, shape, dtype) -> VirtualArray:
        return self._collective(name, shape, dtype)

    def signals(self, name, num_kinds) -> GpuSignals:
        array = self._collective(_flags_name(name), _flags_shape(name, num_kinds, self.num_ranks), FLAG_DTYPE)
        return GpuSignals(array, self.rank)

    def barrier(self):
        import cupy

        # NOTE: my device work is complete before I arrive, so after the barrier everyone sees it.
        cupy.cuda.Device(self.device).synchronize()
        self.world.thread_barrier()

    def close(self):
        if not self._closed:
            self._closed = True
            self.barrier()

    def __exit__(self, exc_type, *rest):
        if exc_type is not None:
            self._closed = True
            self.world.abort()  # peers waiting in a collective fail fast instead of hanging
            return
        self.close()


def _flags_name(name):
    return f"signals/{name}"


def _flags_shape(name, num_kinds, num_ranks):
    if isinstance(num_kinds, bool) or not isinstance(num_kinds, (int, np.integer)) or num_kinds < 1:
        raise ValueError(f"signals {name!r}: num_kinds must be an int >= 1, got {num_kinds!r}")
    return (int(num_kinds), num_ranks)
