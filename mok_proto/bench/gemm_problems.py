"""Our grouped expert GEMMs against torch._grouped_mm and a dense cuBLAS GEMM (scripts/bench_gemm.py):
the operands of one EP rank's load, the six problems (ours, the torch reference, the dense GEMM of
the same FLOPs), the timing and the output check. torch and CuPy are imported inside the functions."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mok_proto.bench.timing import summarize, time_stages
from mok_proto.problem import rows_per_expert

ERR_TOL = 2.0 ** -6  # bf16 outputs (ours fuse in fp32, the reference rounds GEMM outputs to bf16 first)
PROBLEMS = ("gate_up", "down", "down_bwd", "gate_up_bwd", "down_wgrad", "gate_up_wgrad")


def settle(flush):
    """Before a timed call, untimed: an L2 flush (zero `flush`, a device buffer larger than L2) and a
    GPU sleep that hides the host's launch cost."""
    import torch

    flush.zero_()
    torch.cuda._sleep(2_000_000)  # ~1 ms: longer than any wrapper's host-side cost


def timed(fn, iters, warmup, flush):
    """One event pair around fn per iteration, after an L2 flush and a GPU sleep that hides the
    host's launch cost (neither is timed)."""

    def iteration(mark):
        settle(flush)
        mark("run")
        fn()
        mark(None)

    return summarize(time_stages(iteration, iters, warmup, api="torch")["run"])


def rel_err(got, want):
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def grouped_mm(a, b, offs):
    """torch._grouped_mm, with the operand layout it accepts (layouts prepared outside timing)."""
    import torch

    try:
        torch._grouped_mm(a, b, offs=offs)
        return lambda: torch._grouped_mm(a, b, offs=offs)
    except RuntimeError:
        bt = b.transpose(-2, -1).contiguous().transpose(-2, -1)
        torch._grouped_mm(a, bt, offs=offs)
        return lambda: torch._grouped_mm(a, bt, offs=offs)


def make_operands(shape, ep: int, tokens: int):
    """Random bf16 operands of one rank's load at EP=ep (tokens x K rows over E/ep experts), as torch
    tensors and as CuPy views of the same memory (`c`), with the output buffers of every problem."""
    import cupy
    import torch

    dev = torch.device("cuda")
    cp = lambda t: cupy.from_dlpack(t.view(torch.int16) if t.dtype == torch.bfloat16 else t)  # noqa: E731
    num_experts, hidden, ffn = shape.num_experts // ep, shape.hidden, shape.ffn
    rows = tokens * shape.top_k
    torch.manual_seed(0)
    bf = lambda *s, scale=1.0: (torch.randn(*s, device=dev) * scale).to(torch.bfloat16)  # noqa: E731
    x, dy = bf(rows, hidden), bf(rows, hidden)
    h, g, u, dg, du = (bf(rows, ffn) for _ in range(5))
    wg, wu = bf(num_experts, hidden, ffn, scale=hidden ** -0.5), bf(num_experts, hidden, ffn, scale=hidden ** -0.5)
    wd = bf(num_experts, ffn, hidden, scale=ffn ** -0.5)
    wgu, dgu = torch.cat([wg, wu], dim=2), torch.cat([dg, du], dim=1)
    c = {name: cp(t) for name, t in (("x", x), ("dy", dy), ("h", h), ("g", g), ("u", u), ("dg", dg), ("du", du),
                                     ("wg", wg), ("wu", wu), ("wd", wd))}
    out = {name: torch.empty(rows, n, dtype=torch.bfloat16, device=dev) for name, n in
           (("h", ffn), ("y", hidden), ("dg", ffn), ("du", ffn), ("dx", hidden))}
    dwd = torch.empty(num_experts, ffn, hidden, device=dev)
    dwg, dwu = torch.empty(num_experts, hidden, ffn, device=dev), torch.empty(num_experts, hidden, ffn, device=dev)
    c.update({"out_" + name: cp(t) for name, t in out.items()})
    c.update(dwd=cp(dwd), dwg=cp(dwg), dwu=cp(dwu))
    return SimpleNamespace(num_experts=num_experts, hidden=hidden, ffn=ffn, rows=rows, x=x, dy=dy, h=h, g=g, u=u,
                           wd=wd, wgu=wgu, dgu=dgu, out=out, dwd=dwd, dwg=dwg, dwu=dwu, c=c)


def problems(ops, routing: str):
    """({problem: (ours, make the torch reference, the dense GEMM's operands, FLOPs)}, offs, error
    record) of one routing ("uniform" or "skewed", mok_proto.problem.rows_per_expert)."""
    import cupy
    import torch

    from mok_proto.kernels import gemm
    from mok_proto.kernels.errors import ErrorRecord

    rows, hidden, ffn, c = ops.rows, ops.hidden, ops.ffn, ops.c
    x, dy, h, wd, wgu, dgu = ops.x, ops.dy, ops.h, ops.wd, ops.wgu, ops.dgu
    counts = rows_per_expert(rows, ops.num_experts, routing)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    d_off, d_cnt = cupy.asarray(offsets.astype(np.int32)), cupy.asarray(counts.astype(np.int32))
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
    err = ErrorRecord(gemm.TIMEOUT_NS / 1e9)
    table = {
        "gate_up": (lambda: gemm.gate_up(c["x"], c["wg"], c["wu"], d_off, d_cnt, c["out_h"], error=err),
                    lambda: grouped_mm(x, wgu, offs), (x, wgu[0]), 2 * rows * hidden * 2 * ffn),
        "down": (lambda: gemm.down(c["h"], c["wd"], d_off, d_cnt, c["out_y"], error=err),
                 lambda: grouped_mm(h, wd, offs), (h, wd[0]), 2 * rows * ffn * hidden),
        "down_bwd": (lambda: gemm.down_bwd(c["dy"], c["wd"], c["g"], c["u"], d_off, d_cnt, c["out_dg"],
                                           c["out_du"], error=err),
                     lambda: grouped_mm(dy, wd.transpose(-2, -1), offs), (dy, wd[0].t()),
                     2 * rows * hidden * ffn),
        "gate_up_bwd": (lambda: gemm.gate_up_bwd(c["dg"], c["du"], c["wg"], c["wu"], d_off, d_cnt, c["out_dx"],
                                                 error=err),
                        lambda: grouped_mm(dgu, wgu.transpose(-2, -1), offs), (dgu, wgu[0].t()),
                        2 * rows * 2 * ffn * hidden),
        "down_wgrad": (lambda: gemm.down_wgrad(c["h"], c["dy"], d_off, d_cnt, c["dwd"], error=err),
                       lambda: grouped_mm(h.t(), dy, offs), (h.t(), dy), 2 * rows * ffn * hidden),
        "gate_up_wgrad": (lambda: gemm.gate_up_wgrad(c["x"], c["dg"], c["du"], d_off, d_cnt, c["dwg"], c["dwu"],
                                                     error=err),
                          lambda: grouped_mm(x.t(), dgu, offs), (x.t(), dgu), 2 * rows * hidden * 2 * ffn),
    }
    return table, offs, err


def reference_errors(name, ops, offs):
    """Max relative error of our outputs for problem `name` against torch._grouped_mm."""
    import torch

    x, dy, h, g, u, dgu, wgu, wd, out = ops.x, ops.dy, ops.h, ops.g, ops.u, ops.dgu, ops.wgu, ops.wd, ops.out
    ffn = h.shape[1]
    if name == "gate_up":
        ref = grouped_mm(x, wgu, offs)().float()
        return rel_err(out["h"], torch.nn.functional.silu(ref[:, :ffn]) * ref[:, ffn:])
    if name == "down":
        return rel_err(out["y"], grouped_mm(h, wd, offs)())
    if name == "down_bwd":
        dh, sig = grouped_mm(dy, wd.transpose(-2, -1), offs)().float(), torch.sigmoid(g.float())
        return max(rel_err(out["dg"], dh * u.float() * sig * (1 + g.float() * (1 - sig))),
                   rel_err(out["du"], dh * g.float() * sig))
    if name == "gate_up_bwd":
        return rel_err(out["dx"], grouped_mm(dgu, wgu.transpose(-2, -1), offs)())
    if name == "down_wgrad":
        return rel_err(ops.dwd, grouped_mm(h.t(), dy, offs)())
    ref = grouped_mm(x.t(), dgu, offs)()
    return max(rel_err(ops.dwg, ref[..., :ffn]), rel_err(ops.dwu, ref[..., ffn:]))
