"""A GPU communication round (routing all-gather, device schedule, dispatch, stand-in expert,
combine, weighted sum) against NumPy, for every direction choice.

    python tests/mpi_programs/check_gpu_comm.py --backend virtual --ranks 4
    NVSHMEM_DISABLE_NVLS=1 mpirun -n 4 python tests/mpi_programs/check_gpu_comm.py --backend nvshmem

Checks, per rank this process drives: the device schedule equals mok_proto/schedule.py bit for
bit (offsets, counts, src_rank, src_slot, recv_row); the output equals the float32 NumPy round
bit for bit under all four (dispatch, combine) choices; 20 replays of a captured CUDA graph give
the same bytes; an overflow raises CapacityError on every rank (NVSHMEM: a rank whose own buffer
fits finds it in its weighted sum, from its slots that got no row); a missing peer raises
SymmTimeoutError.
"""

import itertools
import re
import sys

import numpy as np

import gpu_program
from mok_proto.config import DIRECTIONS, MoEShape, RunConfig
from mok_proto.layer.gpu_comm import GpuCommRound
from mok_proto.reference import stand_in_round
from mok_proto.problem import make_problem
from mok_proto.schedule import build_pull_schedule
from mok_proto.symm.base import CapacityError, SymmTimeoutError

CASES = {  # name: (H, E, K, N, routing)
    "random": (64, 16, 4, 24, "random"),
    "one-expert": (64, 16, 4, 24, "one-expert"),
    "one-token": (64, 16, 2, 1, "random"),
    "hidden-37": (37, 16, 3, 9, "skewed"),
    "hidden-100": (100, 8, 2, 17, "random"),
    "many-slots": (8, 16, 4, 700, "skewed"),  # 2800 slots per rank: 3 schedule segments, the last partial
}


def check_case(heap, name, case_id, replays):
    import cupy

    h, e, k, n, routing = CASES[name]
    num_ranks = heap.num_ranks
    shape = MoEShape(name, hidden=h, ffn=8, num_experts=e, top_k=k, num_tokens=n)
    prob = make_problem(shape, num_ranks, seed=11 + case_id, routing=routing)
    scale = np.random.default_rng(case_id).uniform(0.5, 2.0, e).astype(np.float32)
    base = np.random.default_rng(100 + case_id).standard_normal(prob.x.shape).astype(np.float32)
    want = stand_in_round(prob.x, prob.topk_idx, prob.topk_weights, scale, base)
    rnd = GpuCommRound(heap, RunConfig(shape, num_ranks, timeout_s=20), name=f"c{case_id}")
    for rank in rnd.ranks:
        rnd.set_inputs(rank, prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank], scale, base[rank])
    first = None
    for dispatch, combine in itertools.product(DIRECTIONS, repeat=2):
        rnd.policy.update(dispatch=dispatch, combine=combine)
        rnd.poison()  # NaN in every row buffer: a row read before it landed cannot pass
        rnd.enqueue()
        rnd.check()
        heap.barrier()
        outs = {rank: rnd.output(rank).get() for rank in rnd.ranks}
        for rank, out in outs.items():
            assert np.array_equal(out, want[rank]), \
                f"{name} {dispatch}/{combine} rank {rank}: max |diff| {np.nanmax(np.abs(out - want[rank]))}"
        if first is None:
            first = outs
            check_schedule(rnd, prob.topk_idx, e)
        graph = rnd.capture()
        stream = cupy.cuda.Stream(non_blocking=True)
        for _ in range(replays):
            rnd.poison()
            cupy.cuda.Device().synchronize()
            graph.launch(stream)
            stream.synchronize()
            rnd.check()
            heap.barrier()
            for rank in rnd.ranks:
                assert rnd.output(rank).get().tobytes() == first[rank].tobytes(), \
                    f"{name} {dispatch}/{combine} rank {rank}: graph replay differs"
    rnd.close()
    return f"{name}: 4 policies bitwise equal to NumPy, schedule identical, {replays} graph replays each"


def check_schedule(rnd, topk_idx_all, num_experts):
    for rank in rnd.ranks:
        want = build_pull_schedule(topk_idx_all, num_experts, rank)
        offsets, counts, src_rank, src_slot = rnd.schedule_arrays(rank)
        assert np.array_equal(offsets, want.expert_offsets), (rank, offsets, want.expert_offsets)
        assert np.array_equal(counts, want.tokens_per_expert), (rank, counts, want.tokens_per_expert)
        assert np.array_equal(src_rank, want.src_rank) and np.array_equal(src_slot, want.src_slot), rank
        assert np.array_equal(rnd.bufs["recv_row"].instance(rank).get(), want.recv_row), rank


def check_failures(heap, virtual):
    """Overflow -> CapacityError on every rank (naming an overflowing rank); a peer that never runs
    -> SymmTimeoutError naming it."""
    num_ranks = heap.num_ranks
    shape = MoEShape("fail", hidden=8, ffn=4, num_experts=2 * num_ranks, top_k=2, num_tokens=4)
    prob = make_problem(shape, num_ranks, seed=5, routing="one-expert")
    scale = np.ones(shape.num_experts, np.float32)
    capacity = shape.num_tokens * num_ranks - 1
    rnd = GpuCommRound(heap, RunConfig(shape, num_ranks, timeout_s=20), name="overflow", capacity=capacity)
    for rank in rnd.ranks:
        rnd.set_inputs(rank, prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank], scale)
    # The error record's first report wins. Virtual ranks share one record: the first overflowing
    # rank's schedule to report (rank 0 always overflows: every first choice is expert 0; others
    # may). Under NVSHMEM a rank that overflows reports its own schedule's error; one that does not
    # sees the overflow in its weighted sum (its slots routed to an overflowing rank got no row:
    # recv_row = -1) and names the lowest such rank. Every rank raises: each routes a slot to rank 0.
    over = {r for r in range(num_ranks)
            if build_pull_schedule(prob.topk_idx, shape.num_experts, r).num_slots > capacity}
    assert 0 in over
    rnd.enqueue()
    try:
        rnd.check()
    except CapacityError as e:
        named = int(re.search(r"overflow on rank (\d+)", str(e)).group(1))
        assert named in over, (str(e), sorted(over))
        if virtual or rnd.ranks[0] in over:
            assert named in rnd.ranks and str(e).startswith("schedule: "), (str(e), rnd.ranks, sorted(over))
        else:
            (rank,) = rnd.ranks
            owners = prob.topk_idx[rank] // (shape.num_experts // num_ranks)
            unplaced = np.isin(owners, sorted(over))
            want = (f"weighted sum: receive buffer overflow on rank {int(owners[unplaced].min())} (seen by rank {rank}: "
                    f"{int(unplaced.sum())} of its {shape.num_tokens * shape.top_k} slots got no expert result)")
            assert want in str(e), (want, str(e))
    else:
        raise AssertionError(f"ranks {rnd.ranks}: the round raised nothing although ranks {sorted(over)} overflowed")
    heap.barrier()
    if num_ranks < 2:
        return
    missing = num_ranks - 1
    ranks = list(range(missing)) if virtual else None
    rnd = GpuCommRound(heap, RunConfig(shape, num_ranks, timeout_s=0.5), name="missing", ranks=ranks)
    for rank in rnd.ranks:
        rnd.set_inputs(rank, prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank], scale)
    if missing in rnd.ranks:  # NVSHMEM: the missing peer's process simply does not run the round
        heap.barrier()
        return
    rnd.enqueue()
    try:
        rnd.check()
    except SymmTimeoutError as e:
        assert e.peer == missing, str(e)
    else:
        raise AssertionError("a round without its last rank finished")
    heap.barrier()


def main():
    args = gpu_program.parser(CASES).parse_args()
    heap, _ = gpu_program.open_heap(args)
    try:
        lines = [check_case(heap, name, i, args.replays) for i, name in enumerate(args.cases.split(","))]
        check_failures(heap, virtual=args.backend == "virtual")
    finally:
        heap.close()
    if heap.launch_ranks[0] == 0:
        print(f"OK gpu comm backend={args.backend} R={heap.num_ranks}")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
