"""The PyTorch baselines: the anchor's unfused pipeline on one GPU (torch_pipeline), the naive
NCCL all-to-all round (NcclRound) and the layer as a PyTorch user writes it on R ranks
(TorchNcclLayer). torch is imported inside the functions (no GPU import at module level)."""

from __future__ import annotations

import functools
import os

import numpy as np

from mok_proto.bench.emulation import EP
from mok_proto.bench.timing import summarize, time_stages


def torch_pipeline(shape, data, iters, warmup):
    """The anchor's unfused pipeline for rank 0, on the same inputs: ({pass: stats}, results).

    As the anchor defines it (../shared/anchors/torch_layer_baseline.py): the dispatch source
    x_src holds the token rows of all EP=64 ranks and requires grad (so autograd builds its
    [64 N, H] input gradient, and accumulates it and the weight gradients across iterations), and
    the backward is t(forward + backward, grad mode) - t(forward, no_grad). Here rows 0..W N of
    x_src are our W virtual ranks' tokens (the only rows routed to rank 0's experts; W = 2 under
    uniform routing), the other (64 - W) N rows random. Also timed, and reported beside it (key
    `variant_2n`): the previous, lighter variant: an x_src of only the W N rows, the backward timed
    by one event pair around autograd.backward."""
    import torch
    import torch.nn.functional as F

    a = anchor_inputs(shape, data)
    w1, w2, s1, s2, x_own, x_srcs, x_all, topk = a.w1, a.w2, a.s1, a.s2, a.x_own, a.x_srcs, a.x_all, a.topk
    offs, dout, d_others = a.offs, a.dout, a.d_others

    def experts(xr):
        g, u = torch._grouped_mm(xr, w1, offs=offs).chunk(2, -1)
        return torch._grouped_mm(F.silu(g) * u, w2, offs=offs)

    def fwd(x_src):
        return anchor_forward(a, x_src, experts)

    def fwd_bwd(x_src, mark):
        mark("fwd")
        result, others = fwd(x_src)
        mark("bwd")
        torch.autograd.backward([result, others], [dout, d_others])
        mark(None)

    stats = {}
    with torch.no_grad():
        stats["fwd"] = summarize(time_stages(lambda mark: (mark("run"), fwd(x_srcs["anchor"]), mark(None)), iters,
                                             warmup, api="torch")["run"])
        out = full_output(shape, data, topk, x_all, s1, s2).float().cpu().numpy()
    variant = time_stages(lambda mark: fwd_bwd(x_srcs["variant_2n"], mark), iters, warmup, api="torch")
    x_srcs["variant_2n"] = None
    anchor = time_stages(lambda mark: fwd_bwd(x_srcs["anchor"], mark), iters, warmup, api="torch")
    both = summarize(anchor["total"])
    stats["bwd"] = {"median_ms": both["median_ms"] - stats["fwd"]["median_ms"], "iters": both["iters"],
                    "fwd_bwd_median_ms": both["median_ms"], "definition": "anchor: t(fwd+bwd) - t(fwd, no_grad)",
                    "bwd_event_median_ms": summarize(anchor["bwd"])["median_ms"],
                    "variant_2n_bwd_ms": summarize(variant["bwd"])["median_ms"]}
    for param in (w1, w2, s1, s2, x_own, x_srcs["anchor"]):  # autograd accumulated over the timed runs: one clean run
        param.grad = None
    fwd_bwd(x_srcs["anchor"], lambda stage: None)
    i = shape.ffn
    ref = {"out": out, "w_down": w2.grad.float().cpu().numpy(), "w_gate": w1.grad[..., :i].float().cpu().numpy(),
           "w_up": w1.grad[..., i:].float().cpu().numpy()}
    return stats, ref


def anchor_inputs(shape, data):
    """The anchor pipeline's tensors for rank 0 (torch_pipeline's doc), as a SimpleNamespace: the
    routed (token, choice) pairs sorted by expert (tok, j, e, offs), the owned slots, the bf16
    weights (leaves with requires_grad), the dispatch sources, routing weights and output gradients."""
    from types import SimpleNamespace

    import torch

    dev, bf = "cuda", torch.bfloat16
    n, h, k = shape.num_tokens, shape.hidden, shape.top_k
    num = len(data["topk_idx"])  # virtual ranks
    el = shape.num_experts // num
    t = lambda a, dtype=bf: torch.as_tensor(a, device=dev).to(dtype)  # noqa: E731
    topk = t(data["topk_idx"].reshape(num * n, k), torch.int64)
    tok, j = (topk < el).nonzero(as_tuple=True)  # (token, choice) pairs for rank 0's experts
    e = topk[tok, j]
    order = torch.sort(e, stable=True).indices
    tok, j, e = tok[order], j[order], e[order]
    offs = torch.cumsum(torch.bincount(e, minlength=el), 0).to(torch.int32)
    # Rank 0 of the anchor owns 1/64 of the rows it receives (its N of the 64 N tokens): the first
    # W N / 64 of our W N tokens play that part (the rest are "other owners'": copied out), so
    # torch's combine copies as many rows as the anchor's.
    own = tok < (num * n) // EP
    own_slot = (tok * k + j)[own]
    wts = data["weights"]
    w1 = torch.cat([t(wts["w_gate"][:el]), t(wts["w_up"][:el])], dim=2).requires_grad_()
    w2 = t(wts["w_down"][:el]).requires_grad_()
    s1 = torch.cat([t(wts["shared_gate"]), t(wts["shared_up"])], dim=1).requires_grad_()
    s2 = t(wts["shared_down"]).requires_grad_()
    x_all = t(data["x"].reshape(num * n, h))
    x_own = x_all[:n].clone().requires_grad_()
    gen = torch.Generator(device=dev).manual_seed(1)
    x_ep = torch.cat([x_all, torch.randn(max(EP - num, 0) * n, h, device=dev, dtype=bf, generator=gen)])
    x_srcs = {"anchor": x_ep.requires_grad_(), "variant_2n": x_all.clone().requires_grad_()}
    w_all = t(data["topk_w"].reshape(num * n, k), torch.float32)
    w_own = w_all[:n].to(bf)[:, :, None]
    dout_all = t(data["dout"].reshape(num * n, h), torch.float32)
    dout = dout_all[:n].to(bf)
    # what the other owners send back for their rows: w[t,j] * dout[t] (so the weight gradients
    # of rank 0's experts are complete and comparable with ours)
    d_others = (w_all[tok, j, None] * dout_all[tok])[~own].to(bf)

    return SimpleNamespace(n=n, h=h, k=k, dev=dev, bf=bf, topk=topk, tok=tok, j=j, e=e, offs=offs, own=own,
                           own_slot=own_slot, w1=w1, w2=w2, s1=s1, s2=s2, x_all=x_all, x_own=x_own, x_srcs=x_srcs,
                           w_own=w_own, dout=dout, d_others=d_others)


def anchor_forward(a, x_src, experts):
    """The anchor's forward on anchor_inputs `a`: dispatch (index_select from x_src), experts(rows in
    expert order) -> result rows, combine into rank 0's slots (the others' rows returned apart), the
    shared expert and the weighted sum. Returns (rank 0's output, the other owners' rows)."""
    import torch
    import torch.nn.functional as F

    n, k, h = a.n, a.k, a.h
    xr = x_src.index_select(0, a.tok)  # dispatch: pull rows from their owners
    y = experts(xr)
    mine = torch.zeros(n * k, h, device=a.dev, dtype=a.bf).index_copy(0, a.own_slot, y[a.own])
    others = y[~a.own]
    gs, us = (a.x_own @ a.s1).chunk(2, -1)
    shared = (F.silu(gs) * us) @ a.s2
    return shared + (mine.view(n, k, h) * a.w_own).sum(1), others


def full_output(shape, data, topk, x_all, s1, s2):
    """Rank 0's whole output with torch (untimed): its tokens through the experts of EVERY rank
    (the timed pipeline only computes rank 0's experts, as the anchor does); a peer's expert j
    computes with the weights every peer holds (emulation.make_inputs: routed expert El + j)."""
    import torch
    import torch.nn.functional as F

    n, k = shape.num_tokens, shape.top_k
    wts = data["weights"]
    dev, bf = x_all.device, torch.bfloat16
    w1 = torch.cat([torch.as_tensor(wts["w_gate"], device=dev), torch.as_tensor(wts["w_up"], device=dev)], 2).to(bf)
    w2 = torch.as_tensor(wts["w_down"], device=dev).to(bf)
    el = len(wts["w_gate"]) // 2
    e = topk[:n].reshape(-1)
    e = torch.where(e < el, e, el + e % el)  # the routed weights: rank 0's, then the peers'
    order = torch.sort(e, stable=True).indices
    offs = torch.cumsum(torch.bincount(e, minlength=2 * el), 0).to(torch.int32)
    g, u = torch._grouped_mm(x_all[order // k], w1, offs=offs).chunk(2, -1)
    y = torch._grouped_mm(F.silu(g) * u, w2, offs=offs).float()
    w = torch.as_tensor(data["topk_w"][0], device=dev).reshape(-1)[order]
    gs, us = (x_all[:n] @ s1.detach()).chunk(2, -1)
    out = ((F.silu(gs) * us) @ s2.detach()).float()
    return out.index_add(0, order // k, w[:, None] * y)


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


def as_torch(a):
    """A CuPy array as a torch tensor on the same memory (DLPack); uint16 (our bf16 bits) as bfloat16."""
    import cupy
    import torch

    if a.dtype == np.uint16:
        return torch.from_dlpack(a.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)
