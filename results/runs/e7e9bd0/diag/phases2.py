"""Diagnostic: per-tile phases of the weight-gradient tiles (cycles) in (a) standalone launches with fewer
clusters, (b) the fused backward and the sequential backward of the layer."""
import os, sys, numpy as np, cupy
sys.path.insert(0, "scripts")
from mok_proto.kernels import gemm
from mok_proto.kernels import fused as F

def summarize(tag, mod, reset=False):
    pn = cupy.ndarray((264,), cupy.int32, mod.get_global("mok_phase_n"))
    ph = cupy.ndarray((132, 2, 128, 4), cupy.uint64, mod.get_global("mok_phase"))
    if reset:
        pn[:] = 0; ph[:] = 0; cupy.cuda.runtime.deviceSynchronize(); return
    n = pn.get().reshape(132, 2); a = ph.get().astype(np.int64)
    main, epi, gap = [], [], []
    for b in range(132):
        for w in range(2):
            t = a[b, w, :min(n[b, w], 128)]
            if len(t) == 0: continue
            main += list(t[:, 2] - t[:, 1]); epi += list(t[:, 3] - t[:, 2]); gap += list(t[1:, 0] - t[:-1, 3])
    med = lambda v: float(np.median(v)) if len(v) else float("nan")
    print(f"{tag}: tiles recorded {sum(min(x,128) for x in n.ravel())}, median cycles mainloop {med(main):.0f} epilogue {med(epi):.0f} "
          f"(p10 {np.percentile(epi,10):.0f} p90 {np.percentile(epi,90):.0f}) gap {med(gap):.0f}", flush=True)

mode = sys.argv[1]
if mode == "clusters":
    from mok_proto.config import get_shape
    from mok_proto.problem import rows_per_expert
    shape = get_shape("deepseek-v4-pro"); E, H, I = shape.num_experts // 64, shape.hidden, shape.ffn; rows = 2048 * shape.top_k
    rng = cupy.random.default_rng(0)
    bf = lambda *s: (rng.standard_normal(s, dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)
    h, dy = bf(rows, I), bf(rows, H); dwd = cupy.empty((E, I, H), cupy.float32)
    counts = rows_per_expert(rows, E, "uniform")
    off = cupy.asarray(np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)); cnt = cupy.asarray(counts.astype(np.int32))
    fn = lambda: gemm.down_wgrad(h, dy, off, cnt, dwd)
    fn(); cupy.cuda.runtime.deviceSynchronize()
    _, mod = gemm.MODULE._lookup("mok::gemm::grouped_gemm<4>")
    for c in (66, 33, 16, 4, 1):
        gemm.MAX_CLUSTERS = c
        fn(); cupy.cuda.runtime.deviceSynchronize(); summarize("", mod, reset=True)
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event(); e0.record(); fn(); e1.record(); e1.synchronize()
        summarize(f"deepseek down_wgrad standalone, {c} clusters, {cupy.cuda.get_elapsed_time(e0, e1):.3f} ms", mod)
    gemm.MAX_CLUSTERS = None
else:
    import bench_layer as bl
    for name in sys.argv[2].split(","):
        shape = bl.emulated_shape(name); data = bl.make_inputs(shape); heap, layer = bl.staged_layer(shape, data)
        layer.enqueue_forward(); layer.enqueue_backward(); layer.check()
        # one module holds every grouped_gemm<kP>, and so one mok_phase: the shared and routed wgrad launches
        _, gmod = gemm.MODULE._lookup("mok::gemm::grouped_gemm<4>")
        summarize("", gmod, reset=True)
        layer.enqueue_forward(); layer.enqueue_backward(); layer.check()
        summarize(f"{name} sequential backward (standalone wgrad launches, shared + routed, per WG in order)", gmod)
        layer.set_backward_plan(layer.fused_backward_plan(0, 2048))
        layer.enqueue_forward(); layer.enqueue_backward(); layer.check()
        _, fmod = F.MODULE._lookup(F.KERNELS["bwd"])
        summarize("", fmod, reset=True)
        layer.enqueue_forward(); layer.enqueue_backward(); layer.check()
        summarize(f"{name} fused backward comm 0 mb 2048 (wgrad tiles, shared + routed)", fmod)
        layer.set_backward_plan(None); layer.close(); heap.close()
