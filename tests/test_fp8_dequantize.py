"""The segment row dequantizer (cuda/fp8.cuh dequantize_segment_rows, mok_proto/kernels/fp8.py):
its wrapper's checks and what it packs (CPU, nothing launches), and on the GPU (marked gpu) its
bf16 rows bitwise equal to reference_fp8.round_bf16(fp8.dequantize_rows(codes, scales)) on each
segment's rows, for every e4m3 code at ordinary, tiny (subnormal products), huge (overflowing
products) and infinite scales, and nothing written outside the segments."""

import numpy as np
import pytest

from mok_proto import fp8, reference_fp8
from mok_proto.kernels import fp8 as kq

from test_fp8 import B, _one_sm_grids, _reference

SENTINEL = 0xBEEF  # what the rows outside every segment hold before and after


def _args(rows=512, cols=384):
    return (np.zeros((rows, cols), np.uint8), np.zeros((rows, cols // B), np.float32), np.zeros(3, np.int32),
            np.zeros(3, np.int32), np.zeros((rows, cols), np.uint16))


def test_dequantizer_refuses_bad_arguments_before_any_launch(no_launch):
    codes, scales, off, cnt, out = _args()
    kq.dequantize_segment_rows(codes, scales, off, cnt, out)  # valid: no error
    kq.dequantize_segment_rows(codes, scales, off, cnt, out.view(np.int16))  # bf16 bits as int16 too
    misaligned = np.zeros(512 * 384 + 8, np.uint16)[1:1 + 512 * 384].reshape(512, 384)
    refused = [
        ((codes, scales, off, cnt, out.view(np.float16)), r"out: expected bf16 bits .* got float16 \(512, 384\)"),
        ((codes, scales, off, cnt, np.zeros((512, 384), np.float32)), "out: expected bf16 bits"),
        ((codes, scales, off, cnt, out[:, :256]), r"out: expected .* \(512, 384\), got uint16 \(512, 256\)"),
        ((codes, scales, off, cnt, None), "out: expected .* got None"),
        ((codes, scales, off, cnt, np.zeros((512, 768), np.uint16)[:, ::2]), "out: must be C-contiguous"),
        ((codes, scales, off, cnt, misaligned), "out: .* 16-byte aligned"),
        ((codes.view(np.int8), scales, off, cnt, out), "codes: expected a 2-D uint8 array"),
        ((codes[None], scales, off, cnt, out), "codes: expected a 2-D uint8 array"),
        ((np.zeros((512, 768), np.uint8)[:, ::2], scales, off, cnt, out), "codes: must be C-contiguous"),
        ((np.zeros((512, 200), np.uint8), scales, off, cnt, out), "K=200 must be a multiple of 128"),
        ((codes, scales[:, :2], off, cnt, out), r"scales: expected .* \(512, 3\)"),
        ((codes, scales.astype(np.float64), off, cnt, out), "scales: expected .* float32"),
        ((codes, scales, off.astype(np.int64), cnt, out), "row_offsets: expected"),
        ((codes, scales, off, cnt[:2], out), "1 to 65535 segments"),
    ]
    for args, message in refused:
        with pytest.raises(ValueError, match=message):
            kq.dequantize_segment_rows(*args)


def test_dequantizer_packs_what_the_kernel_reads(monkeypatch):
    got = []
    monkeypatch.setattr(kq, "_launch_segments", lambda kernel, grid, fields: got.append((kernel, grid(132), fields)))
    codes, scales, off, cnt, out = _args()
    kq.dequantize_segment_rows(codes, scales, off, cnt, out)
    (kernel, grid, fields), = got
    assert kernel == "mok::fp8::dequantize_segment_rows" and kernel in kq.MODULE.names
    assert grid == (-(-kq.CTAS_PER_SM * 132 // 3), 3)  # as the row quantizer: CTAs of one segment per grid row
    assert fields["codes"] is codes and fields["scales"] is scales and fields["out"] is out
    assert fields["row_offsets"] is off and fields["row_counts"] is cnt and fields["num_groups"] == 3
    assert (fields["rows"], fields["cols"]) == (512, 384)


def _layout():
    """(offsets, counts, rows): three segments with gaps between them and an empty one."""
    return np.array([0, 256, 384, 640], np.int32), np.array([129, 100, 0, 131], np.int32), 896


def _scale_bits(rng, n: int) -> np.ndarray:
    """n fp32 scales (built from their bits: no host rounding can flush them) of each kind: ordinary
    (2^-20 .. 2^20), tiny normal ones (2^-140 .. 2^-118: products subnormal in fp32 and bf16, or
    rounding to zero), subnormal ones, huge ones (2^119 .. 2^127: products that overflow), and
    infinities (code 0 gives NaN)."""
    mant = rng.integers(0, 1 << 23, (5, n), dtype=np.uint32)
    biased = np.stack([rng.integers(127 - 20, 127 + 21, n), rng.integers(127 - 140, 127 - 117, n), np.zeros(n, int),
                       rng.integers(127 + 119, 255, n), np.full(n, 255)]).astype(np.uint32)
    mant[2] |= mant[2] == 0  # a subnormal, not zero
    mant[4] = 0  # infinity
    return ((biased << np.uint32(23)) | mant).view(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("one_sm", [False, True])
def test_gpu_dequantizer_equals_the_reference_per_segment(one_sm, monkeypatch):
    """Every code (both NaN codes, both zeros, the subnormals) meets every kind of scale inside the
    segments: the bf16 bits equal the reference's wherever it is not NaN, NaN where it is; the rows
    of the gaps and of the empty segment keep the sentinel (one_sm: a few CTAs, each thread taking
    many chunks, the in-flight ones past a segment's end included)."""
    import cupy

    _one_sm_grids(monkeypatch, one_sm)
    offsets, counts, rows = _layout()
    cols = 512
    rng = np.random.default_rng(5)
    codes = ((np.arange(cols)[None, :] + 37 * np.arange(rows)[:, None]) % 256).astype(np.uint8)
    pool = np.append(_scale_bits(rng, 16).ravel(), np.float32(1.1416 * 2.0**119))  # x 448: 1.9978 * 2^127
    scales = pool[rng.integers(0, pool.size, (rows, cols // B))]
    scales[np.arange(rows), np.arange(rows) % (cols // B)] = pool[np.arange(rows) % pool.size]  # every scale used
    out = cupy.full((rows, cols), SENTINEL, cupy.uint16)
    kq.dequantize_segment_rows(cupy.asarray(codes), cupy.asarray(scales), cupy.asarray(offsets), cupy.asarray(counts),
                               out)
    got = out.get()
    inside = np.zeros(rows, bool)
    for o, c in zip(offsets, counts):
        inside[o:o + c] = True
    values = _reference("dequantize_rows", codes[inside], scales[inside])  # fp32, subnormals kept
    want = reference_fp8.round_bf16(values)
    nan = np.isnan(want)
    # the data covers what the test claims (by bits: this process may flush subnormals)
    assert set(np.unique(codes[inside])) == set(range(256)) and np.isin(pool.view(np.uint32),
                                                                         scales[inside].view(np.uint32)).all()
    bits, rounded = values.view(np.uint32), want.view(np.uint32)
    assert ((bits & 0x7FFFFFFF) - 1 < 0x007FFFFF).any()  # subnormal products
    assert (bits == 0).any() and (bits == 0x80000000).any()  # zeros of both signs
    assert np.isinf(values).any() and (nan & ~np.isnan(fp8.DECODE[codes[inside]])).any()  # 0 * inf
    assert (np.isfinite(values) & np.isinf(want)).any()  # finite fp32, bf16's infinity
    assert (~nan & (bits != rounded)).any()  # bf16's own rounding
    got_in = got[inside]
    want_bits = (want.view(np.uint32) >> 16).astype(np.uint16)
    differ = np.nonzero((got_in != want_bits) & ~nan)
    assert not len(differ[0]), f"{len(differ[0])} differ, first at {tuple(int(d[0]) for d in differ)}"
    is_nan = ((got_in & 0x7F80) == 0x7F80) & ((got_in & 0x7F) != 0)
    assert (is_nan == nan).all(), "NaN where the reference is not, or not where it is"
    assert (got[~inside] == SENTINEL).all(), "rows outside every segment were written"
