"""NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 mpirun -n 8 python scripts/bench_nccl_baseline.py [--shapes kimi-k2.7,...] [--tokens 2048]

The naive baseline users would write: NCCL all_to_all_single dispatch and combine
(mok_proto.bench.torch_baselines.NcclRound).

One rank per GPU (torch.distributed, NCCL). Per iteration, like bench_comm.py and on the same
inputs (mok_proto.problem.make_routed_tokens, same seed, same shapes and bytes):
  layout    slots sorted by destination rank, split sizes exchanged with all_to_all_single and
            READ BY THE HOST (.tolist(): the CPU-GPU synchronization MoK removes);
  dispatch  token rows gathered, all_to_all_single of the rows and of their expert ids;
  expert    stand-in: y = scale[e] * row;
  combine   all_to_all_single back, rows put into their [N*K] slots;
  weighted_sum  fixed-order weighted sum.
The stages match bench_comm.py's (layout ~ its routing all-gather + schedule).
Median (p20, p80) of each stage over --iters iterations, slowest rank; logical GB/s = (token,
choice) rows x row bytes / time for all ranks; %link: the bytes that leave each GPU (rows whose
expert is remote) per second against the link ceiling measured in the same run, a 1 GiB-per-rank
all_to_all_single (bytes leaving each GPU per second). Outputs are checked bit for bit against
the NumPy round (exit 1 on a mismatch). JSON lines: results/bench_nccl_baseline.jsonl.
"""

from __future__ import annotations

import os
import sys

import numpy as np

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

from mok_proto.bench import append_result, require_gpu, slowest_rank, summarize, time_stages  # noqa: E402
from mok_proto.bench.ceilings import nccl_a2a_gbs  # noqa: E402
from mok_proto.bench.cli import parser  # noqa: E402
from mok_proto.bench.torch_baselines import NcclRound, init_distributed  # noqa: E402
from mok_proto.config import PAPER_SHAPES, get_shape  # noqa: E402
from mok_proto.reference import stand_in_round  # noqa: E402
from mok_proto.problem import make_routed_tokens  # noqa: E402


def main():
    p = parser(__doc__)
    p.add_argument("--shapes", default=",".join(PAPER_SHAPES))
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank (2048: the EP=8 load of bench_comm)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    require_gpu("bench_nccl_baseline.py", need_cupy=False, need_torch=True)
    import torch
    from mpi4py import MPI

    comm = init_distributed()
    rank, num_ranks, lead = comm.rank, comm.size, comm.rank == 0
    # One rank has no link: then nothing crosses one, and no ceiling or % is reported.
    link = comm.allreduce(nccl_a2a_gbs(num_ranks), op=MPI.MIN) if num_ranks > 1 else float("nan")
    if lead:
        print(f"# NCCL all_to_all_single baseline, {num_ranks} ranks on {torch.cuda.get_device_name()}; "
              f"link ceiling (a2a, slowest rank): {link:.0f} GB/s per GPU")
        print(f"{'shape':<16}{'R':>3}{'N/rank':>7}{'layout_ms':>10}{'disp_ms':>9}{'disp_GB/s':>10}{'%link':>6}"
              f"{'expert_ms':>10}{'comb_ms':>9}{'comb_GB/s':>10}{'%link':>6}{'wsum_ms':>9}  exact")
    failed = []
    for shape_name in args.shapes.split(","):
        shape = get_shape(shape_name).with_tokens(args.tokens)
        if shape.num_experts % num_ranks:
            continue
        data = make_routed_tokens(shape, num_ranks, seed=0)
        rnd = NcclRound(data, rank, num_ranks)
        samples = time_stages(rnd.run, args.iters, args.warmup, api="torch")
        out = rnd.run(lambda stage: None).cpu().numpy()
        want = stand_in_round(data.x[rank:rank + 1], data.topk_idx[rank:rank + 1], data.topk_weights[rank:rank + 1],
                               data.scale)[0]
        exact = comm.allreduce(bool(np.array_equal(out, want)), op=MPI.LAND)
        if not exact:
            failed.append(shape_name)
        stats = slowest_rank({stage: summarize(v) for stage, v in samples.items()}, comm)
        moved = shape.num_tokens * shape.top_k * num_ranks * shape.hidden * 4
        gbs = {op: moved / (stats[op]["median_ms"] * 1e-3) / 1e9 for op in ("dispatch", "combine")}
        crossing = data.remote_rows() * shape.hidden * 4 / num_ranks  # bytes that leave each GPU
        pct = {op: 100 * crossing / (stats[op]["median_ms"] * 1e-3) / 1e9 / link if num_ranks > 1 else float("nan")
               for op in gbs}
        if lead:
            print(f"{shape_name:<16}{num_ranks:>3}{shape.num_tokens:>7}{stats['layout']['median_ms']:>10.3f}"
                  f"{stats['dispatch']['median_ms']:>9.3f}{gbs['dispatch']:>10.0f}{pct['dispatch']:>6.1f}"
                  f"{stats['expert']['median_ms']:>10.3f}{stats['combine']['median_ms']:>9.3f}{gbs['combine']:>10.0f}"
                  f"{pct['combine']:>6.1f}{stats['weighted_sum']['median_ms']:>9.3f}  "
                  f"{'yes' if exact else 'MISMATCH'}", flush=True)
            append_result("bench_nccl_baseline", {
                "shape": shape_name, "ranks": num_ranks, "tokens_per_rank": shape.num_tokens, "hidden": shape.hidden,
                "top_k": shape.top_k, "stages": stats, "dispatch_gbs": gbs["dispatch"], "combine_gbs": gbs["combine"],
                "pct_of_link": pct, "link_ceiling_gbs": link, "remote_rows": data.remote_rows(),
                "bit_exact": bool(exact)})
    torch.distributed.destroy_process_group()
    if failed:
        if lead:
            print(f"FAIL: {len(failed)} shapes differ from the NumPy round: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
