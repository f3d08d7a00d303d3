"""The main job: one MoE layer forward + backward on R ranks, checked against the reference.

    mpirun -n 4 python -m mok_proto.demo [--shape small] [--policy dispatch=push] [--seed 0] [--backend auto]

Every rank builds every rank's inputs from one seed, runs its part of the distributed layer,
and compares its slice with the single-process reference over all ranks' data. Rank 0 prints
one row per rank: shape, policy, time, max relative error, and SHA-256 of the output and of
all gradients (equal checksums = bitwise-equal results across runs and policies).
Exit codes: 0 ok, 1 mismatch against the reference or a protocol error (a peer timed out, a
buffer would overflow: one line per rank says which), 2 bad argument.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import numpy as np

from mok_proto import reference
from mok_proto.config import PRESETS, RunConfig, format_policy, get_shape, parse_policy
from mok_proto.problem import make_problem
from mok_proto.symm.base import CapacityError, SymmTimeoutError

BACKENDS = ("auto", "cpu", "gpu")
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}  # max |got - ref| / max |ref|, per array


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def parse_args(argv):
    p = _ArgumentParser(prog="python -m mok_proto.demo", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="small", help=f"preset: {', '.join(PRESETS)} (default small)")
    p.add_argument("--policy", default="", help="operator=push|pull list, e.g. dispatch=push,combine=pull "
                   "(operators: dispatch, combine, rev_combine, rev_dispatch; default MoK's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto", help="auto (GPU if present, else CPU), cpu or gpu")
    p.add_argument("--routing", default="random", help="random, skewed or one-expert")
    p.add_argument("--dtype", default="float32", help="float32 or float64")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds any rank waits for a peer")
    args = p.parse_args(argv)
    if args.backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}")
    if args.routing not in ("random", "skewed", "one-expert"):
        raise ValueError(f"--routing must be random, skewed or one-expert, got {args.routing!r}")
    return args


def resolve_backend(name: str) -> str:
    if name == "cpu":
        return "cpu"
    # The GPU backend (mok_proto.kernels) joins here when it exists; until then auto means cpu.
    if name == "gpu":
        raise ValueError("--backend gpu: the GPU layer is not built yet; use --backend cpu")
    return "cpu"


def checksum(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def rel_error(got, ref) -> float:
    """max |got - ref| / max |ref|; inf if anything is not finite (NaN never compares as small)."""
    if not ref.size:
        return 0.0
    err = float(np.abs(got.astype(np.float64) - ref).max()) / max(float(np.abs(ref).max()), 1e-30)
    return err if np.isfinite(err) else float("inf")


def run_rank(comm, args):
    """This rank's part: returns one result row (dict)."""
    from mok_proto.layer.cpu import CpuMoELayer
    from mok_proto.symm.mpi import MpiHeap

    rank, num_ranks = comm.rank, comm.size
    shape = get_shape(args.shape)
    run = RunConfig(shape, num_ranks=num_ranks, policy=parse_policy(args.policy), seed=args.seed,
                    dtype=args.dtype, timeout_s=args.timeout)
    prob = make_problem(shape, num_ranks, seed=args.seed, routing=args.routing, dtype=args.dtype)

    with MpiHeap(comm) as heap:
        layer = CpuMoELayer(heap, run, prob.local_weights(rank))
        heap.barrier()
        t0 = time.perf_counter()
        out = layer.forward(prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank])
        t1 = time.perf_counter()
        grads = layer.backward(prob.dout[rank])
        t2 = time.perf_counter()

    # Reference over all ranks' tokens (float64), then this rank's slice.
    ref_out, cache = reference.forward(prob.flat("x"), prob.flat("topk_idx"), prob.flat("topk_weights"),
                                       prob.weights, dtype="float64")
    ref_grads = reference.backward(prob.flat("dout").astype(np.float64), cache)
    n, num_local = shape.num_tokens, run.num_local_experts
    tokens, experts = slice(rank * n, (rank + 1) * n), slice(rank * num_local, (rank + 1) * num_local)
    errors = {"out": rel_error(out, ref_out[tokens])}
    for key, g in grads.items():
        if key in ("x", "topk_weights"):
            errors[key] = rel_error(g, ref_grads[key][tokens])
        elif key.startswith("w_"):
            errors[key] = rel_error(g, ref_grads[key][experts])
    # Shared-expert grads are per-rank partial sums: check their sum over ranks, in rank order.
    for key in sorted(k for k in grads if k.startswith("shared_")):
        total = sum(comm.allgather(grads[key]))
        errors[key] = rel_error(total, ref_grads[key])
    return dict(rank=rank, shape=shape.name, policy=format_policy(run.policy), fwd_ms=(t1 - t0) * 1e3,
                bwd_ms=(t2 - t1) * 1e3, max_err=max(errors.values()), worst=max(errors, key=errors.get),
                out_sha=checksum([out]), grad_sha=checksum([grads[k] for k in sorted(grads)]))


def _launcher_rank() -> int:
    """This process's rank as the MPI launcher announced it (no MPI init needed)."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def main(argv=None) -> int:
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        get_shape(args.shape)
        parse_policy(args.policy)
        backend = resolve_backend(args.backend)
    except ValueError as e:
        if _launcher_rank() == 0:  # one line per job, not one per rank
            print(f"mok_proto.demo: error: {e}", file=sys.stderr)
        return 2
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    try:
        row = run_rank(comm, args)
    except ValueError as e:  # a config that does not fit this many ranks, say
        if comm.rank == 0:
            print(f"mok_proto.demo: error: {e}", file=sys.stderr)
        return 2
    except (SymmTimeoutError, CapacityError) as e:  # the protocol failed: say where, every rank
        print(f"mok_proto.demo: rank {comm.rank}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    rows = comm.gather(row, root=0)
    tol = TOLERANCE[args.dtype]
    ok = comm.allreduce(row["max_err"] <= tol, op=MPI.LAND)
    if comm.rank == 0:
        print(f"# {get_shape(args.shape).describe()} R={comm.size} backend={backend} dtype={args.dtype} "
              f"routing={args.routing} seed={args.seed}")
        print(f"# policy {rows[0]['policy']}")
        print(f"{'rank':>4} {'fwd_ms':>8} {'bwd_ms':>8} {'max_rel_err':>11} {'(array)':>14}  "
              f"{'sha256(out)':<16}  {'sha256(grads)':<16}")
        for r in rows:
            print(f"{r['rank']:>4} {r['fwd_ms']:>8.2f} {r['bwd_ms']:>8.2f} {r['max_err']:>11.2e} "
                  f"{'(' + r['worst'] + ')':>14}  {r['out_sha'][:16]}  {r['grad_sha'][:16]}")
        print("PASS: every rank matches the reference" if ok else
              f"FAIL: a rank differs from the reference by more than {tol:g} (relative)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
