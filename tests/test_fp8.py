"""The e4m3 block quantizers. CPU: the NumPy rule (mok_proto/fp8.py) against definitions written
apart from it: the 256 codes from the format's fields, a brute-force nearest-code search with ties
to even, NVIDIA's own conversion (cuda_fp8.h's host path, where nvcc is found), and the block rule
restated per case. GPU (marked gpu): the CUDA quantizers (cuda/fp8.cuh) equal to the rule bit for
bit, codes and scales, on the same edge cases and on random data of the paper shapes' H and I; the
segment quantizers (the GPU layer's) on each expert segment's rows, nothing outside them."""

import functools
import io
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mok_proto import fp8, reference_fp8
from mok_proto.config import PAPER_SHAPES, PRESETS
from mok_proto.reference import from_bf16, to_bf16
from mok_proto.validate import InputError

ROOT = Path(__file__).resolve().parents[1]

B = fp8.BLOCK
NVCC = shutil.which("nvcc")
FINITE = fp8.DECODE[:0x7F].astype(np.float64)  # the 127 non-negative finite values, codes 0 .. 0x7E


def _field_value(code: int) -> float:
    """A code's value from its fields, one code at a time (NaN for S.1111.111)."""
    sign, exp, man = code >> 7, (code >> 3) & 0xF, code & 7
    if exp == 15 and man == 7:
        return math.nan
    value = math.ldexp(man, -9) if exp == 0 else math.ldexp(8 + man, exp - 10)
    return -value if sign else value


def _nearest(x) -> np.ndarray:
    """Brute force: the code of the nearest finite value, ties to the even code, beyond 448 the
    largest; zeros keep their sign; NaN -> 0x7F."""
    x = np.asarray(x, np.float32)
    if x.size > 1 << 18:  # in pieces: the temporaries then reuse memory instead of faulting in fresh pages
        return np.concatenate([_nearest(part) for part in np.array_split(x.ravel(), -(-x.size >> 18))]).reshape(x.shape)
    x = x.astype(np.float64)
    a = np.abs(x)
    hi = np.clip(np.searchsorted(FINITE, a), 1, 126)
    lo = hi - 1
    d_lo, d_hi = a - FINITE[lo], FINITE[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(a >= 448, 126, pick)
    code = pick.astype(np.uint8) | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7F), code)


@functools.cache
def _sweep() -> np.ndarray:
    """Float32 values of every magnitude e4m3 can hold and beyond (bit patterns at an odd stride,
    so every low-bit pattern occurs), every midpoint between neighbouring codes and the floats on
    either side of it, and the specials; both signs. Built once (read-only): two tests read it."""
    bits = np.arange(0, 0x44000000, 211, dtype=np.uint32).view(np.float32)
    mid = ((FINITE[:-1] + FINITE[1:]) / 2).astype(np.float32)
    assert np.array_equal(mid.astype(np.float64), (FINITE[:-1] + FINITE[1:]) / 2)  # midpoints are float32s
    up, down = np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(0))
    specials = np.array([0.0, np.inf, 464.0, 480.0, 1e30, np.finfo(np.float32).max, np.finfo(np.float32).tiny,
                         1e-45, 2.0 ** -10, np.nextafter(np.float32(2.0 ** -10), np.float32(1))], np.float32)
    x = np.concatenate([bits, mid, up, down, specials])
    x = np.concatenate([x, -x])
    x.setflags(write=False)
    return x


# --------------------------------------------------------------------------------------------
# e4m3 values
# --------------------------------------------------------------------------------------------
def test_decode_every_code():
    want = np.array([_field_value(c) for c in range(256)], np.float64)
    got = fp8.decode_e4m3(np.arange(256, dtype=np.uint8)).astype(np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got).sum() == 2  # 0x7F, 0xFF
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok], want[ok]) and np.array_equal(np.signbit(got[ok]), np.signbit(want[ok]))
    named = {0x00: 0.0, 0x01: 2.0 ** -9, 0x07: 7 * 2.0 ** -9, 0x08: 2.0 ** -6, 0x38: 1.0, 0x39: 1.125, 0x7E: 448.0,
             0xFE: -448.0, 0x80: -0.0}
    for code, value in named.items():
        assert fp8.decode_e4m3(np.uint8(code)) == value and np.signbit(fp8.decode_e4m3(np.uint8(code))) == (code > 0x7F)
    with pytest.raises(InputError, match="uint8"):
        fp8.decode_e4m3(np.arange(4, dtype=np.int32))


def test_encode_is_the_nearest_code_ties_to_even():
    # and every upper half of the float32 bits with the lower half 0, 1 or 0xFFFF (NaNs, infinities)
    halves = (np.arange(1 << 16, dtype=np.uint32)[:, None] << 16) | np.uint32([0, 1, 0xFFFF])
    x = np.concatenate([_sweep(), halves.view(np.float32).ravel()])
    with np.errstate(invalid="ignore"):  # casting a signalling NaN
        got, want = fp8.encode_e4m3(x), _nearest(x)
    bad = np.nonzero(got != want)[0]
    assert not len(bad), [(float(x[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]


def test_encode_specials():
    f = np.float32
    cases = [  # (value, code): a list, as -0.0 and 0.0 are one dict key
        (np.inf, 0x7E), (-np.inf, 0xFE), (464.0, 0x7E), (-464.0, 0xFE), (1e30, 0x7E),  # saturation (464: a tie)
        (np.nan, 0x7F), (-np.nan, 0x7F),  # every NaN is the positive NaN code
        (-0.0, 0x80), (0.0, 0x00), (-1e-45, 0x80), (1e-40, 0x00),  # zeros keep their sign; float32 subnormals
        (2.0 ** -10, 0x00), (3 * 2.0 ** -10, 0x02), (5 * 2.0 ** -10, 0x02), (2.0 ** -9, 0x01),  # subnormal ties
        (1.0625, 0x38), (1.1875, 0x3A), (15 * 2.0 ** -10, 0x08),  # normal ties; the subnormal-normal border
    ]
    for value, code in cases:
        got = int(fp8.encode_e4m3(f(value)))
        assert got == code, (value, hex(got), hex(code))
    payload = np.array([0x7F800001, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000], np.uint32).view(np.float32)
    assert np.all(fp8.encode_e4m3(payload) == 0x7F)
    codes = np.arange(256, dtype=np.uint8)
    round_trip = fp8.encode_e4m3(fp8.decode_e4m3(codes))
    assert np.array_equal(round_trip, np.where((codes & 0x7F) == 0x7F, np.uint8(0x7F), codes))


_HOST_PROGRAM = r"""
#include <cuda_fp8.h>
#include <cstdio>
#include <vector>
int main(int argc, char** argv) {
  FILE* in = std::fopen(argv[1], "rb");
  FILE* out = std::fopen(argv[2], "wb");
  std::vector<float> x(1 << 20);
  std::vector<unsigned char> q(x.size());
  size_t n;
  while ((n = std::fread(x.data(), 4, x.size(), in)) > 0) {
    for (size_t i = 0; i < n; ++i) q[i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3);
    std::fwrite(q.data(), 1, n, out);
  }
  return 0;
}
"""


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (cuda_fp8.h's host conversion is the cross-check)")
def test_encode_equals_nvidia_conversion(tmp_path):
    """cuda_fp8.h's host __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) is NVIDIA's software
    model of cvt.rn.satfinite.e4m3x2.f32: the rule's code for every value of the sweep, NaN included."""
    (tmp_path / "cvt.cu").write_text(_HOST_PROGRAM)
    # -x c++: host code only (the conversion's host path; nvcc's device passes would add nothing)
    proc = subprocess.run([NVCC, "-std=c++17", "-x", "c++", str(tmp_path / "cvt.cu"), "-o", str(tmp_path / "cvt")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    x = np.concatenate([_sweep(), np.array([np.nan, -np.nan], np.float32)])
    x.tofile(tmp_path / "x.bin")
    subprocess.run([str(tmp_path / "cvt"), str(tmp_path / "x.bin"), str(tmp_path / "q.bin")], check=True, timeout=120)
    want = np.fromfile(tmp_path / "q.bin", np.uint8)
    assert want.size == x.size
    got = fp8.encode_e4m3(x)
    bad = np.nonzero(got != want)[0]
    assert not len(bad), [(float(x[i]), hex(got[i]), hex(want[i])) for i in bad[:8]]


# --------------------------------------------------------------------------------------------
# scales
# --------------------------------------------------------------------------------------------
def test_block_scale():
    f = np.float32
    amax = np.array([0.0, 448.0, 1.0, 3e38, 1e-44, 1e-40, np.inf], f)
    got = fp8.block_scale(amax)
    want = [1.0, 1.0, f(1.0) / f(448.0), f(3e38) / f(448.0), 1.0, f(1e-40) / f(448.0), np.inf]
    assert got.dtype == np.float32 and np.array_equal(got, np.array(want, f))
    assert f(1e-44) / f(448.0) == 0  # the quotient underflows: scale 1 as for amax 0


def test_pow2_scale_is_the_smallest_power_of_two_above_amax_over_448():
    amax = np.concatenate([np.arange(1, 0x7F800000, 4099, dtype=np.uint32).view(np.float32),
                           np.array([448.0, 224.0, 256.0, np.nextafter(np.float32(448.0), np.float32(1e9)),
                                     np.finfo(np.float32).max, 1e-45, 1e-40], np.float32)])
    scale = fp8.block_scale(amax, pow2=True).astype(np.float64)
    mant, exp = np.frexp(scale)
    assert np.all(mant == 0.5) and np.all(scale >= 2.0 ** -149)  # powers of two, float32's range
    a = amax.astype(np.float64)
    assert np.all(a / scale <= 448)  # exact in float64: no block saturates
    assert np.all((a / (scale / 2) > 448) | (scale == 2.0 ** -149))  # and the smallest such
    assert fp8.block_scale(np.float32(448.0), pow2=True) == 1 and fp8.block_scale(np.float32(1.0), pow2=True) == 2.0 ** -8
    assert fp8.block_scale(np.float32(0.0), pow2=True) == 1 and np.isinf(fp8.block_scale(np.float32(np.inf), pow2=True))


# --------------------------------------------------------------------------------------------
# block quantizers
# --------------------------------------------------------------------------------------------
def _scale(amax: float, pow2: bool) -> np.float32:
    """The rule's scale, restated apart from fp8.block_scale (pow2: by exact comparisons)."""
    if math.isinf(amax):
        return np.float32(np.inf)
    if not pow2:
        scale = np.float32(amax) / np.float32(448)
        return np.float32(1) if scale == 0 else scale
    if amax == 0:
        return np.float32(1)
    e = math.ceil(math.log2(amax / 448))
    while amax > math.ldexp(448, e):
        e += 1
    while e > -149 and amax <= math.ldexp(448, e - 1):
        e -= 1
    return np.float32(math.ldexp(1, max(e, -149)))


def _rule(block: np.ndarray, pow2: bool = False):
    """The rule for one block, restated: (codes, scale)."""
    block = np.asarray(block, np.float32)
    present = block[~np.isnan(block)]
    scale = _scale(float(np.abs(present).max()) if present.size else 0.0, pow2)
    with np.errstate(invalid="ignore", divide="ignore"):
        return _nearest(block / scale), scale


def _random(rng, *shape):
    """Normal values, each row at its own magnitude (10^-30 .. 10^30)."""
    mags = 10.0 ** rng.uniform(-30, 30, size=(*shape[:-1], 1))
    return (rng.standard_normal(shape) * mags).astype(np.float32)


def _edge_matrix(seed: int = 0) -> np.ndarray:
    """[256, 512] fp32: random rows at many magnitudes, and rows (1 x 128 blocks) and 128 x 128
    blocks holding the edge cases."""
    rng = np.random.default_rng(seed)
    x = _random(rng, 256, 512)
    x[0] = 0.0  # a row of zeros
    x[1, :64] = -0.0
    x[2] = rng.standard_normal(512)
    x[2, 5], x[2, 140], x[2, 300] = 1e6, -3e38, 5e37  # beyond e4m3's range
    x[3, ::7] = np.nan  # NaN gaps: ignored by amax, coded in place
    x[4, 128:256] = np.nan  # a block of NaN
    x[5, 17], x[5, 400] = np.inf, -np.inf
    x[6] = rng.standard_normal(512) * 1e-40  # float32 subnormals (scale still nonzero)
    x[7] = rng.integers(-8, 8, 512) * np.float32(1e-45)  # scale underflows: 1
    x[8, :128] = np.concatenate([[448.0], FINITE[:127:2].astype(np.float32), -FINITE[1:127:2][:63]])  # exact codes
    mid = ((FINITE[:-1] + FINITE[1:]) / 2).astype(np.float32)
    x[9, :128] = np.concatenate([[448.0], mid, [0.0]])  # amax 448: scale 1, every tie
    x[10, :128] = np.float32(2.0 ** -9) * rng.integers(-7, 8, 128)  # e4m3 subnormals at scale 1 ...
    x[10, 0] = 448.0
    x[11, :128] = x[9, :128] * np.float32(2.0**110)  # every tie again at scales the quantizers first move
    x[12, :128] = x[9, :128] * np.float32(2.0**-100)  # into range by a power of two (cuda/fp8.cuh divisor)
    x[128:256, 384:512] = 0.0  # a 128 x 128 block of zeros
    x[200:210, :128] = np.nan
    return x


@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_rows_is_the_rule_per_block(pow2):
    x = _edge_matrix()
    codes, scales = fp8.quantize_rows(x, pow2=pow2)
    assert codes.shape == x.shape and codes.dtype == np.uint8 and scales.shape == (256, 4) and scales.dtype == np.float32
    for r in range(x.shape[0]):
        for j in range(4):
            want_codes, want_scale = _rule(x[r, j * B:(j + 1) * B], pow2)
            assert np.array_equal(codes[r, j * B:(j + 1) * B], want_codes), (r, j)
            assert scales[r, j].view(np.uint32) == np.float32(want_scale).view(np.uint32), (r, j)


def test_edge_cases_code_as_specified():
    x = _edge_matrix()
    codes, scales = fp8.quantize_rows(x)
    assert np.all(codes[0] == 0) and np.all(scales[0] == 1)  # zeros: code 0, scale 1
    assert np.all(codes[1, :64] == 0x80)  # -0 keeps its sign
    assert codes[2, 5] == 0x7E and codes[2, 140] == 0xFE and codes[2, 300] == 0x7E  # amax's own element is +-448
    assert scales[2, 1] == np.float32(3e38) / np.float32(448)
    nan = np.isnan(x[3])
    assert np.all(codes[3][nan] == 0x7F) and np.all(codes[3][~nan] != 0x7F)
    assert scales[3, 0] == np.float32(np.abs(x[3, :128][~nan[:128]]).max()) / np.float32(448)  # NaN ignored
    assert np.all(codes[4, 128:256] == 0x7F) and scales[4, 1] == 1  # a NaN block: amax 0
    assert np.isinf(scales[5, 0]) and codes[5, 17] == 0x7F and np.all(np.isin(codes[5, :128][np.arange(128) != 17],
                                                                             [0x00, 0x80]))
    assert np.all(scales[6] > 0) and np.all(scales[6] < np.finfo(np.float32).tiny) and np.all(scales[7] == 1)
    assert np.array_equal(fp8.decode_e4m3(codes[8, :128]), x[8, :128])  # exact e4m3 values stay exact
    assert np.array_equal(codes[9, 1:128], _nearest(x[9, 1:128])) and scales[9, 0] == 1  # ties to even
    assert np.array_equal(fp8.decode_e4m3(codes[10, :128]), x[10, :128])  # subnormal codes, exact


def test_rows_layout_names_each_block():
    x = np.zeros((3, 2, 4 * B), np.float32)  # leading dims are kept
    amax = np.arange(1, 25, dtype=np.float32).reshape(3, 2, 4) * 448  # block (a, b, j) has amax 448 (12 a + 4 b + j + 1)
    x[..., ::B] = amax  # the first element of each block
    codes, scales = fp8.quantize_rows(x)
    assert scales.shape == (3, 2, 4) and np.array_equal(scales, amax / np.float32(448))
    assert np.all(codes[..., ::B] == 0x7E) and np.count_nonzero(codes) == 24


@pytest.mark.parametrize("pow2", [False, True])
def test_transposed_rows_are_the_rows_of_the_transpose(pow2):
    x = _edge_matrix(1)
    codes, scales = fp8.quantize_rows(x, pow2=pow2, transpose=True)
    want_codes, want_scales = fp8.quantize_rows(np.ascontiguousarray(x.T), pow2=pow2)
    assert codes.shape == (512, 256) and scales.shape == (512, 2) and codes.flags.c_contiguous
    assert np.array_equal(codes, want_codes) and np.array_equal(scales.view(np.uint32), want_scales.view(np.uint32))
    for k in (0, 17, 511):  # scales[k, i] covers x[i*B:(i+1)*B, k]
        for i in range(2):
            assert scales[k, i].view(np.uint32) == np.float32(_rule(x[i * B:(i + 1) * B, k], pow2)[1]).view(np.uint32)


@pytest.mark.parametrize("pow2", [False, True])
def test_blocks_are_the_rule_per_tile_and_transpose_invariant(pow2):
    w = np.stack([_edge_matrix(2), _random(np.random.default_rng(3), 256, 512)])  # [2, 256, 512]
    codes, scales = fp8.quantize_blocks(w, pow2=pow2)
    assert codes.shape == w.shape and scales.shape == (2, 2, 4)
    for e in range(2):
        for i in range(2):
            for j in range(4):
                tile = w[e, i * B:(i + 1) * B, j * B:(j + 1) * B]
                want_codes, want_scale = _rule(tile.ravel(), pow2)
                assert np.array_equal(codes[e, i * B:(i + 1) * B, j * B:(j + 1) * B].ravel(), want_codes), (e, i, j)
                assert scales[e, i, j].view(np.uint32) == np.float32(want_scale).view(np.uint32), (e, i, j)
    codes_t, scales_t = fp8.quantize_blocks(np.ascontiguousarray(np.swapaxes(w, -1, -2)), pow2=pow2)
    assert np.array_equal(codes_t, np.swapaxes(codes, -1, -2))
    assert np.array_equal(scales_t.view(np.uint32), np.swapaxes(scales, -1, -2).view(np.uint32))


def _half_step(v: np.ndarray) -> np.ndarray:
    """Half the e4m3 spacing at |v| (v = x / scale, at most 448)."""
    exp = np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** -6)))
    return 2.0 ** (exp - 4)


def _both_quantizers(x, pow2):
    """(codes, scales, dequantized, each element's scale) of quantize_rows and quantize_blocks."""
    for quantize, back, spread in [(fp8.quantize_rows, fp8.dequantize_rows, lambda s: np.repeat(s, B, axis=-1)),
                                   (fp8.quantize_blocks, fp8.dequantize_blocks,
                                    lambda s: np.repeat(np.repeat(s, B, axis=-2), B, axis=-1))]:
        codes, scales = quantize(x, pow2=pow2)
        yield codes, scales, back(codes, scales).astype(np.float64), spread(scales).astype(np.float64)


@pytest.mark.parametrize("pow2", [False, True])
def test_dequantize_within_half_a_step(pow2):
    x = _random(np.random.default_rng(4), 256, 1024)
    x64 = x.astype(np.float64)
    for _, _, y, scale in _both_quantizers(x, pow2):
        # e4m3's rounding of x / scale, plus the two float32 roundings (x / scale, decode * scale)
        bound = _half_step(x64 / scale) * scale + 2.0 ** -23 * np.abs(x64)
        assert np.all(np.abs(y - x64) <= bound)
        assert np.all(np.abs(y) <= 448 * scale * (1 + 2.0 ** -23))


def test_pow2_dequantization_is_exact():
    rng = np.random.default_rng(5)
    x = _random(rng, 256, 512)
    for codes, _, y, scale in _both_quantizers(x, True):
        assert np.array_equal(y, fp8.decode_e4m3(codes).astype(np.float64) * scale)  # the product is exact
        assert np.array_equal(codes, _nearest((x.astype(np.float64) / scale).astype(np.float32)))  # x / 2^e exact
        assert np.all(np.abs(x.astype(np.float64)) / scale <= 448)  # nothing saturates
    # values on a block's e4m3 grid come back unchanged
    grid = FINITE[rng.integers(0, 127, (128, 256))].astype(np.float32) * np.float32(2.0 ** -20)
    grid[:, ::B] = np.float32(448 * 2.0 ** -20)
    for _, scales, y, _ in _both_quantizers(grid, True):
        assert np.all(scales == np.float32(2.0 ** -20)) and np.array_equal(y, grid)


def test_bad_shapes_and_types_are_refused():
    with pytest.raises(InputError, match="K=100 must be a multiple of 128"):
        fp8.quantize_rows(np.zeros((2, 100), np.float32))
    with pytest.raises(InputError, match="M.*must be a multiple of 128"):
        fp8.quantize_rows(np.zeros((100, 128), np.float32), transpose=True)
    with pytest.raises(InputError, match="2-D"):
        fp8.quantize_rows(np.zeros((2, 128, 128), np.float32), transpose=True)
    with pytest.raises(InputError, match="R=64"):
        fp8.quantize_blocks(np.zeros((64, 128), np.float32))
    with pytest.raises(InputError, match="floating-point"):
        fp8.quantize_rows(np.zeros((1, 128), np.uint16))
    with pytest.raises(InputError, match="scales must have shape"):
        fp8.dequantize_rows(np.zeros((2, 256), np.uint8), np.ones((2, 1), np.float32))
    codes, scales = fp8.quantize_rows(np.zeros((0, 256), np.float32))  # no rows: empty results
    assert codes.shape == (0, 256) and scales.shape == (0, 2)


# --------------------------------------------------------------------------------------------
# GPU: the CUDA quantizers equal the rule bit for bit
# --------------------------------------------------------------------------------------------
def _paper_sizes() -> list:
    """(H, I) of each paper shape."""
    return sorted({(PRESETS[s].hidden, PRESETS[s].ffn) for s in PAPER_SHAPES})


def _inputs(x: np.ndarray, kind: str):
    """(device input, the float32 values it holds)."""
    import cupy

    if kind == "bf16":
        bits = to_bf16(x)
        return cupy.asarray(bits), from_bf16(bits)
    return cupy.asarray(x), x


def _assert_bitwise(got, want, what):
    _assert_host_bitwise(got.get(), want, what)


def _assert_host_bitwise(got, want, what):
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    assert got.shape == want.shape, what
    view = np.uint8 if want.dtype == np.uint8 else np.uint32
    diff = np.nonzero(got.view(view) != want.view(view))
    assert not len(diff[0]), f"{what}: {len(diff[0])} differ, first at {tuple(int(d[0]) for d in diff)}"


def _flushes_subnormals() -> bool:
    """Whether this process's CPU flushes float32 subnormals (MXCSR FTZ/DAZ, which a shared library
    built with fast math sets for the whole process when it loads)."""
    tiny = np.array([1e-40], np.float32)
    return bool((tiny * np.float32(3.0))[0] == 0)


def _reference(name: str, *arrays: np.ndarray, **kwargs):
    """fp8.<name>(*arrays, **kwargs) (name "reference_fp8.<f>": that module's), computed in a fresh
    Python when this process flushes subnormals (the rule keeps them: a flushed CPU would code them
    as zeros). Returns what the function returns (a tuple of arrays, or one array)."""
    module, _, func = name.rpartition(".")
    module = module or "fp8"
    if not _flushes_subnormals():
        return getattr({"fp8": fp8, "reference_fp8": reference_fp8}[module], func)(*arrays, **kwargs)
    buf = io.BytesIO()
    np.savez(buf, *arrays)
    code = ("import io, sys, numpy as np; from mok_proto import fp8, reference_fp8; "
            "z = np.load(io.BytesIO(sys.stdin.buffer.read())); "
            f"out = {module}.{func}(*[z[f'arr_{{i}}'] for i in range(len(z.files))], **{kwargs!r}); "
            "out = out if isinstance(out, tuple) else (out,); "
            "b = io.BytesIO(); np.savez(b, *out); sys.stdout.buffer.write(b.getvalue())")
    proc = subprocess.run([sys.executable, "-c", code], input=buf.getvalue(), capture_output=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    with np.load(io.BytesIO(proc.stdout)) as z:
        out = tuple(z[f"arr_{i}"] for i in range(len(z.files)))
    return out if len(out) > 1 else out[0]


def test_the_reference_keeps_subnormals():
    # the GPU comparisons need a reference that keeps float32 subnormals (row 6 of the edge matrix)
    x = _edge_matrix()
    codes, _ = _reference("quantize_rows", x)
    assert np.count_nonzero(codes[6] & 0x7F) > 256


def _check_gpu(x: np.ndarray, kind: str, pow2: bool, what: str, rows: bool = True):
    """Both quantizers (rows: also the row quantizer, both orientations) on x [R, C]."""
    from mok_proto.kernels import fp8 as kfp8

    dev, values = _inputs(x, kind)
    for transpose in (False, True) if rows else ():
        codes, scales = kfp8.quantize_rows(dev, pow2=pow2, transpose=transpose)
        want = _reference("quantize_rows", values, pow2=pow2, transpose=transpose)
        _assert_bitwise(codes, want[0], f"{what} rows transpose={transpose} codes")
        _assert_bitwise(scales, want[1], f"{what} rows transpose={transpose} scales")
    w = dev.reshape(1, *dev.shape)
    codes, scales, codes_t, scales_t = kfp8.quantize_blocks(w, pow2=pow2, transposed=True)
    want = _reference("quantize_blocks", values.reshape(1, *values.shape), pow2=pow2)
    _assert_bitwise(codes, want[0], f"{what} blocks codes")
    _assert_bitwise(scales, want[1], f"{what} blocks scales")
    _assert_bitwise(codes_t, np.ascontiguousarray(np.swapaxes(want[0], -1, -2)), f"{what} blocks codes_t")
    _assert_bitwise(scales_t, np.ascontiguousarray(np.swapaxes(want[1], -1, -2)), f"{what} blocks scales_t")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("pow2", [False, True])
def test_gpu_quantizers_equal_the_rule_on_edge_cases(kind, pow2):
    _check_gpu(_edge_matrix(), kind, pow2, "edge cases")


def _division_matrix() -> np.ndarray:
    """[R, 128] fp32, one 1 x 128 block a row led by its amax (each amax's rows a whole number of
    128-row tiles, so the block and column quantizers see the same maxima): under block maxima from
    float32 subnormals to its largest value (and infinity; one scale just above 2^-90, where the
    quantizers stop moving it), every bf16 value within the block and quotients on and 1-3 ulp
    around every e4m3 code and rounding boundary: what the quantizers' division by the block's
    reciprocal (cuda/fp8.cuh Divisor) must code as the IEEE division."""
    bf16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    bf16 = bf16[np.isfinite(bf16)]
    codes = np.unique(FINITE[FINITE > 0].astype(np.float64))
    targets = np.concatenate([codes, (codes[:-1] + codes[1:]) / 2])
    blocks = []
    for amax in np.array([3e-39, 2.9e-30, 4e-25, 0.37, 5.1e3, 2.9e33, 3.3e38, np.inf], np.float32):
        scale = fp8.block_scale(amax)
        with np.errstate(over="ignore", invalid="ignore"):
            near = [(targets * np.float64(scale)).astype(np.float32)]
            for direction in (-1, 1):
                step = near[0]
                for _ in range(3):
                    step = np.nextafter(step, np.float32(direction * np.inf))
                    near.append(step)
        near = np.concatenate(near)
        values = np.concatenate([bf16, near, -near])
        values = values[~(np.abs(values) > amax) & np.isfinite(values)]
        values = np.resize(values, -(-values.size // (127 * 128)) * 127 * 128).reshape(-1, 127)
        blocks.append(np.concatenate([np.full((values.shape[0], 1), amax, np.float32), values], axis=1))
    return np.concatenate(blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_gpu_quantizers_divide_as_the_rule(pow2):
    _check_gpu(_division_matrix(), "f32", pow2, "division cases")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("cols", [37, 130, 200])
def test_gpu_column_quantizer_on_ragged_columns(kind, cols):
    """quantize_rows(transpose=True) where a block of the column quantizer (kQuantColumns columns)
    is partly past the last column, with cols no multiple of 4 (the one-by-one loads: 37, 130) or
    of the block (200): every code and scale equals the rule's, NaN and zero rows included."""
    from mok_proto.kernels import fp8 as kfp8

    x = _edge_matrix(3)[:, :cols].copy()
    dev, values = _inputs(x, kind)
    codes, scales = kfp8.quantize_rows(dev, transpose=True)
    want = _reference("quantize_rows", values, transpose=True)
    _assert_bitwise(codes, want[0], f"[256, {cols}] transposed codes")
    _assert_bitwise(scales, want[1], f"[256, {cols}] transposed scales")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("pow2", [False, True])
def test_gpu_quantizers_equal_the_rule_at_paper_sizes(kind, pow2):
    """Activations x [256, H], h [256, I] (every quantizer); a weight [H, I] (blocks, both
    orientations: [I, H] is its transpose)."""
    rng = np.random.default_rng(6)
    for hidden, ffn in _paper_sizes():
        for rows, cols in ((256, hidden), (256, ffn), (hidden, ffn)):
            x = (rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-3, 3, (rows, 1))).astype(np.float32)
            _check_gpu(x, kind, pow2, f"[{rows}, {cols}]", rows=rows == 256)


@pytest.mark.gpu
def test_gpu_quantizers_batch_and_leading_dims():
    """Experts' weights [E, R, C] in one launch, rows with leading dims, outputs given by the caller."""
    import cupy
    from mok_proto.kernels import fp8 as kfp8

    rng = np.random.default_rng(7)
    w = _random(rng, 3, 256, 384)
    codes, scales = kfp8.quantize_blocks(cupy.asarray(w))
    want = fp8.quantize_blocks(w)
    _assert_bitwise(codes, want[0], "batched codes")
    _assert_bitwise(scales, want[1], "batched scales")
    x = _random(rng, 2, 3, 256)
    out = cupy.full((2, 3, 256), 0xAB, cupy.uint8), cupy.full((2, 3, 2), np.nan, cupy.float32)
    codes, scales = kfp8.quantize_rows(cupy.asarray(x), codes=out[0], scales=out[1])
    assert codes is out[0] and scales is out[1]
    want = fp8.quantize_rows(x)
    _assert_bitwise(codes, want[0], "leading dims codes")
    _assert_bitwise(scales, want[1], "leading dims scales")
    with pytest.raises(ValueError, match="multiple of 128"):
        kfp8.quantize_rows(cupy.zeros((2, 100), cupy.float32))


def _segment_layout():
    """(offsets, counts, rows): segments of 0, 1, 127, 128, 129 and 300 rows, each starting at a
    multiple of 128 with at least one gap row after it (the GPU layer's receive rows)."""
    offsets, pos = [], 0
    counts = [0, 1, 127, 128, 129, 300]
    for count in counts:
        offsets.append(pos)
        pos = -(-(pos + count + 1) // B) * B
    return np.array(offsets, np.int32), np.array(counts, np.int32), pos


def _one_sm_grids(monkeypatch, one_sm: bool):
    """With one_sm, the segment quantizers size their grids for a GPU of one SM: a few CTAs, each
    walking many items across segments (on the real grid most CTAs take one item or none)."""
    if one_sm:
        from mok_proto.kernels import build

        monkeypatch.setattr(build, "num_sms", lambda: 1)


@pytest.mark.gpu
@pytest.mark.parametrize("one_sm", [False, True])
@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_gpu_segment_column_quantizer_on_ragged_columns(kind, one_sm, monkeypatch):
    """quantize_segment_columns with C = 200 (the last item a partial 128-byte slice of each row: 8
    of 32 fp32 or of 64 bf16 columns, the TMA box zero-filled past C): each segment's transposed
    codes and scales are the rule's bit for bit, its last 128-row block zero-padded."""
    import cupy
    from mok_proto.kernels import fp8 as kfp8

    _one_sm_grids(monkeypatch, one_sm)
    offsets, counts, rows = _segment_layout()
    cols = 200
    x = _random(np.random.default_rng(11), rows, cols)
    x[offsets[5]:offsets[5] + 256] = _edge_matrix(1)[:, :cols]
    dev, values = _inputs(x, kind)
    codes_t, scales_t = cupy.full((cols, rows), 0xAB, cupy.uint8), cupy.full((cols, rows // B), np.nan, cupy.float32)
    kfp8.quantize_segment_columns(dev, cupy.asarray(offsets), cupy.asarray(counts), codes_t, scales_t).check()
    got = codes_t.get(), scales_t.get()
    for o, c in zip(offsets, counts):
        if c == 0:
            continue
        want = _reference("reference_fp8.quantize_columns", values[int(o):int(o + c)])
        blocks = slice(int(o) // B, int(o) // B + want[1].shape[1])
        _assert_host_bitwise(got[0][:, int(o):int(o) + want[0].shape[1]], want[0], f"{kind} segment at {o} codes")
        _assert_host_bitwise(got[1][:, blocks], want[1], f"{kind} segment at {o} scales")


@pytest.mark.gpu
@pytest.mark.parametrize("one_sm", [False, True])
@pytest.mark.parametrize("kind", ["f32", "bf16", "e4m3"])
def test_gpu_segment_quantizers_equal_the_rule_per_segment(kind, one_sm, monkeypatch):
    """quantize_segment_rows / _columns: bitwise the rule on each segment's rows (the columns' last
    block zero-padded: reference_fp8.quantize_columns; e4m3 input: on its dequantized values, the
    layer's x^T); the rows and blocks outside every segment keep what they held."""
    import cupy
    from mok_proto.kernels import fp8 as kfp8

    _one_sm_grids(monkeypatch, one_sm)
    offsets, counts, rows = _segment_layout()
    cols = 512
    x = _random(np.random.default_rng(9), rows, cols)
    x[offsets[5]:offsets[5] + 256] = _edge_matrix(1)  # the edge cases inside the longest segment
    if kind == "e4m3":  # (every expected value through _reference: row 6 of the edge cases is subnormal)
        codes_in, scales_in = _reference("quantize_rows", x)
        dev, x_scales = cupy.asarray(codes_in), cupy.asarray(scales_in)
        values = _reference("dequantize_rows", codes_in, scales_in)
    else:
        (dev, values), x_scales = _inputs(x, kind), None
    d_off, d_cnt = cupy.asarray(offsets), cupy.asarray(counts)
    segs = [slice(int(o), int(o + c)) for o, c in zip(offsets, counts)]
    inside = np.zeros(rows, bool)
    for seg in segs:
        inside[seg] = True
    if kind != "e4m3":
        codes, scales = cupy.full((rows, cols), 0xAB, cupy.uint8), cupy.full((rows, cols // B), np.nan, cupy.float32)
        kfp8.quantize_segment_rows(dev, d_off, d_cnt, codes, scales)
        want = _reference("quantize_rows", values)
        got = codes.get(), scales.get()
        _assert_host_bitwise(got[0][inside], want[0][inside], f"{kind} segment rows codes")
        _assert_host_bitwise(got[1][inside], want[1][inside], f"{kind} segment rows scales")
        assert (got[0][~inside] == 0xAB).all() and np.isnan(got[1][~inside]).all(), "rows outside were written"
    codes_t, scales_t = cupy.full((cols, rows), 0xAB, cupy.uint8), cupy.full((cols, rows // B), np.nan, cupy.float32)
    kfp8.quantize_segment_columns(dev, d_off, d_cnt, codes_t, scales_t, x_scales=x_scales).check()
    got = codes_t.get(), scales_t.get()
    written = np.zeros(rows // B, bool)
    for seg in segs:
        if seg.stop == seg.start:
            continue
        want = _reference("reference_fp8.quantize_columns", values[seg])
        blocks = slice(seg.start // B, seg.start // B + want[1].shape[1])
        written[blocks] = True
        _assert_host_bitwise(got[0][:, seg.start:seg.start + want[0].shape[1]], want[0],
                             f"{kind} segment {seg} columns codes")
        _assert_host_bitwise(got[1][:, blocks], want[1], f"{kind} segment {seg} columns scales")
    assert (got[0].reshape(cols, rows // B, B)[:, ~written] == 0xAB).all() and np.isnan(got[1][:, ~written]).all(), \
        "blocks outside every segment were written"


@pytest.mark.gpu
@pytest.mark.parametrize("one_sm", [False, True])
@pytest.mark.parametrize("kind", ["f32", "e4m3"])
def test_gpu_segment_column_quantizer_gives_up_on_rows_that_never_land(kind, one_sm, monkeypatch):
    """A staged item whose bytes never all arrive (here a tensor map of half-height boxes, so each
    stage's barrier waits for bytes no copy brings): the launch ends after the bounded wait with
    the timeout in its record, naming the column quantizer (one_sm: CTAs that staged a second item
    drain it too; e4m3: the row scales' copies arrive on the same barrier); given a record that
    holds an error, a launch quantizes nothing."""
    import time

    import cupy
    from mok_proto.errors import KernelTimeoutError
    from mok_proto.kernels import fp8 as kfp8
    from mok_proto.kernels import gemm
    from mok_proto.kernels.errors import ErrorRecord

    _one_sm_grids(monkeypatch, one_sm)
    offsets, counts, rows = _segment_layout()
    cols = 256
    x = _random(np.random.default_rng(3), rows, cols)
    if kind == "e4m3":
        codes_in, scales_in = _reference("quantize_rows", x)
        dev, extra = cupy.asarray(codes_in), {"x_scales": cupy.asarray(scales_in)}
    else:
        dev, extra = cupy.asarray(x), {}
    d_off, d_cnt = cupy.asarray(offsets), cupy.asarray(counts)

    def fresh():
        return cupy.full((cols, rows), 0xAB, cupy.uint8), cupy.full((cols, rows // B), np.nan, cupy.float32)

    good = ErrorRecord()
    kfp8.quantize_segment_columns(dev, d_off, d_cnt, *fresh(), error=good, **extra).check()  # the real map
    with monkeypatch.context() as m:
        m.setattr(gemm, "TIMEOUT_NS", 20_000_000)
        m.setattr(kfp8, "_column_map", lambda a, k: gemm.tensor_map(a, cols, rows, kfp8.ITEM_BYTES // a.itemsize,
                                                                     B // 2, {"e4m3": "u8"}.get(k, k)))
        record = ErrorRecord(0.02)
        start = time.perf_counter()
        assert kfp8.quantize_segment_columns(dev, d_off, d_cnt, *fresh(), error=record, **extra) is record
        with pytest.raises(KernelTimeoutError, match=r"segment column quantizer .* timed out after 0.02 s"):
            record.check()
        assert time.perf_counter() - start < 5, "the wait or the drains were not bounded by their 20 ms and 1 ms"
    codes_t, scales_t = fresh()
    kfp8.quantize_segment_columns(dev, d_off, d_cnt, codes_t, scales_t, error=record, **extra)  # holds the timeout
    cupy.cuda.Device().synchronize()
    assert (codes_t == 0xAB).all() and cupy.isnan(scales_t).all(), "a launch on a failed record quantized"
