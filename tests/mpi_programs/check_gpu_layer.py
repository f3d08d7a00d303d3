"""The GPU layer (bf16, stage by stage) against the float64 reference, for every policy.

    python tests/mpi_programs/check_gpu_layer.py --backend virtual --ranks 4
    NVSHMEM_DISABLE_NVLS=1 mpirun -n 4 python tests/mpi_programs/check_gpu_layer.py --backend nvshmem

Per case, for every rank this process drives: out and every gradient within TOL of the float64
reference run on the same bf16-rounded inputs (max |err| <= TOL * max |ref| per array); all 16
direction policies bitwise equal; `--replays` replays of one CUDA graph of forward + backward
bitwise equal; NaN-poisoned buffers before every run (a missing wait cannot pass). Prints one
`SHA <case> <digest>` line per case (rank 0) over every rank's results in rank order, so two
backends can be compared. Then: an overflow on rank 0 raises CapacityError naming it on every rank
(under NVSHMEM the other ranks find it in their weighted sum: gpu_program.check_overflow).
"""

import hashlib
import sys

import numpy as np

import gpu_program
from mok_proto.config import MoEShape, RunConfig
from mok_proto.layer.gpu import GpuMoELayer
from mok_proto.problem import make_problem

TOL = 2e-2  # bf16 intermediates (h, y, dy, dg, du rows) vs a float64 reference on the same inputs

CASES = {  # name: (H, I, E, K, N, shared, routing)
    "random": (256, 256, 16, 4, 24, 1, "random"),
    "one-expert": (256, 256, 16, 4, 24, 1, "one-expert"),
    "one-token": (256, 256, 8, 2, 1, 1, "random"),
    "no-shared": (512, 256, 8, 2, 40, 0, "skewed"),
}


def results(layer, rank) -> dict:
    got = {"out": layer.output(rank).get()}
    got.update({key: value.get() for key, value in layer.grads(rank).items()})
    return got


def check_against_reference(got_by_rank, ref, num_ranks, n, num_local, shared_sum):
    for rank, got in got_by_rank.items():
        tokens, experts = slice(rank * n, (rank + 1) * n), slice(rank * num_local, (rank + 1) * num_local)
        assert set(got) == set(ref), f"keys differ: {sorted(got)} vs {sorted(ref)}"
        for key, value in got.items():
            if key.startswith("shared_"):  # per-rank partial sums; the full gradient is their sum
                value, want = shared_sum[key], ref[key]
            elif key.startswith("w_"):
                want = ref[key][experts]
            else:
                want = ref[key][tokens]
            assert value.shape == want.shape, f"{key}: shape {value.shape} vs {want.shape}"
            assert np.isfinite(value).all(), f"rank {rank}: {key} holds NaN/inf (an unwritten or unread row)"
            scale = max(float(np.abs(want).max()), 1e-12)
            err = float(np.abs(value - want).max()) / scale
            assert err <= TOL, f"rank {rank}: {key} relative error {err:.2e} > {TOL}"


def run_once(layer, heap, graph=None, poison=True):
    """One forward + backward (or one replay of `graph`) after NaN-poisoning the layer's buffers
    (poison=False: a graph of the backward alone reads the forward's saved state); the results."""
    import cupy

    heap.barrier()
    if poison:
        layer.poison()
    cupy.cuda.Device().synchronize()
    heap.barrier()
    if graph is None:
        layer.enqueue_forward()
        layer.enqueue_backward()
    else:
        stream = cupy.cuda.Stream(non_blocking=True)
        graph.launch(stream)
        stream.synchronize()
    layer.check()
    heap.barrier()
    return {rank: results(layer, rank) for rank in layer.ranks}


def blob(got_by_rank) -> dict:
    return {rank: b"".join(got[key].tobytes() for key in sorted(got)) for rank, got in got_by_rank.items()}


def check_case(heap, comm, name, case_id, replays, policies):
    h, i, e, k, n, shared, routing = CASES[name]
    num_ranks = heap.num_ranks
    shape = MoEShape(name, hidden=h, ffn=i, num_experts=e, top_k=k, num_tokens=n, num_shared=shared)
    prob = make_problem(shape, num_ranks, seed=7 + case_id, routing=routing)
    ref = prob.reference_results(bf16=True)
    layer = GpuMoELayer(heap, RunConfig(shape, num_ranks, timeout_s=20), name=f"l{case_id}")
    for rank in layer.ranks:
        layer.set_weights(rank, prob.local_weights(rank))
        layer.set_inputs(rank, prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank])
        layer.set_dout(rank, prob.dout[rank])
    first = None
    for policy in policies:
        layer.policy = dict(policy)
        got = run_once(layer, heap)
        if first is None:
            first = blob(got)
            shared_sum = {key: sum(gpu_program.all_ranks(comm, {r: g[key] for r, g in got.items()}).values())
                          for key in got[layer.ranks[0]] if key.startswith("shared_")}
            check_against_reference(got, ref, num_ranks, n, e // num_ranks, shared_sum)
        assert blob(got) == first, f"{name}: results under {policy} differ from the first policy's"
    graph = layer.capture()
    for replay in range(replays):
        assert blob(run_once(layer, heap, graph)) == first, f"{name}: graph replay {replay} differs"
    everyone = gpu_program.all_ranks(comm, first)
    digest = hashlib.sha256(b"".join(v for _, v in sorted(everyone.items()))).hexdigest()[:16]
    layer.close()
    return f"SHA {name} {digest}"


def main():
    args = gpu_program.parser(CASES, with_policies=True).parse_args()
    policies = gpu_program.policies(args)
    heap, comm = gpu_program.open_heap(args)
    try:
        lines = [check_case(heap, comm, name, i, args.replays, policies) for i, name in enumerate(args.cases.split(","))]
        gpu_program.check_overflow(heap)
    finally:
        heap.close()
    if heap.launch_ranks[0] == 0:
        print(f"OK gpu layer backend={args.backend} R={heap.num_ranks}: {len(policies)} policies bitwise equal, "
              f"{args.replays} graph replays")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
