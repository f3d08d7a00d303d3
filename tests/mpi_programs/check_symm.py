"""Run under mpiexec -n R: conformance of a symmetric-memory backend (the contract in symm/base.py),
plus the layer's failure modes: a missing peer times out with a report, an overflow is refused.
"""

import argparse

import numpy as np
from mpi4py import MPI

from mok_proto.config import MoEShape, RunConfig
from mok_proto.layer.cpu import CpuMoELayer
from mok_proto.problem import make_problem
from mok_proto.symm.base import CapacityError, SymmTimeoutError


def make_heap(backend, comm):
    if backend == "cpu":
        from mok_proto.symm.mpi import MpiHeap
        return MpiHeap(comm)
    if backend == "nvshmem":
        from mok_proto.symm.nvshmem import NvshmemHeap
        return NvshmemHeap(comm)
    raise SystemExit(f"unknown backend {backend!r}")


def check_put_get_signal(heap):
    rank, num_ranks = heap.rank, heap.num_ranks
    rows, width = 2 * num_ranks + 1, 3
    a = heap.alloc("a", (rows, width), np.float32)
    # (checked before the next collective: after it, peers may already be writing)
    assert a.local.shape == (rows, width) and not a.local.any(), "fresh buffers start zeroed"
    flags = heap.signals("f", 2)
    for epoch in (1, 2, 3):
        # Everyone stores one row into every peer at row 2*src (+1 on odd epochs), then signals.
        for peer in range(num_ranks):
            row = 2 * rank + (epoch % 2)
            a.put_rows(peer, [row], np.full((1, width), 100 * epoch + rank, np.float32))
            flags.signal(peer, 0, epoch)
        for src in range(num_ranks):
            flags.wait(0, src, epoch, timeout_s=30, op="conformance put")
            row = 2 * src + (epoch % 2)
            assert (a.local[row] == 100 * epoch + src).all(), f"epoch {epoch}: row from {src} = {a.local[row]}"
        # Pull: everyone publishes its own last row and reads every peer's.
        a.local[-1] = 1000 * epoch + rank
        a.publish()
        for peer in range(num_ranks):
            flags.signal(peer, 1, epoch)
        for src in range(num_ranks):
            flags.wait(1, src, epoch, timeout_s=30, op="conformance ready")
            got = a.get_rows(src, [rows - 1, 2 * src + (epoch % 2)])
            assert (got[0] == 1000 * epoch + src).all() and (got[1] == 100 * epoch + src).all(), got
        assert flags.read(0, rank) == epoch
        heap.barrier()
    # A values block that does not hold exactly one row per index is refused (no short/long copy).
    for bad_values in (np.zeros((1, width - 1), np.float32), np.zeros((2, width), np.float32)):
        try:
            a.put_rows((rank + 1) % num_ranks, [0], bad_values)
        except ValueError:
            pass
        else:
            raise AssertionError(f"put_rows accepted values of shape {bad_values.shape} for one row")
    # Row indices out of range are refused, not written somewhere else.
    for bad in ([rows], [-1]):
        try:
            a.put_rows((rank + 1) % num_ranks, bad, np.zeros((1, width), np.float32))
        except IndexError:
            pass
        else:
            raise AssertionError("put_rows accepted an out-of-range row")
    heap.barrier()


def check_timeout(heap):
    """Rank 0 waits for a flag rank 1 never raises: a SymmTimeoutError naming both, quickly."""
    flags = heap.signals("t", 1)
    if heap.rank == 0 and heap.num_ranks > 1:
        try:
            flags.wait(0, 1, 1, timeout_s=0.1, op="injected missing peer")
        except SymmTimeoutError as e:
            assert (e.op, e.rank, e.peer) == ("injected missing peer", 0, 1), str(e)
            assert "rank 0" in str(e) and "peer 1" in str(e)
        else:
            raise AssertionError("wait returned without the flag")
    heap.barrier()


def check_layer_failures(comm, backend):
    shape = MoEShape("t", hidden=8, ffn=4, num_experts=2 * comm.size, top_k=2, num_tokens=4)
    prob = make_problem(shape, comm.size, seed=3, routing="one-expert")
    rank = comm.rank
    # Overflow: every token's first choice is expert 0 (rank 0), which needs R*N rows > capacity.
    with make_heap(backend, comm) as heap:
        layer = CpuMoELayer(heap, RunConfig(shape, num_ranks=comm.size, timeout_s=5), prob.local_weights(rank),
                            capacity=shape.num_tokens * comm.size - 1)
        try:
            layer.forward(prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank])
        except CapacityError as e:
            assert "rank 0" in str(e), str(e)
        else:
            raise AssertionError("overflow was not reported")
    # Routing that is not integer, or out of range before any cast, is refused on every rank.
    with make_heap(backend, comm) as heap:
        layer = CpuMoELayer(heap, RunConfig(shape, num_ranks=comm.size, timeout_s=5), prob.local_weights(rank))
        for bad in (prob.topk_idx[rank] + 0.5, prob.topk_idx[rank].astype(np.int64) + 2 ** 32):
            try:
                layer.forward(prob.x[rank], bad, prob.topk_weights[rank])
            except ValueError as e:
                assert "topk_idx" in str(e), str(e)
            else:
                raise AssertionError(f"forward accepted topk_idx of dtype {bad.dtype} with values {bad.max()}")
    # Missing peer: the last rank never enters forward; every other rank reports it, no hang.
    if comm.size > 1:
        with make_heap(backend, comm) as heap:
            layer = CpuMoELayer(heap, RunConfig(shape, num_ranks=comm.size, timeout_s=1.0), prob.local_weights(rank))
            if rank != comm.size - 1:
                try:
                    layer.forward(prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank])
                except SymmTimeoutError as e:
                    assert e.peer == comm.size - 1 and e.op == "routing all-gather", str(e)
                else:
                    raise AssertionError("forward finished without the missing peer")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="cpu", help="cpu | nvshmem (under mpirun) | virtual (no mpirun)")
    p.add_argument("--ranks", type=int, default=2, help="virtual only: W ranks as W threads of this process")
    args = p.parse_args()
    if args.backend == "virtual":
        # Not under mpirun: the same per-rank checks, one thread per virtual rank (GPU only).
        from mok_proto.symm.virtual import VirtualWorld

        def rank_checks(heap):
            with heap:
                check_put_get_signal(heap)
                check_timeout(heap)

        with VirtualWorld(args.ranks) as world:
            world.run_threads(rank_checks, timeout_s=300)
        print(f"OK symm conformance backend=virtual R={args.ranks}")
        return
    comm = MPI.COMM_WORLD
    if args.backend == "nvshmem":  # GPU: the layer failure checks stay CPU-only
        with make_heap(args.backend, comm) as heap:
            assert (heap.rank, heap.num_ranks) == (comm.rank, comm.size)
            check_put_get_signal(heap)
            check_timeout(heap)
        if comm.rank == 0:
            print(f"OK symm conformance backend={args.backend} R={comm.size}")
        return
    with make_heap(args.backend, comm) as heap:
        assert (heap.rank, heap.num_ranks) == (comm.rank, comm.size)
        check_put_get_signal(heap)
        check_timeout(heap)
    check_layer_failures(comm, args.backend)
    if comm.rank == 0:
        print(f"OK symm conformance backend={args.backend} R={comm.size}")


if __name__ == "__main__":
    main()
