"""Wrappers of cuda/fp8.cuh: the standalone e4m3 block quantizers, bitwise equal to the reference
mok_proto/fp8.py (its docstring is the rule and gives every layout).

Inputs are CuPy arrays of fp32, or of bf16 bits (uint16/int16, the GEMMs' format:
`kernels.gemm.to_bf16`). Outputs are allocated here unless given (`codes=`, `scales=`, ...: C-
contiguous, of the right shape and dtype). Each call uploads its QuantParams (a few bytes); nothing
is read back to the host.

    quantize_rows(x)                  x [..., K] -> codes [..., K] uint8, scales [..., K/128] fp32
    quantize_rows(x, transpose=True)  x [M, K] -> codes [K, M], scales [K, M/128] (the rule on x.T)
    quantize_blocks(w)                w [..., R, C] -> codes [..., R, C], scales [..., R/128, C/128]
                                      (transposed=True: also codes [..., C, R], scales [..., C/128, R/128])
"""

from __future__ import annotations

import numpy as np

from mok_proto import abi
from mok_proto.kernels.build import CudaModule

BLOCK = abi.CONST["kQuantBlock"]
THREADS = abi.CONST["kQuantThreads"]
IN_TYPES = {"f32": "float", "bf16": "unsigned short"}  # input kind -> the kernels' In
MODULE = CudaModule("fp8.cuh", tuple(f"mok::fp8::quantize_rows<{t}, {tr}>" for t in IN_TYPES.values()
                                     for tr in ("false", "true"))
                    + tuple(f"mok::fp8::quantize_blocks<{t}>" for t in IN_TYPES.values()))
MAX_ROW_CTAS = 65535  # grid.x cap of the row kernel (a grid-stride loop covers the rest)


def _kind(x, name: str) -> str:
    if x.dtype == np.float32:
        return "f32"
    if x.dtype in (np.uint16, np.int16):
        return "bf16"
    raise ValueError(f"{name}: expected fp32 or bf16 bits (uint16/int16), got {x.dtype}")


def _check_input(x, name: str):
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    if x.data.ptr % 16:
        raise ValueError(f"{name}: must start at a 16-byte aligned address")
    return _kind(x, name)


def _multiple(name: str, value: int):
    if value % BLOCK:
        raise ValueError(f"{name}={value} must be a multiple of {BLOCK} (pad with zeros: they change no scale)")


def _grid_limit(name: str, value: int):
    if value > 65535:
        raise ValueError(f"{name}={value} exceeds the launch grid's 65535 (a grid y or z dimension)")


def _out(given, shape, dtype, name: str):
    import cupy

    if given is None:
        return cupy.empty(shape, dtype)
    if tuple(given.shape) != tuple(shape) or given.dtype != dtype or not given.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous {np.dtype(dtype).name} array of shape {tuple(shape)}, "
                         f"got {given.dtype} {tuple(given.shape)}")
    return given


def _params(**fields):
    import cupy

    values = dict.fromkeys(abi.QUANT_PARAMS.names, 0)
    values.update(fields)
    return cupy.asarray(abi.QUANT_PARAMS.pack(values))


def quantize_rows(x, *, pow2: bool = False, transpose: bool = False, codes=None, scales=None):
    """(codes, scales) of x in 1 x 128 blocks along the last dimension; transpose=True: of x.T
    (x 2-D [M, K], blocks of 128 rows of one column; codes [K, M], K-major for the weight
    gradients). Equal bit for bit to mok_proto.fp8.quantize_rows on the same values."""
    kind = _check_input(x, "x")
    if transpose:
        if x.ndim != 2:
            raise ValueError(f"x: quantize_rows(transpose=True) takes a 2-D x [M, K], got shape {tuple(x.shape)}")
        rows, cols = x.shape
        _multiple("M", rows)
        codes = _out(codes, (cols, rows), np.uint8, "codes")
        scales = _out(scales, (cols, rows // BLOCK), np.float32, "scales")
        grid = (-(-cols // 32), rows // BLOCK)
        _grid_limit("M / 128", grid[1])
    else:
        if x.ndim < 1:
            raise ValueError("x: needs at least one dimension")
        cols = x.shape[-1]
        _multiple("K", cols)
        rows = x.size // cols if cols else 0
        codes = _out(codes, x.shape, np.uint8, "codes")
        scales = _out(scales, (*x.shape[:-1], cols // BLOCK), np.float32, "scales")
        grid = (min(-(-rows * (cols // BLOCK) // (THREADS // 32)), MAX_ROW_CTAS),)
    if x.size:
        params = _params(batch=1, rows=rows, cols=cols, pow2=int(pow2), x=x, codes=codes, scales=scales)
        MODULE.function(f"mok::fp8::quantize_rows<{IN_TYPES[kind]}, {str(transpose).lower()}>")(
            grid, (THREADS,), (params,))
    return codes, scales


def quantize_blocks(w, *, pow2: bool = False, transposed: bool = False, codes=None, scales=None, codes_t=None,
                    scales_t=None):
    """(codes, scales) of w [..., R, C] in 128 x 128 blocks; transposed=True also returns the
    transposed codes [..., C, R] and scales [..., C/128, R/128] (= the quantization of w's
    transpose: a block's amax does not change), written by the same launch. Equal bit for bit to
    mok_proto.fp8.quantize_blocks."""
    kind = _check_input(w, "w")
    if w.ndim < 2:
        raise ValueError(f"w: needs at least two dimensions [..., R, C], got shape {tuple(w.shape)}")
    rows, cols = w.shape[-2:]
    _multiple("R", rows)
    _multiple("C", cols)
    lead = tuple(w.shape[:-2])
    batch = int(np.prod(lead, dtype=np.int64))
    _grid_limit("R / 128", rows // BLOCK)
    _grid_limit("the leading dimensions' product", batch)
    codes = _out(codes, w.shape, np.uint8, "codes")
    scales = _out(scales, (*lead, rows // BLOCK, cols // BLOCK), np.float32, "scales")
    if transposed:
        codes_t = _out(codes_t, (*lead, cols, rows), np.uint8, "codes_t")
        scales_t = _out(scales_t, (*lead, cols // BLOCK, rows // BLOCK), np.float32, "scales_t")
    if w.size:
        params = _params(batch=batch, rows=rows, cols=cols, pow2=int(pow2), x=w, codes=codes, scales=scales,
                         codes_t=codes_t if transposed else 0, scales_t=scales_t if transposed else 0)
        MODULE.function(f"mok::fp8::quantize_blocks<{IN_TYPES[kind]}>")(
            (cols // BLOCK, rows // BLOCK, batch), (THREADS,), (params,))
    return (codes, scales, codes_t, scales_t) if transposed else (codes, scales)
