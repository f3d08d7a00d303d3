"""The fault-tolerant rank protocol of the R-process benchmark: phases whose failure every rank
learns of (so that all ranks take the same path after it), values shared from one rank, what a
failure left freed collectively, GPUs shared by ranks, and one shape's part on a fresh layer."""

from __future__ import annotations

import time
import traceback

from mok_proto.bench.mpi_problem import MARGIN_BYTES, new_layer
from mok_proto.bench.timing import slowest_rank

HEAP_TIMEOUT_S = 60.0  # host barriers between ranks
NCCL_TIMEOUT_S = 120.0  # every NCCL collective of the torch layer (a failed peer ends the job, not the call)


class Ranks:
    """What every step of the MPI mode shares: the communicator, the heap, printing on rank 0,
    and phases whose failure every rank learns of, so that all ranks take the same path after it
    (the same collectives in the same order)."""

    def __init__(self, comm, heap, per_gpu: int = 1):
        self.comm, self.heap = comm, heap
        self.rank, self.num_ranks, self.lead = comm.rank, comm.size, comm.rank == 0
        self.per_gpu = per_gpu  # the most ranks on one GPU (each allocates its own layer there; every rank agrees)

    def say(self, text: str) -> None:
        if self.lead:
            print(text, flush=True)

    def phase(self, row: dict, name: str, fn):
        """fn() on every rank: (True, its value) if it succeeded on every rank, else (False, None),
        each failing rank's error printed by that rank (with its traceback) and recorded in row.
        RULE: fn calls no MPI collective (a rank that raised before it would be at this phase's
        allgather instead): the reductions (slowest, max, ...) come after a phase that succeeded.
        Inside fn only heap.barrier (bounded: it raises PeerTimeoutError past HEAP_TIMEOUT_S),
        symmetric allocations and frees, and NCCL calls (bounded by NCCL_TIMEOUT_S), each after a
        phase boundary where every rank agreed that its setup succeeded. NOTE: not bounded: an
        allocation's own allgather and NVSHMEM's collective alloc/free (a rank failing inside
        them hangs its peer), and an error outside any phase (main() then aborts the job)."""
        try:
            value, error = fn(), None
        except Exception as e:  # noqa: BLE001 - every failure is reported and the run goes on
            value, error = None, f"{type(e).__name__}: {e}"
            traceback.print_exc()
            print(f"# rank {self.rank}: {row.get('shape', '')}: {name} FAILED: {error}", flush=True)
        return self._agree(row, name, self.comm.allgather(error), value)

    def _agree(self, row: dict, name: str, errors: list, value):
        """(True, value) if no rank has an error, else (False, None) and the errors recorded in row
        (and the arrival barriers resynchronized: called by every rank with the same errors)."""
        if any(errors):
            row.setdefault("errors", []).append({"phase": name, "ranks": {str(r): e for r, e in enumerate(errors) if e}})
            self.resync_barriers()
            return False, None
        return True, value

    def resync_barriers(self) -> None:
        """Drop the arrival tokens a failed phase left in flight and agree on the barrier count
        (watchdog.resync_arrivals): a rank whose heap.barrier timed out (its peer had failed
        elsewhere) sent a token the peer never took, and counted a barrier the peer did not."""
        from mok_proto.symm.watchdog import resync_arrivals

        for p, stale in resync_arrivals(self.comm).items():
            if stale:
                print(f"# rank {self.rank}: dropped {stale} stale barrier arrival(s) of rank {p}", flush=True)

    def shared(self, row: dict, name: str, fn, root: int):
        """fn() on rank `root` only, its value (pickled) sent to every rank: (True, value) on every
        rank, or (False, None) with root's error recorded in row on every rank."""
        value = error = None
        if self.rank == root:
            try:
                value = fn()
            except Exception as e:  # noqa: BLE001 - reported on every rank, the run goes on
                error = f"{type(e).__name__}: {e}"
                traceback.print_exc()
                print(f"# rank {self.rank}: {row.get('shape', '')}: {name} FAILED: {error}", flush=True)
        value, error = self.comm.bcast((value, error), root=root)
        return self._agree(row, name, [error if r == root else None for r in range(self.num_ranks)], value)

    def release(self, row: dict, names) -> None:
        """Free the symmetric arrays of `names` (in alloc order) that a failed allocation, fill or
        free left in heap.arrays, collectively: those every rank holds are freed, in the same
        order on every rank; any left after that (held by some ranks only, or a free failed) are
        forgotten (their memory stays mapped; their names can be allocated again)."""
        arrays = self.heap.arrays
        everyone = self.comm.allgather([name for name in names if name in arrays])
        common = [name for name in everyone[0] if all(name in held for held in everyone)]
        if common:
            self.say(f"#   freeing {len(common)} symmetric arrays left by a failure")
            self.phase(row, "free what a failure left", lambda: [self.heap.free(arrays[name]) for name in common])
        lost = [name for name in names if name in arrays]
        for name in lost:
            del arrays[name]
        if lost:
            print(f"# rank {self.rank}: {len(lost)} symmetric arrays forgotten, not freed: {lost}", flush=True)

    def slowest(self, stats: dict) -> dict:
        return slowest_rank(stats, self.comm)

    def max(self, value):
        from mpi4py import MPI

        return self.comm.allreduce(value, op=MPI.MAX)

    def min(self, value):
        from mpi4py import MPI

        return self.comm.allreduce(value, op=MPI.MIN)

    def free_bytes(self) -> int:
        """The smallest free device memory over the ranks, CuPy's and torch's caches emptied."""
        import cupy
        import torch

        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
        return int(self.min(cupy.cuda.runtime.memGetInfo()[0]))


def gpu_sharing(bus_ids) -> int:
    """The most ranks on one GPU, from every rank's GPU (PCI bus id; an allgather): each of them
    allocates a layer there, and NCCL refuses a GPU shared by two ranks."""
    return max(list(bus_ids).count(b) for b in bus_ids)


def implied_no_torch(args, num_ranks: int, per_gpu: int):
    """Ranks sharing a GPU (NVSHMEM's MPG mode: a check of the whole flow, kernels of different
    processes time-slice) run as --no-torch, since NCCL refuses them: sets args.no_torch and
    returns the line to print, or None."""
    if per_gpu <= 1 or args.no_torch:
        return None
    args.no_torch = True
    return (f"# {num_ranks} ranks, up to {per_gpu} on one GPU: no torch + NCCL layer (NCCL refuses a shared GPU; "
            f"as --no-torch), and the timings are not those of {num_ranks} GPUs")


def run_shape(ranks, prob, args, heap_held: int, link: dict, part: str, row: dict, work):
    """One part of one shape on a fresh layer (allocated and filled if it fits, freed after):
    work(layer, row). Returns (row, heap_held after it); row starts as the shape's config."""
    import cupy

    start = time.time()
    row = row or {**prob.config(), "link": link}
    ranks.say(f"# {prob.name} ({part}): N={prob.shape.num_tokens} H={prob.shape.hidden} I={prob.shape.ffn} "
              f"E={prob.shape.num_experts} (El={prob.shape.num_experts // prob.num_ranks}) K={prob.shape.top_k}, "
              f"capacity {prob.capacity} rows, our layer {prob.layer_bytes / 1e9:.1f} GB per rank")
    free = ranks.free_bytes()
    # Ranks sharing a GPU each allocate a layer there: an allocation NVSHMEM cannot back fails
    # inside its heap and ends the job, so never try one. (heap_held is read off the GPU's free
    # memory: with ranks sharing the GPU it is what all their heaps hold.)
    share = ranks.per_gpu
    if (prob.layer_bytes + MARGIN_BYTES) * share > free + heap_held:
        why = (f"our layer needs {prob.layer_bytes / 1e9:.1f} GB per rank (+ {MARGIN_BYTES >> 30} GiB margin)"
               + (f" x {share} ranks on one GPU" if share > 1 else "")
               + f", {free / 1e9:.1f} GB free + {heap_held / 1e9:.1f} GB held by the heap" + ("s" if share > 1 else ""))
        if part == "sequential":
            row["skipped"] = why
        else:
            row.setdefault("errors", []).append({"phase": "fused part: allocate", "ranks": {"all": why}})
        ranks.say(f"# {prob.name} ({part}): skipped: {why}")
        return row, heap_held
    ok, layer = ranks.phase(row, f"allocate and fill ({part})", lambda: new_layer(ranks, prob, args.seed))
    if ok:
        try:
            work(layer, row)
        finally:
            ranks.phase(row, f"free ({part})", layer.close)
    # What a failed allocation, fill or free left (on any rank) goes too: the next layer of this
    # name must be allocatable (collective, on every path).
    ranks.release(row, prob.array_names())
    layer = None  # (the torch tensors on its buffers went with run_torch's frame)
    cupy.get_default_memory_pool().free_all_blocks()
    # What the heap kept of this layer (free memory that did not come back) stays usable by the next.
    heap_held += max(0, free - ranks.free_bytes())
    row[f"elapsed_{part}_s"] = time.time() - start
    ranks.say(f"# {prob.name} ({part}): done in {row[f'elapsed_{part}_s']:.1f} s")
    return row, heap_held
