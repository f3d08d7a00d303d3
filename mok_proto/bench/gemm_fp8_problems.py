"""bench_gemm.py --precision fp8 (scripts/bench_gemm.py): one EP rank's load in both precisions, our
FP8 grouped GEMMs (kernels/gemm_fp8.py) and our BF16 ones (kernels/gemm.py) on it, torch's row-wise
FP8 operands of the same problem for torch._scaled_grouped_mm, and the check of every FP8 output
against float64 on the dequantized operands.

Legend: T = tokens x K rows over El local experts (mok_proto.problem.rows_per_expert), R padded
rows, H hidden, I expert FFN. Our operands hold expert e's rows at offsets[e], a multiple of
plan.SEGMENT_ROWS as in the layer (the FP8 weight gradients need 128), zeros between the segments.
torch gets the rows packed (its row GEMMs), or each expert's padded to TORCH_K_ALIGN rows where its
weight-gradient GEMM groups them along K. The setup and the check are written against the array
module `ops.xp` and a quantizer: CuPy and kernels.fp8 on the GPU; NumPy and REFERENCE
(mok_proto.fp8 behind the same calls: the same bits) in the CPU tests. torch is imported inside
its functions.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from mok_proto import fp8
from mok_proto.plan.kinds import SEGMENT_ROWS
from mok_proto.problem import rows_per_expert
from mok_proto.reference import from_bf16, to_bf16

ERR_TOL = 2e-3  # of max |ref| of each expert's GEMM (fp32 accumulation of the dequantized products)
BF16_STEP = 2.0 ** -8  # a bf16 output's rounding, relative to its value
SWIGLU_BWD_STEP = 2.0 ** -10  # down_bwd's epilogue (fp32 SwiGLU backward, fast sigmoid), relative, generously
TORCH_K_ALIGN = 16  # torch's 2d-2d grouped GEMM: each group's K a multiple of 16 (16-byte aligned e4m3)
ACTIVATIONS = {"x": "hidden", "dy": "hidden", "h": "ffn", "g": "ffn", "u": "ffn", "dg": "ffn", "du": "ffn"}
QUANTIZED = ("x", "dy", "h", "dg", "du")  # what the FP8 GEMMs read (g, u: down_bwd's bf16 inputs)
WEIGHTS = {"w_gate": ("hidden", "ffn"), "w_up": ("hidden", "ffn"), "w_down": ("ffn", "hidden")}
FLOPS = {"gate_up": 2, "down": 1, "down_bwd": 1, "gate_up_bwd": 2, "down_wgrad": 1, "gate_up_wgrad": 2}  # x 2 T H I


class _Reference:
    """mok_proto.fp8 behind kernels.fp8's calls, on bf16 bits (NumPy): the same codes and scales."""

    @staticmethod
    def quantize_rows(x, transpose=False):
        return fp8.quantize_rows(from_bf16(x), transpose=transpose)

    @staticmethod
    def quantize_blocks(w, transposed=False):
        codes, scales = fp8.quantize_blocks(from_bf16(w))
        if not transposed:
            return codes, scales
        return (codes, scales, np.ascontiguousarray(codes.swapaxes(-1, -2)),
                np.ascontiguousarray(scales.swapaxes(-1, -2)))


REFERENCE = _Reference()


def aligned_layout(counts, align: int):
    """(offsets [El] int32, rows): expert e's segment at offsets[e], its counts[e] rows rounded up to
    a multiple of `align` (1: packed)."""
    sizes = -(-np.asarray(counts, np.int64) // align) * align
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32), int(sizes.sum())


def scatter(packed, counts, offsets, rows: int, xp):
    """packed [T, C] (expert by expert) -> [rows, C]: expert e's rows at offsets[e], zeros elsewhere."""
    out = xp.zeros((rows, packed.shape[1]), packed.dtype)
    start = 0
    for off, cnt in zip(np.asarray(offsets).tolist(), np.asarray(counts).tolist()):
        out[off:off + cnt] = packed[start:start + cnt]
        start += cnt
    return out


def make_operands(shape, ep: int, tokens: int, routing: str, xp, quantizer, seed: int = 0) -> SimpleNamespace:
    """One EP=ep rank's load (tokens x K rows over E/ep experts, `routing`): `src`, the bf16
    activations packed [T, .]; `bf`, our bf16 operands (the activations at the aligned offsets [R, .],
    the weights w_gate, w_up [El, H, I], w_down [El, I, H]); `q`, their FP8 pairs (codes, scales):
    q[a] = quantize_rows(a) and q[a_t] of a's transpose for each of QUANTIZED, q[w] and q[w_t] =
    the 128 x 128 quantization of w in both orientations; zeroed outputs: `out8` (the FP8 GEMMs'),
    `check8` (gate_up's check launch: h, hq, g, u), `out16` (the BF16 GEMMs')."""
    num_experts = shape.num_experts // ep
    dims = {"hidden": shape.hidden, "ffn": shape.ffn}
    hidden, ffn = shape.hidden, shape.ffn
    total = tokens * shape.top_k
    counts = rows_per_expert(total, num_experts, routing)
    offsets, rows = aligned_layout(counts, SEGMENT_ROWS)
    rng = xp.random.RandomState(seed)

    def bf16(*dims_, scale=1.0):
        return to_bf16((rng.standard_normal(dims_) * scale).astype(xp.float32))

    src = {name: bf16(total, dims[dim]) for name, dim in ACTIVATIONS.items()}
    bf = {name: scatter(a, counts, offsets, rows, xp) for name, a in src.items()}
    bf.update({name: bf16(num_experts, dims[r], dims[c], scale=dims[r] ** -0.5) for name, (r, c) in WEIGHTS.items()})
    q = {}
    for name in QUANTIZED:
        q[name] = quantizer.quantize_rows(bf[name])
        q[name + "_t"] = quantizer.quantize_rows(bf[name], transpose=True)
    for name in WEIGHTS:
        codes, scales, codes_t, scales_t = quantizer.quantize_blocks(bf[name], transposed=True)
        q[name], q[name + "_t"] = (codes, scales), (codes_t, scales_t)
    inside = np.zeros(rows, bool)
    for off, cnt in zip(offsets.tolist(), counts.tolist()):
        inside[off:off + cnt] = True

    def act(cols, dtype=xp.uint16):
        return xp.zeros((rows, cols), dtype)

    def hq():
        return act(ffn, xp.uint8), act(ffn // fp8.BLOCK, xp.float32)

    def outputs():
        return {"h": act(ffn), "y": act(hidden), "dg": act(ffn), "du": act(ffn), "dx": act(hidden),
                "dwd": xp.zeros((num_experts, ffn, hidden), xp.float32),
                **{k: xp.zeros((num_experts, hidden, ffn), xp.float32) for k in ("dwg", "dwu")}}

    return SimpleNamespace(xp=xp, num_experts=num_experts, hidden=hidden, ffn=ffn, total=total, rows=rows,
                           counts=counts, offsets=offsets, inside=inside, d_offsets=xp.asarray(offsets),
                           d_counts=xp.asarray(counts.astype(np.int32)), src=src, bf=bf, q=q,
                           out8={**outputs(), "hq": hq(), "dgq": hq(), "duq": hq()}, out16=outputs(),
                           check8={"h": act(ffn), "hq": hq(), "g": act(ffn), "u": act(ffn)})


def row_fields(ops) -> dict:
    """What a results row records of the load: experts, real rows, our padded rows and their alignment,
    the rows per expert."""
    return {"experts": int(ops.num_experts), "rows": int(ops.total), "padded_rows": int(ops.rows),
            "segment_rows": SEGMENT_ROWS, "counts": ops.counts.tolist()}


def flops(name: str, ops) -> int:
    """Useful FLOPs of problem `name` (the real rows only)."""
    return FLOPS[name] * 2 * ops.total * ops.hidden * ops.ffn


def ours(ops, name: str, error=None) -> dict:
    """{"fp8": run, "bf16": run}: our FP8 and our BF16 grouped GEMM of problem `name` on ops' operands,
    into ops.out8 and ops.out16. gate_up writes h (and FP8 its quantization hq), not g and u: as
    bench_gemm's BF16 rows time it; FP8 down_bwd also quantizes dg, du (dgq, duq), as the fused backward runs it (the
    sequential one launches the row quantizer instead)."""
    from mok_proto.kernels import gemm, gemm_fp8

    q, b, o8, o16, off, cnt = ops.q, ops.bf, ops.out8, ops.out16, ops.d_offsets, ops.d_counts
    runs = {
        "gate_up": (lambda: gemm_fp8.gate_up(q["x"], q["w_gate_t"], q["w_up_t"], off, cnt, o8["h"], o8["hq"],
                                             error=error),
                    lambda: gemm.gate_up(b["x"], b["w_gate"], b["w_up"], off, cnt, o16["h"], error=error)),
        "down": (lambda: gemm_fp8.down(q["h"], q["w_down_t"], off, cnt, o8["y"], error=error),
                 lambda: gemm.down(b["h"], b["w_down"], off, cnt, o16["y"], error=error)),
        "down_bwd": (lambda: gemm_fp8.down_bwd(q["dy"], q["w_down"], b["g"], b["u"], off, cnt, o8["dg"], o8["du"],
                                               dgq=o8["dgq"], duq=o8["duq"], error=error),
                     lambda: gemm.down_bwd(b["dy"], b["w_down"], b["g"], b["u"], off, cnt, o16["dg"], o16["du"],
                                           error=error)),
        "gate_up_bwd": (lambda: gemm_fp8.gate_up_bwd(q["dg"], q["du"], q["w_gate"], q["w_up"], off, cnt, o8["dx"],
                                                     error=error),
                        lambda: gemm.gate_up_bwd(b["dg"], b["du"], b["w_gate"], b["w_up"], off, cnt, o16["dx"],
                                                 error=error)),
        "down_wgrad": (lambda: gemm_fp8.down_wgrad(q["h_t"], q["dy_t"], off, cnt, o8["dwd"], error=error),
                       lambda: gemm.down_wgrad(b["h"], b["dy"], off, cnt, o16["dwd"], error=error)),
        "gate_up_wgrad": (lambda: gemm_fp8.gate_up_wgrad(q["x_t"], q["dg_t"], q["du_t"], off, cnt, o8["dwg"],
                                                         o8["dwu"], error=error),
                          lambda: gemm.gate_up_wgrad(b["x"], b["dg"], b["du"], off, cnt, o16["dwg"], o16["dwu"],
                                                     error=error)),
    }[name]
    return {"fp8": runs[0], "bf16": runs[1]}


def check_launch(ops, error=None):
    """gate_up once more (untimed) into ops.check8, writing g and u too: the GEMM's own outputs."""
    from mok_proto.kernels import gemm_fp8

    q, c = ops.q, ops.check8
    return gemm_fp8.gate_up(q["x"], q["w_gate_t"], q["w_up_t"], ops.d_offsets, ops.d_counts, c["h"], c["hq"],
                            g=c["g"], u=c["u"], error=error)


# ---------------------------------------------------------------------------------------------
# the check: float64 on the dequantized operands, each expert's GEMM apart
# ---------------------------------------------------------------------------------------------
def dequantize_rows(pair, xp):
    """float64 values of 1 x 128-blocked codes [..., K], scales [..., K/128] (decode x scale: exact)."""
    codes, scales = pair
    values = xp.asarray(fp8.DECODE, dtype=xp.float64)[codes]
    return (values.reshape(*scales.shape, fp8.BLOCK) * scales.astype(xp.float64)[..., None]).reshape(codes.shape)


def dequantize_blocks(pair, xp):
    """float64 values of 128 x 128-blocked codes [R, C], scales [R/128, C/128]."""
    codes, scales = pair
    values = xp.asarray(fp8.DECODE, dtype=xp.float64)[codes]
    (r, c), b = codes.shape, fp8.BLOCK
    return (values.reshape(r // b, b, c // b, b) * scales.astype(xp.float64)[:, None, :, None]).reshape(r, c)


def implied_error(got, want, step: float, xp) -> float:
    """The least GEMM error, relative to max |want|, that an output read back allows: `got` is the
    GEMM's value want + e rounded within `step` of itself (bf16: BF16_STEP; fp32 outputs: 0), so
    |e| >= (|got - want| - step |want|) / (1 + step) at every element. inf where got is not finite."""
    diff = xp.abs(got - want)
    if not want.size:
        return 0.0
    if not bool(xp.isfinite(diff).all()):
        return math.inf
    excess = max(float(((diff - step * xp.abs(want)) / (1 + step)).max()), 0.0)
    scale = float(xp.abs(want).max())
    return excess / scale if scale > 0 else (math.inf if excess > 0 else 0.0)


def _experts(ops):
    for e, (off, cnt) in enumerate(zip(ops.offsets.tolist(), ops.counts.tolist())):
        if cnt:
            yield e, slice(off, off + cnt)


def _comparisons(name, ops):
    """(got, want, step) per output and expert of problem `name`: got as the last launch left it (as
    float64), want the float64 GEMM (down_bwd: dh, and got each output divided by its SwiGLU factor)."""
    xp, q, o = ops.xp, ops.q, ops.out8

    def weight(key, e):
        return dequantize_blocks((q[key][0][e], q[key][1][e]), xp)

    def f64(a):
        return (from_bf16(a) if a.dtype == np.uint16 else a).astype(xp.float64)

    a = {key: dequantize_rows(q[key], xp) for key in {"gate_up": ("x",), "down": ("h",), "down_bwd": ("dy",),
                                                      "gate_up_bwd": ("dg", "du"), "down_wgrad": ("h_t", "dy_t"),
                                                      "gate_up_wgrad": ("x_t", "dg_t", "du_t")}[name]}
    for e, seg in _experts(ops):
        if name == "gate_up":
            yield f64(ops.check8["g"][seg]), a["x"][seg] @ weight("w_gate_t", e).T, BF16_STEP
            yield f64(ops.check8["u"][seg]), a["x"][seg] @ weight("w_up_t", e).T, BF16_STEP
        elif name == "down":
            yield f64(o["y"][seg]), a["h"][seg] @ weight("w_down_t", e).T, BF16_STEP
        elif name == "down_bwd":
            dh = a["dy"][seg] @ weight("w_down", e).T
            g, u = f64(ops.bf["g"][seg]), f64(ops.bf["u"][seg])
            sig = 1.0 / (1.0 + xp.exp(-g))
            for out, factor in (("dg", u * sig * (1.0 + g * (1.0 - sig))), ("du", g * sig)):
                known = factor != 0  # where it is 0 the output says nothing of dh
                implied_dh = xp.where(known, f64(o[out][seg]) / xp.where(known, factor, 1.0), dh)
                yield implied_dh, dh, BF16_STEP + SWIGLU_BWD_STEP
        elif name == "gate_up_bwd":
            yield f64(o["dx"][seg]), (a["dg"][seg] @ weight("w_gate", e).T
                                      + a["du"][seg] @ weight("w_up", e).T), BF16_STEP
        elif name == "down_wgrad":
            yield f64(o["dwd"][e]), a["h_t"][:, seg] @ a["dy_t"][:, seg].T, 0.0
        else:
            yield f64(o["dwg"][e]), a["x_t"][:, seg] @ a["dg_t"][:, seg].T, 0.0
            yield f64(o["dwu"][e]), a["x_t"][:, seg] @ a["du_t"][:, seg].T, 0.0


def fp8_error(name: str, ops, quantizer) -> tuple[float, list]:
    """(max_rel_err, mismatched) of problem `name`'s FP8 outputs as the last launches left them:
    the largest implied_error over its outputs and experts against float64 on the dequantized
    operands (each expert's GEMM and its max |ref|; gate_up: g and u of check_launch), and the
    outputs that should equal others bit for bit but do not (gate_up: the timed launch's h and hq
    against the check launch's, hq against quantizer.quantize_rows(h)), in the experts' rows."""
    xp = ops.xp
    error = max((implied_error(got, want, step, xp) for got, want, step in _comparisons(name, ops)), default=0.0)
    mismatched = []
    if name == "gate_up":
        o, again, inside = ops.out8, ops.check8, xp.asarray(ops.inside)
        codes, scales = quantizer.quantize_rows(o["h"])
        for what, x, y in (("h (check launch)", o["h"], again["h"]),
                           ("hq (check launch)", o["hq"][0], again["hq"][0]),
                           ("hs (check launch)", o["hq"][1], again["hq"][1]),
                           ("hq (quantize_rows(h))", o["hq"][0], codes), ("hs (quantize_rows(h))", o["hq"][1], scales)):
            if not bool((x[inside].view(np.uint8) == y[inside].view(np.uint8)).all()):
                mismatched.append(what)
    return error, mismatched


# ---------------------------------------------------------------------------------------------
# torch._scaled_grouped_mm: row-wise scales, what torch offers on sm_90
# ---------------------------------------------------------------------------------------------
def torch_fp8(ops, name: str):
    """(run, None): torch._scaled_grouped_mm of problem `name` on row-wise e4m3 operands quantized from
    the same bf16 values (torch_operands, before any timing; bf16 out, use_fast_accum=False); or
    (None, why) where this torch has no such call or refuses the problem here."""
    import torch

    if not hasattr(torch, "_scaled_grouped_mm"):
        return None, f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    a, b, scale_a, scale_b, offs = torch_operands(ops, name)

    def run():
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)

    try:
        run()
        torch.cuda.synchronize()
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:  # torch's refusals
        first = (str(e).splitlines() or [""])[0]
        return None, f"torch._scaled_grouped_mm refused {name}: {type(e).__name__}: {first}"
    return run, None


def torch_operands(ops, name: str):
    """(mat_a, mat_b, scale_a, scale_b, offs) of problem `name` for torch._scaled_grouped_mm. Row
    problems are 2d-3d: A [T, K] packed, B [El, K, N] column-major, offs the experts' ends, one scale
    per row of A and per expert and column of B. Weight gradients are 2d-2d: A [M, T'] and B [T', N]
    column-major with T' the rows, each expert's padded to TORCH_K_ALIGN (zeros), one scale per
    expert and row of A, per expert and column of B. Scales decode: x ~ codes * scale."""
    import torch

    src, w = ops.src, ops.bf

    def t(a):  # bf16 bits (CuPy) -> float32 torch
        return torch.from_dlpack(a.view(np.int16)).view(torch.bfloat16).float()

    if name in ("down_wgrad", "gate_up_wgrad"):
        offsets, rows = aligned_layout(ops.counts, TORCH_K_ALIGN)
        ends = np.append(offsets[1:], rows)
        spans = list(zip([0, *ends[:-1].tolist()], ends.tolist()))

        def by_k(key):  # [C, T'] row-major: K (the rows) contiguous
            return t(scatter(src[key], ops.counts, offsets, rows, ops.xp)).T.contiguous()

        a, b = {"down_wgrad": (by_k("h"), by_k("dy")),
                "gate_up_wgrad": (by_k("x"), torch.cat([by_k("dg"), by_k("du")], 0))}[name]
        (qa, sa), (qb, sb) = rowwise(a, spans), rowwise(b, spans)
        return qa, qb.t(), sa.flatten(), sb.flatten(), torch.tensor(ends, dtype=torch.int32, device="cuda")
    gate_up_w = torch.cat([t(w["w_gate"]), t(w["w_up"])], 2)  # [El, H, 2I]
    a, b_nk = {"gate_up": (t(src["x"]), gate_up_w.transpose(1, 2)),
               "down": (t(src["h"]), t(w["w_down"]).transpose(1, 2)),
               "down_bwd": (t(src["dy"]), t(w["w_down"])),
               "gate_up_bwd": (torch.cat([t(src["dg"]), t(src["du"])], 1), gate_up_w)}[name]
    (qa, sa), (qb, sb) = rowwise(a), rowwise(b_nk.contiguous())
    return qa, qb.transpose(-2, -1), sa, sb, torch.tensor(np.cumsum(ops.counts), dtype=torch.int32, device="cuda")


def rowwise(values, spans=None):
    """values [..., K] float32 (torch) -> (e4m3 codes, fp32 scales): one scale per row, amax / 448
    (1 for a row of zeros), as torch's row-wise recipe; with spans [(start, end)] of K (2-D values):
    one per span and row, scales [spans, rows]."""
    import torch

    def scale_of(v):
        s = v.abs().amax(dim=-1) / fp8.E4M3_MAX
        return torch.where(s > 0, s, torch.ones_like(s))

    if spans is None:
        scales = scale_of(values)
        divisor = scales.unsqueeze(-1)
    else:
        scales = torch.stack([scale_of(values[:, lo:hi]) if hi > lo else values.new_ones(values.shape[0])
                              for lo, hi in spans])
        sizes = torch.tensor([hi - lo for lo, hi in spans], device=values.device)
        divisor = scales.repeat_interleave(sizes, dim=0).T
    codes = (values / divisor).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.contiguous(), scales.contiguous()
