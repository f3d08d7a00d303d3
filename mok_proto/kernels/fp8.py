"""Wrappers of cuda/fp8.cuh: the standalone e4m3 block quantizers, bitwise equal to the reference
mok_proto/fp8.py (its docstring is the rule and gives every layout).

Inputs are CuPy arrays of fp32, or of bf16 bits (uint16/int16, the GEMMs' format:
`kernels.gemm.to_bf16`). Outputs are allocated here unless given (`codes=`, `scales=`, ...: C-
contiguous, of the right shape and dtype). A call's QuantParams (a few bytes) is uploaded the first
time its values are seen and reused after (so the GPU layer's passes can be captured in a CUDA
graph after one run); nothing is read back to the host.

    quantize_rows(x)                  x [..., K] -> codes [..., K] uint8, scales [..., K/128] fp32
    quantize_rows(x, transpose=True)  x [M, K] -> codes [K, M], scales [K, M/128] (the rule on x.T)
    quantize_blocks(w)                w [..., R, C] -> codes [..., R, C], scales [..., R/128, C/128]
                                      (transposed=True: also codes [..., C, R], scales [..., C/128, R/128])
    quantize_segment_rows(x, offsets, counts, codes, scales)
                                      quantize_rows(x) on the rows of expert segments only
    quantize_segment_columns(x, offsets, counts, codes, scales[, x_scales])
                                      quantize_rows(x, transpose=True) of each segment's rows, its last
                                      block zero-padded; x may be e4m3 codes (with x_scales): dequantized first
    dequantize_segment_rows(codes, scales, offsets, counts, out)
                                      fp8.dequantize_rows rounded to bf16, on the rows of expert segments only
The segment quantizers serve the GPU layer's receive rows: segment e is rows [offsets[e],
offsets[e] + counts[e]) (int32 [El] on the device, as the schedule wrote them), starting at a
multiple of 128 rows (the wrapper cannot check device values); the rows outside every segment are
neither read nor written, so they cost nothing and their outputs keep what they hold.
"""

from __future__ import annotations

import numpy as np

from mok_proto import abi
from mok_proto.kernels.build import CudaModule

BLOCK = abi.CONST["kQuantBlock"]
THREADS = abi.CONST["kQuantThreads"]
COLUMNS = abi.CONST["kQuantColumns"]  # columns of x per block of the whole-array column quantizer
IN_TYPES = {"f32": "float", "bf16": "unsigned short"}  # input kind -> the kernels' In
E4M3 = "unsigned char"  # the column segment quantizer's In for e4m3 codes + their row scales
MODULE = CudaModule("fp8.cuh", tuple(f"mok::fp8::quantize_rows<{t}, {tr}>" for t in IN_TYPES.values()
                                     for tr in ("false", "true"))
                    + tuple(f"mok::fp8::quantize_blocks<{t}>" for t in IN_TYPES.values())
                    + tuple(f"mok::fp8::quantize_segment_rows<{t}>" for t in IN_TYPES.values())
                    + tuple(f"mok::fp8::quantize_segment_columns<{t}>" for t in (*IN_TYPES.values(), E4M3))
                    + ("mok::fp8::dequantize_segment_rows",))
MAX_ROW_CTAS = 65535  # grid.x cap of the row kernel (a grid-stride loop covers the rest)
CTAS_PER_SM = abi.CONST["kQuantCtasPerSm"]  # the segment row quantizer's grid (split over the segments)
COLUMN_CTAS_PER_SM = abi.CONST["kQuantColumnCtasPerSm"]  # the segment column quantizer's flat grid
ITEM_BYTES = abi.CONST["kQuantColumnItemBytes"]  # the segment column quantizer's items: 128 rows x this many bytes
CACHE_ENTRIES = 4096  # uploaded QuantParams kept (by value)
_PARAMS: dict = {}


def _address(a) -> int:
    """The first byte's address: a CuPy array's device pointer (a NumPy array's, for CPU tests)."""
    ptr = getattr(a.data, "ptr", None)
    return int(ptr) if ptr is not None else int(a.ctypes.data)


def _kind(x, name: str) -> str:
    if x.dtype == np.float32:
        return "f32"
    if x.dtype in (np.uint16, np.int16):
        return "bf16"
    raise ValueError(f"{name}: expected fp32 or bf16 bits (uint16/int16), got {x.dtype}")


def _aligned(x, name: str):
    """The kernels move 16-byte chunks of x: it must be C-contiguous and 16-byte aligned."""
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    if _address(x) % 16:
        raise ValueError(f"{name}: must start at a 16-byte aligned address")


def _check_input(x, name: str):
    _aligned(x, name)
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
    """The device QuantParams of `fields` (the rest 0), uploaded once per distinct value."""
    import cupy

    values = dict.fromkeys(abi.QUANT_PARAMS.names, 0)
    values.update(fields)
    host = abi.QUANT_PARAMS.pack(values)
    key = tuple(int(v) for v in host)
    params = _PARAMS.pop(key, None)
    if params is None:
        params = cupy.asarray(host)
        if len(_PARAMS) >= CACHE_ENTRIES:
            _PARAMS.pop(next(iter(_PARAMS)))
    _PARAMS[key] = params
    return params


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
        grid = (-(-cols // COLUMNS), rows // BLOCK)
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


# ---------------------------------------------------------------------------------------------
def _segments(row_offsets, row_counts) -> int:
    """num_groups of int32 [El] offsets and counts (every check before any GPU call)."""
    for name, a in (("row_offsets", row_offsets), ("row_counts", row_counts)):
        if a.dtype != np.int32 or a.ndim != 1 or not a.flags.c_contiguous:
            raise ValueError(f"{name}: expected a contiguous 1-D int32 array, got {a.dtype} {tuple(a.shape)}")
    if row_counts.shape != row_offsets.shape or not 1 <= row_offsets.size <= 65535:
        raise ValueError(f"row_offsets, row_counts: 1 to 65535 segments each, got {tuple(row_offsets.shape)} and "
                         f"{tuple(row_counts.shape)}")
    return row_offsets.size


def _given(a, shape, dtype, name: str):
    if a is None or tuple(a.shape) != tuple(shape) or a.dtype != dtype or not a.flags.c_contiguous:
        got = "None" if a is None else f"{a.dtype} {tuple(a.shape)}"
        raise ValueError(f"{name}: expected a C-contiguous {np.dtype(dtype).name} array of shape {tuple(shape)}, "
                         f"got {got}")
    return a


def _launch_segments(kernel: str, grid, fields: dict):
    """Launch `kernel` (a name in MODULE) on the grid `grid(num_sms)` with QuantParams `fields`."""
    from mok_proto.kernels.build import num_sms

    MODULE.function(kernel)(grid(num_sms()), (THREADS,), (_params(**fields),))


def _row_grid(groups: int):
    """The segment row kernels' grid(num_sms): CTAS_PER_SM CTAs an SM split over the segments (grid y)."""
    return lambda sms: (max(1, min(MAX_ROW_CTAS, -(-CTAS_PER_SM * sms // groups))), groups)


def quantize_segment_rows(x, row_offsets, row_counts, codes, scales, *, pow2: bool = False):
    """fp8.quantize_rows of the segments' rows of x [rows, K] (fp32 or bf16 bits) into the given
    codes [rows, K] (uint8) and scales [rows, K/128] (fp32), bitwise; the other rows untouched."""
    kind = _check_input(x, "x")
    if x.ndim != 2:
        raise ValueError(f"x: expected a 2-D [rows, K] array, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    _multiple("K", cols)
    _given(codes, (rows, cols), np.uint8, "codes")
    _given(scales, (rows, cols // BLOCK), np.float32, "scales")
    groups = _segments(row_offsets, row_counts)
    fields = dict(batch=1, rows=rows, cols=cols, pow2=int(pow2), x=x, codes=codes, scales=scales,
                  num_groups=groups, row_offsets=row_offsets, row_counts=row_counts)
    _launch_segments(f"mok::fp8::quantize_segment_rows<{IN_TYPES[kind]}>", _row_grid(groups), fields)


def dequantize_segment_rows(codes, scales, row_offsets, row_counts, out):
    """round_bf16(fp8.dequantize_rows(codes, scales)) of the segments' rows of codes [rows, K] (uint8)
    and scales [rows, K/128] (fp32) into the given out [rows, K] (bf16 bits), bitwise (NaN codes give
    NaN); the other rows untouched."""
    if codes.dtype != np.uint8 or codes.ndim != 2:
        raise ValueError(f"codes: expected a 2-D uint8 array [rows, K], got {codes.dtype} {tuple(codes.shape)}")
    rows, cols = codes.shape
    _multiple("K", cols)
    _given(scales, (rows, cols // BLOCK), np.float32, "scales")
    if out is None or out.dtype not in (np.uint16, np.int16) or tuple(out.shape) != (rows, cols):
        got = "None" if out is None else f"{out.dtype} {tuple(out.shape)}"
        raise ValueError(f"out: expected bf16 bits (uint16/int16) of shape {(rows, cols)}, got {got}")
    _aligned(codes, "codes")
    _aligned(out, "out")
    groups = _segments(row_offsets, row_counts)
    fields = dict(batch=1, rows=rows, cols=cols, codes=codes, scales=scales, out=out, num_groups=groups,
                  row_offsets=row_offsets, row_counts=row_counts)
    _launch_segments("mok::fp8::dequantize_segment_rows", _row_grid(groups), fields)


def quantize_segment_columns(x, row_offsets, row_counts, codes, scales, *, x_scales=None, pow2: bool = False,
                             error=None):
    """fp8.quantize_rows(transpose=True) of each segment's rows of x [rows, C], in 128-row blocks
    from its first row, the rows past its count as zeros (what the reference's zero-padded last
    block gives), into the given codes [C, rows] (uint8) and scales [C, rows/128] (fp32). x: fp32 or
    bf16 bits, or e4m3 codes (uint8) with x_scales [rows, C/128] (fp32): then the values are
    fp8.dequantize_rows(x, x_scales), as the FP8 layer's x^T (docs/design.md 5.7). x's rows must be
    16-byte aligned (C times the element size a multiple of 16): the kernel reads them by TMA.
    Its waits for the staged rows are bounded (kernels.gemm.TIMEOUT_NS) and report into `error`
    (an ErrorRecord; default: this wrapper's own), which it returns: `.check()` it. A record that
    holds an error makes the launch quantize nothing."""
    from mok_proto.kernels import gemm

    if x.dtype == np.uint8:
        kind = "e4m3"
        if not x.flags.c_contiguous:
            raise ValueError("x: must be C-contiguous")
    else:
        kind = _check_input(x, "x")
    if x.ndim != 2:
        raise ValueError(f"x: expected a 2-D [rows, C] array, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    _multiple("rows", rows)
    if _address(x) % 16 or cols * x.itemsize % 16:  # the kernel copies rows to shared memory in 16-byte units
        raise ValueError(f"x: its rows must start at 16-byte aligned addresses (C * {x.itemsize} bytes a multiple "
                         f"of 16, the array 16-byte aligned); got C={cols} at address {_address(x):#x}")
    if (kind == "e4m3") != (x_scales is not None):
        raise ValueError("x_scales: given exactly when x holds e4m3 codes (uint8)")
    if x_scales is not None:
        _multiple("C", cols)
        _given(x_scales, (rows, cols // BLOCK), np.float32, "x_scales")
    _given(codes, (cols, rows), np.uint8, "codes")
    _given(scales, (cols, rows // BLOCK), np.float32, "scales")
    groups = _segments(row_offsets, row_counts)
    error = error if error is not None else gemm.site_record("quantize_segment_columns")
    fields = dict(batch=1, rows=rows, cols=cols, pow2=int(pow2), x=x, codes=codes, scales=scales,
                  x_scales=x_scales if x_scales is not None else 0, num_groups=groups, row_offsets=row_offsets,
                  row_counts=row_counts, error=error.ptr, timeout_ns=gemm.TIMEOUT_NS)

    def grid(sms):  # a flat grid over every segment's (128-row block, 128-byte column slice) items
        return (COLUMN_CTAS_PER_SM * sms,)

    if x.size == 0:  # nothing to quantize (and no tensor map of an empty array)
        return error
    in_type = E4M3 if kind == "e4m3" else IN_TYPES[kind]
    fields["x_map"] = _column_map(x, kind)
    _launch_segments(f"mok::fp8::quantize_segment_columns<{in_type}>", grid, fields)
    return error


def _column_map(x, kind: str):
    """The column quantizer's TMA map of x [rows, C]: boxes of 128 rows x ITEM_BYTES bytes."""
    from mok_proto.kernels import gemm

    rows, cols = x.shape
    return gemm.tensor_map(x, cols, rows, ITEM_BYTES // x.itemsize, BLOCK, {"e4m3": "u8"}.get(kind, kind))
