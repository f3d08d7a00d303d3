"""python scripts/bench_comm.py                                      # one GPU, virtual ranks
    NVSHMEM_DISABLE_NVLS=1 mpirun -n 8 python scripts/bench_comm.py   # one rank per GPU (NVSHMEM)

Dispatch and combine on the GPU, push against pull, for the paper's shapes.

--backend auto (the default) uses NVSHMEM when started by mpirun with more than one process (then
EP = number of processes and other --ep values are skipped), virtual ranks otherwise.

A fixed global batch of --global-tokens (default 16384 = 2048 tokens x 8 GPUs) is spread over EP
ranks, so EP=8 runs 2048 tokens per rank and EP=64 runs 256. Rows are float32 (4*H bytes).
Inputs are seeded random tokens and routing (mok_proto.problem.make_routed_tokens); after timing
each policy, every output is compared bit for bit with the NumPy round (exit 1 on a mismatch).
Under NVSHMEM the link ceiling is measured too: every rank pulls 1 GiB from the next rank at once.
For each (shape, EP, dispatch, combine): median/p20/p80 of each stage (one CUDA event pair per
stage per iteration, slowest rank); logical GB/s of dispatch and combine = (token, choice) rows
delivered x row bytes / time (all ranks together), next to the ceiling measured in the same run:
with virtual ranks a plain device copy in bytes copied per second (a copy reads and writes each
byte, as a row transfer does); under NVSHMEM the link, against the bytes that cross it per GPU
(rows whose expert is on the same rank stay local); and the
signalling cost: the same stages with 4-byte rows, where the time is flags, launches and latency.
With virtual ranks all EP ranks share ONE GPU: this measures HBM, not NVLink. Push dispatch can
exceed the copy ceiling there: a token's K rows are read from HBM once and K-1 times from L2.
Results: JSON lines appended to results/bench_comm.jsonl.

    python scripts/bench_comm.py --link-gbps 368 --ep 2 --global-tokens 4096   # the emulated link

--link-gbps G: virtual ranks that pay an emulated link of G GB/s per direction (mok_proto/link.py,
round trip --link-latency-us), each rank with the launch geometry of a rank that has a GPU to
itself, timing push/push and pull/pull; one row per (shape, stage, direction) with the time of
the same stage on the 2 x H200 run of results/x2/ (`x2_measured_ms`); exit 1 when a stage differs
from it by more than --bar (relative).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys

import numpy as np

os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

from mok_proto.bench import (append_result, copy_ceiling_gbs, peer_pull_gbs, require_gpu, slowest_rank,  # noqa: E402
                             summarize, time_stages)
from mok_proto.bench.cli import parser  # noqa: E402
from mok_proto import results  # noqa: E402
from mok_proto.config import DIRECTIONS, PAPER_SHAPES, RunConfig, get_shape  # noqa: E402
from mok_proto.link import DEFAULT_LATENCY_US, LinkModel  # noqa: E402
from mok_proto.layer.gpu_comm import GpuCommRound  # noqa: E402
from mok_proto.reference import stand_in_round  # noqa: E402
from mok_proto.problem import make_routed_tokens  # noqa: E402


def make_round(heap, shape, name, check=True, link=None, blocks_per_rank=None):
    """One round per (shape, EP); the policy is switched on it (buffers are shared). Returns the
    round, the exact float32 outputs it must produce for the ranks this process drives, and the
    number of rows that cross a link."""
    num_ranks = heap.num_ranks
    # Capacity: balanced load plus 50% headroom for random routing (overflow would be reported).
    expected = shape.num_tokens * shape.top_k
    rnd = GpuCommRound(heap, RunConfig(shape, num_ranks, timeout_s=30, link=link), name=name,
                       capacity=min(int(expected * 1.5) + 64, expected * num_ranks), blocks_per_rank=blocks_per_rank)
    data = make_routed_tokens(shape, num_ranks, seed=0)
    want = {}
    for rank in rnd.ranks:
        rnd.set_inputs(rank, data.x[rank], data.topk_idx[rank], data.topk_weights[rank], data.scale)
        if check:
            want[rank] = stand_in_round(data.x[rank:rank + 1], data.topk_idx[rank:rank + 1],
                                         data.topk_weights[rank:rank + 1], data.scale)[0]
    return rnd, want, data.remote_rows()


def bit_exact(heap, rnd, want) -> bool:
    """One more round on NaN-poisoned buffers; every output this process drives must equal the
    NumPy round bit for bit (a row read before it landed would read NaN)."""
    heap.barrier()
    rnd.poison()
    rnd.enqueue()
    rnd.check()
    heap.barrier()
    return all(np.array_equal(rnd.output(rank).get(), out) for rank, out in want.items())


def time_round(rnd, dispatch, combine, iters, warmup, comm=None):
    """Per-stage stats of one policy; with MPI, each stage's median is the slowest rank's."""
    rnd.policy.update(dispatch=dispatch, combine=combine)
    samples = time_stages(rnd.enqueue, iters, warmup)
    rnd.check()
    return slowest_rank({stage: summarize(v) for stage, v in samples.items()}, comm)


def x2_stage_ms(shape: str, stage: str, direction: str, tokens_per_rank: int):
    """The 2-GPU run's median of one stage (results/x2/bench_comm.jsonl, the policy that moves both
    operators in `direction`), or None."""
    rows = [r for r in results.load("bench_comm", results.RESULTS_DIR / "x2")
            if (r["shape"], r["ep"], r["tokens_per_rank"], r["dispatch"], r["combine"]) ==
            (shape, 2, tokens_per_rank, direction, direction)]
    return results.newest(rows)[-1]["stages"][stage]["median_ms"] if rows else None


def link_check(args) -> int:
    """The emulated link against the 2-GPU run (module doc): a row per (shape, stage, direction)."""
    from mok_proto.bench import gpu_name
    from mok_proto.kernels.build import num_sms
    from mok_proto.symm.virtual import VirtualWorld

    link, failed = LinkModel(args.link_gbps, args.link_latency_us), []
    print(f"# bench_comm: emulated link {link.gbps:g} GB/s per direction, round trip {link.latency_us:g} us, "
          f"virtual ranks on one {gpu_name()}; x2 = the 2 x H200 run (results/x2/)")
    print(f"{'shape':<16}{'EP':>3} {'stage':<9}{'dir':<5}{'ms':>8}{'x2 ms':>8}{'error':>8}")
    for shape_name, ep in itertools.product(args.shapes.split(","), (int(v) for v in args.ep.split(","))):
        shape = get_shape(shape_name).with_tokens(args.global_tokens // ep)
        with VirtualWorld(ep) as heap:
            # each rank as a rank with its own GPU launches them (the launch the 2-GPU run timed)
            rnd, want, _ = make_round(heap, shape, f"{shape_name}.{ep}", check=not args.no_check, link=link,
                                      blocks_per_rank=4 * num_sms())
            for direction in DIRECTIONS:
                stats = time_round(rnd, direction, direction, args.iters, args.warmup)
                exact = bit_exact(heap, rnd, want) if want else True
                for stage in ("dispatch", "combine"):
                    ms, x2 = stats[stage]["median_ms"], x2_stage_ms(shape_name, stage, direction, shape.num_tokens)
                    err = None if x2 is None else ms / x2 - 1
                    bad = not exact or (err is not None and abs(err) > args.bar)
                    if bad:
                        failed.append(f"{shape_name} EP={ep} {stage} {direction}" + ("" if exact else " (not exact)"))
                    print(f"{shape_name:<16}{ep:>3} {stage:<9}{direction:<5}{ms:>8.3f}"
                          f"{'-' if x2 is None else f'{x2:.3f}':>8}{'-' if err is None else f'{err:+.1%}':>8}"
                          f"{'  MISS' if bad else ''}", flush=True)
                    append_result("bench_comm", {
                        "backend": "virtual", "shape": shape_name, "ep": ep, "tokens_per_rank": shape.num_tokens,
                        "hidden": shape.hidden, "top_k": shape.top_k, "stage": stage, "direction": direction,
                        "median_ms": ms, "stats": stats[stage], **link.describe(), "x2_measured_ms": x2,
                        "error_vs_x2": err, "bar": args.bar, "bit_exact": None if args.no_check else bool(exact),
                        "gpu": gpu_name()})
            rnd.close()
    if failed:
        print(f"FAIL: {len(failed)} stages:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


def main():
    p = parser(__doc__)
    p.add_argument("--shapes", default=",".join(PAPER_SHAPES))
    p.add_argument("--ep", default="8,64", help="EP degrees (virtual ranks on one GPU)")
    p.add_argument("--global-tokens", type=int, default=16384)
    p.add_argument("--backend", choices=("auto", "virtual", "nvshmem"), default="auto")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-check", action="store_true", help="skip the bit-exact check against NumPy")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--link-gbps", type=float, default=None,
                   help="emulate a link of this many GB/s per direction (virtual ranks; module doc)")
    p.add_argument("--link-latency-us", type=float, default=DEFAULT_LATENCY_US, help="the emulated link's round trip")
    p.add_argument("--bar", type=float, default=0.15,
                   help="with --link-gbps: largest relative difference from the 2-GPU run's stage times")
    args = p.parse_args()
    if args.link_gbps is not None:
        try:
            LinkModel(args.link_gbps, args.link_latency_us)
        except ValueError as e:
            p.error(str(e))
        if args.backend == "nvshmem":
            p.error("--link-gbps emulates a link between virtual ranks: --backend virtual")
    require_gpu("bench_comm.py")
    if args.link_gbps is not None:
        return link_check(args)

    if args.backend == "auto":
        launched = max(int(os.environ.get(v, "1")) for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"))
        args.backend = "nvshmem" if launched > 1 else "virtual"
    comm = MPI = None
    if args.backend == "nvshmem":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    ceiling = copy_ceiling_gbs()
    lead = comm is None or comm.rank == 0
    if lead:
        where = "ONE GPU (virtual ranks): HBM, not NVLink" if args.backend == "virtual" else "NVSHMEM ranks"
        print(f"# bench_comm on {where}; ceiling: device copy {ceiling:.0f} GB/s copied "
              f"({2 * ceiling:.0f} GB/s read + written)")
        print(f"{'shape':<16}{'EP':>4}{'N/rank':>7} {'disp':>4} {'comb':>4} {'sched_ms':>9}{'disp_ms':>9}{'disp_GB/s':>10}"
              f"{'%ceil':>6}{'comb_ms':>9}{'comb_GB/s':>10}{'%ceil':>6}{'sig_disp_ms':>12}{'sig_comb_ms':>12}")
    heap, link, failed = None, None, []  # failed: rows whose output differs from the NumPy round
    if args.backend == "nvshmem" and comm.size not in [int(v) for v in args.ep.split(",")]:
        if lead:
            print(f"bench_comm: error: {comm.size} processes, but --ep is {args.ep}; pass --ep {comm.size}",
                  file=sys.stderr)
        return 2
    if args.backend == "nvshmem":
        from mok_proto.symm.nvshmem import NvshmemHeap

        heap = NvshmemHeap(comm)
        link = peer_pull_gbs(heap)
        link = comm.allreduce(link, op=MPI.MIN)
        if lead:
            print(f"# link ceiling: every rank pulls 1 GiB from the next rank at once: {link:.0f} GB/s per GPU "
                  f"(slowest rank)")
    for shape_name, ep in itertools.product(args.shapes.split(","), (int(v) for v in args.ep.split(","))):
        shape = get_shape(shape_name).with_tokens(args.global_tokens // ep)
        if args.backend == "virtual":
            from mok_proto.symm.virtual import VirtualWorld

            heap = VirtualWorld(ep)
        elif heap.num_ranks != ep:
            continue  # under mpirun, EP is the number of processes (checked below)
        rnd, want, remote_rows = make_round(heap, shape, f"{shape_name}.{ep}", check=not args.no_check)
        tiny, _, _ = make_round(heap, dataclasses.replace(shape, hidden=1), f"{shape_name}.{ep}.h1", check=False)
        for dispatch, combine in itertools.product(DIRECTIONS, repeat=2):
            stats = time_round(rnd, dispatch, combine, args.iters, args.warmup, comm)
            exact = bit_exact(heap, rnd, want) if want else True
            if comm is not None:
                exact = comm.allreduce(exact, op=MPI.LAND)
            if not (exact or args.no_check):
                failed.append(f"{shape_name} EP={ep} dispatch={dispatch} combine={combine}")
            sig = time_round(tiny, dispatch, combine, args.iters, args.warmup, comm)
            rows = shape.num_tokens * shape.top_k * ep  # (token, choice) rows moved per operator, all ranks
            moved = rows * shape.hidden * 4  # logical bytes delivered
            gbs = {op: moved / (stats[op]["median_ms"] * 1e-3) / 1e9 for op in ("dispatch", "combine")}
            # % of the ceiling: one GPU's HBM copy (virtual ranks: all bytes), or the link (NVSHMEM: the
            # bytes that cross it, per GPU; rows whose expert is local never leave the GPU).
            crossing = remote_rows * shape.hidden * 4 / ep
            pct = {op: 100 * gbs[op] / ceiling if link is None
                   else 100 * crossing / (stats[op]["median_ms"] * 1e-3) / 1e9 / link for op in gbs}
            if lead:
                print(f"{shape_name:<16}{ep:>4}{shape.num_tokens:>7} {dispatch:>4} {combine:>4} "
                      f"{stats['schedule']['median_ms']:>9.3f}{stats['dispatch']['median_ms']:>9.3f}"
                      f"{gbs['dispatch']:>10.0f}{pct['dispatch']:>6.1f}"
                      f"{stats['combine']['median_ms']:>9.3f}{gbs['combine']:>10.0f}{pct['combine']:>6.1f}"
                      f"{sig['dispatch']['median_ms'] + sig['expert']['median_ms']:>12.3f}"
                      f"{sig['combine']['median_ms'] + sig['weighted_sum']['median_ms']:>12.3f}"
                      f"{'' if args.no_check else ('  exact' if exact else '  MISMATCH'):>10}", flush=True)
                append_result("bench_comm", {
                    "backend": args.backend, "shape": shape_name, "ep": ep, "tokens_per_rank": shape.num_tokens,
                    "hidden": shape.hidden, "top_k": shape.top_k, "dispatch": dispatch, "combine": combine,
                    "stages": stats, "signal_stages": sig, "dispatch_gbs": gbs["dispatch"],
                    "combine_gbs": gbs["combine"], "pct_of_ceiling": pct, "copy_ceiling_gbs": ceiling,
                    "remote_rows": remote_rows,
                    "link_ceiling_gbs": link,
                    "bit_exact": None if args.no_check else bool(exact),
                    "note": "virtual ranks on one GPU: HBM bandwidth, not NVLink" if args.backend == "virtual" else "",
                })
        rnd.close()
        tiny.close()
        if args.backend == "virtual":
            heap.close()
    if args.backend == "nvshmem":
        heap.close()
    if failed:
        if lead:
            print(f"FAIL: {len(failed)} rows differ from the NumPy round:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
