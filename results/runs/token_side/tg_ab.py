"""A/B on the H200: the fused backward with its scale and token gradients inside the kernel
(plan.scale, plan.token_grads), with only the token gradients inside, with neither (the old plan), and the sequential backward, graphs interleaved (bench.rotating),
rank 0 of bench_layer's staged EP=64 share. Gradients compared bitwise with the sequential's.
Then one traced backward with them inside: when the SLOT_SUM tasks ran and how long they took."""
import sys
sys.path.insert(0, "scripts")
import numpy as np, cupy
import bench_layer as B
from mok_proto import plan as P
from mok_proto.bench import summarize, time_stages, rotating, paired_ratio

iters = int(sys.argv[2]) if len(sys.argv) > 2 else 20
for name in sys.argv[1].split(","):
    shape = B.emulated_shape(name)
    heap, layer = B.staged_layer(shape, B.make_inputs(shape))
    stream = cupy.cuda.Stream(non_blocking=True)
    layer.enqueue_forward(); layer.enqueue_backward(); layer.check()
    ref = B.result_bytes(layer, "bwd")
    layer.enqueue_forward()
    graphs = {"sequential": layer.capture(forward=False)}
    equal = {}
    for label, tg, sc in (("both", True, True), ("tgrads", True, False), ("neither", False, False)):
        layer.set_backward_plan(layer.fused_backward_plan(0, 2048, token_grads=tg, scale=sc))
        layer.enqueue_forward(); layer.enqueue_backward(); layer.check()
        equal[label] = B.result_bytes(layer, "bwd") == ref
        layer.enqueue_forward()
        graphs[label] = layer.capture(forward=False)
    with stream:
        smp = time_stages(rotating({k: (lambda g=g: g.launch(stream)) for k, g in graphs.items()}), iters, 3)
    layer.check()
    med = {k: float(np.median(v)) for k, v in smp.items()}
    print(f"{name} bwd ms: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items())
          + "; x seq " + ", ".join(f"{k} {paired_ratio(smp['sequential'], smp[k]):.3f}" for k in equal)
          + f"; both / neither {paired_ratio(smp['neither'], smp['both']):.3f}, tgrads / neither "
          f"{paired_ratio(smp['neither'], smp['tgrads']):.3f}; equal to sequential {equal}", flush=True)
    layer.set_backward_plan(layer.fused_backward_plan(0, 2048))
    layer.trace = True
    layer.enqueue_forward(); layer.enqueue_backward(); layer.check()
    rec = layer.forward_timeline(0, "bwd")
    layer.trace = False
    ss = rec[rec["kind"] == int(P.TaskKind.SLOT_SUM)]
    rd = rec[rec["kind"] == int(P.TaskKind.REV_DISPATCH)]
    sc = rec[rec["kind"] == int(P.TaskKind.SCALE)]
    rc = rec[rec["kind"] == int(P.TaskKind.REV_COMBINE)]
    sh = rec[np.isin(rec["kind"], [int(P.TaskKind.SHARED_DOWN_BWD), int(P.TaskKind.SHARED_GATE_UP_BWD)])]
    print(f"  scale tasks end {sc['end_ns'].min() / 1e6:.3f}-{sc['end_ns'].max() / 1e6:.3f} ms "
          f"({((sc['end_ns'] - sc['start_ns']) / 1e3).mean():.0f} us mean), rev_combine starts "
          f"{rc['start_ns'].min() / 1e6:.3f}, ends {rc['end_ns'].max() / 1e6:.3f}; shared data-grad tiles end "
          f"{sh['end_ns'].max() / 1e6:.3f}", flush=True)
    wg = rec[np.isin(rec["kind"], [int(P.TaskKind.DOWN_WGRAD), int(P.TaskKind.GATE_UP_WGRAD)])]
    d = (ss["end_ns"] - ss["start_ns"]) / 1e3
    print(f"  timeline {rec['end_ns'].max() / 1e6:.3f} ms: rev_dispatch ends {rd['end_ns'].max() / 1e6:.3f}, "
          f"slot sums start {ss['start_ns'].min() / 1e6:.3f}-{ss['start_ns'].max() / 1e6:.3f} end "
          f"{ss['end_ns'].min() / 1e6:.3f}-{ss['end_ns'].max() / 1e6:.3f} ms ({len(ss)} tasks, {d.mean():.0f} us mean, "
          f"{d.max():.0f} max), wgrad tiles end {wg['end_ns'].max() / 1e6:.3f}", flush=True)
    layer.close(); heap.close()
