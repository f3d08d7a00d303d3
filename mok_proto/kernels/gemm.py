"""Wrappers of cuda/gemm.cuh: one function per grouped GEMM of the expert FFNs (sm_90a).

Legend: rows = receive rows (expert e's at row_offsets[e] : row_offsets[e] + row_counts[e]),
H hidden, I expert FFN, E experts here (El). BF16 arrays are CuPy uint16/int16 arrays holding
bf16 bits (CuPy has no bfloat16 dtype; `to_bf16` / `from_bf16` convert). Offsets and counts are
int32 device arrays read by the kernel: nothing is read back to the host. Each launch is one
persistent grid of 2-CTA clusters (the CTAs of a cluster share the weight operand by TMA
multicast): as many clusters as the GPU runs at once, at most MAX_CLUSTERS.

    gate_up        h = silu(x Wg) * (x Wu)          (optionally also g = x Wg, u = x Wu)
    down           y = row_scale * (h Wd)
    down_bwd       dh = dy Wd^T; dg = dh * u * silu'(g), du = dh * silu(g)
    gate_up_bwd    dx = dg Wg^T + du Wu^T
    down_wgrad     dWd[e] = h_e^T dy_e              (fp32, deterministic: no atomics)
    gate_up_wgrad  dWg[e] = x_e^T dg_e, dWu[e] = x_e^T du_e
"""

from __future__ import annotations

import numpy as np

from mok_proto.kernels.build import CudaModule, num_sms

BM, BN, BK, STAGES, THREADS, MAX_GROUPS = 128, 256, 64, 4, 384, 1024
CLUSTER = 2  # CTAs per cluster (kCluster): the grid is a multiple of it
CONSUMER_WARPS, STAGING_FLOATS = 8, 2 * 8 * 32  # epilogue staging: 2 slots of 8 rows x 32 fp32 per warp
SMEM_BYTES = (1024 + STAGES * (BM + BN) * BK * 2 + CONSUMER_WARPS * STAGING_FLOATS * 4 + 2 * STAGES * 8 + 2 * 4
              + (MAX_GROUPS + 1) * 4)  # mirrors kSmemBytes
PROBLEMS = ("gate_up", "down", "down_bwd", "gate_up_bwd", "down_wgrad", "gate_up_wgrad")  # enum Problem
# Mirrors struct GemmParams in cuda/gemm.cuh, field for field (all 8 bytes).
PARAM_FIELDS = (
    "num_groups", "m", "n", "k", "lda", "ldb", "ldo", "b_group_stride", "o_group_stride", "k_split",
    "timeout_ns", "a1", "a2", "b1", "b2", "out1", "out2", "out3",
    "row_scale", "row_offsets", "row_counts", "error", "tmap_a1", "tmap_a2", "tmap_b1", "tmap_b2",
    "tmap_aux1", "tmap_aux2",
)
MODULE = CudaModule("gemm.cuh", tuple(f"mok::gemm::grouped_gemm<{i}>" for i in range(len(PROBLEMS))),
                    archs=("sm_90a",))
TIMEOUT_NS = 10 * 10**9
MAX_CLUSTERS = None  # cap on a launch's clusters (None: as many as run at once); 1 runs every tile on 2 SMs
_CLUSTERS: dict = {}  # co-resident clusters by kernel handle
_PARAMS: dict = {}  # device params by (problem, field values), most recent last
_TMAPS: dict = {}  # device tensor maps by (address, dims, box), most recent last


# ---------------------------------------------------------------------------------------------
# bf16 <-> float32 (round to nearest even), for NumPy or CuPy arrays
# ---------------------------------------------------------------------------------------------
def to_bf16(a):
    from mok_proto.reference import array_module

    xp = array_module(a)
    bits = xp.ascontiguousarray(a, dtype=xp.float32).view(xp.uint32)
    rounded = (bits + xp.uint32(0x7FFF) + ((bits >> 16) & xp.uint32(1))) >> 16
    return rounded.astype(xp.uint16)


def from_bf16(a):
    from mok_proto.reference import array_module

    xp = array_module(a)
    return (xp.ascontiguousarray(a).view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)


# ---------------------------------------------------------------------------------------------
def _check(name, a, shape, kind):
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
    ok = {"bf16": (np.uint16, np.int16), "f32": (np.float32,), "i32": (np.int32,)}[kind]
    if a.dtype not in ok:
        raise ValueError(f"{name}: expected {kind} ({', '.join(np.dtype(d).name for d in ok)}), got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    return a


def _multiple(name, value, of):
    if value % of:
        raise ValueError(f"{name}={value} must be a multiple of {of} (tile size)")


def _groups(offsets, counts, rows):
    _check("row_offsets", offsets, offsets.shape, "i32")
    _check("row_counts", counts, offsets.shape, "i32")
    if offsets.ndim != 1 or not 1 <= offsets.size <= MAX_GROUPS:
        raise ValueError(f"row_offsets: 1 to {MAX_GROUPS} experts, got shape {offsets.shape}")
    return offsets.size


def _launch(problem, error, **fields):
    import cupy

    fields = {**{name: 0 for name in PARAM_FIELDS}, "timeout_ns": TIMEOUT_NS, **fields}
    fields["error"] = error.data.ptr
    for name, value in fields.items():
        if hasattr(value, "data"):  # a CuPy array: its address
            fields[name] = value.data.ptr
    key = (problem,) + tuple(int(fields[n]) & 0xFFFFFFFFFFFFFFFF for n in PARAM_FIELDS)
    params = _PARAMS.pop(key, None)
    if params is None:  # a host -> device copy only the first time these arguments are seen
        params = cupy.asarray(np.array(key[1:], np.uint64))
        if len(_PARAMS) >= 256:
            _PARAMS.pop(next(iter(_PARAMS)))
    _PARAMS[key] = params
    kernel = MODULE.function(f"mok::gemm::grouped_gemm<{PROBLEMS.index(problem)}>")
    if kernel.max_dynamic_shared_size_bytes < SMEM_BYTES:
        kernel.max_dynamic_shared_size_bytes = SMEM_BYTES
    clusters = _resident_clusters(kernel)
    if MAX_CLUSTERS is not None:
        clusters = min(clusters, max(1, int(MAX_CLUSTERS)))
    kernel((clusters * CLUSTER,), (THREADS,), (params,), shared_mem=SMEM_BYTES)
    return params


def _resident_clusters(kernel) -> int:
    """How many clusters of this kernel the GPU runs at once (asked of the driver once per kernel;
    the SM count halved if it cannot say): the persistent grid never waits for a second wave."""
    handle = kernel.kernel.ptr
    if handle not in _CLUSTERS:
        clusters = 0
        try:
            from cuda.bindings import driver as cu

            config = cu.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = num_sms() // CLUSTER * CLUSTER, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = THREADS, 1, 1
            config.sharedMemBytes = SMEM_BYTES
            err, clusters = cu.cuOccupancyMaxActiveClusters(cu.CUfunction(handle), config)
            if err != cu.CUresult.CUDA_SUCCESS:
                clusters = 0
        except (ImportError, AttributeError, TypeError, RuntimeError):
            clusters = 0
        _CLUSTERS[handle] = max(1, clusters or num_sms() // CLUSTER)
    return _CLUSTERS[handle]


def tensor_map(array, inner: int, outer: int, box_inner: int, box_outer: int):
    """A TMA descriptor (CUtensorMap, 128 bytes in device memory) for the row-major bf16 2-D view
    [outer, inner] of `array`, boxes of [box_outer, box_inner], 128-byte swizzle. Cached by
    (address, dims, box): encoding and uploading happen once per buffer."""
    import cupy
    from cuda.bindings import driver as cu

    key = (array.data.ptr, inner, outer, box_inner, box_outer)
    dev = _TMAPS.pop(key, None)
    if dev is None:
        err, tmap = cu.cuTensorMapEncodeTiled(
            cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, array.data.ptr,
            [cu.cuuint64_t(inner), cu.cuuint64_t(outer)], [cu.cuuint64_t(inner * 2)],
            [cu.cuuint32_t(box_inner), cu.cuuint32_t(box_outer)], [cu.cuuint32_t(1), cu.cuuint32_t(1)],
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B, cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for [{outer}, {inner}] box [{box_outer}, {box_inner}]")
        dev = cupy.asarray(np.array(tmap.opaque, dtype=np.uint64))  # 256-byte aligned allocation
        if len(_TMAPS) >= 256:
            _TMAPS.pop(next(iter(_TMAPS)))
    _TMAPS[key] = dev
    return dev


def new_error_record():
    import cupy

    return cupy.zeros(8, dtype=np.uint64)


def check_error(error):
    """Raise if a pipeline wait timed out (a kernel bug, reported instead of hanging)."""
    code, op, block, thread = (int(v) for v in error.get()[:4])
    if code:
        raise RuntimeError(f"grouped GEMM pipeline wait timed out (op {op}, block {block}, thread {thread})")


# ---------------------------------------------------------------------------------------------
def gate_up(x, w_gate, w_up, row_offsets, row_counts, h, g=None, u=None, error=None):
    """x [rows,H], w_gate/w_up [E,H,I] -> h [rows,I] (and g, u [rows,I] if given)."""
    num_experts, hidden, ffn = w_gate.shape
    rows = x.shape[0]
    _check("x", x, (rows, hidden), "bf16"), _check("w_gate", w_gate, w_gate.shape, "bf16")
    _check("w_up", w_up, w_gate.shape, "bf16"), _check("h", h, (rows, ffn), "bf16")
    for name, a in (("g", g), ("u", u)):
        if a is not None:
            _check(name, a, (rows, ffn), "bf16")
    _groups(row_offsets, row_counts, rows)
    _multiple("H", hidden, BK), _multiple("I", ffn, BN // 2)
    return _launch("gate_up", error if error is not None else new_error_record(), num_groups=num_experts,
                   n=ffn, k=hidden, lda=hidden, ldb=ffn, ldo=ffn, b_group_stride=hidden * ffn, a1=x, b1=w_gate,
                   b2=w_up, out1=h, out2=g if g is not None else 0, out3=u if u is not None else 0,
                   row_offsets=row_offsets, row_counts=row_counts, tmap_a1=tensor_map(x, hidden, rows, BK, BM),
                   tmap_b1=tensor_map(w_gate, ffn, num_experts * hidden, 64, BK),
                   tmap_b2=tensor_map(w_up, ffn, num_experts * hidden, 64, BK))


def down(h, w_down, row_offsets, row_counts, y, row_scale=None, error=None):
    """h [rows,I], w_down [E,I,H] -> y [rows,H] = row_scale[:,None] * (h Wd)."""
    num_experts, ffn, hidden = w_down.shape
    rows = h.shape[0]
    _check("h", h, (rows, ffn), "bf16"), _check("w_down", w_down, w_down.shape, "bf16")
    _check("y", y, (rows, hidden), "bf16")
    if row_scale is not None:
        _check("row_scale", row_scale, (rows,), "f32")
    _groups(row_offsets, row_counts, rows)
    _multiple("I", ffn, BK), _multiple("H", hidden, BN)
    return _launch("down", error if error is not None else new_error_record(), num_groups=num_experts, n=hidden,
                   k=ffn, lda=ffn, ldb=hidden, ldo=hidden, b_group_stride=ffn * hidden, a1=h, b1=w_down, out1=y,
                   row_scale=row_scale if row_scale is not None else 0, row_offsets=row_offsets,
                   row_counts=row_counts, tmap_a1=tensor_map(h, ffn, rows, BK, BM),
                   tmap_b1=tensor_map(w_down, hidden, num_experts * ffn, 64, BK))


def down_bwd(dy, w_down, g, u, row_offsets, row_counts, dg, du, error=None):
    """dy [rows,H], w_down [E,I,H], g/u [rows,I] -> dg, du [rows,I] (SwiGLU backward fused)."""
    num_experts, ffn, hidden = w_down.shape
    rows = dy.shape[0]
    _check("dy", dy, (rows, hidden), "bf16"), _check("w_down", w_down, w_down.shape, "bf16")
    for name, a in (("g", g), ("u", u), ("dg", dg), ("du", du)):
        _check(name, a, (rows, ffn), "bf16")
    _groups(row_offsets, row_counts, rows)
    _multiple("H", hidden, BK), _multiple("I", ffn, BN)
    return _launch("down_bwd", error if error is not None else new_error_record(), num_groups=num_experts,
                   n=ffn, k=hidden, lda=hidden, ldb=hidden, ldo=ffn, b_group_stride=ffn * hidden, a1=dy,
                   b1=w_down, out1=dg, out2=du, row_offsets=row_offsets, row_counts=row_counts,
                   tmap_a1=tensor_map(dy, hidden, rows, BK, BM),
                   tmap_b1=tensor_map(w_down, hidden, num_experts * ffn, BK, BN // CLUSTER),
                   tmap_aux1=tensor_map(g, ffn, rows, 64, BM), tmap_aux2=tensor_map(u, ffn, rows, 64, BM))


def gate_up_bwd(dg, du, w_gate, w_up, row_offsets, row_counts, dx, error=None):
    """dg/du [rows,I], w_gate/w_up [E,H,I] -> dx [rows,H] = dg Wg^T + du Wu^T."""
    num_experts, hidden, ffn = w_gate.shape
    rows = dg.shape[0]
    _check("dg", dg, (rows, ffn), "bf16"), _check("du", du, (rows, ffn), "bf16")
    _check("w_gate", w_gate, w_gate.shape, "bf16"), _check("w_up", w_up, w_gate.shape, "bf16")
    _check("dx", dx, (rows, hidden), "bf16")
    _groups(row_offsets, row_counts, rows)
    _multiple("I", ffn, BK), _multiple("H", hidden, BN)
    return _launch("gate_up_bwd", error if error is not None else new_error_record(), num_groups=num_experts,
                   n=hidden, k=2 * ffn, k_split=ffn, lda=ffn, ldb=ffn, ldo=hidden, b_group_stride=hidden * ffn,
                   a1=dg, a2=du, b1=w_gate, b2=w_up, out1=dx, row_offsets=row_offsets, row_counts=row_counts,
                   tmap_a1=tensor_map(dg, ffn, rows, BK, BM), tmap_a2=tensor_map(du, ffn, rows, BK, BM),
                   tmap_b1=tensor_map(w_gate, ffn, num_experts * hidden, BK, BN // CLUSTER),
                   tmap_b2=tensor_map(w_up, ffn, num_experts * hidden, BK, BN // CLUSTER))


def down_wgrad(h, dy, row_offsets, row_counts, dw_down, error=None):
    """h [rows,I], dy [rows,H] -> dw_down [E,I,H] fp32, dw_down[e] = h_e^T dy_e."""
    num_experts, ffn, hidden = dw_down.shape
    rows = h.shape[0]
    _check("h", h, (rows, ffn), "bf16"), _check("dy", dy, (rows, hidden), "bf16")
    _check("dw_down", dw_down, dw_down.shape, "f32")
    _groups(row_offsets, row_counts, rows)
    _multiple("I", ffn, BM), _multiple("H", hidden, BN)
    return _launch("down_wgrad", error if error is not None else new_error_record(), num_groups=num_experts,
                   m=ffn, n=hidden, lda=ffn, ldb=hidden, ldo=hidden, o_group_stride=ffn * hidden, a1=h, b1=dy,
                   out1=dw_down, row_offsets=row_offsets, row_counts=row_counts,
                   tmap_a1=tensor_map(h, ffn, rows, 64, BK), tmap_b1=tensor_map(dy, hidden, rows, 64, BK))


def gate_up_wgrad(x, dg, du, row_offsets, row_counts, dw_gate, dw_up, error=None):
    """x [rows,H], dg/du [rows,I] -> dw_gate, dw_up [E,H,I] fp32."""
    num_experts, hidden, ffn = dw_gate.shape
    rows = x.shape[0]
    _check("x", x, (rows, hidden), "bf16"), _check("dg", dg, (rows, ffn), "bf16")
    _check("du", du, (rows, ffn), "bf16"), _check("dw_gate", dw_gate, dw_gate.shape, "f32")
    _check("dw_up", dw_up, dw_gate.shape, "f32")
    _groups(row_offsets, row_counts, rows)
    _multiple("H", hidden, BM), _multiple("I", ffn, BN // 2)
    return _launch("gate_up_wgrad", error if error is not None else new_error_record(), num_groups=num_experts,
                   m=hidden, n=ffn, lda=hidden, ldb=ffn, ldo=ffn, o_group_stride=hidden * ffn, a1=x, b1=dg, b2=du,
                   out1=dw_gate, out2=dw_up, row_offsets=row_offsets, row_counts=row_counts,
                   tmap_a1=tensor_map(x, hidden, rows, 64, BK), tmap_b1=tensor_map(dg, ffn, rows, 64, BK),
                   tmap_b2=tensor_map(du, ffn, rows, 64, BK))
