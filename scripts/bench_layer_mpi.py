"""NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 mpirun --bind-to none -n 2 python scripts/bench_layer_mpi.py [--shapes kimi-k2.7,...] [--iters 10] [--warmup 3] [--routing hot:0.25]

then

    python scripts/bench_layer_mpi.py --single 2 --compare results/x2/digests_mpi.json

or the other way round:

    python scripts/bench_layer_mpi.py --single 2
    NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 mpirun --bind-to none -n 2 python scripts/bench_layer_mpi.py --compare results/x2/digests_single.json

(on the device machine, as root with a carried nvshmem4py: README, "Multi-GPU", gives the command)

The whole MoE layer on R GPUs (one process per GPU, NVSHMEM): ours, sequential and fused,
against the PyTorch + NCCL layer, push against pull per transfer, bitwise checks, in one run.
The mpirun line measures (one process per GPU); --single R runs the same global problem in ONE
process on one GPU (R virtual ranks, mok_proto.symm.virtual; the sequential layer only, shapes
whose R ranks do not fit on one GPU skipped) and checks that every rank's results are bitwise
those of the R processes. Each mode writes its digests (--digests-out, default
<results-dir>/digests_mpi.json or digests_single.json) and compares with the other's (--compare),
so either order works: the second run prints and records (JSON lines) the comparison.
(--bind-to none: Open MPI binds each of 2 ranks to one core by default; the plan helper
processes below leave that binding anyway.)

Per paper shape (config.PAPER_SHAPES, N = 2048 tokens per rank, E/R experts per rank, uniform
random top-K routing identical on every rank, or --routing zipf:ALPHA | hot:FRACTION over the R
ranks with rank 0 the timed (hot) one: mok_proto.routing; weights, x and dout generated on the GPU
per rank from seeded CuPy generators, the same in both modes; every record holds `routing`):
  ours      GpuMoELayer over NvshmemHeap, MoK's policy. Sequential and fused (fused_forward /
            fused_backward plans, comm CTAs 0 and minibatch 1024 or 2048 rows: the faster one is
            reported) timed as CUDA-graph replays; passes alternate (the forward graph, then the
            backward graph), only the timed pass between events, every rank starting each
            iteration together (heap.barrier: device synchronize + host barrier).
  torch     mok_proto.bench.torch_baselines.TorchNcclLayer: the layer with all_to_all_single for
            dispatch and combine (split sizes read by the host), torch._grouped_mm experts, the
            same weights (our buffers, zero copy; gate/up concatenated into a copy when it fits)
            and inputs; forward under no_grad, backward = t(forward + backward) - t(forward), as
            bench_layer.py defines it (no gradient accumulation across iterations). Its output and
            input gradient against ours: max |ours - torch| / max |torch| (loose, bf16).
  push/pull For each transfer (dispatch, combine, rev_combine, rev_dispatch), the sequential
            layer's eager stages (one event pair per stage) with that transfer push and pull, the
            other three at MoK's choice. overhead_ms = stage_ms - bytes / link: the stage beyond
            moving its bytes at the link rate measured in this run (a stage that moves no rows
            cannot be timed in this layer, so this stands in for the signalling cost);
            bytes = the most bf16 rows any rank sends to or receives from other ranks in one
            transfer. pct_link = bytes / stage time against that link.
  link      every rank copies 1 GiB from the next rank's symmetric buffer at once (NVSHMEM peer
            mapping, the same loads/stores as our transfers: the link used above) and a 1 GiB
            NCCL all_to_all_single (mok_proto.bench.ceilings.nccl_a2a_gbs), bytes leaving a GPU/s.
  bitwise   digests (mok_proto.bench.digest: SHA-256 over GPU-side fingerprints of out and every
            gradient, per rank) of every policy, of the sequential graph replays and of each fused
            setting must be equal; and equal to the single-process run's (--compare).
Every timing is the slowest rank's median (p20, p80) over --iters iterations after --warmup.
Order: first, shape by shape, our sequential layer and the torch layer; then, shape by shape on a
fresh layer with the same inputs, the fused passes (never run over NVSHMEM processes before: a
device error there cannot cost the other measurements). Every failure is printed by the rank it
happened on, recorded, and the run goes on with what the ranks can still do together.
The fused plans are built and proved (Plan.check, minutes of CPU for the backward plans of
large shapes) by --plan-workers helper processes per rank while the GPU runs the rest; each plan
on one rank (plan i on rank i % R), sent to the others when it is used.
Receive capacity: the exact padded need of this routing (layer.gpu.receive_capacity); symmetric
heap: NVSHMEM_SYMMETRIC_SIZE defaults to the largest shape's layer (layer.gpu.symmetric_bytes)
plus 10%. A shape whose layer does not fit in GPU memory is skipped with the reason; the
torch layer keeps its gate/up apart (no copy) when the copy does not fit, or is skipped.
Bars (--bar KEY=VALUE; --help lists them with their defaults): the best fused forward and
backward x the torch layer on every shape. Checks: bitwise across policies, sequential and fused,
and to the single process (when compared).
--no-torch (implied when ranks share a GPU, e.g. `mpirun -n 2` on one GPU: NVSHMEM's MPG mode, a
check of the whole flow whose timings are not those of 2 GPUs) runs our layer only: the bars are
not judged, the bitwise checks are, and the fused passes' speed-up over the sequential is printed.
Exit status: 0 all met; 1 a bar or a check failed, or a shape was skipped or failed (listed);
2 no GPU, CuPy, torch, NVSHMEM (nvshmem4py) or mpi4py, or a bad argument (one line).
Results: JSON lines appended to <results-dir>/bench_layer_mpi.jsonl (default results/x<R>): per
shape a record "partial (no fused pass yet)" after the first part and a "complete" one (every
figure, the bars judged unless --no-torch: "bars_judged", "missed") at the end; --single writes mode
"single" records.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

from mok_proto.bench import append_result, git_sha  # noqa: E402
from mok_proto.bench.device import require_mpi_stack  # noqa: E402
from mok_proto.bench.digests import compare_digests, describe_comparison, write_digests  # noqa: E402
from mok_proto.bench.mpi_layer import run_fused, sequential_part  # noqa: E402
from mok_proto.bench.mpi_problem import Problem, single_shape  # noqa: E402
from mok_proto.bench.mpi_args import parse_args, results_dir  # noqa: E402
from mok_proto.bench.mpi_report import judge, print_table  # noqa: E402
from mok_proto.bench.plan_workers import start_plans  # noqa: E402
from mok_proto.bench.ranks import (HEAP_TIMEOUT_S, NCCL_TIMEOUT_S, Ranks, gpu_sharing, implied_no_torch,  # noqa: E402
                                   run_shape)
from mok_proto.config import MOK_POLICY, format_policy  # noqa: E402


def main_single(args) -> int:
    from mok_proto.bench import gpu_name, require_gpu

    require_gpu("bench_layer_mpi.py --single")
    num_ranks = args.single
    out_dir = results_dir(args, num_ranks)
    digests_path = Path(args.digests_out) if args.digests_out else out_dir / "digests_single.json"
    print(f"# bench_layer_mpi --single {num_ranks}: {num_ranks} virtual ranks on {gpu_name()}, "
          f"sequential layer, policy {format_policy(MOK_POLICY)}, seed {args.seed}, routing {args.routing}", flush=True)
    shapes, failed = {}, []
    for name in args.shapes:
        entry = shapes[name] = single_shape(name, args, num_ranks)
        if "error" in entry:
            failed.append(f"{name}: {entry['error']}")
        write_digests(digests_path, "single", num_ranks, shapes)  # after every shape: a stopped run keeps them
        result = compare_digests({name: entry}, args.compare, "single")[name] if args.compare else None
        if result is not None and result["equal"] is False:
            failed.append(f"{name}: differs from {args.compare}")
        elif result is not None and result["equal"] is None and not result.get("skipped"):
            failed.append(f"{name}: not compared with {args.compare} ({result['why']})")
        print(f"{name:<18} {'skipped: ' + entry['skipped'] if 'skipped' in entry else entry.get('error', 'ok')}; "
              f"vs the R processes: {describe_comparison(result)}", flush=True)
        append_result("bench_layer_mpi", {"mode": "single", **entry["config"], **{k: v for k, v in entry.items()
                                                                                  if k != "config"},
                                          "bitwise_vs_mpi": result}, out_dir)
    print(f"# digests: {digests_path}", flush=True)
    if failed:
        print(f"FAIL: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main_mpi(args) -> int:
    from mok_proto.bench import require_gpu

    require_gpu("bench_layer_mpi.py", need_torch=True)
    require_mpi_stack()
    import cupy
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    num_ranks, lead, start = comm.size, comm.rank == 0, time.time()
    out_dir = results_dir(args, num_ranks)
    digests_path = Path(args.digests_out) if args.digests_out else out_dir / "digests_mpi.json"
    problems, rows, failed = [], [], []
    for name in args.shapes:
        try:
            problems.append(Problem(name, args.tokens, num_ranks, args.seed, args.routing))
        except ValueError as e:
            rows.append({"shape": name, "ranks": num_ranks, "skipped": str(e)})
            failed.append(f"{name}: skipped ({e})")
    need = max([p.layer_bytes for p in problems], default=0) + (1 << 30)  # + the link ceiling's buffer
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", f"{-(-int(need * 1.1) // (1 << 20))}M")
    count = cupy.cuda.runtime.getDeviceCount()
    device = comm.rank % count
    cupy.cuda.Device(device).use()
    # Ranks per GPU, the same answer on every rank (by PCI address: per-rank CUDA_VISIBLE_DEVICES too).
    per_gpu = gpu_sharing(comm.allgather(cupy.cuda.Device(device).pci_bus_id))
    note = implied_no_torch(args, num_ranks, per_gpu)
    if note and lead:
        print(note, flush=True)
    # Preflight (collective): every GPU of this host must map every other's memory (NVLink / P2P),
    # or each symmetric allocation would fail only after minutes of setup.
    no_peer = [p for p in range(count) if p != device and not cupy.cuda.runtime.deviceCanAccessPeer(device, p)]
    everyone = comm.allgather(no_peer)
    if any(everyone):
        if lead:
            print("bench_layer_mpi.py: GPUs without peer access: " + "; ".join(
                f"rank {r} (GPU {r % count}) cannot reach GPU(s) {bad}" for r, bad in enumerate(everyone) if bad),
                file=sys.stderr, flush=True)
        return 2
    free_at_start = cupy.cuda.runtime.memGetInfo()[0]

    from mok_proto.bench.ceilings import nccl_a2a_gbs, peer_pull_gbs
    from mok_proto.bench.torch_baselines import init_distributed
    from mok_proto.kernels.fused import default_num_sms
    from mok_proto.symm.nvshmem import NvshmemHeap

    heap = NvshmemHeap(comm, timeout_s=HEAP_TIMEOUT_S)
    ranks = Ranks(comm, heap, per_gpu)
    # Memory the heap holds that free memory does not show (a static heap's reservation; a
    # dynamic heap may keep what it mapped after a free): usable by our next layer only.
    heap_held = max(0, int(ranks.max(free_at_start - cupy.cuda.runtime.memGetInfo()[0])))
    if not args.no_torch:
        init_distributed(NCCL_TIMEOUT_S)  # torch.distributed (NCCL), after the heap
    import torch

    ranks.say(f"# bench_layer_mpi: R={num_ranks} processes on {torch.cuda.get_device_name()}, iters {args.iters} "
              f"warmup {args.warmup}, seed {args.seed}, routing {args.routing}, "
              f"NVSHMEM_SYMMETRIC_SIZE={os.environ['NVSHMEM_SYMMETRIC_SIZE']}, "
              f"git {git_sha()}")
    for row in rows:
        ranks.say(f"# {row['shape']}: skipped: {row['skipped']}")
    pool = None
    link = {"nvshmem_pull_gbs": float("nan"), "nccl_a2a_gbs": None if args.no_torch else float("nan")}
    try:
        setup = {"shape": "setup"}
        ranks.say("# compiling the fused kernels (their occupancy sizes the plans)")
        ok, num_sms = ranks.phase(setup, "fused kernels (compile, occupancy)",
                                  lambda: {pass_: default_num_sms(1, pass_) for pass_ in ("fwd", "bwd")})
        if not ok:
            failed.append(f"setup: {setup['errors']}: no fused pass is timed")
            args.fused = []
        pool, jobs = start_plans(problems, args.fused, num_sms, args.plan_workers, comm.rank, num_ranks)
        if num_ranks > 1:
            before = ranks.free_bytes()
            ok, gbs = ranks.phase(setup, "link: NVSHMEM peer pull", lambda: peer_pull_gbs(heap))
            link["nvshmem_pull_gbs"] = ranks.min(gbs) if ok else float("nan")
            ranks.release(setup, ["link-ceiling"])  # peer_pull_gbs's buffer, if it failed before freeing it
            heap_held += max(0, before - ranks.free_bytes())
            if not args.no_torch:
                ok, gbs = ranks.phase(setup, "link: NCCL all_to_all", lambda: nccl_a2a_gbs(num_ranks))
                link["nccl_a2a_gbs"] = ranks.min(gbs) if ok else float("nan")
            torch.cuda.empty_cache()
        nccl = "not run" if link["nccl_a2a_gbs"] is None else f"{link['nccl_a2a_gbs']:.0f} GB/s per GPU"
        ranks.say(f"# link: NVSHMEM peer pull {link['nvshmem_pull_gbs']:.0f} GB/s per GPU, NCCL all_to_all "
                  f"{nccl} (slowest rank); {len(jobs)} fused plans being proved, split over "
                  f"the ranks, by {args.plan_workers} helper processes per rank; {time.time() - start:.0f} s so far")
        digests, done = {}, {}
        # Part 1, every shape: our sequential layer and the torch layer (kernels run before).
        for prob in problems:
            row, heap_held = run_shape(ranks, prob, args, heap_held, link, "sequential", {},
                                       lambda layer, row, prob=prob: sequential_part(ranks, prob, layer, args, row))
            rows.append(row)
            done[prob.name] = row
            # Recorded as soon as the shape is done: a run stopped later keeps it.
            digests[prob.name] = {"config": {k: row.get(k) for k in ("shape", "ranks", "tokens_per_rank", "seed",
                                                                     "routing", "capacity")}}
            if "digests" in row:
                digests[prob.name]["per_rank"] = {str(r): d for r, d in enumerate(row["digests"])}
            else:
                digests[prob.name]["skipped"] = row.get("skipped", "no digests (failed before them)")
            if args.compare:
                row["bitwise_vs_single"] = compare_digests({prob.name: digests[prob.name]}, args.compare,
                                                           "mpi")[prob.name]
                ranks.say(f"#   bitwise vs the single process ({args.compare}): "
                          f"{describe_comparison(row['bitwise_vs_single'])}")
            if lead:
                append_result("bench_layer_mpi", {"mode": "mpi", "record": "partial (no fused pass yet)", **row,
                                                  "iters": args.iters, "warmup": args.warmup}, out_dir)
                write_digests(digests_path, "mpi", num_ranks, digests)
        # Part 2, every shape: the fused passes (never run over NVSHMEM processes before: a device
        # error there must not cost the shapes above their measurements).
        for prob in problems:
            row = done[prob.name]
            if "digests" in row and args.fused:
                row, heap_held = run_shape(ranks, prob, args, heap_held, link, "fused", row,
                                           lambda layer, row, prob=prob: run_fused(ranks, prob, layer, args, jobs, row))
            missed = judge(row, bars=not args.no_torch, limits=args.bars)
            failed += [f"{prob.name}: {'; '.join(missed)}"] if missed else []
            bars = {p: args.bars[f"fused_{p}_x_torch"].value for p in ("fwd", "bwd")}
            if lead:
                append_result("bench_layer_mpi", {"mode": "mpi", "record": "complete", **row, "iters": args.iters,
                                                  "warmup": args.warmup, "bars": bars, "missed": missed}, out_dir)
        if lead:
            print_table(rows, link, digests_path, args.compare, bars=not args.no_torch, limits=args.bars)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        heap.close()
    unjudged = " (no torch layer: bars not judged)" if args.no_torch else ""
    if failed:
        ranks.say(f"FAIL ({time.time() - start:.0f} s): " + " | ".join(failed) + unjudged)
        return 1
    ranks.say(f"all {'checks' if args.no_torch else 'bars and checks'} met ({time.time() - start:.0f} s){unjudged}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv, __doc__)
    if args.single is not None:
        return main_single(args)
    try:
        return main_mpi(args)
    except Exception:  # noqa: BLE001 (SystemExit, a refusal up front with its exit status, passes)
        # NOTE: an error outside a phase (e.g. a sticky CUDA error on one rank) leaves the other rank
        # in a collective, and MPI_Finalize at exit would wait for it: end the whole job instead.
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
        raise


if __name__ == "__main__":
    sys.exit(main())
