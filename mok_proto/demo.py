"""The main job: one MoE layer forward + backward on R ranks, checked against the reference.

    mpirun -n 4 python -m mok_proto.demo [--shape small] [--policy dispatch=push] [--seed 0] [--backend auto]
    python -m mok_proto.demo --backend gpu --virtual 4     # 4 ranks in one process, on one GPU

Every rank builds every rank's inputs from one seed, runs its part of the distributed layer,
and compares its slice with the single-process reference over all ranks' data. Rank 0 prints
one row per rank: shape, policy, time, max relative error, and SHA-256 of the output and of
all gradients (equal checksums = bitwise-equal results across runs and policies).
Before MPI starts, the run is checked (options, ranks, memory per rank) and refused in one line.
No rank waits longer than --timeout for a peer: a stopped or dead peer ends the job, with one line
naming it (mok_proto.symm.watchdog). Exit codes (mok_proto.exitcodes): 0 pass, 1 mismatch
against the reference, 2 bad argument or a run that cannot fit, 3 protocol error (a buffer would
overflow, an unexpected error on a rank), 4 a stopped, dead or missing peer.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import traceback

import numpy as np

from mok_proto import accuracy
from mok_proto.config import PRECISIONS, PRESETS, RunConfig, format_policy, get_shape, parse_policy
from mok_proto.exitcodes import EXIT_BAD_ARGUMENT, EXIT_MISMATCH, EXIT_PASS, EXIT_PEER, EXIT_PROTOCOL
from mok_proto.problem import make_problem
from mok_proto.symm.base import CapacityError, SymmTimeoutError

BACKENDS = ("auto", "cpu", "gpu")
# max |got - ref| / max |ref|, per array. bf16: the GPU layer (bf16 rows, fp32 accumulation)
# against the float64 reference on the same bf16-rounded inputs.
# fp8 (--precision fp8): err_rel_rms per array, against the float64 reference on the bf16 inputs
# (mok_proto.accuracy: what the block-scaled e4m3 recipe meets on every array).
TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "bf16": 2e-2, "fp8": accuracy.ERR_REL_RMS_RECIPE}
DEFAULT_SHAPE = {"cpu": "small", "gpu": "tile"}
FP8_SHAPE = "tile"  # the smallest preset whose H and I are multiples of 128 (fp8.BLOCK)
# The longest --timeout: every wait counts it (and multiples of it) in int64 nanoseconds.
MAX_TIMEOUT_S = 1e6


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)

    def print_help(self, file=None):
        if _launcher_rank() == 0:  # -h under mpiexec: one help text, not one per rank
            super().print_help(file)


def parse_args(argv):
    p = _ArgumentParser(prog="python -m mok_proto.demo", description=__doc__.split("\n")[0])
    p.add_argument("--shape", default=None, help=f"preset: {', '.join(PRESETS)} (default: small on the CPU, "
                   "tile on the GPU, whose GEMM tiles need H and I multiples of 256)")
    p.add_argument("--policy", default="", help="operator=push|pull list, e.g. dispatch=push,combine=pull "
                   "(operators: dispatch, combine, rev_combine, rev_dispatch; default MoK's choice)")
    p.add_argument("--seed", type=int, default=0, help="seed of every rank's inputs, an integer >= 0 (default 0)")
    p.add_argument("--backend", default="auto", help="auto, cpu or gpu. auto: the GPU when CuPy sees one (and, "
                   "under mpiexec, nvshmem4py is installed), else the CPU")
    p.add_argument("--virtual", type=int, default=0, help="GPU only: run this many ranks in ONE process "
                   "(virtual ranks on one GPU; start without mpiexec). 0: one rank per process (NVSHMEM)")
    p.add_argument("--routing", default="random", help="random, skewed or one-expert")
    p.add_argument("--dtype", default="float32", help="float32 or float64")
    p.add_argument("--precision", default="bf16", help="the routed experts: bf16 (the --dtype on the CPU) or fp8 "
                   "(block-scaled e4m3, docs/design.md 5.6-5.7; errors as err_rel_rms; default shape tile)")
    p.add_argument("--dispatch-dtype", default="bf16", help="with --precision fp8: what the dispatch moves, bf16 "
                   "rows (quantized where they land) or fp8 (e4m3 codes + scales, quantized by the token owner)")
    p.add_argument("--wgrad-precision", default=None, help="with --precision fp8: the routed weight gradients' "
                   "precision, fp8 (default) or bf16 (from the bf16 rows the layer holds, docs/design.md 5.7)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds any rank waits for a peer; a stopped or "
                   f"dead peer ends the job (exit 4) about this long after it stopped (default 30, at most "
                   f"{MAX_TIMEOUT_S:g})")
    args = p.parse_args(argv)
    if args.backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}")
    if args.routing not in ("random", "skewed", "one-expert"):
        raise ValueError(f"--routing must be random, skewed or one-expert, got {args.routing!r}")
    if args.precision not in PRECISIONS or args.dispatch_dtype not in PRECISIONS:
        raise ValueError(f"--precision and --dispatch-dtype must be one of {', '.join(PRECISIONS)}, got "
                         f"{args.precision!r}, {args.dispatch_dtype!r}")
    if args.wgrad_precision is not None and args.precision != "fp8":
        raise ValueError("--wgrad-precision needs --precision fp8")
    if args.seed < 0:
        raise ValueError(f"--seed must be an integer >= 0, got {args.seed}")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # NaN fails too
        raise ValueError(f"--timeout must be a number of seconds > 0 and <= {MAX_TIMEOUT_S:g}, got {args.timeout:g}")
    operators = [item.partition("=")[0].strip() for item in args.policy.split(",") if item.strip()]
    twice = sorted({op for op in operators if operators.count(op) > 1})
    if twice:
        raise ValueError(f"--policy names {', '.join(twice)} more than once: {args.policy!r}")
    return args


def gpu_unavailable(virtual: int) -> str | None:
    """None if the GPU backend can run here, else why not (one line)."""
    from mok_proto.symm.gpu import require_cupy

    try:
        require_cupy(who="the GPU backend")
    except (RuntimeError, ValueError) as e:
        return str(e)
    if virtual == 0 and _launcher_size() > 1:
        try:
            import nvshmem.core  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return f"the GPU backend under mpiexec needs nvshmem4py ({type(e).__name__}); or use --virtual R"
    return None


def resolve_backend(name: str, virtual: int) -> str:
    if name == "cpu":
        if virtual:
            raise ValueError("--virtual runs GPU ranks; it needs --backend gpu or auto on a GPU machine")
        return "cpu"
    why = gpu_unavailable(virtual)
    if name == "gpu" and why:
        raise ValueError(f"--backend gpu: {why}")
    if why and virtual:
        raise ValueError(f"--virtual: {why}")
    return "cpu" if why else "gpu"


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


def estimate_bytes(run: RunConfig) -> int:
    """Peak memory one rank of the CPU demo needs: every rank builds every rank's inputs and the
    global weights, runs its part of the layer, then the float64 reference over all R*N tokens."""
    shape, num_ranks = run.shape, run.num_ranks
    n, h, i, e, k = shape.num_tokens, shape.hidden, shape.ffn, shape.num_experts, shape.top_k
    dt = np.dtype(run.dtype).itemsize
    weights = 3 * e * h * i + shape.num_shared * 3 * h * shape.shared_ffn_size  # elements
    rows = num_ranks * n * k  # (token, choice) rows of all ranks: the worst-case receive rows too
    problem = dt * (weights + 2 * num_ranks * n * h)  # weights, x, dout
    layer = dt * (n * h + 2 * n * k * h + 2 * rows * h + rows * (h + 3 * i) + 3 * (e // num_ranks) * h * i)
    ref = 8 * (2 * weights + rows * (4 * h + 3 * i) + num_ranks * n * (2 * h + 3 * shape.shared_ffn_size))
    return problem + layer + ref


def memory_limit_bytes(ranks_here: int) -> tuple[int, str]:
    """(bytes one rank may use, how that was found): available memory over the ranks on this host."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return avail // max(ranks_here, 1), f"{avail / 2**30:.1f} GiB available / {ranks_here} ranks on this host"


def check_fits(run: RunConfig, backend: str, ranks_here: int) -> None:
    """ValueError (one line) if the run cannot fit in memory; checked before anything is allocated."""
    need = estimate_bytes(run)
    limit, how = memory_limit_bytes(ranks_here)
    if need > limit:
        small = ", ".join(name for name, shape in PRESETS.items() if shape.num_experts % run.num_ranks == 0
                          and estimate_bytes(RunConfig(shape, num_ranks=run.num_ranks, dtype=run.dtype)) <= limit)
        raise ValueError(f"--shape {run.shape.name} on the {backend} backend needs about {need / 2**30:.1f} GiB "
                         f"per rank, more than the {limit / 2**30:.1f} GiB limit ({how}); "
                         f"shapes that fit: {small or 'none'}")


def run_rank(comm, args, run: RunConfig, heap_timeout_s: float):
    """This rank's part: returns its result row (a list of one dict)."""
    from mok_proto.layer.cpu import CpuMoELayer
    from mok_proto.symm import watchdog
    from mok_proto.symm.mpi import MpiHeap

    rank, num_ranks, shape = comm.rank, comm.size, run.shape
    prob = make_problem(shape, num_ranks, seed=args.seed, routing=args.routing, dtype=args.dtype)

    _step(args, "setup")
    with MpiHeap(comm, timeout_s=heap_timeout_s) as heap:
        layer = CpuMoELayer(heap, run, prob.local_weights(rank))
        heap.barrier()
        _step(args, "forward")
        t0 = time.perf_counter()
        out = layer.forward(prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank])
        t1 = time.perf_counter()
        _step(args, "backward")
        grads = layer.backward(prob.dout[rank])
        t2 = time.perf_counter()
        _step(args, "cleanup")

    # over all ranks' tokens (float64); each row checks its slice. fp8: on the bf16 inputs it stores
    ref = prob.reference_results(bf16=run.precision == "fp8")
    shared = {}
    for key in sorted(k for k in grads if k.startswith("shared_")):  # per-rank partial sums
        watchdog.arrival_barrier(comm, f"gather of {key}", heap_timeout_s)
        with watchdog.guard(f"gather of {key}"):
            shared[key] = sum(comm.allgather(grads[key]))
    return [result_row(run, rank, out, grads, shared, ref, (t1 - t0) * 1e3, (t2 - t1) * 1e3)]


def result_row(run, rank, out, grads, shared, ref, fwd_ms, bwd_ms) -> dict:
    """One rank's row: its errors against its slice of the reference (the shared expert's
    gradients: their sum over ranks, in rank order), timings, checksums."""
    n, num_local = run.shape.num_tokens, run.num_local_experts
    tokens, experts = slice(rank * n, (rank + 1) * n), slice(rank * num_local, (rank + 1) * num_local)
    error = rel_error if run.precision != "fp8" else lambda g, r: accuracy.errors(g, r)["err_rel_rms"]
    errors = {"out": error(out, ref["out"][tokens])}
    for key, g in grads.items():
        if key in ("x", "topk_weights"):
            errors[key] = error(g, ref[key][tokens])
        elif key.startswith("w_"):
            errors[key] = error(g, ref[key][experts])
    errors.update({key: error(total, ref[key]) for key, total in shared.items()})
    return dict(rank=rank, shape=run.shape.name, policy=format_policy(run.policy), fwd_ms=fwd_ms, bwd_ms=bwd_ms,
                max_err=max(errors.values()), worst=max(errors, key=errors.get),
                out_sha=checksum([out]), grad_sha=checksum([grads[k] for k in sorted(grads)]))


def run_ranks_gpu(comm, args, run: RunConfig, heap_timeout_s: float):
    """The GPU layer for the ranks this process drives (all of them with --virtual, else its own
    with NVSHMEM): one warm-up forward + backward (compiles the kernels), one timed. Returns rows."""
    import cupy

    from mok_proto.layer.gpu import GpuMoELayer
    from mok_proto.symm import watchdog

    shape, num_ranks = run.shape, run.num_ranks
    prob = make_problem(shape, num_ranks, seed=args.seed, routing=args.routing)
    _step(args, "setup")
    if args.virtual:
        from mok_proto.symm.virtual import VirtualWorld
        heap = VirtualWorld(num_ranks)
    else:
        from mok_proto.symm.nvshmem import NvshmemHeap
        heap = NvshmemHeap(comm, timeout_s=heap_timeout_s)
    try:
        layer = GpuMoELayer(heap, run)
        for r in layer.ranks:
            layer.set_weights(r, prob.local_weights(r))
            layer.set_inputs(r, prob.x[r], prob.topk_idx[r], prob.topk_weights[r])
            layer.set_dout(r, prob.dout[r])
        for timed in (False, True):
            heap.barrier()
            _step(args, "forward")
            t0 = time.perf_counter()
            layer.enqueue_forward()
            layer.check()
            t1 = time.perf_counter()
            _step(args, "backward")
            layer.enqueue_backward()
            layer.check()
            t2 = time.perf_counter()
        results = {r: (layer.output(r).get(), {k: v.get() for k, v in layer.grads(r).items()}) for r in layer.ranks}
        _step(args, "cleanup")
        layer.close()
    finally:
        heap.close()
    cupy.cuda.Device().synchronize()
    ref = prob.reference_results(bf16=True)  # on the bf16-rounded inputs the GPU computes with
    shared = {}
    for key in sorted(k for k in next(iter(results.values()))[1] if k.startswith("shared_")):
        mine = [results[r][1][key] for r in sorted(results)]
        if args.virtual:
            shared[key] = sum(mine)
            continue
        watchdog.arrival_barrier(comm, f"gather of {key}", heap_timeout_s)
        with watchdog.guard(f"gather of {key}"):
            shared[key] = sum(comm.allgather(mine[0]))
    return [result_row(run, r, out, grads, shared, ref, (t1 - t0) * 1e3, (t2 - t1) * 1e3)
            for r, (out, grads) in sorted(results.items())]


def _step(args, name):
    """Hook between the steps of a run (tests stop a rank here: tests/mpi_programs/stop_rank.py)."""
    if args.on_step is not None:
        args.on_step(name)


def _launcher_env(names, default: int) -> int:
    for var in names:
        if var in os.environ:
            return int(os.environ[var])
    return default


def _launcher_rank() -> int:
    """This process's rank as the MPI launcher announced it (no MPI init needed)."""
    return _launcher_env(("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"), 0)


def _launcher_size() -> int:
    return _launcher_env(("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"), 1)


def _ranks_here() -> int:
    return _launcher_env(("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"), _launcher_size())


def _fail(comm, code: int, line: str):
    """Report one line from this rank and end the whole job now (no collective cleanup)."""
    from mok_proto.symm import watchdog

    watchdog.abort(comm, f"mok_proto.demo: rank {comm.rank}: {line}", code)


def main(argv=None, on_step=None) -> int:
    """on_step(name) runs at "setup", "forward", "backward", "cleanup", "finish" (before MPI_Finalize):
    a hook for fault tests."""
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        if args.virtual < 0 or (args.virtual and _launcher_size() > 1):
            raise ValueError("--virtual R runs R ranks in one process: a positive count, started without mpiexec")
        backend = resolve_backend(args.backend, args.virtual)
        fp8 = args.precision == "fp8"
        shape = get_shape((FP8_SHAPE if fp8 else DEFAULT_SHAPE[backend]) if args.shape is None else args.shape)
        if backend == "gpu":
            from mok_proto.layer.gpu import check_tiles

            check_tiles(shape)
            if args.dtype != "float32":
                raise ValueError("--dtype: the GPU layer computes in bf16 with fp32 accumulation; --dtype is the "
                                 "CPU backend's")
        run = RunConfig(shape, num_ranks=args.virtual or _launcher_size(), policy=parse_policy(args.policy),
                        seed=args.seed, dtype=args.dtype, timeout_s=args.timeout, precision=args.precision,
                        dispatch_dtype=args.dispatch_dtype, wgrad_precision=args.wgrad_precision)
        check_fits(run, backend, _ranks_here())
    except ValueError as e:
        if _launcher_rank() == 0:  # one line per job, not one per rank
            print(f"mok_proto.demo: error: {e}", file=sys.stderr)
        return EXIT_BAD_ARGUMENT
    args.on_step = on_step
    from mok_proto.symm import watchdog

    # NOTE: MPI_Init and MPI_Finalize block until every rank arrives and hold the GIL (no thread
    # runs): a helper process forked now bounds them.
    last_resort = watchdog.LastResort(_launcher_rank())
    last_resort.arm("MPI startup", args.timeout)
    from mpi4py import MPI

    last_resort.disarm()
    comm = MPI.COMM_WORLD
    dog = watchdog.start(comm, args.timeout)
    # Collectives wait one timeout longer than a peer's flags: a rank that gave up on a flag
    # reports it (and ends the job) before a collective on another rank would.
    heap_timeout = 2 * args.timeout
    dtype = "fp8" if run.precision == "fp8" else "bf16" if backend == "gpu" else args.dtype
    try:
        mine = (run_ranks_gpu if backend == "gpu" else run_rank)(comm, args, run, heap_timeout)
        watchdog.arrival_barrier(comm, "gather of results", heap_timeout)
        with dog.guard("gather of results"):
            rows = comm.gather(mine, root=0)
            ok = comm.allreduce(all(row["max_err"] <= TOLERANCE[dtype] for row in mine), op=MPI.LAND)
        code = EXIT_PASS if ok else EXIT_MISMATCH
        if comm.rank == 0:
            print_rows(args, backend, dtype, run, [row for part in rows for row in part], ok)
        watchdog.arrival_barrier(comm, "end of run", heap_timeout)
    except (SymmTimeoutError, watchdog.PeerTimeoutError) as e:  # a peer is stuck or gone
        _fail(comm, EXIT_PEER, f"{type(e).__name__}: {e}; ending the job (exit {EXIT_PEER})")
    except CapacityError as e:
        _fail(comm, EXIT_PROTOCOL, f"CapacityError: {e}; ending the job (exit {EXIT_PROTOCOL})")
    except Exception as e:  # noqa: BLE001 - any other failure on one rank must not leave the others waiting
        traceback.print_exc()
        _fail(comm, EXIT_PROTOCOL, f"{type(e).__name__}: {e}; ending the job (exit {EXIT_PROTOCOL})")
    dog.close()
    last_resort.arm("MPI finalize", args.timeout)  # MPI_Finalize runs at exit
    _step(args, "finish")
    return code


def print_rows(args, backend, dtype, run, rows, ok):
    tol = TOLERANCE[dtype]
    where = f" ({'virtual ranks in one process' if args.virtual else 'NVSHMEM, one process per rank'})" \
        if backend == "gpu" else ""
    print(f"# {run.shape.describe()} R={run.num_ranks} backend={backend}{where} dtype={dtype} "
          f"routing={args.routing} seed={args.seed}")
    print(f"# policy {rows[0]['policy']}")
    metric = "rel_rms_err" if dtype == "fp8" else "max_rel_err"
    if dtype == "fp8":
        print(f"# routed experts fp8 (e4m3, 1x128 / 128x128 scales), dispatch {run.dispatch_dtype}, "
              f"weight gradients {'fp8' if run.fp8_wgrad else 'bf16'}; "
              f"err_rel_rms per array against the float64 reference on the bf16 inputs")
    print(f"{'rank':>4} {'fwd_ms':>8} {'bwd_ms':>8} {metric:>11} {'(array)':>14}  "
          f"{'sha256(out)':<16}  {'sha256(grads)':<16}")
    for r in rows:
        print(f"{r['rank']:>4} {r['fwd_ms']:>8.2f} {r['bwd_ms']:>8.2f} {r['max_err']:>11.2e} "
              f"{'(' + r['worst'] + ')':>14}  {r['out_sha'][:16]}  {r['grad_sha'][:16]}")
    print("PASS: every rank matches the reference" if ok else
          f"FAIL: a rank differs from the reference by more than {tol:g} (relative)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
