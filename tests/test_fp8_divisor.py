"""cuda/fp8.cuh's Divisor, mirrored in NumPy: the quantizers divide a block's values by its scale
with the reciprocal computed once a block and Markstein's correction (four float32 operations a
value), and the codes must be those of the IEEE division the rule (mok_proto.fp8) specifies.
Float32 fused multiply-adds: reference_fp8.fma32 (IEEE fmaf in NumPy, tested against libm's)."""

import numpy as np
import pytest

from mok_proto import fp8
from mok_proto.reference_fp8 import fma32

F32, F64 = np.float32, np.float64
LOW = -90  # cuda/fp8.cuh divisor(): a scale below 2^LOW is moved up by 2^100 first


def divisor(scale):
    """(b, y, k) of cuda/fp8.cuh divisor() for float32 scales > 0."""
    scale = np.asarray(scale, F32)
    biased = (scale.view(np.uint32) >> 23).astype(np.int64)
    inf = biased == 0xFF
    k = np.where(biased < 127 + LOW, F32(2.0**100), F32(1)).astype(F32)
    b = np.where(inf, F32(0), scale * k).astype(F32)
    with np.errstate(divide="ignore"):
        y = np.where(inf, F32(0), F32(1) / np.where(inf, F32(1), b)).astype(F32)  # rcp.rn
    return b, y, k


def quotient(x, d, corrected: bool = True):
    """cuda/fp8.cuh quotient(): x / scale as the kernels compute it (without the correction: q0)."""
    b, y, k = d
    with np.errstate(all="ignore"):
        xk = (x * k).astype(F32)
        q0 = (xk * y).astype(F32)
        if not corrected:
            return q0
        return fma32(-fma32(b, q0, -xk), y, q0)


def _codes(x, amax, pow2: bool, corrected: bool = True):
    """(codes by Divisor, codes by the division, in-block mask) of values x under amax's scale (amax:
    one block maximum, or one per value)."""
    scale = fp8.block_scale(np.asarray(amax, F32), pow2)
    scales = np.full(x.shape, scale, F32)
    with np.errstate(all="ignore"):
        want = fp8.encode_e4m3((x / scales).astype(F32))
    got = fp8.encode_e4m3(quotient(x, divisor(scales), corrected))
    return got, want, ~(np.abs(x) > amax)  # a block's values: |x| <= amax, or NaN


BF16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(F32)  # every bf16 value, NaN and infinities too


def _amaxes(rng):
    """Block maxima over float32's whole range: subnormal, tiny, ordinary, huge, infinite; both
    sides of 448 * 2^e (where the scale's significand is all ones or a power of two)."""
    exps = np.arange(-149, 128, 9)
    sig = np.array([1.0, 1.75, 1.7500001, 1.9999999, 1.3], F64)
    fixed = (sig[None, :] * 2.0 ** exps[:, None].astype(F64)).ravel()
    rand = rng.uniform(1, 2, 40) * 2.0 ** rng.integers(-149, 128, 40).astype(F64)
    with np.errstate(over="ignore"):
        amax = np.concatenate([fixed, rand]).astype(F32)
    return np.concatenate([amax[np.isfinite(amax) & (amax > 0)], [np.float32(np.inf)]])


@pytest.mark.parametrize("pow2", [False, True])
def test_every_bf16_value_codes_as_the_division(pow2):
    """Every bf16 value of a block (as the epilogues and movers quantize) under block maxima over
    float32's whole range: the codes equal the division's."""
    for amax in _amaxes(np.random.default_rng(1)):
        got, want, inside = _codes(BF16, amax, pow2)
        bad = np.flatnonzero((got != want) & inside)
        assert bad.size == 0, (float(amax), BF16[bad[:4]], got[bad[:4]], want[bad[:4]])


def test_float32_values_code_as_the_division():
    """float32 values at every magnitude below their block's amax (subnormals, zeros of both signs)."""
    rng = np.random.default_rng(2)
    for amax in _amaxes(rng):
        top = float(amax) if np.isfinite(amax) else 3e38
        with np.errstate(under="ignore"):
            x = (rng.uniform(-1, 1, 20000) * top * 2.0 ** -rng.integers(0, 180, 20000)).astype(F32)
        x[:6] = [amax, -amax, 0.0, -0.0, np.nan, -np.nan]
        for pow2 in (False, True):
            got, want, inside = _codes(x, amax, pow2)
            assert np.array_equal(got[inside], want[inside]), float(amax)


def test_quotients_at_code_boundaries_code_as_the_division():
    """x / scale on, and 1-3 ulp either side of, every rounding boundary between two e4m3 codes
    (and the e4m3 codes themselves), at scales over float32's range: the cases where a quotient one
    ulp off would change a code."""
    rng = np.random.default_rng(3)
    codes = fp8.DECODE[np.isfinite(fp8.DECODE) & (fp8.DECODE > 0)].astype(F64)
    codes = np.unique(codes)
    targets = np.concatenate([codes, (codes[:-1] + codes[1:]) / 2, [2.0**-10]])  # codes, midpoints
    checked = mismatched_q0 = 0
    for _ in range(60):
        scale = (rng.uniform(1, 2, targets.size) * 2.0 ** rng.integers(-140, 120, targets.size)).astype(F32)
        with np.errstate(over="ignore"):
            amax = (np.float32(448) * scale.astype(F64)).astype(F32)  # (inf past float32's range)
            on = (targets * scale.astype(F64)).astype(F32)
        for ulps in range(-3, 4):
            x = on
            for _ in range(abs(ulps)):
                x = np.nextafter(x, F32(np.inf) if ulps > 0 else F32(0))
            got, want, inside = _codes(x, amax, pow2=False)
            assert np.array_equal(got[inside], want[inside])
            checked += int(inside.sum())
            q0, _, _ = _codes(x, amax, pow2=False, corrected=False)
            mismatched_q0 += int((q0 != want)[inside].sum())
    assert checked > 100000
    # the cases are hard: the reciprocal's product alone (no correction) codes some of them wrong
    assert mismatched_q0 > 0
