"""Run under mpiexec -n R: the CPU distributed layer against the reference, for every policy.

Each rank checks its own slice (float32 vs a float64 reference: max |err| <= TOL * max |ref| per
array) and that all 16 direction choices, run twice each, give bitwise-identical bytes. Several
cases (--case, repeated) run one after the other in one job, each on a heap of its own, each printing
its OK line. Exits non-zero (assertion, naming the case) on any failure.
"""

import argparse
import itertools
import sys

import numpy as np
from mpi4py import MPI

from mok_proto import reference
from mok_proto.config import DIRECTIONS, OPERATORS, MoEShape, RunConfig
from mok_proto.layer.cpu import CpuMoELayer
from mok_proto.problem import make_problem
from mok_proto.symm.mpi import MpiHeap

TOL = 1e-4  # float32 layer vs float64 reference, relative to the array's largest magnitude


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True, action="append", metavar="H,I,E,K,N,num_shared:ROUTING",
                   help="a shape and its routing (random | one-expert | skewed); repeat for more cases")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default="all", help="all | mok")
    args = p.parse_args()
    each_case(args.case, lambda shape_text, routing: check_case(shape_text, routing, args.seed, args.policies))


def each_case(cases, check):
    """check(*fields) for each case "FIELD:FIELD:...", in order. A failure on any rank prints
    `FAILED CASE <case>` to stderr (conftest.check_case reads it) and ends the job, naming the case."""
    for case in cases:
        try:
            check(*case.split(":"))
        except Exception as e:
            print(f"FAILED CASE {case}", file=sys.stderr, flush=True)
            e.add_note(f"case {case}")
            raise


def check_case(shape_text, routing, seed, which_policies):
    shape, comm, rank, num_ranks = world(shape_text)
    e, n = shape.num_experts, shape.num_tokens
    prob = make_problem(shape, num_ranks, seed=seed, routing=routing)
    ref = reference_of(prob)
    num_local = e // num_ranks
    tokens, experts = slice(rank * n, (rank + 1) * n), slice(rank * num_local, (rank + 1) * num_local)

    policies = [dict(zip(OPERATORS, combo)) for combo in itertools.product(DIRECTIONS, repeat=4)]
    run = RunConfig(shape, num_ranks=num_ranks, timeout_s=60)
    if which_policies == "mok":
        policies = [run.policy]
    first = None
    with MpiHeap(comm) as heap:
        layer = CpuMoELayer(heap, run, prob.local_weights(rank))
        for policy in policies:
            layer.policy = policy  # same buffers, new directions: the epochs keep growing
            for repeat in range(2):
                got, blob = step(layer, heap, prob, rank)
                if first is None:
                    first = blob
                    check_against_reference(comm, got, ref, tokens, experts)
                for key in first:
                    assert blob[key] == first[key], f"rank {rank}: {key} differs under {policy} (repeat {repeat})"
    if rank == 0:
        print(f"OK R={num_ranks} {shape_text} routing={routing}: {len(policies)} policies x 2 runs bitwise equal",
              flush=True)


def world(shape_text):
    """--shape H,I,E,K,N,num_shared -> (MoEShape, MPI.COMM_WORLD, this rank, R)."""
    h, i, e, k, n, ns = (int(v) for v in shape_text.split(","))
    comm = MPI.COMM_WORLD
    shape = MoEShape("test", hidden=h, ffn=i, num_experts=e, top_k=k, num_tokens=n, num_shared=ns)
    return shape, comm, comm.rank, comm.size


def reference_of(prob) -> dict:
    """The float64 reference over every rank's tokens: out and every gradient."""
    ref_out, cache = reference.forward(prob.flat("x"), prob.flat("topk_idx"), prob.flat("topk_weights"),
                                       prob.weights, dtype="float64")
    ref = reference.backward(prob.flat("dout").astype(np.float64), cache)
    ref["out"] = ref_out
    return ref


def step(layer, heap, prob, rank):
    """One forward and backward of `rank` after poisoning: ({name: result}, {name: its bytes})."""
    poison(layer, heap)
    got = {"out": layer.forward(prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank])}
    got.update(layer.backward(prob.dout[rank]))
    return got, {key: got[key].tobytes() for key in got}


def poison(layer, heap):
    """NaN into every row buffer between rounds (all ranks idle: barriers on both sides), so a row
    read before it landed reads NaN, not the previous round's identical bytes."""
    heap.barrier()
    for buf in (layer.tokens, layer.token_slots_out, layer.token_slots_in, layer.expert_in, layer.expert_dy,
                layer.expert_out):
        buf.local[...] = np.nan
        buf.publish()
    for act in layer.activations.values():
        act[...] = np.nan
    heap.barrier()


def check_against_reference(comm, got, ref, tokens, experts):
    assert set(got) == set(ref), f"keys differ: {sorted(got)} vs {sorted(ref)}"
    for key, value in got.items():
        assert value.dtype == np.float32, f"{key} dtype {value.dtype}"
        if key.startswith("shared_"):  # per-rank partial sums; the full gradient is their sum
            value, want = sum(comm.allgather(value)), ref[key]
        elif key.startswith("w_"):
            want = ref[key][experts]
        else:
            want = ref[key][tokens]
        assert value.shape == want.shape, f"{key}: shape {value.shape} vs {want.shape}"
        scale = max(float(np.abs(want).max()), 1e-12) if want.size else 1.0
        err = float(np.abs(value - want).max()) / scale if want.size else 0.0
        assert err <= TOL, f"rank {comm.rank}: {key} relative error {err:.2e} > {TOL}"


if __name__ == "__main__":
    main()
