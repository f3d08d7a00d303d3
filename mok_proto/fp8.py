"""FP8 (e4m3) block quantization, specified exactly: the reference the CUDA quantizers
(cuda/fp8.cuh) match bit for bit, codes and scales.

Legend: M rows, K columns (the dimension a GEMM contracts over), B = BLOCK = 128.

e4m3 (`float8_e4m3fn`): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; the
largest finite value is 448 (S.1111.110); NaN is S.1111.111; subnormals are m * 2^-9, m = 1..7.
`encode_e4m3` (float32 -> code) rounds to nearest, ties to even; a finite value or an infinity
beyond +-448 saturates to +-448 (0x7E / 0xFE); zero and values that round to zero keep their sign;
every NaN becomes 0x7F (the positive NaN code: the PTX ISA leaves the sign of the NaN that `cvt`
writes open, and the sign of a NaN made by arithmetic differs between CPUs and GPUs).
`decode_e4m3` is exact. Both work on the bits with integer operations.

The block rule, per block of `x` (float32 values; NaN ignored by amax):

    amax  = max |x| over the block, NaN ignored (a block of NaN and zeros has amax 0)
    scale = fl32(amax / 448)            (IEEE division, round to nearest)
            1 where that is 0           (amax 0, or so small that the quotient underflows)
          | 2^ceil(log2(amax / 448))    (pow2: the smallest power of two with amax / scale <= 448,
                                         from amax's bits, at least 2^-149; 1 for amax 0)
            an infinite amax gives an infinite scale in both modes (the block's infinities become
            NaN codes, its finite values zero codes: an overflow stays visible downstream)
    q     = encode_e4m3(fl32(x / scale))    (IEEE division)
    x    ~= decode_e4m3(q) * scale          (exact with pow2 scales, which never saturate)

Layouts (every array C-contiguous):
- `quantize_rows(x)`: blocks of 1 x B along the last dimension. x [..., K] -> codes [..., K] uint8,
  scales [..., K / B] float32; scales[..., j] covers x[..., j*B : (j+1)*B]. Activations (x, h, dy)
  as the row GEMMs read them (K-major: the contraction dimension contiguous).
- `quantize_rows(x, transpose=True)`: the same rule applied to x.T of a 2-D x [M, K]: blocks of
  B rows x 1 column. codes [K, M] (= quantize_rows(x.T)), scales [K, M / B]; scales[k, i] covers
  x[i*B : (i+1)*B, k]. The weight-gradient GEMMs contract over the rows (tokens), and Hopper's FP8
  wgmma takes only K-major operands: they read this orientation.
- `quantize_blocks(w)`: blocks of B x B over the last two dimensions. w [..., R, C] -> codes
  [..., R, C], scales [..., R / B, C / B]; scales[..., i, j] covers w[..., i*B:(i+1)*B, j*B:(j+1)*B].
  A B x B block has the same amax transposed, so quantize_blocks(w.T) is the transpose of
  quantize_blocks(w), codes and scales: a weight is quantized once and read in both orientations.

Shapes: the blocked dimensions must be multiples of B, else InputError (one line). The layer's H
and I are multiples of 256 and expert segments are aligned to 128 rows, so nothing is lost; a
caller with a ragged dimension pads it with zeros, which change no amax and quantize to 0 (a
partial block quantized as if zero-padded is what padding gives).
"""

from __future__ import annotations

import functools

import numpy as np

from mok_proto.abi import CONST
from mok_proto.validate import InputError

BLOCK = CONST["kQuantBlock"]  # 128: the block edge
E4M3_MAX = float(CONST["kE4m3Max"])  # 448
NAN_CODE = 0x7F
MAX_CODE = 0x7E  # +448

_F32_448 = 0x43E00000  # bits of 448.0
_F32_INF = 0x7F800000


def _decode_table() -> np.ndarray:
    """float32 value of each of the 256 codes, built from the definition."""
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp, man = (codes >> 3) & 0xF, codes & 0x7
    value = np.where(exp == 0, man * 2.0 ** -9, (1.0 + man / 8.0) * 2.0 ** (exp.astype(np.int64) - 7))
    value = (sign * value).astype(np.float32)  # every value is exact in float32
    value[(codes & 0x7F) == 0x7F] = np.nan
    return value


DECODE = _decode_table()
DECODE.setflags(write=False)


def decode_e4m3(codes) -> np.ndarray:
    """uint8 codes -> float32 values (exact; both NaN codes give NaN)."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise InputError(f"codes must be uint8, got {codes.dtype}")
    return DECODE[codes]


def encode_e4m3(x) -> np.ndarray:
    """float32 values -> uint8 e4m3 codes: round to nearest even, saturate to +-448, NaN -> 0x7F."""
    bits = _as_f32(x, "x").view(np.uint32)
    # the rule's code by table: the upper 16 bits, and whether any of the lower 16 is set
    index = (bits >> 15) & np.uint32(0x1FFFE)
    index |= (bits & np.uint32(0xFFFF)) != 0
    return np.asarray(_encode_table()[index])


def _encode_rule(bits: np.ndarray) -> np.ndarray:
    """uint32 float32 bits -> their e4m3 codes, the rule in integer arithmetic."""
    sign = ((bits >> 31) << 7).astype(np.uint32)
    mag = bits & np.uint32(0x7FFFFFFF)
    # value = m * 2^(e - 23): a float32 subnormal (biased exponent 0) has no implicit bit
    biased = (mag >> 23).astype(np.int64)
    e = np.maximum(biased, 1) - 127
    m = (mag & 0x7FFFFF).astype(np.int64) | np.where(biased > 0, 1 << 23, 0)
    # keep 3 mantissa bits in e4m3's normal range (e >= -6), fewer below it (subnormals: 2^-9 steps)
    shift = np.minimum(20 + np.maximum(-6 - e, 0), 40)
    k = m >> shift
    rest, half = m & ((1 << shift) - 1), 1 << (shift - 1)
    k += (rest > half) | ((rest == half) & ((k & 1) == 1))  # ties to even
    # code = biased exponent * 8 + mantissa = max(e + 6, 0) * 8 + k (a carry into k = 16 moves the
    # exponent up by itself; below e = -6, k is the subnormal mantissa)
    code = np.maximum(e + 6, 0) * 8 + k
    code = np.where(mag > _F32_448, MAX_CODE, code)
    code = (code.astype(np.uint32) | sign).astype(np.uint8)
    return np.where(mag > _F32_INF, np.uint8(NAN_CODE), code)


@functools.cache
def _encode_table() -> np.ndarray:
    """The code of each float32 by its upper 16 bits t and s = (lower 16 bits != 0), at 2 t + s:
    the rule's half bit is bit 19 or above (shift >= 20), so the lower 16 bits count only as a
    sticky bit (its 448, infinity and NaN thresholds have them zero): t * 2^16 + s stands for all.
    Built on first use (a process that never encodes does not pay for it)."""
    index = np.arange(1 << 17, dtype=np.uint32)
    table = _encode_rule(((index >> 1) << 16) | (index & 1))
    table.setflags(write=False)
    return table


def block_scale(amax, pow2: bool = False) -> np.ndarray:
    """The block rule's scale (float32) of each amax (float32, >= 0 or NaN-free by construction)."""
    amax = _as_f32(amax, "amax")
    if pow2:
        return _pow2_scale(amax)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        scale = amax / np.float32(E4M3_MAX)
    return np.where(scale == 0, np.float32(1.0), scale).astype(np.float32)


def _pow2_scale(amax: np.ndarray) -> np.ndarray:
    """2^e with e the smallest integer such that amax <= 448 * 2^e, at least -149 (the smallest
    float32); from amax's bits: amax = 1.f * 2^E gives e = E - 8 + (1.f > 1.75), as 448 = 1.75 * 2^8."""
    bits = amax.view(np.uint32).astype(np.int64)
    sub = bits < (1 << 23)
    # a subnormal amax: normalise its mantissa (bit length by frexp, exact for integers < 2^24)
    length = np.frexp(np.where(sub, bits, 1).astype(np.float64))[1]
    norm = np.where(sub, (bits << np.where(sub, 24 - length, 0)) & 0x7FFFFF, bits & 0x7FFFFF)
    exp = np.where(sub, -126 - (24 - length), (bits >> 23) - 127)
    e = np.maximum(exp - 8 + (norm > 0x600000), -149)
    scale = np.where(e >= -126, ((e + 127).clip(1, 254) << 23), 1 << (e + 149).clip(0, 22))
    scale = scale.astype(np.uint32).view(np.float32)
    scale = np.where(amax == 0, np.float32(1.0), scale)
    return np.where(np.isinf(amax), amax, scale).astype(np.float32)


def _quantize(blocks: np.ndarray, pow2: bool):
    """blocks [..., n] (each row of the last axis one block) -> codes [..., n], scales [...]."""
    amax = np.fmax.reduce(np.abs(blocks), axis=-1, initial=np.float32(0))  # fmax skips NaN
    scale = block_scale(amax, pow2)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        codes = encode_e4m3(blocks / scale[..., None])
    return codes, scale


def quantize_rows(x, *, pow2: bool = False, transpose: bool = False):
    """x [..., K] -> (codes [..., K] uint8, scales [..., K / 128] float32): blocks of 1 x 128 along
    the last dimension. transpose=True: x [M, K] -> (codes [K, M], scales [K, M / 128]), the rule
    applied to x.T (blocks of 128 rows of one column). See the module docstring."""
    x = _as_f32(x, "x")
    if transpose:
        if x.ndim != 2:
            raise InputError(f"quantize_rows(transpose=True) takes a 2-D x [M, K], got shape {x.shape}")
        _check_multiple(x.shape[0], "M")
        x = x.T
    if x.ndim < 1:
        raise InputError("x must have at least one dimension")
    _check_multiple(x.shape[-1], "K")
    codes, scales = _quantize(np.ascontiguousarray(x).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK), pow2)
    return np.ascontiguousarray(codes.reshape(x.shape)), np.ascontiguousarray(scales)


def dequantize_rows(codes, scales) -> np.ndarray:
    """codes [..., K], scales [..., K / 128] -> float32 [..., K] (decode * scale, one rounding)."""
    values = decode_e4m3(codes)
    scales = _as_f32(scales, "scales")
    if values.ndim < 1:
        raise InputError("codes must have at least one dimension")
    _check_multiple(values.shape[-1], "K")
    if scales.shape != (*values.shape[:-1], values.shape[-1] // BLOCK):
        raise InputError(f"scales must have shape {(*values.shape[:-1], values.shape[-1] // BLOCK)}, "
                         f"got {scales.shape}")
    with np.errstate(invalid="ignore", over="ignore"):
        return (values.reshape(*scales.shape, BLOCK) * scales[..., None]).reshape(values.shape)


def quantize_blocks(w, *, pow2: bool = False):
    """w [..., R, C] -> (codes [..., R, C] uint8, scales [..., R / 128, C / 128] float32): blocks of
    128 x 128 over the last two dimensions. See the module docstring."""
    w = _as_f32(w, "w")
    lead, rows, cols = _blocked_shape(w, "w")
    tiles = w.reshape(*lead, rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    tiles = np.moveaxis(tiles, -3, -2).reshape(*lead, rows // BLOCK, cols // BLOCK, BLOCK * BLOCK)
    codes, scales = _quantize(tiles, pow2)
    codes = np.moveaxis(codes.reshape(*lead, rows // BLOCK, cols // BLOCK, BLOCK, BLOCK), -2, -3)
    return np.ascontiguousarray(codes.reshape(w.shape)), np.ascontiguousarray(scales)


def dequantize_blocks(codes, scales) -> np.ndarray:
    """codes [..., R, C], scales [..., R / 128, C / 128] -> float32 [..., R, C]."""
    values = decode_e4m3(codes)
    scales = _as_f32(scales, "scales")
    lead, rows, cols = _blocked_shape(values, "codes")
    want = (*lead, rows // BLOCK, cols // BLOCK)
    if scales.shape != want:
        raise InputError(f"scales must have shape {want}, got {scales.shape}")
    full = np.repeat(np.repeat(scales, BLOCK, axis=-2), BLOCK, axis=-1)
    with np.errstate(invalid="ignore", over="ignore"):
        return values * full


def _as_f32(a, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.kind != "f":
        raise InputError(f"{name} must hold floating-point values, got {a.dtype} (bf16 bits: convert with "
                         f"reference.from_bf16 first)")
    return np.asarray(a, dtype=np.float32, order="C")


def _blocked_shape(a: np.ndarray, name: str):
    """(leading dims, R, C) of an array blocked 128 x 128 over its last two dimensions."""
    if a.ndim < 2:
        raise InputError(f"{name} must have at least two dimensions [..., R, C], got shape {a.shape}")
    rows, cols = a.shape[-2:]
    _check_multiple(rows, "R")
    _check_multiple(cols, "C")
    return a.shape[:-2], rows, cols


def _check_multiple(n: int, name: str):
    if n % BLOCK:
        raise InputError(f"{name}={n} must be a multiple of {BLOCK} (pad with zeros: they change no scale)")
