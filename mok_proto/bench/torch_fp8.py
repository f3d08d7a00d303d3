"""bench_layer.py --precision fp8's second baseline: the anchor's pipeline (torch_baselines) with the
routed experts' forward GEMMs as torch._scaled_grouped_mm on row-wise e4m3 operands, what torch
offers on sm_90 (gemm_fp8_problems.rowwise: one scale per row, amax / 448). The weights are
quantized once, before timing (one scale per expert and output column); the dispatched rows and
SwiGLU's h are quantized inside the timed forward, as a torch user's FP8 layer must; bf16 out; the
shared expert stays BF16. Forward only: its backward is not timed (backward_note says why)."""

from __future__ import annotations

from mok_proto.bench.timing import summarize, time_stages

REFUSALS = (RuntimeError, ValueError, TypeError, NotImplementedError)  # how torch refuses a call


def torch_fp8_pipeline(shape, data, iters, warmup):
    """(stats of the forward, timed as torch_pipeline's: eager, no_grad, one event pair an
    iteration), or (None, why) where this torch has no torch._scaled_grouped_mm or refuses it."""
    import torch
    import torch.nn.functional as F

    from mok_proto.bench.gemm_fp8_problems import rowwise
    from mok_proto.bench.torch_baselines import anchor_forward, anchor_inputs

    if not hasattr(torch, "_scaled_grouped_mm"):
        return None, f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    a = anchor_inputs(shape, data)
    bf = torch.bfloat16
    with torch.no_grad():
        # B operands [El, K, N] column-major: codes of W^T [El, N, K], one scale per expert and column
        q1, s1 = rowwise(a.w1.detach().float().transpose(1, 2).contiguous())
        q2, s2 = rowwise(a.w2.detach().float().transpose(1, 2).contiguous())
        b1, b2 = q1.transpose(-2, -1), q2.transpose(-2, -1)

        def experts(xr):
            qa, sa = rowwise(xr.float())
            g, u = torch._scaled_grouped_mm(qa, b1, sa, s1, offs=a.offs, out_dtype=bf).chunk(2, -1)
            qh, sh = rowwise((F.silu(g) * u).float())
            return torch._scaled_grouped_mm(qh, b2, sh, s2, offs=a.offs, out_dtype=bf)

        def fwd():
            return anchor_forward(a, a.x_srcs["anchor"], experts)

        try:
            fwd()
            torch.cuda.synchronize()
        except REFUSALS as e:
            return None, f"torch._scaled_grouped_mm refused the pipeline: {type(e).__name__}: {_first_line(e)}"
        stats = summarize(time_stages(lambda mark: (mark("run"), fwd(), mark(None)), iters, warmup, api="torch")["run"])
    return stats, None


def backward_note() -> str:
    """Why the FP8 pipeline's backward is not timed, from a backward through a small
    torch._scaled_grouped_mm: the error autograd raises (its first line), or that it has one and
    this bench times the forward only."""
    import torch

    x = torch.ones(32, 32, device="cuda", requires_grad=True)
    w = torch.ones(1, 32, 32, device="cuda").to(torch.float8_e4m3fn).transpose(-2, -1)
    one = torch.ones(1, 32, device="cuda")
    try:
        out = torch._scaled_grouped_mm(x.to(torch.float8_e4m3fn), w, one[0], one,
                                       offs=torch.tensor([32], dtype=torch.int32, device="cuda"),
                                       out_dtype=torch.bfloat16)
    except REFUSALS as e:
        return f"forward only: the backward probe's forward was refused ({type(e).__name__}: {_first_line(e)})"
    try:
        out.float().sum().backward()
    except REFUSALS as e:
        return (f"forward only: torch {torch.__version__} has no backward through torch._scaled_grouped_mm "
                f"({type(e).__name__}: {_first_line(e)})")
    return f"forward only: torch {torch.__version__} differentiates torch._scaled_grouped_mm; not timed here"


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [""])[0]
