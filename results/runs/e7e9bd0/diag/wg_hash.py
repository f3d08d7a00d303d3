"""Weight-gradient outputs' digests for ragged experts (0, 1, 63, 64, 129, 191, 192, 2000 rows ...):
run under two kernel variants, the digests must be equal (same fp32 bits)."""
import hashlib, numpy as np, cupy
from mok_proto.kernels import gemm
rng = np.random.default_rng(5)
for H, I, counts in ((256, 256, [0, 1, 63, 64, 129, 191, 192, 2000, 250, 3]), (7168, 512, [700, 0, 130, 2049])):
    counts = np.array(counts, np.int32); offs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
    rows = int(counts.sum()) + 64
    def bf(*s): return cupy.asarray(gemm.to_bf16(rng.standard_normal(s).astype(np.float32)))
    x, dg, du, h, dy = bf(rows, H), bf(rows, I), bf(rows, I), bf(rows, I), bf(rows, H)
    E = len(counts)
    dwg = cupy.full((E, H, I), np.nan, cupy.float32); dwu = cupy.full((E, H, I), np.nan, cupy.float32)
    dwd = cupy.full((E, I, H), np.nan, cupy.float32)
    oc, cc = cupy.asarray(offs), cupy.asarray(counts)
    gemm.gate_up_wgrad(x, dg, du, oc, cc, dwg, dwu).check()
    gemm.down_wgrad(h, dy, oc, cc, dwd).check()
    cupy.cuda.runtime.deviceSynchronize()
    # against a float64 reference, loosely (the digest is the exact check)
    xe = gemm.from_bf16(cupy.asnumpy(x)).astype(np.float64); dge = gemm.from_bf16(cupy.asnumpy(dg)).astype(np.float64)
    e = 3; ref = xe[offs[e]:offs[e] + counts[e]].T @ dge[offs[e]:offs[e] + counts[e]]
    err = float(np.abs(cupy.asnumpy(dwg[e]) - ref).max())
    nan = int(cupy.isnan(dwg).sum() + cupy.isnan(dwu).sum() + cupy.isnan(dwd).sum())
    d = hashlib.sha256(b"".join(cupy.asnumpy(a).tobytes() for a in (dwg, dwu, dwd))).hexdigest()[:16]
    print(f"WGHASH H={H} I={I} digest {d} nan {nan} max_err_e3 {err:.2e}")
