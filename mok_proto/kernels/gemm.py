"""Wrappers of cuda/gemm.cuh: one function per grouped GEMM of the expert FFNs (sm_90a).

Legend: rows = receive rows (expert e's at row_offsets[e] : row_offsets[e] + row_counts[e]),
H hidden, I expert FFN, E experts here (El). BF16 arrays are CuPy uint16/int16 arrays holding
bf16 bits (CuPy has no bfloat16 dtype; `to_bf16` / `from_bf16` convert). Offsets and counts are
int32 device arrays read by the kernel: nothing is read back to the host. Each launch is one
persistent grid of 2-CTA clusters (the CTAs of a cluster share the weight operand by TMA
multicast): as many clusters as the GPU runs at once, at most MAX_CLUSTERS. Every wrapper
returns the ErrorRecord its launch reports into (`error=`, or the wrapper's own per-problem
record): `.check()` it after the launch. A record keeps its first error until `clear()`, and a
launch given a record that holds an error runs no tile (fail-stop: check before reusing one).
The first launch of a problem reads the kernel's shared-memory size back from the device: do it
once outside any graph capture.

    gate_up        h = silu(x Wg) * (x Wu)          (optionally also g = x Wg, u = x Wu)
    down           y = row_scale * (h Wd)
    down_bwd       dh = dy Wd^T; dg = dh * u * silu'(g), du = dh * silu(g)
    gate_up_bwd    dx = dg Wg^T + du Wu^T
    down_wgrad     dWd[e] = h_e^T dy_e              (fp32, deterministic: no atomics)
    gate_up_wgrad  dWg[e] = x_e^T dg_e, dWu[e] = x_e^T du_e
"""

from __future__ import annotations

import contextlib

import numpy as np

from mok_proto import abi
from mok_proto.kernels.build import CudaModule, num_sms
from mok_proto.kernels.errors import ErrorRecord
from mok_proto.reference import from_bf16, to_bf16  # noqa: F401 - the kernels' bf16 format

_C = abi.CONST
BM, BN, BK, THREADS, MAX_GROUPS, CLUSTER = (_C[k] for k in ("kBM", "kBN", "kBK", "kThreads", "kMaxGroups", "kCluster"))
PROBLEMS = tuple(text for _, text in abi.GEMM_PROBLEM.members)  # enum Problem, by name
MODULE = CudaModule("gemm.cuh", tuple(f"mok::gemm::grouped_gemm<{i}>" for i in range(len(PROBLEMS)))
                    + ("mok::gemm::export_sizes",), archs=("sm_90a",))
TIMEOUT_NS = 10 * 10**9
MAX_CLUSTERS = None  # cap on a launch's clusters (None: as many as run at once); 1 runs every tile on 2 SMs
# The diagnostic builds without epilogue (cuda/gemm.cuh kEpilogue), launched inside without_epilogue().
NO_EPILOGUE = "MOK_GEMM_NO_EPILOGUE"
MODULE.variant(NO_EPILOGUE)  # (registered: the CPU tests compile it)
_BARE = [False]  # inside without_epilogue()
_CLUSTERS: dict = {}  # co-resident clusters by kernel handle
# A layer on W virtual ranks launches ~20 GEMMs per rank per step, each with its params and up to
# four tensor maps: every one must stay cached, so that a captured graph never uploads.
CACHE_ENTRIES = 4096
_PARAMS: dict = {}  # device params by (problem, field values), most recent last
_TMAPS: dict = {}  # device tensor maps by (address, dims, box), most recent last
_SITE_RECORDS: dict = {}  # (device, problem) -> the wrapper's own error record


def smem_bytes(module=None, namespace: str = "mok::gemm") -> int:
    """Dynamic shared memory of a launch: sizeof(SharedStorage) + alignment slack, as the compiled
    header computes it (kSmemBytes, written by export_sizes). module, namespace: another family of
    grouped GEMMs (kernels/gemm_fp8.py)."""
    return (module or MODULE).read_sizes(f"{namespace}::export_sizes", 1)[0]


def site_record(problem: str) -> ErrorRecord:
    """The error record a wrapper uses when the caller gives none (one per problem and device; it
    keeps an error until cleared, so a failure is never silently overwritten). `problem`: the
    wrapper's name (gemm_fp8's are prefixed "fp8 ")."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), problem)
    if key not in _SITE_RECORDS:
        _SITE_RECORDS[key] = ErrorRecord(TIMEOUT_NS / 1e9)
    return _SITE_RECORDS[key]


# ---------------------------------------------------------------------------------------------
def _check(name, a, shape, kind):
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(a.shape)}")
    ok = {"bf16": (np.uint16, np.int16), "f32": (np.float32,), "i32": (np.int32,), "u8": (np.uint8,)}[kind]
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


def _launch(problem, error: ErrorRecord | None, pack_only: bool = False, **fields):
    """Pack GemmParams, launch one persistent grid, return the error record it reports into.
    pack_only: launch nothing, return the packed host struct (uint64 words) instead: the fused
    layer runs the same problem's tiles inside its own kernel (kernels/fused.py)."""
    return launch_grouped(MODULE, "mok::gemm", abi.GEMM_PARAMS, problem, problem, error, pack_only, fields)


@contextlib.contextmanager
def without_epilogue():
    """Inside, the grouped GEMMs (BF16 and FP8) launch their build without epilogue: its tiles run
    their k-loops and store nothing, so their outputs keep what they held (bench_gemm.py
    --epilogue-share)."""
    before, _BARE[0] = _BARE[0], True
    try:
        yield
    finally:
        _BARE[0] = before


def launch_grouped(module, namespace: str, struct, problem: str, site: str, error: ErrorRecord | None,
                   pack_only: bool, fields: dict):
    """One persistent grid of `namespace`::grouped_gemm<problem> (a grouped-GEMM family: this
    module's, or gemm_fp8's) with its params `struct` packed from `fields`; `site`: the wrapper's
    own error record's name; inside without_epilogue(), the module's build without epilogue.
    Returns the error record, or with pack_only the packed host struct."""
    import cupy

    error = error if error is not None else site_record(site)
    fields = {**{name: 0 for name in struct.names}, "timeout_ns": TIMEOUT_NS, **fields, "error": error.ptr}
    host = struct.pack(fields)
    if pack_only:
        return host
    if _BARE[0]:
        module = module.variant(NO_EPILOGUE)
    key = (namespace, problem) + tuple(int(v) for v in host)
    params = _PARAMS.pop(key, None)
    if params is None:  # a host -> device copy only the first time these arguments are seen
        params = cupy.asarray(host)
        if len(_PARAMS) >= CACHE_ENTRIES:
            _PARAMS.pop(next(iter(_PARAMS)))
    _PARAMS[key] = params
    kernel = module.function(f"{namespace}::grouped_gemm<{PROBLEMS.index(problem)}>")
    smem = smem_bytes(module, namespace)
    if kernel.max_dynamic_shared_size_bytes < smem:
        kernel.max_dynamic_shared_size_bytes = smem
    clusters = resident_clusters(kernel, smem=smem)
    if MAX_CLUSTERS is not None:
        clusters = min(clusters, max(1, int(MAX_CLUSTERS)))
    kernel((clusters * CLUSTER,), (THREADS,), (params,), shared_mem=smem)
    return error


def resident_clusters(kernel, strict: bool = False, smem: int | None = None) -> int:
    """How many clusters of this kernel the GPU runs at once (asked of the driver once per kernel;
    the SM count halved if it cannot say): the persistent grid never waits for a second wave.
    strict: raise instead of guessing (a kernel whose CTAs wait for each other would hang, up to
    its timeouts, on a wrong guess). smem: the launch's dynamic shared memory (default: this
    module's grouped_gemm's)."""
    handle = kernel.kernel.ptr
    if strict and _CLUSTERS.get(handle, 0) == 0:
        _CLUSTERS.pop(handle, None)
    if handle not in _CLUSTERS:
        clusters = 0
        try:
            from cuda.bindings import driver as cu

            config = cu.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = num_sms() // CLUSTER * CLUSTER, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = THREADS, 1, 1
            config.sharedMemBytes = smem if smem is not None else smem_bytes()
            err, clusters = cu.cuOccupancyMaxActiveClusters(cu.CUfunction(handle), config)
            if err != cu.CUresult.CUDA_SUCCESS:
                clusters = 0
        except (ImportError, AttributeError, TypeError, RuntimeError):
            clusters = 0
        if strict and not clusters:
            raise RuntimeError("the driver did not say how many clusters of the fused kernel run at once "
                               "(cuOccupancyMaxActiveClusters): refusing to guess a persistent grid")
        _CLUSTERS[handle] = max(1, clusters or num_sms() // CLUSTER)
    return _CLUSTERS[handle]


def tensor_map(array, inner: int, outer: int, box_inner: int, box_outer: int, dtype: str = "bf16"):
    """A TMA descriptor (CUtensorMap, 128 bytes in device memory) for the row-major 2-D view
    [outer, inner] of `array` (elements: "bf16", "u8" for e4m3 codes, or "f32"), boxes of
    [box_outer, box_inner], 128-byte swizzle. Cached by (address, dims, box, dtype): encoding and
    uploading happen once per buffer."""
    import cupy
    from cuda.bindings import driver as cu

    key = (array.data.ptr, inner, outer, box_inner, box_outer, dtype)
    dev = _TMAPS.pop(key, None)
    if dev is None:
        kind, size = {"bf16": ("BFLOAT16", 2), "u8": ("UINT8", 1), "f32": ("FLOAT32", 4)}[dtype]
        err, tmap = cu.cuTensorMapEncodeTiled(
            getattr(cu.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{kind}"), 2, array.data.ptr,
            [cu.cuuint64_t(inner), cu.cuuint64_t(outer)], [cu.cuuint64_t(inner * size)],
            [cu.cuuint32_t(box_inner), cu.cuuint32_t(box_outer)], [cu.cuuint32_t(1), cu.cuuint32_t(1)],
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B, cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for [{outer}, {inner}] box [{box_outer}, {box_inner}]")
        dev = cupy.asarray(np.array(tmap.opaque, dtype=np.uint64))  # 256-byte aligned allocation
        if len(_TMAPS) >= CACHE_ENTRIES:
            _TMAPS.pop(next(iter(_TMAPS)))
    _TMAPS[key] = dev
    return dev


# ---------------------------------------------------------------------------------------------
def gate_up(x, w_gate, w_up, row_offsets, row_counts, h, g=None, u=None, error=None, pack_only=False):
    """x [rows,H], w_gate/w_up [E,H,I] -> h [rows,I] (and g, u [rows,I] if given). pack_only: see
    _launch (every wrapper has it: the fused kernels run these problems' tiles)."""
    num_experts, hidden, ffn = w_gate.shape
    rows = x.shape[0]
    _check("x", x, (rows, hidden), "bf16"), _check("w_gate", w_gate, w_gate.shape, "bf16")
    _check("w_up", w_up, w_gate.shape, "bf16"), _check("h", h, (rows, ffn), "bf16")
    for name, a in (("g", g), ("u", u)):
        if a is not None:
            _check(name, a, (rows, ffn), "bf16")
    _groups(row_offsets, row_counts, rows)
    _multiple("H", hidden, BK), _multiple("I", ffn, BN // 2)
    return _launch("gate_up", error, pack_only, num_groups=num_experts,
                   n=ffn, k=hidden, lda=hidden, ldb=ffn, ldo=ffn, b_group_stride=hidden * ffn, a1=x, b1=w_gate,
                   b2=w_up, out1=h, out2=g if g is not None else 0, out3=u if u is not None else 0,
                   row_offsets=row_offsets, row_counts=row_counts, tmap_a1=tensor_map(x, hidden, rows, BK, BM),
                   tmap_b1=tensor_map(w_gate, ffn, num_experts * hidden, 64, BK),
                   tmap_b2=tensor_map(w_up, ffn, num_experts * hidden, 64, BK))


def down(h, w_down, row_offsets, row_counts, y, row_scale=None, error=None, pack_only=False):
    """h [rows,I], w_down [E,I,H] -> y [rows,H] = row_scale[:,None] * (h Wd)."""
    num_experts, ffn, hidden = w_down.shape
    rows = h.shape[0]
    _check("h", h, (rows, ffn), "bf16"), _check("w_down", w_down, w_down.shape, "bf16")
    _check("y", y, (rows, hidden), "bf16")
    if row_scale is not None:
        _check("row_scale", row_scale, (rows,), "f32")
    _groups(row_offsets, row_counts, rows)
    _multiple("I", ffn, BK), _multiple("H", hidden, BN)
    return _launch("down", error, pack_only, num_groups=num_experts, n=hidden,
                   k=ffn, lda=ffn, ldb=hidden, ldo=hidden, b_group_stride=ffn * hidden, a1=h, b1=w_down, out1=y,
                   row_scale=row_scale if row_scale is not None else 0, row_offsets=row_offsets,
                   row_counts=row_counts, tmap_a1=tensor_map(h, ffn, rows, BK, BM),
                   tmap_b1=tensor_map(w_down, hidden, num_experts * ffn, 64, BK))


def down_bwd(dy, w_down, g, u, row_offsets, row_counts, dg, du, error=None, pack_only=False):
    """dy [rows,H], w_down [E,I,H], g/u [rows,I] -> dg, du [rows,I] (SwiGLU backward fused)."""
    num_experts, ffn, hidden = w_down.shape
    rows = dy.shape[0]
    _check("dy", dy, (rows, hidden), "bf16"), _check("w_down", w_down, w_down.shape, "bf16")
    for name, a in (("g", g), ("u", u), ("dg", dg), ("du", du)):
        _check(name, a, (rows, ffn), "bf16")
    _groups(row_offsets, row_counts, rows)
    _multiple("H", hidden, BK), _multiple("I", ffn, BN)
    return _launch("down_bwd", error, pack_only, num_groups=num_experts,
                   n=ffn, k=hidden, lda=hidden, ldb=hidden, ldo=ffn, b_group_stride=ffn * hidden, a1=dy,
                   b1=w_down, out1=dg, out2=du, row_offsets=row_offsets, row_counts=row_counts,
                   tmap_a1=tensor_map(dy, hidden, rows, BK, BM),
                   tmap_b1=tensor_map(w_down, hidden, num_experts * ffn, BK, BN // CLUSTER),
                   tmap_aux1=tensor_map(g, ffn, rows, 64, BM), tmap_aux2=tensor_map(u, ffn, rows, 64, BM))


def gate_up_bwd(dg, du, w_gate, w_up, row_offsets, row_counts, dx, error=None, pack_only=False):
    """dg/du [rows,I], w_gate/w_up [E,H,I] -> dx [rows,H] = dg Wg^T + du Wu^T."""
    num_experts, hidden, ffn = w_gate.shape
    rows = dg.shape[0]
    _check("dg", dg, (rows, ffn), "bf16"), _check("du", du, (rows, ffn), "bf16")
    _check("w_gate", w_gate, w_gate.shape, "bf16"), _check("w_up", w_up, w_gate.shape, "bf16")
    _check("dx", dx, (rows, hidden), "bf16")
    _groups(row_offsets, row_counts, rows)
    _multiple("I", ffn, BK), _multiple("H", hidden, BN)
    return _launch("gate_up_bwd", error, pack_only, num_groups=num_experts,
                   n=hidden, k=2 * ffn, k_split=ffn, lda=ffn, ldb=ffn, ldo=hidden, b_group_stride=hidden * ffn,
                   a1=dg, a2=du, b1=w_gate, b2=w_up, out1=dx, row_offsets=row_offsets, row_counts=row_counts,
                   tmap_a1=tensor_map(dg, ffn, rows, BK, BM), tmap_a2=tensor_map(du, ffn, rows, BK, BM),
                   tmap_b1=tensor_map(w_gate, ffn, num_experts * hidden, BK, BN // CLUSTER),
                   tmap_b2=tensor_map(w_up, ffn, num_experts * hidden, BK, BN // CLUSTER))


def down_wgrad(h, dy, row_offsets, row_counts, dw_down, error=None, pack_only=False, accumulate=False):
    """h [rows,I], dy [rows,H] -> dw_down [E,I,H] fp32, dw_down[e] = h_e^T dy_e. accumulate: add
    to dw_down as the rows after the ones it holds (segments split at a multiple of BK rows give
    the bits of one launch over all of them)."""
    num_experts, ffn, hidden = dw_down.shape
    rows = h.shape[0]
    _check("h", h, (rows, ffn), "bf16"), _check("dy", dy, (rows, hidden), "bf16")
    _check("dw_down", dw_down, dw_down.shape, "f32")
    _groups(row_offsets, row_counts, rows)
    _multiple("I", ffn, BM), _multiple("H", hidden, BN)
    return _launch("down_wgrad", error, pack_only, num_groups=num_experts,
                   m=ffn, n=hidden, lda=ffn, ldb=hidden, ldo=hidden, o_group_stride=ffn * hidden, a1=h, b1=dy,
                   out1=dw_down, row_offsets=row_offsets, row_counts=row_counts, accumulate=int(bool(accumulate)),
                   tmap_a1=tensor_map(h, ffn, rows, 64, BK), tmap_b1=tensor_map(dy, hidden, rows, 64, BK))


def gate_up_wgrad(x, dg, du, row_offsets, row_counts, dw_gate, dw_up, error=None, pack_only=False,
                  accumulate=False):
    """x [rows,H], dg/du [rows,I] -> dw_gate, dw_up [E,H,I] fp32; accumulate as down_wgrad."""
    num_experts, hidden, ffn = dw_gate.shape
    rows = x.shape[0]
    _check("x", x, (rows, hidden), "bf16"), _check("dg", dg, (rows, ffn), "bf16")
    _check("du", du, (rows, ffn), "bf16"), _check("dw_gate", dw_gate, dw_gate.shape, "f32")
    _check("dw_up", dw_up, dw_gate.shape, "f32")
    _groups(row_offsets, row_counts, rows)
    _multiple("H", hidden, BM), _multiple("I", ffn, BN // 2)
    return _launch("gate_up_wgrad", error, pack_only, num_groups=num_experts,
                   m=hidden, n=ffn, lda=hidden, ldb=ffn, ldo=ffn, o_group_stride=hidden * ffn, a1=x, b1=dg, b2=du,
                   out1=dw_gate, out2=dw_up, row_offsets=row_offsets, row_counts=row_counts,
                   accumulate=int(bool(accumulate)), tmap_a1=tensor_map(x, hidden, rows, 64, BK), tmap_b1=tensor_map(dg, ffn, rows, 64, BK),
                   tmap_b2=tensor_map(du, ffn, rows, 64, BK))
