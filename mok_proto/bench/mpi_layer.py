"""Our layer and the torch + NCCL layer on R processes (scripts/bench_layer_mpi.py): the
sequential layer's eager stages per transfer-direction policy and its graph-replayed passes,
each fused setting, and the torch layer on the same weights; every step a phase of the rank
protocol (mok_proto.bench.ranks)."""

from __future__ import annotations

import time

import numpy as np

from mok_proto.bench.digests import result_digests
from mok_proto.bench.mpi_problem import MARGIN_BYTES
from mok_proto.bench.timing import summarize, time_stages
from mok_proto.bench.torch_baselines import TorchNcclLayer, as_torch
from mok_proto.config import DIRECTIONS, MOK_POLICY, OPERATORS

PASS_OF = {"dispatch": "fwd", "combine": "fwd", "rev_combine": "bwd", "rev_dispatch": "bwd"}  # stage -> pass


def eager_step(layer, heap) -> None:
    """One forward and backward, every rank starting together (the first compiles the kernels
    and uploads their descriptors)."""
    heap.barrier()
    layer.enqueue_forward()
    layer.enqueue_backward()
    layer.check()


def graphs_of(layer, heap):
    """(forward graph, backward graph) of the layer's current plans, after one eager step."""
    eager_step(layer, heap)
    return layer.capture(backward=False), layer.capture(forward=False)


def time_graphs(ranks, layer, graphs, pass_: str, iters: int, warmup: int) -> dict:
    """Replays alternate (forward graph, backward graph); the events bracket `pass_` only; every
    iteration starts on all ranks together. This rank's stats (a phase body: the caller takes
    the slowest rank's after the phase)."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)

    def one(mark):
        ranks.heap.barrier()
        for name, graph in zip(("fwd", "bwd"), graphs):
            if name == pass_:
                mark("run")
            graph.launch(stream)
            if name == pass_:
                mark(None)

    with stream:
        samples = time_stages(one, iters, warmup)
        stream.synchronize()
    layer.check()
    return summarize(samples["run"])


def time_eager_stages(ranks, layer, iters: int, warmup: int) -> dict:
    """{pass: {stage: stats}} of the layer's eager passes under its policy: events at the stages
    of the timed pass, both passes every iteration, every iteration starting on all ranks
    together; this rank's (a phase body: the caller takes the slowest rank's after the phase)."""
    out = {}
    for pass_ in ("fwd", "bwd"):
        def one(mark, pass_=pass_):
            ranks.heap.barrier()
            layer.enqueue_forward(mark if pass_ == "fwd" else None)
            layer.enqueue_backward(mark if pass_ == "bwd" else None)

        samples = time_stages(one, iters, warmup)
        layer.check()
        out[pass_] = {stage: summarize(v) for stage, v in samples.items()}
    return out


def policies_to_time() -> dict:
    """{label: policy}: MoK's, then each transfer flipped (the others at MoK's choice)."""
    out = {"mok": dict(MOK_POLICY)}
    for op in OPERATORS:
        for direction in DIRECTIONS:
            if direction != MOK_POLICY[op]:
                out[f"{op}={direction}"] = {**MOK_POLICY, op: direction}
    return out


def push_pull(stages: dict, nbytes: int, link_gbs: float) -> dict:
    """{op: {direction: stage_ms, overhead_ms, pct_link, ...}} from the eager stages of each policy
    (overhead = the stage beyond moving `nbytes` at the link rate)."""
    wire_ms = nbytes / (link_gbs * 1e9) * 1e3 if link_gbs > 0 else 0.0  # nan (no link): False -> 0
    out = {}
    for op in OPERATORS:
        out[op] = {}
        for direction in DIRECTIONS:
            label = "mok" if MOK_POLICY[op] == direction else f"{op}={direction}"
            if label in stages:
                ms = stages[label][PASS_OF[op]][op]["median_ms"]
                out[op][direction] = {"stage_ms": ms, "overhead_ms": ms - wire_ms, "bytes": nbytes,
                                      "pct_link": 100 * wire_ms / ms if ms > 0 else float("nan"), "policy": label}
    return out


def run_sequential(ranks, prob, layer, args, row: dict) -> dict:
    """Our sequential layer: push/pull eager stages per policy, the passes as graph replays,
    digests; fills row. Returns the output and input gradient (float32 copies, for the torch
    comparison), {} if it failed before them."""
    from mok_proto.kernels import gemm

    rank, heap, say = ranks.rank, ranks.heap, ranks.say
    say("#   first step (the first shape compiles the kernels)")
    ok, _ = ranks.phase(row, "first step (compiles)", lambda: eager_step(layer, heap))
    if not ok:
        return {}
    # Push vs pull: eager stages of the sequential layer, one transfer flipped at a time.
    digests, stages, ours = {}, {}, {}
    for label, policy in policies_to_time().items():
        def timed(policy=policy):
            layer.policy = dict(policy)
            got = time_eager_stages(ranks, layer, args.iters, args.warmup)
            return got, result_digests(layer, rank)

        ok, got = ranks.phase(row, f"stages {label}", timed)
        if not ok:
            return ours
        got = ({pass_: ranks.slowest(by) for pass_, by in got[0].items()}, got[1])
        stages[label], digests[label] = got
        say(f"#   eager passes, {label}: fwd {got[0]['fwd']['total']['median_ms']:.3f} ms, bwd "
            f"{got[0]['bwd']['total']['median_ms']:.3f} ms")
        if label == "mok":
            ours = {"out": layer.output(rank), "dx": gemm.from_bf16(layer.result_views(rank)["x"])}
    layer.policy = dict(MOK_POLICY)
    row["stages_ms"] = {label: {p: {stage: st["median_ms"] for stage, st in by.items()} for p, by in got.items()}
                        for label, got in stages.items()}
    row["push_pull"] = push_pull(stages, prob.crossing_bytes, row["link"]["nvshmem_pull_gbs"])
    say("#   push/pull, eager stage ms (+ beyond the bytes at link rate): " + "; ".join(
        f"{op} " + ", ".join(f"{d} {v['stage_ms']:.3f} (+{v['overhead_ms']:.3f})" for d, v in by.items())
        for op, by in row["push_pull"].items()))
    # The passes as graph replays.
    ok, graphs = ranks.phase(row, "sequential graphs", lambda: graphs_of(layer, heap))
    if not ok:
        return ours
    seq = {}
    for pass_ in ("fwd", "bwd"):
        ok, st = ranks.phase(row, f"sequential {pass_}", lambda p=pass_: time_graphs(
            ranks, layer, graphs, p, args.iters, args.warmup))
        if not ok:
            return ours
        seq[pass_] = ranks.slowest({"run": st})["run"]
    digests["sequential graphs"] = result_digests(layer, rank)
    row["ours"] = {"sequential": seq, "fused": {"fwd": [], "bwd": []}}
    say(f"#   ours sequential (graphs): fwd {seq['fwd']['median_ms']:.3f} ms, bwd {seq['bwd']['median_ms']:.3f} ms")
    record_digests(ranks, row, digests)
    return ours


def record_digests(ranks, row: dict, digests: dict) -> None:
    """Every rank's {label: digests} into row["bitwise"] (each label against MoK's sequential
    layer, which row["digests"] keeps per rank)."""
    everyone = ranks.comm.allgather(digests)
    if "digests" not in row:
        row["digests"] = [d["mok"] for d in everyone]
    equal = {**row.get("bitwise", {}).get("equal_to_mok_sequential", {}),
             **{label: all(d[label] == mok for d, mok in zip(everyone, row["digests"])) for label in digests}}
    row["bitwise"] = {"equal_to_mok_sequential": equal, "all": all(equal.values())}


def run_fused(ranks, prob, layer, args, jobs, row: dict) -> None:
    """Each fused setting of each pass (the other pass sequential) as graph replays, its results
    against the sequential layer's (row["digests"]: the first part of this run, on another layer
    object with the same inputs); fills row["ours"]["fused"]."""
    rank, heap, say = ranks.rank, ranks.heap, ranks.say
    mok = row["digests"][rank]
    digests = {}
    ok, digests["sequential, second layer"] = ranks.phase(row, "first step (fused part)", lambda: (
        eager_step(layer, heap), result_digests(layer, rank))[1])
    if not ok:
        return
    settings = [(pass_, comm_blocks, minibatch) for pass_ in ("fwd", "bwd") for comm_blocks, minibatch in args.fused]
    for pass_, comm_blocks, minibatch in settings:
        if any(ranks.comm.allgather(layer.failed)):  # spent on some rank: every later step would only time out
            row.setdefault("errors", []).append({"phase": "fused settings after a layer error", "ranks": {}})
            break
        label = f"fused {pass_} {comm_blocks}:{minibatch}"
        waited = time.time()
        root, job = jobs[prob.name, pass_, comm_blocks, minibatch]
        ok, plan = ranks.shared(row, f"{label} plan (proved by rank {root})", lambda job=job: job.get(args.plan_timeout),
                                root)
        if not ok:
            continue
        waited = ranks.max(time.time() - waited)

        def fused(pass_=pass_, plan=plan):
            (layer.set_forward_plan if pass_ == "fwd" else layer.set_backward_plan)(plan)
            try:
                st = time_graphs(ranks, layer, graphs_of(layer, heap), pass_, args.iters, args.warmup)
                return st, result_digests(layer, rank)
            finally:
                layer.set_forward_plan(None)
                layer.set_backward_plan(None)

        ok, got = ranks.phase(row, label, fused)
        if not ok:
            continue
        st, digests[label] = ranks.slowest({"run": got[0]})["run"], got[1]
        same = all(ranks.comm.allgather(digests[label] == mok))
        row["ours"]["fused"][pass_].append({"comm_blocks": comm_blocks, "minibatch_rows": minibatch,
                                            "segment_rows": plan.knobs.segment_rows, **st,
                                            "plan_wait_s": waited, "plan_tasks": len(plan.tasks),
                                            "num_sms": plan.num_sms, "equal_to_sequential": same})
        say(f"#   ours {label}: {st['median_ms']:.3f} ms (sequential {row['ours']['sequential'][pass_]['median_ms']:.3f}),"
            f" results equal to the sequential layer's: {same} (waited {waited:.0f} s for its plan)")
    record_digests(ranks, row, digests)


def torch_bytes(prob, concat: bool) -> int:
    """Device memory the torch layer adds beside ours (it reads our weights, inputs and dout):
    weight gradients (bf16), the concatenated gate/up copy, activations (rough, generous)."""
    s = prob.shape
    el = s.num_experts // prob.num_ranks
    routed = el * s.hidden * s.ffn * 2  # one bf16 [El, H, I]
    received = int(np.bincount(prob.topk.reshape(-1) // el, minlength=prob.num_ranks).max())
    activations = (12 * received * (s.hidden + 2 * s.ffn) * 2 + 8 * s.num_tokens * s.top_k * s.hidden * 2
                   + 16 * s.num_tokens * (s.hidden + 2 * s.shared_ffn_size) * 4)
    return 3 * routed + (2 * routed if concat else 0) + 9 * s.hidden * s.shared_ffn_size * 2 + activations


def run_torch(ranks, prob, layer, ours: dict, iters: int, warmup: int, row: dict) -> None:
    """The torch + NCCL layer on our weights and inputs: its timings and its error against ours
    (row["torch"]). Two phases: its setup (local), then its passes (NCCL: entered only once every
    rank's setup succeeded) and the comparison; the reductions after both succeeded."""
    import torch

    rank, b = ranks.rank, layer.bufs
    free = ranks.free_bytes()
    concat = torch_bytes(prob, True) + MARGIN_BYTES <= free
    if not concat and torch_bytes(prob, False) + MARGIN_BYTES > free:  # the same verdict on every rank
        why = (f"MemoryError: the torch layer needs ~{torch_bytes(prob, False) / 1e9:.1f} GB beside ours, "
               f"{free / 1e9:.1f} GB are free")
        ranks.say(f"#   torch: {why}")
        row.setdefault("errors", []).append({"phase": "torch", "ranks": {"all": why}})
        return

    def setup():
        shared = tuple(as_torch(b[key].instance(rank))[0] for key in ("shared_gate", "shared_up", "shared_down")) \
            if layer.has_shared else None
        model = TorchNcclLayer(ranks.num_ranks, rank, *(as_torch(b[key].instance(rank))
                                                        for key in ("w_gate", "w_up", "w_down")),
                               shared=shared, concat=concat)
        x = as_torch(b["x"].instance(rank)).detach().requires_grad_()
        idx = torch.as_tensor(prob.topk[rank], device="cuda").long()
        w = torch.as_tensor(prob.topk_w[rank], device="cuda").requires_grad_()
        return model, x, idx, w, as_torch(b["dout"].instance(rank))

    ok, inputs = ranks.phase(row, "torch setup", setup)
    if not ok:
        return

    def passes(model, x, idx, w, dout):
        leaves = model.parameters() + [x, w]

        def fwd(mark):
            ranks.heap.barrier()
            with torch.no_grad():
                model.forward(x, idx, w, mark)
            mark(None)

        def fwd_bwd(mark):
            ranks.heap.barrier()
            for leaf in leaves:  # fresh gradients every iteration (no accumulation)
                leaf.grad = None
            mark("fwd")
            out = model.forward(x, idx, w)
            mark("bwd")
            torch.autograd.backward(out, dout)
            mark(None)

        stages = time_stages(fwd, iters, warmup, api="torch")
        both = time_stages(fwd_bwd, iters, warmup, api="torch")
        fwd_bwd(lambda stage: None)  # once more untimed: x.grad for the comparison
        with torch.no_grad():
            out = model.forward(x, idx, w)
        torch.cuda.synchronize()

        def rel_err(mine, ref):
            ref = ref.float()
            return float((as_torch(mine) - ref).abs().max() / ref.abs().max().clamp_min(1e-30))

        return (stages, both, float(np.median(both["total"]) - np.median(stages["total"])),
                {"out": rel_err(ours["out"], out), "x": rel_err(ours["dx"], x.grad)})

    ok, got = ranks.phase(row, "torch", lambda: passes(*inputs))
    inputs = None
    if not ok:
        return
    stages, both, bwd_ms, errors = got
    fwd_stats = ranks.slowest({stage: summarize(v) for stage, v in stages.items()})
    both_stats = ranks.slowest({"total": summarize(both["total"])})
    row["torch"] = {"fwd": fwd_stats["total"], "fwd_stages": {k: v for k, v in fwd_stats.items() if k != "total"},
                    "fwd_bwd": both_stats["total"], "bwd_median_ms": ranks.max(bwd_ms),
                    "bwd_definition": "t(fwd+bwd) - t(fwd, no_grad), the slowest rank's",
                    "gate_up": "concatenated" if concat else "separate (the concatenated copy did not fit)",
                    "max_rel_err_vs_ours": {key: ranks.max(err) for key, err in errors.items()}}


def sequential_part(ranks, prob, layer, args, row: dict) -> None:
    """Part 1 of a shape: our sequential layer, then the torch layer on the same weights."""
    ours = run_sequential(ranks, prob, layer, args, row)
    if ours and not args.no_torch:
        run_torch(ranks, prob, layer, ours, args.iters, args.warmup, row)
    if "torch" in row:
        t = row["torch"]
        ranks.say(f"#   torch + NCCL: fwd {t['fwd']['median_ms']:.3f} ms, bwd {t['bwd_median_ms']:.3f} ms "
                  f"(gate/up {t['gate_up'].split(' ')[0]}); max rel err vs ours: out "
                  f"{t['max_rel_err_vs_ours']['out']:.1e}, dx {t['max_rel_err_vs_ours']['x']:.1e}")
