"""Run under mpiexec -n R: the CPU layer through a small ring (many turns, the backward replaying
the forward) against the same layer whose ring holds every row, bitwise, for the given policies;
and against the float64 reference. Exits non-zero (assertion) on any failure.

Routing `worst-case`: every choice of every token of every rank goes to rank 0's experts, the
most rows any routing can send one rank (needs El = E/R >= K)."""

import argparse
import itertools

import numpy as np

from check_layer import check_against_reference, each_case, reference_of, step, world
from mok_proto.config import DIRECTIONS, MOK_POLICY, OPERATORS, RunConfig
from mok_proto.layer.cpu import CpuMoELayer
from mok_proto.problem import make_problem
from mok_proto.symm.mpi import MpiHeap


def worst_case(prob, num_local):
    """Every token's K choices on rank 0's first K experts, in a per-token rotated order."""
    r, n, k = prob.topk_idx.shape
    assert num_local >= k, f"worst-case routing needs El={num_local} >= K={k}"
    t = np.arange(r * n).reshape(r, n, 1)
    prob.topk_idx[...] = ((t + np.arange(k)) % num_local).astype(np.int32)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True, action="append", metavar="H,I,E,K,N,num_shared:ROUTING:POLICIES",
                   help="a shape, its routing (worst-case | random | skewed) and the policies (all: 16 | some: "
                        "MoK's, all push, all pull); repeat for more cases, run one after the other")
    p.add_argument("--align", type=int, default=4, help="segment rows (the ring is a multiple of it)")
    args = p.parse_args()
    each_case(args.case, lambda shape_text, routing, which_policies: check_case(shape_text, routing, which_policies,
                                                                                args.align))


def check_case(shape_text, routing, which_policies, align):
    shape, comm, rank, num_ranks = world(shape_text)
    e, n = shape.num_experts, shape.num_tokens
    num_local = e // num_ranks
    prob = make_problem(shape, num_ranks, seed=3, routing="random" if routing == "worst-case" else routing)
    if routing == "worst-case":
        worst_case(prob, num_local)
    # Rank 0's rows (the most of any rank here): rings of about a quarter of them, and of one segment.
    counts = np.bincount(prob.topk_idx.reshape(-1), minlength=e)[:num_local]
    need = int((-(-counts // align) * align).sum())
    quarter = max(align, need // 4 // align * align)
    rings = [None, quarter, align]

    if which_policies == "all":
        policies = [dict(zip(OPERATORS, combo)) for combo in itertools.product(DIRECTIONS, repeat=4)]
    else:
        policies = [dict(MOK_POLICY), dict.fromkeys(OPERATORS, "push"), dict.fromkeys(OPERATORS, "pull")]
    run = RunConfig(shape, num_ranks=num_ranks, timeout_s=60)
    first, turns = None, []
    for ring in rings:
        with MpiHeap(comm) as heap:
            layer = CpuMoELayer(heap, run, prob.local_weights(rank), macrobatch_rows=ring, align=align)
            turns.append(layer.num_turns)
            for policy in policies:
                layer.policy = policy
                got, blob = step(layer, heap, prob, rank)
                if first is None:
                    first = blob
                    check_against_reference(comm, got, reference_of(prob), slice(rank * n, (rank + 1) * n),
                                            slice(rank * num_local, (rank + 1) * num_local))
                for key in first:
                    assert blob[key] == first[key], f"rank {rank}: {key} differs with ring {ring} under {policy}"
                replayed = comm.allreduce(layer.replayed_rows)
                assert (replayed > 0) == (layer.num_turns > 1 and ring != rings[0]), \
                    f"ring {ring}: {replayed} rows replayed in {layer.num_turns} turns"
    assert turns[0] == 1 and 1 < turns[1] <= turns[2], turns
    if rank == 0:
        print(f"OK R={num_ranks} {shape_text} routing={routing}: rings {rings[1:]} ({turns[1:]} turns) x "
              f"{len(policies)} policies bitwise equal to one turn", flush=True)


if __name__ == "__main__":
    main()
