"""The naive baseline users would write: NCCL all_to_all_single dispatch and combine.

    NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 mpirun -n 8 python scripts/bench_nccl_baseline.py

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

import argparse
import functools
import os
import sys

import numpy as np

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

from mok_proto.bench import append_result, require_gpu, slowest_rank, summarize, time_stages  # noqa: E402
from mok_proto.config import PAPER_SHAPES, get_shape  # noqa: E402
from mok_proto.reference import stand_in_round  # noqa: E402
from mok_proto.problem import make_routed_tokens  # noqa: E402


def init_distributed(timeout_s: float | None = None):
    """torch.distributed over NCCL, one rank per GPU; timeout_s bounds every NCCL collective (a
    rank that failed between two of them then ends the job instead of blocking its peers for
    torch's default 10 minutes)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    torch.cuda.set_device(comm.rank % torch.cuda.device_count())
    port = comm.bcast(29500 + (os.getpid() % 1000) if comm.rank == 0 else None, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    extra = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("nccl", rank=comm.rank, world_size=comm.size,
                            device_id=torch.device("cuda", torch.cuda.current_device()), **extra)
    return comm


class NcclRound:
    """One rank's naive all-to-all round; stage(name) marks stage boundaries for timing."""

    def __init__(self, data, rank, num_ranks, device="cuda"):
        import torch

        dev = torch.device(device)
        self.rank, self.num_ranks = rank, num_ranks
        self.x = torch.from_numpy(data.x[rank]).to(dev)
        self.idx = torch.from_numpy(data.topk_idx[rank]).to(dev)
        self.w = torch.from_numpy(data.topk_weights[rank]).to(dev)
        self.scale = torch.from_numpy(data.scale).to(dev)
        self.num_local = data.scale.shape[0] // num_ranks
        self.top_k = self.idx.shape[1]

    def run(self, mark):
        import torch
        import torch.distributed as dist

        k, n = self.top_k, self.x.shape[0]
        mark("layout")  # what bench_comm's routing all-gather + schedule do
        flat = self.idx.reshape(-1)  # [N*K]
        order = torch.argsort(flat // self.num_local, stable=True)  # slots grouped by destination rank
        send_counts = torch.bincount(flat // self.num_local, minlength=self.num_ranks)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()  # host readback
        mark("dispatch")
        rows = self.x.index_select(0, order // k)
        recv = rows.new_empty((sum(recv_split), rows.shape[1]))
        dist.all_to_all_single(recv, rows, recv_split, send_split)
        recv_expert = flat.new_empty(sum(recv_split))
        dist.all_to_all_single(recv_expert, flat.index_select(0, order), recv_split, send_split)
        mark("expert")
        y = recv * self.scale.index_select(0, recv_expert)[:, None]
        mark("combine")
        back = torch.empty_like(rows)
        dist.all_to_all_single(back, y, send_split, recv_split)
        y_slots = torch.empty_like(back)
        y_slots[order] = back
        y_slots = y_slots.view(n, k, -1)
        mark("weighted_sum")
        out = torch.zeros_like(self.x)
        for j in range(k):  # fixed order, separate multiply and add, as the NumPy reference
            out += self.w[:, j, None] * y_slots[:, j]
        mark(None)
        return out


@functools.lru_cache(maxsize=None)
def _all_to_all_rows():
    """torch.autograd.Function: rows all_to_all_single'd with split sizes, and their gradient
    sent back the reverse way (built on first use: torch is imported lazily)."""
    import torch
    import torch.distributed as dist

    class AllToAllRows(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rows, out_split, in_split):
            ctx.splits = (out_split, in_split)
            out = rows.new_empty((sum(out_split),) + tuple(rows.shape[1:]))
            dist.all_to_all_single(out, rows.contiguous(), out_split, in_split)
            return out

        @staticmethod
        def backward(ctx, grad):
            out_split, in_split = ctx.splits
            back = grad.new_empty((sum(in_split),) + tuple(grad.shape[1:]))
            dist.all_to_all_single(back, grad.contiguous(), in_split, out_split)
            return back, None, None

    return AllToAllRows


def all_to_all_rows(rows, out_split: list, in_split: list):
    """rows [sum(in_split), ...] -> [sum(out_split), ...]: in_split[p] rows go to rank p,
    out_split[p] rows come from it (NCCL all_to_all_single); autograd sends gradients back."""
    return _all_to_all_rows().apply(rows, out_split, in_split)


class TorchNcclLayer:
    """The MoE layer as a PyTorch user writes it on R ranks (one per GPU, torch.distributed NCCL):
    this rank's El = E/R routed SwiGLU experts (rank r owns experts r El .. (r + 1) El - 1) and the
    optional shared expert, forward and backward by autograd, bf16 with fp32 routing weights.

    forward(x [N,H] bf16, topk_idx [N,K] int64, topk_weights [N,K] fp32):
      layout        (token, choice) slots sorted by destination rank (expert // El), split sizes
                    exchanged with all_to_all_single and READ BY THE HOST (.tolist(): the naive
                    baseline's CPU-GPU synchronization)
      shared        x @ [gate | up] -> silu(g) * u -> @ down
      dispatch      the slots' token rows and their expert ids all_to_all_single'd to the owners
      experts       received rows sorted by local expert, torch._grouped_mm gate/up (one [El,H,2I]
                    weight, or gate and up apart when concat=False), SwiGLU, grouped_mm down, unsorted
      combine       result rows all_to_all_single'd back, put into their [N*K] slots
      weighted_sum  out = shared + sum_j w[:, j] * y[:, j] in fp32, j in order, rounded to bf16
    The weights are leaves with requires_grad (w_down and the shared down projection share memory
    with the tensors given; gate/up are concatenated into a copy unless concat=False)."""

    def __init__(self, num_ranks: int, rank: int, w_gate, w_up, w_down, shared=None, concat: bool = True):
        import torch

        self.num_ranks, self.rank = num_ranks, rank
        self.num_local = w_gate.shape[0]
        if concat:
            self.w1, self.w_gate, self.w_up = torch.cat([w_gate, w_up], dim=2).requires_grad_(), None, None
        else:
            self.w1, self.w_gate, self.w_up = None, w_gate.detach().requires_grad_(), w_up.detach().requires_grad_()
        self.w2 = w_down.detach().requires_grad_()
        self.s1 = self.s2 = None
        if shared is not None:  # (gate [H,Is], up [H,Is], down [Is,H])
            self.s1 = torch.cat([shared[0], shared[1]], dim=1).requires_grad_()
            self.s2 = shared[2].detach().requires_grad_()

    def parameters(self) -> list:
        return [p for p in (self.w1, self.w_gate, self.w_up, self.w2, self.s1, self.s2) if p is not None]

    def forward(self, x, topk_idx, topk_weights, mark=None):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        mark = mark or (lambda stage: None)
        n, k = topk_idx.shape
        el, num_ranks = self.num_local, self.num_ranks
        mark("layout")
        flat = topk_idx.reshape(-1)  # [N*K] global expert of slot t*K + j
        dest = flat // el
        order = torch.argsort(dest, stable=True)  # slots grouped by destination rank
        send_counts = torch.bincount(dest, minlength=num_ranks)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()  # host readback
        mark("shared")
        out = None
        if self.s1 is not None:
            gs, us = (x @ self.s1).chunk(2, -1)
            out = ((F.silu(gs) * us) @ self.s2).float()
        mark("dispatch")
        recv = all_to_all_rows(x.index_select(0, order // k), recv_split, send_split)
        recv_expert = flat.new_empty(sum(recv_split))
        dist.all_to_all_single(recv_expert, flat.index_select(0, order), recv_split, send_split)
        mark("experts")
        local = recv_expert - self.rank * el
        perm = torch.argsort(local, stable=True)  # received rows grouped by local expert
        offs = torch.cumsum(torch.bincount(local, minlength=el), 0).to(torch.int32)
        xs = recv.index_select(0, perm)
        if self.w1 is not None:
            g, u = torch._grouped_mm(xs, self.w1, offs=offs).chunk(2, -1)
        else:
            g, u = torch._grouped_mm(xs, self.w_gate, offs=offs), torch._grouped_mm(xs, self.w_up, offs=offs)
        y = torch._grouped_mm(F.silu(g) * u, self.w2, offs=offs)
        y = y.index_select(0, _inverse(perm))  # back in received order
        mark("combine")
        back = all_to_all_rows(y, send_split, recv_split)  # rows in `order`
        y_slots = back.index_select(0, _inverse(order)).view(n, k, -1)
        mark("weighted_sum")
        w = topk_weights.float()
        for j in range(k):  # fixed order, as the layer's token sums
            term = w[:, j, None] * y_slots[:, j].float()
            out = term if out is None else out + term
        return out.to(x.dtype)


def _inverse(perm):
    """The inverse of a permutation (torch int64)."""
    import torch

    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def link_ceiling_gbs(num_ranks, nbytes=1 << 30, iters=10):
    """all_to_all_single of nbytes per rank: bytes that leave each GPU per second."""
    import torch
    import torch.distributed as dist

    send = torch.ones(nbytes // 4, device="cuda")
    recv = torch.empty_like(send)
    samples = time_stages(lambda mark: (mark("a2a"), dist.all_to_all_single(recv, send), mark(None)), iters, 2,
                          api="torch")
    return nbytes * (num_ranks - 1) / num_ranks / (np.median(samples["a2a"]) * 1e-3) / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    link = comm.allreduce(link_ceiling_gbs(num_ranks), op=MPI.MIN) if num_ranks > 1 else float("nan")
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
