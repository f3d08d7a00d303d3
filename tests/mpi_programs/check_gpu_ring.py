"""The GPU layer (sequential passes) through a ring of several turns, under worst-case routing:
every choice of every token of every rank on rank 0's experts (the most rows one rank can get).

    python tests/mpi_programs/check_gpu_ring.py --backend virtual --ranks 4
    NVSHMEM_DISABLE_NVLS=1 mpirun -n 4 python tests/mpi_programs/check_gpu_ring.py --backend nvshmem

Rank 0 receives 2048 rows. Per direction policy: a ring of a quarter of them (512 rows) and of one
segment (SEGMENT_ROWS), forward and backward (the backward replaying every turn after the first),
bitwise equal to a ring that holds every row (one turn), which is within TOL of the float64
reference; a CUDA graph of the ring's passes replayed bitwise equal, and one of the backward alone
replayed twice in a row (turn 0 replayed too); the fused passes (once a
turn) bitwise equal too; NaN-poisoned buffers before every run.
"""

import sys

import numpy as np

import gpu_program
from check_gpu_layer import blob, check_against_reference, run_once
from mok_proto.config import MoEShape, RunConfig
from mok_proto.layer.gpu import GpuMoELayer
from mok_proto.plan import PAIR_ROWS, SEGMENT_ROWS, FusedKnobs
from mok_proto.problem import make_problem

RANK0_ROWS = 2048


def worst_case_problem(num_ranks):
    """(shape, problem): K = 2, El = 3, N = 2048 / (2 R) tokens a rank, every choice on rank 0's
    experts: the first on expert 0, the second on expert 1 for every tenth token, else on expert 2.
    Rank 0's segments (1024, ~103 and ~921 rows, padded to SEGMENT_ROWS) put two experts in one
    turn, one of them starting mid-ring and one ending mid-turn, and expert 2 starts an odd number
    of row tiles in: one tile pair holds two experts (the fused kernel's loads without multicast)."""
    k, el = 2, 3
    n = RANK0_ROWS // (k * num_ranks)
    shape = MoEShape("ring", hidden=256, ffn=256, num_experts=el * num_ranks, top_k=k, num_tokens=n)
    prob = make_problem(shape, num_ranks, seed=11)
    t = np.arange(num_ranks * n).reshape(num_ranks, n)
    prob.topk_idx[..., 0] = 0
    prob.topk_idx[..., 1] = np.where(t % 10 == 0, 1, 2).astype(np.int32)
    return shape, prob


def layer_for(heap, shape, prob, ring, name):
    layer = GpuMoELayer(heap, RunConfig(shape, heap.num_ranks, timeout_s=30), name=name, macrobatch_rows=ring)
    for rank in layer.ranks:
        layer.set_weights(rank, prob.local_weights(rank))
        layer.set_inputs(rank, prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank])
        layer.set_dout(rank, prob.dout[rank])
    return layer


def main():
    args = gpu_program.parser({"worst-case": None}, with_policies=True).parse_args()
    policies = gpu_program.policies(args)
    heap, comm = gpu_program.open_heap(args)
    num_ranks = heap.num_ranks
    shape, prob = worst_case_problem(num_ranks)
    try:
        first, turns = None, []
        for i, ring in enumerate((None, RANK0_ROWS // 4, SEGMENT_ROWS)):
            layer = layer_for(heap, shape, prob, ring, f"ring{i}")
            turns.append(layer.num_turns)
            for policy in policies:
                layer.policy = dict(policy)
                got = run_once(layer, heap)
                if first is None:
                    first = blob(got)
                    ref = prob.reference_results(bf16=True)
                    shared = {key: sum(gpu_program.all_ranks(comm, {r: g[key] for r, g in got.items()}).values())
                              for key in got[layer.ranks[0]] if key.startswith("shared_")}
                    check_against_reference(got, ref, num_ranks, shape.num_tokens, 3, shared)
                assert blob(got) == first, f"ring {ring} under {policy}: results differ from one turn's"
            if ring is not None:
                graph = layer.capture()
                for replay in range(args.replays):
                    assert blob(run_once(layer, heap, graph)) == first, f"ring {ring}: graph replay {replay} differs"
                # a graph of the backward alone: its second replay follows a backward, not a forward,
                # so the ring holds the last turn, not turn 0 (the backward replays turn 0 too)
                layer.enqueue_forward()
                backward = layer.capture(forward=False)
                for replay in range(2):
                    assert blob(run_once(layer, heap, backward, poison=False)) == first, f"ring {ring}: backward {replay}"
                for policy in policies:  # the fused passes, once a turn: the same bits
                    layer.policy = dict(policy)
                    layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(0, PAIR_ROWS)))
                    layer.set_backward_plan(layer.fused_backward_plan(FusedKnobs(0, PAIR_ROWS)))
                    assert not layer.fused_bwd.plan.scale and not layer.fused_bwd.plan.token_grads
                    assert blob(run_once(layer, heap)) == first, f"ring {ring}, fused, {policy}: differs from one turn"
                layer.set_forward_plan(None)
                layer.set_backward_plan(None)
            layer.close()
        assert turns[0] == 1 and 1 < turns[1] < turns[2], turns
    finally:
        heap.close()
    if heap.launch_ranks[0] == 0:
        print(f"OK gpu ring worst case backend={args.backend} R={num_ranks}: rings of {RANK0_ROWS // 4} and "
              f"{SEGMENT_ROWS} rows ({turns[1]} and {turns[2]} turns) x {len(policies)} policies, sequential and "
              f"fused, bitwise equal to one turn, {args.replays} graph replays")
    return 0


if __name__ == "__main__":
    sys.exit(main())
