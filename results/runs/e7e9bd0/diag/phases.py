"""Per-tile phases of our weight-gradient GEMMs (diagnostic build): ramp, mainloop, epilogue, gap (SM cycles)."""
import sys, numpy as np, cupy
from mok_proto.config import get_shape
from mok_proto.kernels import gemm
from mok_proto.problem import rows_per_expert
for shape_name in sys.argv[1].split(","):
    shape = get_shape(shape_name)
    E, H, I = shape.num_experts // 64, shape.hidden, shape.ffn
    rows = 2048 * shape.top_k
    rng = cupy.random.default_rng(0)
    bf = lambda *s: (rng.standard_normal(s, dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)
    x, dy, h, dg, du = bf(rows, H), bf(rows, H), bf(rows, I), bf(rows, I), bf(rows, I)
    dwd, dwg, dwu = cupy.empty((E, I, H), cupy.float32), cupy.empty((E, H, I), cupy.float32), cupy.empty((E, H, I), cupy.float32)
    counts = rows_per_expert(rows, E, "uniform")
    off = cupy.asarray(np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)); cnt = cupy.asarray(counts.astype(np.int32))
    runs = {"down_wgrad": lambda: gemm.down_wgrad(h, dy, off, cnt, dwd), "gate_up_wgrad": lambda: gemm.gate_up_wgrad(x, dg, du, off, cnt, dwg, dwu)}
    for name, fn in runs.items():
        fn(); fn(); cupy.cuda.runtime.deviceSynchronize()
        k, mod = gemm.MODULE._lookup(f"mok::gemm::grouped_gemm<{gemm.PROBLEMS.index(name)}>")
        pn = mod.get_global("mok_phase_n"); pn_arr = cupy.ndarray((264,), cupy.int32, pn); pn_arr[:] = 0
        ph = cupy.ndarray((132, 2, 128, 4), cupy.uint64, mod.get_global("mok_phase")); ph[:] = 0
        s0, s1 = cupy.cuda.Event(), cupy.cuda.Event(); s0.record(); fn(); s1.record(); s1.synchronize()
        ms = cupy.cuda.get_elapsed_time(s0, s1)
        n = pn_arr.get().reshape(132, 2); a = ph.get().astype(np.int64)
        ramp, main, epi, gap = [], [], [], []
        for b in range(132):
            for w in range(2):
                m = min(n[b, w], 128)
                t = a[b, w, :m]
                ramp += list(t[:, 1] - t[:, 0]); main += list(t[:, 2] - t[:, 1]); epi += list(t[:, 3] - t[:, 2])
                gap += list(t[1:, 0] - t[:-1, 3])
        kb = int(np.ceil(counts[0] / 64))
        med = lambda v: float(np.median(v)) if len(v) else float("nan")
        tiles = n.sum() // 2
        print(f"{shape_name} {name}: {ms:.3f} ms, {tiles} tiles/2, k_blocks {kb} (ideal mainloop {kb*1024} cyc at 2048 MAC/clk), "
              f"median cycles: ramp {med(ramp):.0f} mainloop {med(main):.0f} epilogue {med(epi):.0f} gap {med(gap):.0f}; "
              f"p90 epi {np.percentile(epi,90):.0f} main {np.percentile(main,90):.0f}; tiles per WG {np.median(n):.0f}", flush=True)
