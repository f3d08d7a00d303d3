"""Run under mpiexec -n R: the CPU layer with FP8 routed experts (RunConfig.precision="fp8").

For both dispatch dtypes (bf16 rows; e4m3 codes + fp32 scales), a ring holding every row (three
direction policies) and a ring of one segment (many turns, the backward replaying): every run
gives the bytes of the first (bf16 dispatch, one turn, MoK's policy), which equals
reference_fp8 on every rank's tokens with the receive buffers' row order: bitwise for the routed
results (with an fp8 or no shared expert: for out and x too), within a bf16 rounding step for out
and x with a bf16 shared expert (fp32 GEMMs of R N rows against N), within fp32 rounding for the
shared expert's gradient (the sum of the ranks' partial sums; with a bf16 shared expert, within a
few bf16 steps of its dg and du, whose fp32 GEMMs round otherwise with another BLAS kernel).
With bf16 weight gradients (RunConfig.wgrad_precision) each dispatch dtype's routed weight
gradients are reference_fp8's with that dtype, bitwise, for both rings, and differ from the fp8
ones; every other result is the fp8 runs' bits. Exits non-zero on any failure.
"""

import argparse

import numpy as np

from check_layer import each_case, world
from mok_proto import accuracy, reference_fp8
from mok_proto.config import MOK_POLICY, OPERATORS, RunConfig
from mok_proto.layer.cpu import CpuMoELayer
from mok_proto.problem import make_problem
from mok_proto.schedule import expert_slot_order
from mok_proto.symm.mpi import MpiHeap

ALIGN = 128  # the smallest segment alignment FP8 takes: rings of 128 rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True, action="append", metavar="H,I,E,K,N,num_shared:ROUTING:SHARED",
                   help="a shape, its routing (random | one-expert | skewed) and the shared expert's precision "
                        "(bf16 | fp8); repeat for more cases, run one after the other")
    each_case(p.parse_args().case, check_case)


def check_case(shape_text, routing, shared_precision):
    shape, comm, rank, num_ranks = world(shape_text)
    e, n, h = shape.num_experts, shape.num_tokens, shape.hidden
    num_local = e // num_ranks
    prob = make_problem(shape, num_ranks, seed=5, routing=routing)
    ref = reference_results(prob, shared_precision)
    tokens, experts = slice(rank * n, (rank + 1) * n), slice(rank * num_local, (rank + 1) * num_local)
    policies = [dict(MOK_POLICY), dict.fromkeys(OPERATORS, "push"), dict.fromkeys(OPERATORS, "pull")]

    first, turns = None, []
    for dispatch in ("bf16", "fp8"):
        run = RunConfig(shape, num_ranks=num_ranks, timeout_s=60, precision="fp8",
                        shared_precision=shared_precision, dispatch_dtype=dispatch)
        want_bytes = {"bf16": 2 * h, "fp8": h + 4 * h // 128}[dispatch]
        for ring in (None, ALIGN):
            with MpiHeap(comm) as heap:
                layer = CpuMoELayer(heap, run, prob.local_weights(rank), macrobatch_rows=ring, align=ALIGN)
                row_bytes = layer.tokens.local.nbytes // n
                assert row_bytes == want_bytes, f"{dispatch} dispatch moves {row_bytes} B a row, not {want_bytes}"
                turns.append(comm.allreduce(layer.num_turns, op=max_op()))
                for policy in policies if ring is None else policies[:1]:  # the ring's policies: check_ring.py
                    layer.policy = policy
                    got, blob = step(layer, heap, prob, rank)
                    if first is None:
                        first = blob
                        verdict(comm, against_reference(comm, got, ref, tokens, experts, shared_precision, shape))
                    verdict(comm, [f"rank {rank}: {key} differs with {dispatch} dispatch, ring {ring}, policy {policy}"
                                   for key in first if blob[key] != first[key]])
    assert turns[1] > 1, f"the ring of {ALIGN} rows must take several turns on some rank, got {turns}"
    for dispatch in ("bf16", "fp8"):  # bf16 weight gradients: the routed ones are the reference's with this
        # dispatch dtype (for every ring: runs of whole blocks); every other result the fp8 runs' bits
        run = RunConfig(shape, num_ranks=num_ranks, timeout_s=60, precision="fp8", shared_precision=shared_precision,
                        dispatch_dtype=dispatch, wgrad_precision="bf16")
        want = reference_results(prob, shared_precision, wgrad_precision="bf16", dispatch_dtype=dispatch)
        for ring in (None, ALIGN):
            with MpiHeap(comm) as heap:
                layer = CpuMoELayer(heap, run, prob.local_weights(rank), macrobatch_rows=ring, align=ALIGN)
                got, blob = step(layer, heap, prob, rank)
            same = {key: blob[key] == first[key] for key in first}
            verdict(comm, [f"rank {rank}: {key} with bf16 weight gradients, {dispatch} dispatch, ring {ring}: differs"
                           for key in first if not key.startswith("w_") and not same[key]]
                    + [f"rank {rank}: {key}: the bf16 weight gradients' bits are the fp8 ones'" for key in first
                       if key.startswith("w_") and same[key] and np.any(got[key] != 0)])
            verdict(comm, [f"rank {rank}: {key} with bf16 weight gradients, {dispatch} dispatch, ring {ring}: "
                           f"differs from reference_fp8" for key in ("w_gate", "w_up", "w_down")
                           if not np.array_equal(got[key], want[key][experts], equal_nan=True)])
    if rank == 0:
        print(f"OK R={num_ranks} {shape_text} routing={routing} shared={shared_precision}: bf16 and fp8 "
              f"dispatch x rings (1 turn x {len(policies)} policies, {turns[1]} turns) bitwise equal; matches reference_fp8; "
              f"so do bf16 weight gradients", flush=True)


def max_op():
    from mpi4py import MPI

    return MPI.MAX


def reference_results(prob, shared_precision, **wgrad) -> dict:
    """reference_fp8 over every rank's tokens, each expert's rows in its owner's receive order
    (wgrad: its wgrad_precision, dispatch_dtype)."""
    order = expert_slot_order(prob.topk_idx, prob.weights["w_gate"].shape[0])
    out, cache = reference_fp8.forward(prob.flat("x"), prob.flat("topk_idx"), prob.flat("topk_weights"), prob.weights,
                                       shared_precision=shared_precision, slot_order=order, **wgrad)
    return {"out": out, **reference_fp8.backward(prob.flat("dout"), cache)}


def step(layer, heap, prob, rank):
    """One forward and backward of `rank` after poisoning: ({name: result}, {name: its bytes})."""
    heap.barrier()  # NaN (float) or all-ones bytes (a NaN code, a NaN scale, a bf16 NaN) into every row buffer
    for buf in (layer.tokens, layer.token_slots_out, layer.token_slots_in, layer.expert_in, layer.expert_dy,
                layer.expert_out):
        buf.local.view(np.uint8)[...] = 0xFF
        buf.publish()
    for act in layer.activations.values():
        act[...] = np.nan
    heap.barrier()
    got = {"out": layer.forward(prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank])}
    got.update(layer.backward(prob.dout[rank]))
    return got, {key: got[key].tobytes() for key in got}


def verdict(comm, failures):
    """Every rank raises if any rank failed (no rank is left waiting in a later collective)."""
    failures = sum(comm.allgather(failures), [])
    assert not failures, "; ".join(failures)


def against_reference(comm, got, ref, tokens, experts, shared_precision, shape) -> list:
    """What differs from the reference, one line each (the shared gradients' partial sums
    gathered from every rank first: a collective)."""
    assert set(got) == set(ref), f"keys differ: {sorted(got)} vs {sorted(ref)}"
    shared = {key: sum(comm.allgather(got[key])) for key in sorted(got) if key.startswith("shared_")}
    exact_tokens = shared_precision == "fp8" or shape.num_shared == 0
    failures = []
    for key, value in got.items():
        if value.dtype != np.float32:
            failures.append(f"{key} dtype {value.dtype}")
        if key in shared:  # per-rank partial sums: fp32 adds in another order (and, with a bf16 shared
            err = accuracy.errors(shared[key], ref[key])  # expert, dg, du a bf16 step off where out, x may be)
            bad = err["err_max"] > 1e-5 if exact_tokens else err["err_max"] > 1e-3 or err["err_rel_rms"] > 1e-4
        elif key.startswith("w_") or key == "topk_weights" or exact_tokens:
            want = ref[key][experts] if key.startswith("w_") else ref[key][tokens]
            err = accuracy.errors(value, want)
            bad = not np.array_equal(value, want, equal_nan=True)
        else:  # out, x with a bf16 shared expert: at most a bf16 step where its fp32 GEMM rounded otherwise
            err = accuracy.errors(value, ref[key][tokens])
            bad = err["err_max"] > 1e-2 or err["err_rel_rms"] > 1e-3
        if bad:
            failures.append(f"rank {comm.rank}: {key} differs from reference_fp8 {err}")
    return failures


if __name__ == "__main__":
    main()
