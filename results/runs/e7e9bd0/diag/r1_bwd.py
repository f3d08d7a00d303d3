"""R=1 (one rank owning every expert): why is the fused backward ~2x the sequential? Time the
sequential backward graph against fused backward plans (old balanced cost model, new, round
robin), interleaved, and summarize each one's timeline (per-kind GEMM ms per lane, tail)."""
import os, sys, time
sys.path.insert(0, "scripts")
import numpy as np, cupy
import bench_layer_mpi as B
from mok_proto import plan as P
from mok_proto.bench import summarize, time_stages, rotating, paired_ratio
from mok_proto.layer.gpu import GpuMoELayer
from mok_proto.symm.virtual import VirtualWorld

name = sys.argv[1] if len(sys.argv) > 1 else "qwen3.5-397b"
prob = B.Problem(name, None, 1, 0)
world = VirtualWorld(1)
layer = GpuMoELayer(world, prob.run, capacity=prob.capacity, name=name)
B.fill_layer(layer, 0, prob.topk, prob.topk_w, 0)
layer.enqueue_forward(); layer.enqueue_backward(); layer.check()
stream = cupy.cuda.Stream(non_blocking=True)
layer.enqueue_forward()
seq_g = layer.capture(forward=False, backward=True)
def result():
    return B.result_digests(layer, 0)
ref = result()
new_expected = P.expected_rows
def old_expected(shape, num_ranks, capacity_rows):
    el = shape.num_experts // num_ranks
    return min(capacity_rows, shape.num_tokens * shape.top_k + el * P.PAIR_ROWS // 2)
print(f"# {name} R=1 capacity {prob.capacity}", flush=True)
for label, assign, exp in (("balanced-old", "balanced", old_expected), ("balanced-new", "balanced", new_expected),
                           ("round_robin", "round_robin", new_expected)):
    P.expected_rows = exp
    t0 = time.time()
    pl = layer.fused_backward_plan(0, 2048, assign=assign)
    P.expected_rows = new_expected
    layer.set_backward_plan(pl)
    layer.enqueue_forward(); layer.enqueue_backward(); layer.check()
    equal = result() == ref
    layer.enqueue_forward()
    g = layer.capture(forward=False, backward=True)
    with stream:
        smp = time_stages(rotating({"f": lambda: g.launch(stream), "s": lambda: seq_g.launch(stream)}), 6, 2)
    layer.check()
    ms, sms = float(np.median(smp["f"])), float(np.median(smp["s"]))
    layer.trace = True
    layer.enqueue_forward(); layer.enqueue_backward(); layer.check()
    rec = layer.forward_timeline(0, "bwd")
    layer.trace = False
    lanes = {}
    gem = ~np.isin(rec["kind"], [int(k) for k in (P.TaskKind.REV_COMBINE, P.TaskKind.REV_DISPATCH)])
    t0n = rec["start_ns"].min()
    out = {}
    for k in np.unique(rec["kind"][gem]):
        sel = gem & (rec["kind"] == k)
        per_block = np.bincount(rec["block"][sel], weights=(rec["end_ns"] - rec["start_ns"])[sel], minlength=132)
        out[P.TaskKind(int(k)).name.lower()] = (round(per_block.mean() / 1e6, 3), round(per_block.max() / 1e6, 3))
    ends = np.array([rec["end_ns"][gem & (rec["block"] == b)].max() for b in np.unique(rec["block"][gem])]) - t0n
    print(f"{label}: fused {ms:.3f} ms, sequential {sms:.3f} ms, x seq {paired_ratio(smp['s'], smp['f']):.3f}, equal {equal}, "
          f"span {(rec['end_ns'].max() - t0n) / 1e6:.3f} ms, lane ends {ends.min() / 1e6:.3f}-{ends.max() / 1e6:.3f}; "
          f"GEMM ms per lane (mean, max): {out}", flush=True)
    layer.set_backward_plan(None)
