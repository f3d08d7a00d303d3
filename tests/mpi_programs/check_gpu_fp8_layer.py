"""The GPU layer with FP8 routed experts (RunConfig(precision="fp8"): the sequential and the fused
passes).

    python tests/mpi_programs/check_gpu_fp8_layer.py --backend virtual --ranks 4
    NVSHMEM_DISABLE_NVLS=1 mpirun -n 2 python tests/mpi_programs/check_gpu_fp8_layer.py --backend nvshmem

Per case (the shared expert bf16), for every rank this process drives:
- every quantization point bitwise (docs/design.md 5.7): the weights' codes, xq = q(x of each
  receive row's token), hq = q(the stored h); every routed GEMM within 2e-3 of max |ref| of its
  expert (the FP8 GEMM tests' bound) of a float64 product of the layer's own dequantized operands,
  carried through bf16 rounding and the SwiGLU backward (the backward's operands requantized here
  from the bf16 tensors the layer stored: the quantizer is bitwise the reference's);
- out and every gradient: err_rel_rms against the float64 reference on the bf16 inputs at most
  accuracy.ERR_REL_RMS_RECIPE and at most the float32 mirror's (reference_fp8, receive-row order)
  plus MIRROR_SLACK; the routed arrays' at least MIN_FP8_ERR (an FP8 layer, not a bf16 one); the
  layer within MIRROR_RMS of the mirror itself;
- bf16 and fp8 dispatch, a ring of every row and of one segment (several turns, the backward
  replaying), every direction policy asked for, the fused forward (fused_forward_fp8: bf16 rows
  quantized by its movers, or fp8 rows moved) and the fused backward (fused_backward_fp8: dy rows
  quantized by its movers, the routed weight gradients after it) under every policy (the ring of
  one segment: once a turn, three policies):
  bitwise equal; `--replays` CUDA graph replays (of the fused passes where they run) bitwise equal;
  NaN-poisoned buffers (e4m3 NaN codes too) before every run;
- wgrad_precision bf16, both dispatch dtypes: its weight gradients against float64 products of the
  layer's bf16 rows, its accuracy, a ring, the fused passes and replays bitwise equal to its
  sequential passes, every other result the fp8 weight gradients' bits.
Prints `SHA <case> <digest>` per case (rank 0), as check_gpu_layer.py.
"""

import hashlib
import sys

import numpy as np

import gpu_program
from check_gpu_layer import blob, run_once
from mok_proto import accuracy, fp8, reference_fp8
from mok_proto.config import MOK_POLICY, OPERATORS, MoEShape, RunConfig
from mok_proto.layer.gpu import GpuMoELayer
from mok_proto.plan import SEGMENT_ROWS, FusedKnobs, inside_kernel
from mok_proto.problem import make_problem
from mok_proto.reference import from_bf16, sigmoid, to_bf16
from mok_proto.schedule import expert_slot_order

TOL = 2e-3  # of max |ref| of an expert's GEMM (tests/test_gemm_fp8.py)
BF16_STEP = 2.0 ** -8
SIGMOID_REL = 1e-5  # the epilogues' fast sigmoid, relative
MIRROR_SLACK = 0.01  # err_rel_rms: the GPU layer at most this much above the float32 mirror's
MIRROR_RMS = 0.01  # err_rel_rms of the GPU layer against the mirror (in-block sums, sigmoid: a few flipped codes)
FP32_TOL = 1e-4  # of max |ref|: a bf16 weight gradient's fp32 accumulation (tests/test_gemm.py)
MIN_FP8_ERR = 0.01  # a routed array's err_rel_rms at least this (bf16 GEMMs would give ~0.004)
ROUTED = ("out", "w_gate", "w_up", "w_down")

CASES = {  # name: (H, I, E, K, N, shared, routing)
    "random": (256, 256, 16, 4, 24, 1, "random"),
    "one-expert": (256, 512, 8, 2, 160, 1, "one-expert"),  # expert 0: R N rows, several 128-row blocks
    "no-shared": (512, 256, 8, 2, 40, 0, "skewed"),
}


def deq(pair) -> np.ndarray:
    """float64 values of (codes, scales): 1 x 128 rows, or a weight's 128 x 128 blocks."""
    codes, scales = pair
    rows = scales.shape[-2] == codes.shape[-2]
    return (fp8.dequantize_rows if rows else fp8.dequantize_blocks)(codes, scales).astype(np.float64)


def host(layer, name, rank) -> np.ndarray:
    """A buffer of `rank` on the host; bf16 ones as float64 values."""
    a = layer._b(name, rank).get()
    return from_bf16(a).astype(np.float64) if a.dtype == np.uint16 else a


def pair(layer, name, rank):
    return host(layer, name, rank), host(layer, name + "_s", rank)


def within(name, got, want, bound):
    excess = np.abs(got - want) - bound
    assert np.all(excess <= 0), f"{name}: {np.count_nonzero(~(excess <= 0))} of {excess.size} beyond the bound, " \
                                f"worst by {np.nanmax(excess):.3g}"


def bf16_bound(err, want):
    """A bound on |value - want| carried through bf16's rounding of the value."""
    return err * (1 + BF16_STEP) + BF16_STEP * np.abs(want)


def segments(layer, rank):
    """[(local expert, ring rows)] of `rank`'s non-empty experts (one turn: the receive rows), and
    (src_rank, src_slot) of every receive row."""
    el, cap = layer.num_local, layer.capacity
    sched = layer._b("sched", rank).get()
    offsets, counts = sched[:el], sched[el + 1:2 * el + 1]
    src = sched[2 * el + 1:2 * el + 1 + cap], sched[2 * el + 1 + cap:]
    return [(l, slice(int(o), int(o + c))) for l, (o, c) in enumerate(zip(offsets, counts)) if c], src


def check_forward_stages(layer, rank, x_bf16):
    """The forward's quantization points bitwise, its two GEMMs within the bound."""
    k = layer.shape.top_k
    for key in ("w_gate", "w_up", "w_down"):  # quantized once, both orientations
        codes, scales = fp8.quantize_blocks(host(layer, key, rank).astype(np.float32))
        name = "wq_" + key[2:]
        assert np.array_equal(host(layer, name, rank), codes) and np.array_equal(
            host(layer, name + "_s", rank).view(np.uint32), scales.view(np.uint32)), f"rank {rank}: {name}"
        assert np.array_equal(host(layer, name + "_t", rank), codes.swapaxes(1, 2)) and np.array_equal(
            host(layer, name + "_t_s", rank), scales.swapaxes(1, 2)), f"rank {rank}: {name}_t"
    xq, hq, g, u, y = (pair(layer, "xq", rank), pair(layer, "hq", rank), host(layer, "g", rank),
                       host(layer, "u", rank), host(layer, "y", rank))
    (wg, wu, wd) = (pair(layer, n, rank) for n in ("wq_gate_t", "wq_up_t", "wq_down_t"))
    found, (src_rank, src_slot) = segments(layer, rank)
    for l, rows in found:
        codes, scales = fp8.quantize_rows(x_bf16[src_rank[rows], src_slot[rows] // k])  # the rows' tokens
        assert np.array_equal(xq[0][rows], codes) and np.array_equal(xq[1][rows], scales), \
            f"rank {rank} expert {l}: xq is not q(x) of its tokens"
        h = host(layer, "h", rank)[rows].astype(np.float32)
        codes, scales = fp8.quantize_rows(h)
        assert np.array_equal(hq[0][rows], codes) and np.array_equal(hq[1][rows], scales), f"rank {rank}: hq != q(h)"
        a = deq((xq[0][rows], xq[1][rows]))
        for name, got, w in (("g", g, wg), ("u", u, wu)):
            ref = a @ deq((w[0][l], w[1][l])).T
            within(f"rank {rank} expert {l} {name}", got[rows], ref, bf16_bound(TOL * np.abs(ref).max(), ref))
        ref = deq((hq[0][rows], hq[1][rows])) @ deq((wd[0][l], wd[1][l])).T
        within(f"rank {rank} expert {l} y", y[rows], ref, bf16_bound(TOL * np.abs(ref).max(), ref))


def check_backward_stages(layer, rank):
    """The backward's four GEMMs within the bound, on operands requantized from the bf16 tensors
    the layer stored (x^T from the dequantized xq)."""
    g, u, dy, dg, du, h, dx = (host(layer, n, rank) for n in ("g", "u", "recv_dy", "dg", "du", "h", "dx_rows"))
    xq = pair(layer, "xq", rank)
    wd, wg, wu = (pair(layer, n, rank) for n in ("wq_down", "wq_gate", "wq_up"))
    found, _ = segments(layer, rank)
    for l, rows in found:
        where = f"rank {rank} expert {l}"
        dh = deq(fp8.quantize_rows(dy[rows].astype(np.float32))) @ deq((wd[0][l], wd[1][l])).T
        sig = sigmoid(g[rows])
        err = TOL * np.abs(dh).max()
        gl, ul = g[rows], u[rows]
        # as tests/test_gemm_fp8.py bounds down_bwd: dh's error through the factor, the fast sigmoid
        dsilu = sig * (1 + gl * (1 - sig))
        for name, got, factor, slack in (("dg", dg, ul * dsilu, np.abs(dh * ul) * (1 + np.abs(gl))),
                                         ("du", du, gl * sig, np.abs(dh * gl))):
            ref = dh * factor
            within(f"{where} {name}", got[rows], ref, bf16_bound(err * np.abs(factor) + SIGMOID_REL * slack, ref))
        ref = sum(deq(fp8.quantize_rows(a[rows].astype(np.float32))) @ deq((w[0][l], w[1][l])).T
                  for a, w in ((dg, wg), (du, wu)))
        within(f"{where} dx rows", dx[rows], ref, bf16_bound(TOL * np.abs(ref).max(), ref))
        cols = {name: deq(reference_fp8.quantize_columns(a[rows].astype(np.float32)))
                for name, a in (("h", h), ("dy", dy), ("dg", dg), ("du", du))}
        cols["x"] = deq(reference_fp8.quantize_columns(fp8.dequantize_rows(xq[0][rows], xq[1][rows])))
        for name, a, b in (("w_down", "h", "dy"), ("w_gate", "x", "dg"), ("w_up", "x", "du")):
            ref = cols[a] @ cols[b].T
            within(f"{where} d{name}", host(layer, "d" + name, rank)[l], ref, TOL * np.abs(ref).max())


def results(layer, rank) -> dict:
    got = {"out": layer.output(rank).get()}
    got.update({key: value.get() for key, value in layer.grads(rank).items()})
    return got


def check_accuracy(comm, got_by_rank, ref, mirror, shape, num_ranks):
    """err_rel_rms of every array against the float64 reference and the float32 mirror."""
    n, num_local = shape.num_tokens, shape.num_experts // num_ranks
    everyone = gpu_program.all_ranks(comm, got_by_rank)
    got = {key: np.concatenate([everyone[r][key] for r in range(num_ranks)]) for key in ref
           if not key.startswith("shared_")}
    got.update({key: sum(everyone[r][key] for r in range(num_ranks)) for key in ref if key.startswith("shared_")})
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in ref.items()}, (n, num_local)
    table, mirrored = accuracy.error_table(got, ref), accuracy.error_table(mirror, ref)
    against_mirror = accuracy.error_table(got, mirror)
    for key, err in table.items():
        rms = err["err_rel_rms"]
        assert rms <= accuracy.ERR_REL_RMS_RECIPE, f"{key}: err_rel_rms {rms:.4f} > {accuracy.ERR_REL_RMS_RECIPE}"
        assert rms <= mirrored[key]["err_rel_rms"] + MIRROR_SLACK, \
            f"{key}: err_rel_rms {rms:.4f}, the float32 mirror's {mirrored[key]['err_rel_rms']:.4f}"
        assert key not in ROUTED or rms >= MIN_FP8_ERR, f"{key}: err_rel_rms {rms:.4f}: no FP8 quantization?"
        assert against_mirror[key]["err_rel_rms"] <= MIRROR_RMS, f"{key}: {against_mirror[key]} from the mirror"
    return max(v["err_rel_rms"] for v in table.values())


def mirror_results(prob, **wgrad) -> dict:
    """reference_fp8 over every rank's tokens, each expert's rows in its owner's receive order
    (wgrad: its wgrad_precision, dispatch_dtype)."""
    order = expert_slot_order(prob.topk_idx, prob.weights["w_gate"].shape[0])
    out, cache = reference_fp8.forward(prob.flat("x"), prob.flat("topk_idx"), prob.flat("topk_weights"), prob.weights,
                                       slot_order=order, **wgrad)
    return {"out": out, **reference_fp8.backward(prob.flat("dout"), cache)}


def poisoned(layer, heap):
    """Every rank's buffers NaN-poisoned, before a run."""
    import cupy

    heap.barrier()
    layer.poison()
    cupy.cuda.Device().synchronize()
    heap.barrier()


def staged_run(layer, heap, x_bf16):
    """One forward and backward, poisoned first, checking the stages in between."""
    poisoned(layer, heap)
    layer.enqueue_forward()
    layer.check()
    for rank in layer.ranks:
        check_forward_stages(layer, rank, x_bf16)
    heap.barrier()
    layer.enqueue_backward()
    layer.check()
    for rank in layer.ranks:
        check_backward_stages(layer, rank)
    heap.barrier()
    return {rank: results(layer, rank) for rank in layer.ranks}


def forward_only(layer, heap) -> bytes:
    """One forward after NaN-poisoning (a ring forward keeps no activations for a backward): the outputs."""
    poisoned(layer, heap)
    layer.enqueue_forward()
    layer.check()
    heap.barrier()
    return b"".join(layer.output(rank).get().tobytes() for rank in layer.ranks)


def check_fused_forward(layer, heap, policies, want, name):
    """The fused FP8 forward (its movers quantize the bf16 rows they pull, or pull the fp8 rows; a
    push dispatch runs before it) then the sequential backward: the bits of the sequential passes,
    under every policy, with the spare warps or two communicating CTAs moving rows, and with every
    pair claimed at run time; a ring of one minibatch (both transfers inside: the rows and their
    codes rewritten within the launch) gives the sequential forward's outputs. Leaves MoK's policy
    and its fused forward set."""
    for policy in policies:
        layer.policy = dict(policy)
        for knobs in (FusedKnobs(0, 256), FusedKnobs(2, 256), FusedKnobs(0, 256, claim="all")):
            if knobs.comm_blocks and not any(inside_kernel("fwd", policy)):
                continue  # nothing to move inside the kernel: no communicating CTAs (plan.fused_forward)
            layer.set_forward_plan(layer.fused_forward_plan(knobs))
            assert blob(run_once(layer, heap)) == want, f"{name}: fused fp8 forward, {policy}, {knobs}"
    layer.policy = {**MOK_POLICY, "dispatch": "pull", "combine": "push"}
    layer.set_forward_plan(None)
    sequential = forward_only(layer, heap)
    layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(0, 256, ring_minibatches=1)))
    assert forward_only(layer, heap) == sequential, f"{name}: fused fp8 forward on a ring of one minibatch"
    layer.policy = dict(MOK_POLICY)
    layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(0, 256)))
    # run once before the graph capture (its first launch uploads the pass's params)
    assert blob(run_once(layer, heap)) == want, f"{name}: fused fp8 forward, MoK's policy"


def check_fused_backward(layer, heap, policies, want, name):
    """The fused FP8 backward (its movers quantize the dy rows they pull; a push reverse-combine runs
    before it; the routed weight gradients after it) behind the fused forward: the bits of the
    sequential passes, under every policy, with the spare warps or two communicating CTAs moving
    rows, and with every pair claimed at run time. Leaves MoK's policy and its fused passes set."""
    for policy in policies:
        layer.policy = dict(policy)
        layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(0, 256)))
        for knobs in (FusedKnobs(0, 256), FusedKnobs(2, 256), FusedKnobs(0, 256, claim="all")):
            if knobs.comm_blocks and not any(inside_kernel("bwd", policy)):
                continue  # nothing to move inside the kernel: no communicating CTAs (plan.fused_backward)
            layer.set_backward_plan(layer.fused_backward_plan(knobs))
            assert not layer.fused_bwd.plan.routed_wgrads
            assert blob(run_once(layer, heap)) == want, f"{name}: fused fp8 backward, {policy}, {knobs}"
    layer.policy = dict(MOK_POLICY)
    layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(0, 256)))
    layer.set_backward_plan(layer.fused_backward_plan(FusedKnobs(0, 256)))
    # run once before the graph capture (its first launch uploads the passes' params)
    assert blob(run_once(layer, heap)) == want, f"{name}: fused fp8 passes, MoK's policy"


def check_bf16_wgrads(layer, rank):
    """wgrad_precision bf16: the weight gradients within FP32_TOL of max |ref| of float64 products of
    the bf16 rows the layer holds (x: recv; with fp8 dispatch bf16(deq(xq)), checked bitwise)."""
    h, dy, dg, du = (host(layer, n, rank) for n in ("h", "recv_dy", "dg", "du"))
    xq = pair(layer, "xq", rank)
    found, _ = segments(layer, rank)
    fp8_dispatch = layer.run.dispatch_dtype == "fp8"
    x = host(layer, "recv", rank)
    for l, rows in found:
        where = f"rank {rank} expert {l}"
        if fp8_dispatch:
            want = reference_fp8.round_bf16(fp8.dequantize_rows(xq[0][rows], xq[1][rows]))
            assert np.array_equal(x[rows], want), f"{where}: recv is not bf16(deq(xq))"
        for name, a, b in (("w_down", h, dy), ("w_gate", x, dg), ("w_up", x, du)):
            ref = a[rows].T @ b[rows]
            within(f"{where} d{name} (bf16)", host(layer, "d" + name, rank)[l], ref, FP32_TOL * np.abs(ref).max())


def check_wgrad_bf16(heap, comm, name, case_id, prob, fp8_bits, replays, policies):
    """RunConfig.wgrad_precision bf16, both dispatch dtypes: the sequential passes (their weight
    gradients checked, accuracy against the float64 reference and the mirror), a ring of one segment,
    the fused passes (under `policies`: the dequantizer before a pushed reverse-combine's quantizer,
    replayed dispatches) and graph replays bitwise equal to them; every result but the weight
    gradients the fp8 weight gradients' bits. Returns the worst err_rel_rms."""
    worst = 0.0
    for dispatch in ("bf16", "fp8"):
        run = RunConfig(prob.shape, heap.num_ranks, timeout_s=30, precision="fp8", dispatch_dtype=dispatch,
                        wgrad_precision="bf16")
        want = None
        for ring in (None, SEGMENT_ROWS):
            layer = GpuMoELayer(heap, run, name=f"w{case_id}{dispatch}{ring or 0}", macrobatch_rows=ring)
            for rank in layer.ranks:
                layer.set_weights(rank, prob.local_weights(rank))
                layer.set_inputs(rank, prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank])
                layer.set_dout(rank, prob.dout[rank])
            if ring is None:
                poisoned(layer, heap)
                layer.enqueue_forward()
                layer.enqueue_backward()
                layer.check()
                for rank in layer.ranks:
                    check_bf16_wgrads(layer, rank)
                got = {rank: results(layer, rank) for rank in layer.ranks}
                worst = max(worst, check_accuracy(comm, got, prob.reference_results(bf16=True),
                                                  mirror_results(prob, wgrad_precision="bf16", dispatch_dtype=dispatch),
                                                  prob.shape, heap.num_ranks))
                for rank, res in got.items():
                    assert all(np.array_equal(res[k], v) != k.startswith("w_") or not np.any(v)
                               for k, v in fp8_bits[rank].items()), f"{name}: bf16 weight gradients, {dispatch} dispatch"
                want = blob(got)
            else:  # the sequential passes in turns (the weight gradients accumulating over them)
                assert blob(run_once(layer, heap)) == want, f"{name}: bf16 weight gradients, {dispatch}, ring {ring}"
            after = FusedKnobs(0, 256, routed_wgrads=False, token_grads=False)  # (inside by default)
            for policy in policies[1:] + policies[:1]:  # (MoK's last: its plans are captured below)
                layer.policy = dict(policy)
                if ring is None:  # (the ring's forward stays sequential)
                    layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(0, 256)))
                for knobs in [after] * (ring is None) + [FusedKnobs(0, 256)]:
                    layer.set_backward_plan(layer.fused_backward_plan(knobs))
                    assert layer.fused_bwd.plan.routed_wgrads == (knobs is not after)
                    assert blob(run_once(layer, heap)) == want, \
                        f"{name}: bf16 wgrads, {dispatch}, ring {ring}, {policy}, {knobs}"
            graph = layer.capture()
            for replay in range(replays):
                assert blob(run_once(layer, heap, graph)) == want, f"{name}: bf16 wgrads, graph replay {replay}"
            layer.close()
    return worst


def check_case(heap, comm, name, case_id, replays, policies):
    h, i, e, k, n, shared, routing = CASES[name]
    num_ranks = heap.num_ranks
    shape = MoEShape(name, hidden=h, ffn=i, num_experts=e, top_k=k, num_tokens=n, num_shared=shared)
    prob = make_problem(shape, num_ranks, seed=17 + case_id, routing=routing)
    x_bf16 = from_bf16(to_bf16(prob.x.astype(np.float32)))  # the layer rounds x to bf16 on the way in
    few = [dict(MOK_POLICY), dict.fromkeys(OPERATORS, "push"), dict.fromkeys(OPERATORS, "pull")]
    first, worst, turns, fp8_results = None, None, [], None
    for dispatch in ("bf16", "fp8"):
        for ring in (None, SEGMENT_ROWS):
            run = RunConfig(shape, num_ranks, timeout_s=30, precision="fp8", dispatch_dtype=dispatch)
            layer = GpuMoELayer(heap, run, name=f"f{case_id}{dispatch}{ring or 0}", macrobatch_rows=ring)
            turns.append(layer.num_turns)
            for rank in layer.ranks:
                layer.set_weights(rank, prob.local_weights(rank))
                layer.set_inputs(rank, prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank])
                layer.set_dout(rank, prob.dout[rank])
            if ring is None:  # one turn: every stage checked, then every policy asked for
                got = staged_run(layer, heap, x_bf16)
                if first is None:
                    first, fp8_results = blob(got), got
                    worst = check_accuracy(comm, got, prob.reference_results(bf16=True), mirror_results(prob), shape,
                                           num_ranks)
                assert blob(got) == first, f"{name}: {dispatch} dispatch differs from bf16 dispatch"
            for policy in policies if ring is None else few:
                layer.policy = dict(policy)
                assert blob(run_once(layer, heap)) == first, f"{name}: {dispatch} dispatch, ring {ring}, {policy}"
            if ring is None:  # the fused passes (fused_forward_fp8, fused_backward_fp8), their graph replays below
                check_fused_forward(layer, heap, policies, first, name)
                check_fused_backward(layer, heap, policies, first, name)
            else:  # ... once a turn of the ring (MoK's policy last: replayed)
                for policy in few[1:] + few[:1]:
                    layer.policy = dict(policy)
                    layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(0, 256)))
                    layer.set_backward_plan(None)
                    assert blob(run_once(layer, heap)) == first, f"{name}: fused fp8 forward, ring {ring}, {policy}"
                    layer.set_backward_plan(layer.fused_backward_plan(FusedKnobs(0, 256)))
                    assert blob(run_once(layer, heap)) == first, f"{name}: fused fp8 passes, ring {ring}, {policy}"
            graph = layer.capture()
            for replay in range(replays):
                assert blob(run_once(layer, heap, graph)) == first, f"{name}: graph replay {replay} differs"
            layer.close()
    assert turns[0] == 1 and turns[1] > 1, turns
    worst_bf16 = check_wgrad_bf16(heap, comm, name, case_id, prob, fp8_results, replays, few)
    everyone = gpu_program.all_ranks(comm, first)
    digest = hashlib.sha256(b"".join(v for _, v in sorted(everyone.items()))).hexdigest()[:16]
    return (f"SHA {name} {digest}\n# {name}: err_rel_rms at most {worst:.4f} ({worst_bf16:.4f} with bf16 weight "
            f"gradients), a ring of one segment: {turns[1]} turns")


def main():
    args = gpu_program.parser(CASES, with_policies=True).parse_args()
    policies = gpu_program.policies(args)
    heap, comm = gpu_program.open_heap(args)
    try:
        lines = [check_case(heap, comm, name, i, args.replays, policies)
                 for i, name in enumerate(args.cases.split(","))]
    finally:
        heap.close()
    if heap.launch_ranks[0] == 0:
        print(f"OK gpu fp8 layer backend={args.backend} R={heap.num_ranks}: bf16 and fp8 dispatch x rings x "
              f"{len(policies)} policies and the fused passes bitwise equal, {args.replays} graph replays, stages "
              "within the GEMM bound; bf16 weight gradients")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
