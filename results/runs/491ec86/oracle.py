"""Experiment (H200): how much of the fused passes' tail is static imbalance? The 491ec86 timelines
show each lane's end tracks its GEMM busy time (corr 0.85-1.00), lanes ending 55-348 us apart.
Here: trace the default plan once, then build the same plan with the `balanced` list schedule fed
the MEASURED duration of every tile pair (an oracle for this routing: what a dynamic, claim-in-
order scheduler could approach), and time default vs oracle vs sequential interleaved
(bench.rotating), outputs compared bitwise. Rank 0 of bench_layer's staged EP=64 share.
    python3 results/runs/491ec86/oracle.py kimi-k2.7,deepseek-v4-pro fwd,bwd 20   (from the repository root)"""
import bisect, collections, sys
sys.path.insert(0, "scripts")
import numpy as np, cupy
import bench_layer as B
from mok_proto import plan as P
from mok_proto.bench import time_stages, rotating, paired_ratio

ORIG_ASSIGN = P._assign_clusters


def measured_costs(plan, rec):
    """{(kind, p, expert): mean ns} over the pair's tasks (both CTAs, every column tile)."""
    t = plan.tasks
    gemm = ~np.isin(t["kind"], [int(k) for k in P.MOVER_KINDS])
    acc = collections.defaultdict(list)
    for i in np.flatnonzero(gemm):
        acc[(int(t["kind"][i]), int(t["row_tile"][i]) // 2, int(t["expert"][i]))].append(
            float(rec["end_ns"][i] - rec["start_ns"][i]))
    return {k: max(1, int(np.mean(v))) for k, v in acc.items()}


def oracle_assign(costs):
    def assign(_assign, pairs, clusters, _cost):
        finish_of, by_free, out = {}, sorted((0, -c) for c in range(clusters)), []
        for kind, p, _, waits, signals, fields in pairs:
            tiles = (2 * p, 2 * p + 1)
            ready = max((finish_of.get(c, 0) for rt in tiles for c in waits(rt)), default=0)
            j = bisect.bisect_right(by_free, (max(ready, by_free[0][0]), 0)) - 1
            free, neg = by_free.pop(j)
            finish = max(free, ready) + costs.get((int(kind), p, int(fields.get("expert", -1))), 1)
            bisect.insort(by_free, (finish, neg))
            for c in {c for rt in tiles for c in signals(rt)}:
                finish_of[c] = max(finish_of.get(c, 0), finish)
            out.append(-neg)
        return out
    return assign


def lanes(plan, rec):
    comp = ~np.isin(plan.tasks["kind"], [int(k) for k in P.MOVER_KINDS])
    blocks = np.unique(plan.tasks["block"][comp])
    end = np.array([rec["end_ns"][comp & (plan.tasks["block"] == b)].max() for b in blocks]) / 1e3
    busy = np.array([(rec["end_ns"] - rec["start_ns"])[comp & (plan.tasks["block"] == b)].sum() for b in blocks]) / 1e3
    span = rec["end_ns"].max() / 1e3
    return (f"span {span:.0f} us, lane ends {end.min():.0f}-{end.max():.0f} (mean idle after {span - end.mean():.0f}), "
            f"busy {busy.min():.0f}-{busy.max():.0f}, corr {np.corrcoef(end, busy)[0, 1]:.2f}")


def traced(layer, pass_):
    layer.trace = True
    layer.enqueue_forward()
    if pass_ == "bwd":
        layer.enqueue_backward()
    layer.check()
    layer.trace = False
    return layer.forward_timeline(0, pass_)


shapes, passes = sys.argv[1].split(","), sys.argv[2].split(",")
iters = int(sys.argv[3]) if len(sys.argv) > 3 else 20
for name in shapes:
    shape = B.emulated_shape(name)
    heap, layer = B.staged_layer(shape, B.make_inputs(shape))
    stream = cupy.cuda.Stream(non_blocking=True)
    for pass_ in passes:
        build = layer.fused_forward_plan if pass_ == "fwd" else layer.fused_backward_plan
        setp = layer.set_forward_plan if pass_ == "fwd" else layer.set_backward_plan
        layer.set_forward_plan(None); layer.set_backward_plan(None)
        layer.enqueue_forward(); layer.enqueue_backward(); layer.check()
        ref = B.result_bytes(layer, pass_)
        def capture():
            if pass_ == "fwd":
                return layer.capture(forward=True, backward=False)
            layer.enqueue_forward()
            return layer.capture(forward=False)
        graphs = {"sequential": capture()}
        default = build(0, 2048)
        setp(default)
        rec = traced(layer, pass_)
        print(f"{name} {pass_} default ({default.assign}): {lanes(default, rec)}", flush=True)
        costs = measured_costs(default, rec)
        P._assign_clusters = oracle_assign(costs)
        try:
            oracle = build(0, 2048, assign="balanced")
        finally:
            P._assign_clusters = ORIG_ASSIGN
        oracle.check()
        equal = {}
        for label, pl in (("default", default), ("oracle", oracle)):
            setp(pl)
            layer.enqueue_forward()
            if pass_ == "bwd":
                layer.enqueue_backward()
            layer.check()
            equal[label] = B.result_bytes(layer, pass_) == ref
            graphs[label] = capture()
        rec2 = traced(layer, pass_)
        print(f"{name} {pass_} oracle: {lanes(oracle, rec2)}", flush=True)
        with stream:
            smp = time_stages(rotating({k: (lambda g=g: g.launch(stream)) for k, g in graphs.items()}), iters, 3)
        layer.check()
        med = {k: float(np.median(v)) for k, v in smp.items()}
        print(f"{name} {pass_} ms: " + ", ".join(f"{k} {v:.3f}" for k, v in med.items())
              + f"; x seq default {paired_ratio(smp['sequential'], smp['default']):.3f}, oracle "
              f"{paired_ratio(smp['sequential'], smp['oracle']):.3f}; oracle / default "
              f"{paired_ratio(smp['default'], smp['oracle']):.3f}; equal {equal}", flush=True)
        setp(None)
    layer.close(); heap.close()
