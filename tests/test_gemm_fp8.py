"""Numerics of the grouped FP8 GEMMs (cuda/gemm_fp8.cuh) against float64 on the dequantized
operands, within 2e-3 of max |ref| of each expert's GEMM (the issue's bound), carried
through each epilogue (bf16 rounding, SwiGLU and its backward) as an elementwise bound. Ragged
experts (0, 1, 127, 128, 129, 300 rows); the rows between segments hold NaN (codes, scales, bf16)
and must stay untouched; h's codes and scales are bit for bit fp8.quantize_rows of the bf16 h the
kernel stores; a second launch gives the same bits; the weight gradients split at a 128-row
boundary accumulate to the bits of one launch. Operands are quantized by the NumPy reference."""

import numpy as np
import pytest

from mok_proto import abi, fp8
from mok_proto.errors import KernelTimeoutError
from mok_proto.kernels.errors import ErrorRecord
from mok_proto.reference import from_bf16, to_bf16

pytestmark = pytest.mark.gpu

TOL = 2e-3  # of max |ref| of an expert's GEMM
BF16_STEP = 2.0 ** -8  # bf16's rounding, relative to the value
SIGMOID_REL = 1e-5  # the epilogues' fast sigmoid (__expf, __fdividef), relative, generously
COUNTS = [0, 1, 127, 128, 129, 300]
B = fp8.BLOCK
SENTINEL = 0xAB  # hq code bytes outside every expert: must stay


def _round_up(n, m):
    return -(-n // m) * m


def _layout(aligned):
    """(offsets, counts, rows): at least one gap row after every segment; segments start at
    multiples of 128 rows (aligned: the weight gradients' rule) or 3 gap rows apart."""
    offsets, pos = [], 0
    for count in COUNTS:
        offsets.append(pos)
        pos = _round_up(pos + count + 1, B) if aligned else pos + count + 3
    return np.array(offsets, np.int32), np.array(COUNTS, np.int32), _round_up(pos, B)


def _segments(d):
    for e, (off, cnt) in enumerate(zip(d["offsets"], d["counts"])):
        yield e, slice(int(off), int(off + cnt))


def _activations(rng, d, cols):
    """fp32 [rows, cols]: normal values, each (row, 128-block) at its own magnitude 2^[-3, 3] (a scale
    applied to the wrong row or block shows); NaN in the rows outside every expert."""
    x = rng.standard_normal((d["rows"], cols)) * 2.0 ** rng.uniform(-3, 3, (d["rows"], cols // B)).repeat(B, axis=1)
    x[~d["inside"]] = np.nan
    return x.astype(np.float32)


def _quantized_rows(x, d):
    """quantize_rows(x), the gap rows' scales NaN too (their codes are NaN codes already)."""
    codes, scales = fp8.quantize_rows(x)
    scales[~d["inside"]] = np.nan
    return codes, scales


def _quantized_t(x, d):
    """quantize_rows(x, transpose=True): [cols, rows]; scale blocks wholly outside every expert NaN."""
    codes, scales = fp8.quantize_rows(x, transpose=True)
    used = np.zeros(scales.shape[1], bool)
    for _, rows in _segments(d):
        used[rows.start // B: -(-rows.stop // B)] = rows.stop > rows.start
    scales[:, ~used] = np.nan
    return codes, scales


def _weights(rng, e, r, c):
    """w [e, r, c] (each 128 x 128 block at its own magnitude) quantized: (codes, scales) of w and of
    its transpose [e, c, r] (quantize_blocks: one quantization, both orientations)."""
    mags = 2.0 ** rng.uniform(-2, 2, (e, r // B, c // B))
    w = (rng.standard_normal((e, r, c)) * r ** -0.5 * mags.repeat(B, axis=1).repeat(B, axis=2)).astype(np.float32)
    codes, scales = fp8.quantize_blocks(w)
    return (codes, scales), (np.ascontiguousarray(codes.swapaxes(1, 2)), np.ascontiguousarray(scales.swapaxes(1, 2)))


def _dequantized(pair):
    """float64 values of an FP8 operand: 1 x 128 rows (codes [R, K], scales [R, K/128]) or one
    weight's 128 x 128 blocks (scales [R/128, K/128])."""
    codes, scales = pair
    rows = scales.shape[0] == codes.shape[0]
    return (fp8.dequantize_rows if rows else fp8.dequantize_blocks)(codes, scales).astype(np.float64)


def _gemm(a, b):
    """The reference: C = A B^T in float64 on the dequantized operands A [M, K], B [N, K]."""
    return _dequantized(a) @ _dequantized(b).T


def _dev(pair):
    import cupy

    return tuple(cupy.asarray(a) for a in pair)


def _setup(hidden, ffn, aligned=True, seed=0):
    import cupy

    rng = np.random.default_rng(seed)
    offsets, counts, rows = _layout(aligned)
    d = dict(offsets=offsets, counts=counts, rows=rows, hidden=hidden, ffn=ffn, e=len(counts),
             d_offsets=cupy.asarray(offsets), d_counts=cupy.asarray(counts))
    d["inside"] = np.zeros(rows, bool)
    for _, seg in _segments(d):
        d["inside"][seg] = True
    for name, cols in (("x", hidden), ("dy", hidden), ("h", ffn), ("dg", ffn), ("du", ffn)):
        d[name] = _activations(rng, d, cols)
        d[name + "_q"] = _quantized_rows(d[name], d)
    for name in ("g", "u"):  # bf16 inputs of down_bwd
        bits = to_bf16(np.where(d["inside"][:, None], rng.standard_normal((rows, ffn)), np.nan).astype(np.float32))
        d[name], d[name + "_ref"] = cupy.asarray(bits), from_bf16(bits).astype(np.float64)
    for name, r, c in (("w_gate", hidden, ffn), ("w_up", hidden, ffn), ("w_down", ffn, hidden)):
        d[name], d[name + "_t"] = _weights(rng, d["e"], r, c)
    return d


def _nan(shape, dtype):
    import cupy

    return cupy.full(shape, 0x7FC0 if dtype == np.uint16 else np.nan, dtype)


def _per_expert(d, cols, fn):
    """[rows, cols] float64: fn(e, rows) of each expert in its rows, NaN elsewhere."""
    out = np.full((d["rows"], cols), np.nan)
    for e, seg in _segments(d):
        if seg.stop > seg.start:
            out[seg] = fn(e, seg)
    return out


def _expert_max(d, ref):
    """[rows, 1]: max |ref| over each expert's rows (the scale of that expert's GEMM)."""
    out = np.ones((d["rows"], 1))
    for _, seg in _segments(d):
        if seg.stop > seg.start:
            out[seg] = np.abs(ref[seg]).max()
    return out


def _bf16_bound(err, want):
    """A bound on |value - want| carried through bf16's rounding of the value."""
    return err * (1 + BF16_STEP) + BF16_STEP * np.abs(want)


def _check(name, got, want, bound, d):
    """got (device, bf16 bits or fp32) within `bound` of want in every expert's rows, NaN elsewhere."""
    got = got.get()
    got = (from_bf16(got) if got.dtype == np.uint16 else got).astype(np.float64)
    inside = d["inside"]
    assert np.isnan(got[~inside]).all(), f"{name}: rows outside every expert were written"
    excess = np.abs(got - want) - np.broadcast_to(bound, want.shape)
    excess = excess[inside]
    assert np.all(excess <= 0), (f"{name}: {np.count_nonzero(~(excess <= 0))} of {excess.size} beyond the bound, "
                                 f"worst by {np.nanmax(excess):.3g}")


def _run(launch, *args, **kwargs):
    record = ErrorRecord()
    assert launch(*args, error=record, **kwargs) is record
    record.check()


def _same_bits(name, a, b):
    assert a.get().tobytes() == b.get().tobytes(), f"{name}: two launches differ"


@pytest.fixture(params=[(256, 256, True), (768, 512, True), (768, 512, False)],
                ids=["H256-I256", "H768-I512", "H768-I512-unaligned"])
def data(request):
    return _setup(*request.param)


@pytest.fixture(autouse=True, params=[None, 1], ids=["all-clusters", "one-cluster"])
def cluster_cap(request, monkeypatch):
    """Every test twice: on the whole GPU, and on one cluster, which runs every tile in turn."""
    from mok_proto.kernels import gemm

    monkeypatch.setattr(gemm, "MAX_CLUSTERS", request.param)
    return request.param


def _silu_parts(g):
    sig = 1.0 / (1.0 + np.exp(-g))
    return sig, g * sig, sig * (1.0 + g * (1.0 - sig))  # sigmoid, silu, silu'


def _gate_up(d, pow2=False, with_gu=True):
    import cupy
    from mok_proto.kernels import gemm_fp8

    rows, ffn = d["rows"], d["ffn"]
    out = dict(h=_nan((rows, ffn), np.uint16), hq=(cupy.full((rows, ffn), SENTINEL, np.uint8),
                                                   _nan((rows, ffn // B), np.float32)))
    if with_gu:
        out.update(g=_nan((rows, ffn), np.uint16), u=_nan((rows, ffn), np.uint16))
    _run(gemm_fp8.gate_up, _dev(d["x_q"]), _dev(d["w_gate_t"]), _dev(d["w_up_t"]), d["d_offsets"], d["d_counts"],
         out["h"], out["hq"], out.get("g"), out.get("u"), pow2=pow2)
    return out


def test_gate_up(data):
    d = data
    out = _gate_up(d)
    xq = d["x_q"]
    acc = {k: _per_expert(d, d["ffn"], lambda e, seg, w=d[f"w_{k}_t"]: _gemm(
        (xq[0][seg], xq[1][seg]), (w[0][e], w[1][e]))) for k in ("gate", "up")}
    err_g, err_u = TOL * _expert_max(d, acc["gate"]), TOL * _expert_max(d, acc["up"])
    _check("g", out["g"], acc["gate"], _bf16_bound(err_g, acc["gate"]), d)
    _check("u", out["u"], acc["up"], _bf16_bound(err_u, acc["up"]), d)
    sig, silu, dsilu = _silu_parts(acc["gate"])
    h = silu * acc["up"]
    # first order in g's and u's errors (25% for the curvature), their product, the fast sigmoid
    err_h = 1.25 * (np.abs(acc["up"] * dsilu) * err_g + np.abs(silu) * err_u) + err_g * err_u
    err_h = err_h + SIGMOID_REL * np.abs(h)
    _check("h", out["h"], h, _bf16_bound(err_h, h), d)
    # hq, hs: the rule on the bf16 h the kernel stored, bit for bit
    h_bf16 = from_bf16(out["h"].get())
    inside = d["inside"]
    for pow2, launched in ((False, out), (True, _gate_up(d, pow2=True, with_gu=False))):
        want_codes, want_scales = fp8.quantize_rows(np.where(inside[:, None], h_bf16, 0).astype(np.float32), pow2=pow2)
        codes, scales = (a.get() for a in launched["hq"])
        assert np.array_equal(codes[inside], want_codes[inside]), f"hq codes (pow2={pow2})"
        assert np.array_equal(scales[inside].view(np.uint32), want_scales[inside].view(np.uint32)), f"hs (pow2={pow2})"
        assert np.all(codes[~inside] == SENTINEL) and np.isnan(scales[~inside]).all(), "hq outside the experts"
        _same_bits("h (pow2 launch)", launched["h"], out["h"])
    again = _gate_up(d, with_gu=False)  # a second launch, without g, u: the same h, hq
    for name, a, b in (("h", again["h"], out["h"]), ("hq codes", *(x[0] for x in (again["hq"], out["hq"]))),
                       ("hs", *(x[1] for x in (again["hq"], out["hq"])))):
        _same_bits(name, a, b)


def test_down_with_and_without_row_scale(data):
    import cupy
    from mok_proto.kernels import gemm_fp8

    d = data
    hq = d["h_q"]
    acc = _per_expert(d, d["hidden"], lambda e, seg: _gemm((hq[0][seg], hq[1][seg]),
                                                           (d["w_down_t"][0][e], d["w_down_t"][1][e])))
    err = TOL * _expert_max(d, acc)
    scale = np.random.default_rng(1).uniform(0.5, 1.5, d["rows"]).astype(np.float32)
    runs = []
    for row_scale in (scale, None):
        s = np.ones((d["rows"], 1)) if row_scale is None else row_scale.astype(np.float64)[:, None]
        y = _nan((d["rows"], d["hidden"]), np.uint16)
        _run(gemm_fp8.down, _dev(hq), _dev(d["w_down_t"]), d["d_offsets"], d["d_counts"], y,
             None if row_scale is None else cupy.asarray(row_scale))
        _check("y" if row_scale is None else "y (row scale)", y, s * acc, _bf16_bound(s * err, s * acc), d)
        runs.append(y)
    y = _nan((d["rows"], d["hidden"]), np.uint16)
    _run(gemm_fp8.down, _dev(hq), _dev(d["w_down_t"]), d["d_offsets"], d["d_counts"], y)
    _same_bits("y", y, runs[1])


def test_down_bwd_fuses_swiglu_backward(data):
    from mok_proto.kernels import gemm_fp8

    d = data
    dyq = d["dy_q"]
    dh = _per_expert(d, d["ffn"], lambda e, seg: _gemm((dyq[0][seg], dyq[1][seg]),
                                                       (d["w_down"][0][e], d["w_down"][1][e])))
    err = TOL * _expert_max(d, dh)
    g, u = d["g_ref"], d["u_ref"]
    sig, silu, dsilu = _silu_parts(g)
    want = {"dg": dh * u * dsilu, "du": dh * silu}
    bound = {"dg": np.abs(u * dsilu) * err + SIGMOID_REL * np.abs(dh * u) * (1 + np.abs(g)),
             "du": np.abs(silu) * err + SIGMOID_REL * np.abs(dh * g)}
    outs = []
    for _ in range(2):
        dg, du = _nan((d["rows"], d["ffn"]), np.uint16), _nan((d["rows"], d["ffn"]), np.uint16)
        _run(gemm_fp8.down_bwd, _dev(dyq), _dev(d["w_down"]), d["g"], d["u"], d["d_offsets"], d["d_counts"], dg, du)
        outs.append({"dg": dg, "du": du})
    for name in ("dg", "du"):
        _check(name, outs[0][name], want[name], _bf16_bound(bound[name], want[name]), d)
        _same_bits(name, outs[0][name], outs[1][name])


def test_down_bwd_quantizes_dg_du_as_the_row_quantizer(data):
    """dgq, duq (down_bwd's epilogue, the FP8 backward's gate_up_bwd operands): bit for bit
    fp8.quantize_rows of the dg, du the same launch stored; the gap rows untouched; dg, du the
    same bits as a launch without them."""
    import cupy
    from mok_proto.kernels import gemm_fp8

    d = data
    rows, ffn, inside = d["rows"], d["ffn"], d["inside"]
    outs = {}
    for with_codes in (True, False):
        dg, du = _nan((rows, ffn), np.uint16), _nan((rows, ffn), np.uint16)
        codes = {name: (cupy.full((rows, ffn), SENTINEL, np.uint8), _nan((rows, ffn // B), np.float32))
                 for name in ("dgq", "duq")} if with_codes else {}
        _run(gemm_fp8.down_bwd, _dev(d["dy_q"]), _dev(d["w_down"]), d["g"], d["u"], d["d_offsets"], d["d_counts"],
             dg, du, **codes)
        outs[with_codes] = dict(dg=dg, du=du, **codes)
    for name in ("dg", "du"):
        _same_bits(name, outs[True][name], outs[False][name])
        stored = from_bf16(outs[True][name].get())
        want_codes, want_scales = fp8.quantize_rows(np.where(inside[:, None], stored, 0).astype(np.float32))
        codes, scales = (a.get() for a in outs[True][name + "q"])
        assert np.array_equal(codes[inside], want_codes[inside]), f"{name}q codes"
        assert np.array_equal(scales[inside].view(np.uint32), want_scales[inside].view(np.uint32)), f"{name}q scales"
        assert np.all(codes[~inside] == SENTINEL) and np.isnan(scales[~inside]).all(), f"{name}q outside the experts"


def test_the_build_without_epilogue_stores_nothing(data):
    """Inside gemm.without_epilogue() (bench_gemm.py --epilogue-share) gate_up and down_bwd, the
    FP8 problems with the largest epilogues (their codes too), run to the end and write nothing."""
    import cupy
    from mok_proto.kernels import gemm, gemm_fp8

    d = data
    rows, ffn = d["rows"], d["ffn"]
    with gemm.without_epilogue():
        out = _gate_up(d)
        dg, du = _nan((rows, ffn), np.uint16), _nan((rows, ffn), np.uint16)
        codes = {name: (cupy.full((rows, ffn), SENTINEL, np.uint8), _nan((rows, ffn // B), np.float32))
                 for name in ("dgq", "duq")}
        _run(gemm_fp8.down_bwd, _dev(d["dy_q"]), _dev(d["w_down"]), d["g"], d["u"], d["d_offsets"], d["d_counts"],
             dg, du, **codes)
    for name, a in (("h", out["h"]), ("g", out["g"]), ("u", out["u"]), ("dg", dg), ("du", du)):
        assert (a == 0x7FC0).all(), f"{name}: written by the build without epilogue"
    for name, (c, sc) in (("hq", out["hq"]), *codes.items()):
        assert (c == SENTINEL).all() and cupy.isnan(sc).all(), f"{name}: written by the build without epilogue"
    again = _gate_up(d, with_gu=False)  # after it, the real kernels
    assert not (again["h"] == 0x7FC0).all(), "after without_epilogue(): h not written"

def test_gate_up_bwd(data):
    from mok_proto.kernels import gemm_fp8

    d = data
    dgq, duq = d["dg_q"], d["du_q"]
    want = _per_expert(d, d["hidden"], lambda e, seg: (
        _gemm((dgq[0][seg], dgq[1][seg]), (d["w_gate"][0][e], d["w_gate"][1][e]))
        + _gemm((duq[0][seg], duq[1][seg]), (d["w_up"][0][e], d["w_up"][1][e]))))
    err = TOL * _expert_max(d, want)
    outs = []
    for _ in range(2):
        dx = _nan((d["rows"], d["hidden"]), np.uint16)
        _run(gemm_fp8.gate_up_bwd, _dev(dgq), _dev(duq), _dev(d["w_gate"]), _dev(d["w_up"]), d["d_offsets"],
             d["d_counts"], dx)
        outs.append(dx)
    _check("dx", outs[0], want, _bf16_bound(err, want), d)
    _same_bits("dx", outs[0], outs[1])


# ---------------------------------------------------------------------------------------------
# weight gradients: K = the expert's rows (segments at multiples of 128 rows)
# ---------------------------------------------------------------------------------------------
def _wgrad_operands(d):
    return {name: _quantized_t(d[name], d) for name in ("x", "h", "dy", "dg", "du")}


def _wgrads(d, ops, offsets, counts, outs, accumulate=False):
    from mok_proto.kernels import gemm_fp8

    dwd, dwg, dwu = outs
    if dwd is not None:
        _run(gemm_fp8.down_wgrad, _dev(ops["h"]), _dev(ops["dy"]), offsets, counts, dwd, accumulate=accumulate)
    _run(gemm_fp8.gate_up_wgrad, _dev(ops["x"]), _dev(ops["dg"]), _dev(ops["du"]), offsets, counts, dwg, dwu,
         accumulate=accumulate)


def _wgrad_outputs(d, with_dwd):
    e, hidden, ffn = d["e"], d["hidden"], d["ffn"]
    return (_nan((e, ffn, hidden), np.float32) if with_dwd else None, _nan((e, hidden, ffn), np.float32),
            _nan((e, hidden, ffn), np.float32))


def _expert_t(pair, seg):
    """An expert's columns of a transposed operand: codes [X, T_e] zero-padded to whole k-blocks
    (what the kernel's cleared tail multiplies), the scales of those blocks."""
    codes, scales = pair
    rows, blocks = seg.stop - seg.start, -(-(seg.stop - seg.start) // B)
    padded = np.zeros((codes.shape[0], blocks * B), np.uint8)
    padded[:, :rows] = codes[:, seg]
    return padded, scales[:, seg.start // B: seg.start // B + blocks]


# (H, I): odd M tile counts too (the cluster's last pair has one real tile): dWd with I = 128 (1
# tile), dWg/dWu with H = 384 (3 tiles; dWd is skipped there: its N = H must be a multiple of 256).
@pytest.mark.parametrize("shape", [(256, 256), (768, 512), (512, 128), (384, 128)], ids=lambda s: f"H{s[0]}-I{s[1]}")
def test_weight_grads(shape):
    d = _setup(*shape)
    ops = _wgrad_operands(d)
    with_dwd = d["hidden"] % 256 == 0
    results = []
    for _ in range(2):
        outs = _wgrad_outputs(d, with_dwd)
        _wgrads(d, ops, d["d_offsets"], d["d_counts"], outs)
        results.append([None if a is None else a.get() for a in outs])
    for name, a, b in zip(("dWd", "dWg", "dWu"), *results):
        assert a is None or a.tobytes() == b.tobytes(), f"{name}: two launches differ"
    checks = [("dWg", 1, "x", "dg"), ("dWu", 2, "x", "du")] + ([("dWd", 0, "h", "dy")] if with_dwd else [])
    for e, seg in _segments(d):
        for name, i, a, b in checks:
            got = results[0][i][e].astype(np.float64)
            if seg.stop == seg.start:
                assert not got.any(), f"{name}[{e}]: an expert with no rows must get a zero gradient"
                continue
            want = _gemm(_expert_t(ops[a], seg), _expert_t(ops[b], seg))
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err <= TOL, f"{name}[{e}] ({seg.stop - seg.start} rows): relative error {err:.2e}"


def test_weight_grads_accumulate_over_split_rows_bitwise():
    """Every expert's rows in two launches, the second with accumulate=True from row 128 on (one
    k-block: the scale blocks stay whole): the bits of one launch over all rows."""
    import cupy

    d = _setup(768, 512)
    ops = _wgrad_operands(d)
    first = np.minimum(d["counts"], B).astype(np.int32)
    parts = [(cupy.asarray(d["offsets"]), cupy.asarray(first), False),
             (cupy.asarray(d["offsets"] + first), cupy.asarray(d["counts"] - first), True)]

    def grads(launches):
        outs = _wgrad_outputs(d, True)
        for offsets, counts, accumulate in launches:
            _wgrads(d, ops, offsets, counts, outs, accumulate)
        return [a.get() for a in outs]

    whole = grads([(d["d_offsets"], d["d_counts"], False)])
    for name, a, b in zip(("dWd", "dWg", "dWu"), whole, grads(parts)):
        assert a.tobytes() == b.tobytes(), f"{name}: two accumulated launches differ from one"
    for a, b in zip(whole, grads([(o, c, False) for o, c, _ in parts])):  # the flag carries the first part
        assert a.tobytes() != b.tobytes()


# ---------------------------------------------------------------------------------------------
def test_launch_on_a_failed_error_record_does_nothing():
    import cupy
    from mok_proto.kernels import gemm_fp8

    d = _setup(256, 256)
    record = ErrorRecord()
    fields = dict.fromkeys(abi.ERROR_RECORD.names, 0)
    fields.update(code=abi.ERROR_CODE["kErrTimeout"], op=abi.OP["kOpGemmMma"], detail=abi.GEMM_PROBLEM["kDown"])
    record.words[...] = cupy.asarray(abi.ERROR_RECORD.pack(fields))  # an earlier launch's timeout, say
    h = _nan((d["rows"], d["ffn"]), np.uint16)
    hq = (cupy.full((d["rows"], d["ffn"]), SENTINEL, np.uint8), _nan((d["rows"], d["ffn"] // B), np.float32))
    gemm_fp8.gate_up(_dev(d["x_q"]), _dev(d["w_gate_t"]), _dev(d["w_up_t"]), d["d_offsets"], d["d_counts"], h, hq,
                     error=record)
    with pytest.raises(KernelTimeoutError, match="GEMM consumer .* of grouped GEMM down timed out"):
        record.check()
    assert np.isnan(from_bf16(h.get())).all() and np.all(hq[0].get() == SENTINEL), "no tile may run"


def test_default_error_record_is_returned_and_checked():
    from mok_proto.kernels import gemm_fp8

    d = _setup(256, 256)
    y = _nan((d["rows"], d["hidden"]), np.uint16)
    record = gemm_fp8.down(_dev(d["h_q"]), _dev(d["w_down_t"]), d["d_offsets"], d["d_counts"], y)
    assert record is gemm_fp8.site_record("down")  # the wrapper's own, per problem
    record.check()
    assert np.isfinite(from_bf16(y.get())[d["inside"]]).all(), "every expert row is written"


def test_smem_size_comes_from_the_compiled_header():
    from mok_proto.kernels import gemm_fp8

    smem = gemm_fp8.smem_bytes()
    stages = abi.CONST["kStages"] * (abi.CONST["kBM"] + abi.CONST["kBN"]) * B  # e4m3 codes: a byte each
    assert stages < smem <= 227 * 1024, smem
