"""Wrappers of cuda/gemm_fp8.cuh: the grouped FP8 GEMMs of the expert FFNs (sm_90a), e4m3 x e4m3
-> fp32 with block scales applied once per 128-deep k-block (mok_proto/reference_fp8.py
scaled_matmul is its float32 mirror).

Legend as kernels/gemm.py. An FP8 operand is a pair (codes, scales): uint8 e4m3 codes and fp32
scales in mok_proto/fp8.py's layouts (kernels/fp8.py quantizes on the GPU, bit for bit the same):
    activation [rows, K]           quantize_rows(x):                 codes [rows, K], scales [rows, K/128]
    weight, as [E, N, K]           quantize_blocks(w):               codes [E, N, K], scales [E, N/128, K/128]
    weight-gradient operand        quantize_rows(x, transpose=True): codes [X, rows], scales [X, rows/128]
Every operand is K-major (Hopper's FP8 MMA reads no other): the forward takes the weights
transposed (quantize_blocks(w, transposed=True)'s codes_t, scales_t: Wg^T [E, I, H], Wd^T [E, H, I]),
the data gradients the weights as they are. Tile sizes: K and N multiples of 128 (N of down,
down_bwd, gate_up_bwd, down_wgrad: 256). The weight gradients contract over rows: `rows` a multiple
of 128, and every expert segment must start at a multiple of 128 rows (the kernel reads the offsets
on the device and cannot check them; a misaligned segment reads the wrong scale blocks).

    gate_up        g = x Wg, u = x Wu; h = silu(g) * u in bf16, hq = quantize_rows(h) of that bf16 h
    down           y = row_scale * (h Wd)
    down_bwd       dh = dy Wd^T; dg = dh * u * silu'(g), du = dh * silu(g)   (g, u bf16 as gate_up wrote them);
                   dgq, duq = quantize_rows of the stored dg, du where asked
    gate_up_bwd    dx = dg Wg^T + du Wu^T
    down_wgrad     dWd[e] = h_e^T dy_e                 (fp32, deterministic: no atomics)
    gate_up_wgrad  dWg[e] = x_e^T dg_e, dWu[e] = x_e^T du_e
Every wrapper checks its arguments first (one-line ValueError), then launches and returns the
ErrorRecord the launch reports into (`error=`, or the wrapper's own record), as kernels/gemm.py's
do; pack_only returns the packed Fp8GemmParams instead of launching.
"""

from __future__ import annotations

from mok_proto import abi
from mok_proto.kernels import gemm
from mok_proto.kernels.build import CudaModule

BK = abi.CONST["kQuantBlock"]  # k depth of a stage: one 1 x 128 scale block
BM, BN = gemm.BM, gemm.BN
NAMESPACE = "mok::gemm_fp8"
MODULE = CudaModule("gemm_fp8.cuh", tuple(f"{NAMESPACE}::grouped_gemm<{i}>" for i in range(len(gemm.PROBLEMS)))
                    + (f"{NAMESPACE}::export_sizes",), archs=("sm_90a",))
MODULE.variant(gemm.NO_EPILOGUE)  # gemm.without_epilogue()'s (registered: the CPU tests compile it)


def smem_bytes() -> int:
    """Dynamic shared memory of a launch (kSmemBytes of the compiled header)."""
    return gemm.smem_bytes(MODULE, NAMESPACE)


def site_record(problem: str):
    """The error record a wrapper uses when the caller gives none (gemm.site_record's, "fp8 " + problem)."""
    return gemm.site_record(f"fp8 {problem}")


# ---------------------------------------------------------------------------------------------
def _pair(name, pair, ndim):
    """(codes, scales) of an FP8 operand; codes with `ndim` dimensions."""
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise ValueError(f"{name}: expected a pair (codes, scales), got {type(pair).__name__}")
    codes, scales = pair
    if codes.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim}-D codes, got shape {tuple(codes.shape)}")
    return codes, scales


def _rows(name, pair, shape):
    """A 1 x 128-blocked operand: codes `shape` [R, K], scales [R, K / 128]."""
    codes, scales = _pair(name, pair, 2)
    gemm._check(f"{name} codes", codes, shape, "u8")
    gemm._check(f"{name} scales", scales, (shape[0], shape[1] // BK), "f32")
    return codes, scales


def _blocks(name, pair, shape):
    """A 128 x 128-blocked weight: codes `shape` [E, N, K], scales [E, N / 128, K / 128]."""
    codes, scales = _pair(name, pair, 3)
    gemm._check(f"{name} codes", codes, shape, "u8")
    gemm._check(f"{name} scales", scales, (shape[0], shape[1] // BK, shape[2] // BK), "f32")
    return codes, scales


def _row_operands(a_name, a, w_name, w, k_name, n_name, n_of):
    """A row problem's A (1 x 128 blocks, codes [rows, K]) and weight (128 x 128 blocks, codes
    [E, N, K]), checked (K a multiple of 128, N of n_of): (rows, K, E, N, A codes, A scales, W
    codes, W scales)."""
    ac, _ = _pair(a_name, a, 2)
    wc, _ = _pair(w_name, w, 3)
    (rows, k), (num_experts, n) = ac.shape, wc.shape[:2]
    _multiple(k_name, k, BK), _multiple(n_name, n, n_of)
    return (rows, k, num_experts, n, *_rows(a_name, a, (rows, k)), *_blocks(w_name, w, (num_experts, n, k)))


def _multiple(name, value, of):
    if value % of:
        raise ValueError(f"{name}={value} must be a multiple of {of}")


def _map(codes, inner: int, outer: int):
    """The TMA map of codes viewed as [outer, inner], boxes of 128 rows x 128 bytes."""
    return gemm.tensor_map(codes, inner, outer, BK, BM, "u8")


def _launch(problem, error, pack_only, **fields):
    return gemm.launch_grouped(MODULE, NAMESPACE, abi.FP8_GEMM_PARAMS, problem, f"fp8 {problem}", error, pack_only,
                               fields)


def _row_problem_fields(a_k: int, b_n: int, b_k: int) -> dict:
    """Scale strides of a row problem: A's [rows, a_k / 128], B's [E, b_n / 128, b_k / 128]."""
    return dict(a_scale_stride=a_k // BK, b_scale_stride=b_k // BK, b_scale_group_stride=(b_n // BK) * (b_k // BK))


# ---------------------------------------------------------------------------------------------
def gate_up(x, w_gate_t, w_up_t, row_offsets, row_counts, h, hq, g=None, u=None, pow2=False, error=None,
            pack_only=False):
    """x (codes [rows,H], scales), w_gate_t / w_up_t (Wg^T, Wu^T codes [E,I,H], scales [E,I/128,H/128])
    -> h bf16 [rows,I] and hq (codes [rows,I], scales [rows,I/128]) = quantize_rows(h) of the bf16 h
    (pow2: power-of-two scales); g, u bf16 [rows,I] too where given."""
    rows, hidden, num_experts, ffn, xc, xs, wgc, wgs = _row_operands("x", x, "w_gate_t", w_gate_t, "H", "I", BN // 2)
    wuc, wus = _blocks("w_up_t", w_up_t, (num_experts, ffn, hidden))
    gemm._check("h", h, (rows, ffn), "bf16")
    hqc, hqs = _rows("hq", hq, (rows, ffn))
    for name, a in (("g", g), ("u", u)):
        if a is not None:
            gemm._check(name, a, (rows, ffn), "bf16")
    gemm._groups(row_offsets, row_counts, rows)
    return _launch("gate_up", error, pack_only, num_groups=num_experts, n=ffn, k=hidden, ldo=ffn,
                   **_row_problem_fields(hidden, ffn, hidden), pow2=int(bool(pow2)), scale_a1=xs, scale_b1=wgs,
                   scale_b2=wus, out1=h, out2=g if g is not None else 0, out3=u if u is not None else 0,
                   out_codes=hqc, out_scales=hqs, row_offsets=row_offsets, row_counts=row_counts,
                   tmap_a1=_map(xc, hidden, rows), tmap_b1=_map(wgc, hidden, num_experts * ffn),
                   tmap_b2=_map(wuc, hidden, num_experts * ffn))


def down(h, w_down_t, row_offsets, row_counts, y, row_scale=None, error=None, pack_only=False):
    """h (codes [rows,I], scales), w_down_t (Wd^T codes [E,H,I], scales [E,H/128,I/128]) -> y bf16
    [rows,H] = row_scale[:,None] * (h Wd)."""
    rows, ffn, num_experts, hidden, hc, hs, wdc, wds = _row_operands("h", h, "w_down_t", w_down_t, "I", "H", BN)
    gemm._check("y", y, (rows, hidden), "bf16")
    if row_scale is not None:
        gemm._check("row_scale", row_scale, (rows,), "f32")
    gemm._groups(row_offsets, row_counts, rows)
    return _launch("down", error, pack_only, num_groups=num_experts, n=hidden, k=ffn, ldo=hidden,
                   **_row_problem_fields(ffn, hidden, ffn), scale_a1=hs, scale_b1=wds, out1=y,
                   row_scale=row_scale if row_scale is not None else 0, row_offsets=row_offsets,
                   row_counts=row_counts, tmap_a1=_map(hc, ffn, rows), tmap_b1=_map(wdc, ffn, num_experts * hidden))


def down_bwd(dy, w_down, g, u, row_offsets, row_counts, dg, du, dgq=None, duq=None, error=None, pack_only=False):
    """dy (codes [rows,H], scales), w_down (Wd codes [E,I,H], scales [E,I/128,H/128]), g/u bf16
    [rows,I] -> dg, du bf16 [rows,I] (the SwiGLU backward of dh = dy Wd^T); with dgq, duq (codes
    [rows,I], scales [rows,I/128], both or neither) also quantize_rows of the stored dg, du."""
    rows, hidden, num_experts, ffn, dyc, dys, wdc, wds = _row_operands("dy", dy, "w_down", w_down, "H", "I", BN)
    for name, a in (("g", g), ("u", u), ("dg", dg), ("du", du)):
        gemm._check(name, a, (rows, ffn), "bf16")
    if (dgq is None) != (duq is None):
        raise ValueError("dgq, duq: give both (dg and du quantized in the epilogue) or neither")
    codes = {}
    if dgq is not None:
        (dgc, dgs), (duc, dus) = _rows("dgq", dgq, (rows, ffn)), _rows("duq", duq, (rows, ffn))
        codes = dict(out_codes=dgc, out_scales=dgs, out_codes2=duc, out_scales2=dus)
    gemm._groups(row_offsets, row_counts, rows)
    return _launch("down_bwd", error, pack_only, num_groups=num_experts, n=ffn, k=hidden, ldo=ffn,
                   **_row_problem_fields(hidden, ffn, hidden), scale_a1=dys, scale_b1=wds, out1=dg, out2=du, **codes,
                   row_offsets=row_offsets, row_counts=row_counts, tmap_a1=_map(dyc, hidden, rows),
                   tmap_b1=_map(wdc, hidden, num_experts * ffn), tmap_aux1=gemm.tensor_map(g, ffn, rows, 64, BM),
                   tmap_aux2=gemm.tensor_map(u, ffn, rows, 64, BM))


def gate_up_bwd(dg, du, w_gate, w_up, row_offsets, row_counts, dx, error=None, pack_only=False):
    """dg/du (codes [rows,I], scales), w_gate/w_up (Wg, Wu codes [E,H,I], scales [E,H/128,I/128])
    -> dx bf16 [rows,H] = dg Wg^T + du Wu^T (one accumulator over K = 2I: dg/Wg, then du/Wu)."""
    dgc, _ = _pair("dg", dg, 2)
    wc, _ = _pair("w_gate", w_gate, 3)
    (rows, ffn), (num_experts, hidden) = dgc.shape, wc.shape[:2]
    _multiple("I", ffn, BK), _multiple("H", hidden, BN)
    dgc, dgs = _rows("dg", dg, (rows, ffn))
    duc, dus = _rows("du", du, (rows, ffn))
    wgc, wgs = _blocks("w_gate", w_gate, (num_experts, hidden, ffn))
    wuc, wus = _blocks("w_up", w_up, (num_experts, hidden, ffn))
    gemm._check("dx", dx, (rows, hidden), "bf16")
    gemm._groups(row_offsets, row_counts, rows)
    return _launch("gate_up_bwd", error, pack_only, num_groups=num_experts, n=hidden, k=2 * ffn, k_split=ffn,
                   ldo=hidden, **_row_problem_fields(ffn, hidden, ffn), scale_a1=dgs, scale_a2=dus, scale_b1=wgs,
                   scale_b2=wus, out1=dx, row_offsets=row_offsets, row_counts=row_counts,
                   tmap_a1=_map(dgc, ffn, rows), tmap_a2=_map(duc, ffn, rows),
                   tmap_b1=_map(wgc, ffn, num_experts * hidden), tmap_b2=_map(wuc, ffn, num_experts * hidden))


def down_wgrad(h_t, dy_t, row_offsets, row_counts, dw_down, error=None, pack_only=False, accumulate=False):
    """h_t (h^T codes [I,rows], scales [I,rows/128]), dy_t (dy^T codes [H,rows], scales) -> dw_down
    fp32 [E,I,H], dw_down[e] = h_e^T dy_e. accumulate: add to dw_down as the rows after the ones it
    holds (segments split at a multiple of 128 rows give the bits of one launch)."""
    num_experts, ffn, hidden = dw_down.shape
    hc, _ = _pair("h_t", h_t, 2)
    rows = hc.shape[1]
    _multiple("rows", rows, BK), _multiple("I", ffn, BM), _multiple("H", hidden, BN)
    hc, hs = _rows("h_t", h_t, (ffn, rows))
    dyc, dys = _rows("dy_t", dy_t, (hidden, rows))
    gemm._check("dw_down", dw_down, dw_down.shape, "f32")
    gemm._groups(row_offsets, row_counts, rows)
    return _launch("down_wgrad", error, pack_only, num_groups=num_experts, m=ffn, n=hidden, ldo=hidden,
                   o_group_stride=ffn * hidden, a_scale_stride=rows // BK, b_scale_stride=rows // BK, scale_a1=hs,
                   scale_b1=dys, out1=dw_down, row_offsets=row_offsets, row_counts=row_counts,
                   accumulate=int(bool(accumulate)), tmap_a1=_map(hc, rows, ffn), tmap_b1=_map(dyc, rows, hidden))


def gate_up_wgrad(x_t, dg_t, du_t, row_offsets, row_counts, dw_gate, dw_up, error=None, pack_only=False,
                  accumulate=False):
    """x_t (x^T codes [H,rows], scales [H,rows/128]), dg_t/du_t (codes [I,rows], scales) -> dw_gate,
    dw_up fp32 [E,H,I]; accumulate as down_wgrad."""
    num_experts, hidden, ffn = dw_gate.shape
    xc, _ = _pair("x_t", x_t, 2)
    rows = xc.shape[1]
    _multiple("rows", rows, BK), _multiple("H", hidden, BM), _multiple("I", ffn, BN // 2)
    xc, xs = _rows("x_t", x_t, (hidden, rows))
    dgc, dgs = _rows("dg_t", dg_t, (ffn, rows))
    duc, dus = _rows("du_t", du_t, (ffn, rows))
    gemm._check("dw_gate", dw_gate, dw_gate.shape, "f32"), gemm._check("dw_up", dw_up, dw_gate.shape, "f32")
    gemm._groups(row_offsets, row_counts, rows)
    return _launch("gate_up_wgrad", error, pack_only, num_groups=num_experts, m=hidden, n=ffn, ldo=ffn,
                   o_group_stride=hidden * ffn, a_scale_stride=rows // BK, b_scale_stride=rows // BK, scale_a1=xs,
                   scale_b1=dgs, scale_b2=dus, out1=dw_gate, out2=dw_up, row_offsets=row_offsets,
                   row_counts=row_counts, accumulate=int(bool(accumulate)), tmap_a1=_map(xc, rows, hidden),
                   tmap_b1=_map(dgc, rows, ffn), tmap_b2=_map(duc, rows, ffn))
