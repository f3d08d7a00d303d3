"""The fused forward and backward (persistent launches of plan.fused_forward / fused_backward
plans) against the sequential GPU layer, bitwise.

    python tests/mpi_programs/check_fused_layer.py --backend virtual --ranks 4
    NVSHMEM_DISABLE_NVLS=1 mpirun -n 4 python tests/mpi_programs/check_fused_layer.py --backend nvshmem
    python tests/mpi_programs/check_fused_layer.py --backend virtual --ranks 4 --backward --replays 20

Per case and policy: the sequential forward + backward, then for every knob setting (communication
CTAs, minibatch rows, ring, lookahead, raster, spread_from, claim) the fused forward (+ the sequential
backward on its cache): the output,
the slot rows, the shared expert's rows, the forward's cache (receive, g, u, h, y rows) and every
gradient are bitwise equal to the sequential run's; with a ring smaller than the minibatches
(no cache kept) the output and slot rows are, and a backward is refused. NaN-poisoned buffers
before every run. Then `--replays` replays of one CUDA graph of the fused forward (every tile
pair claimed at run time: which cluster runs a pair varies, the bits may not) are bitwise
equal, a traced forward gives the same bits and a record per task, a counter wait
that cannot be met raises KernelTimeoutError (no hang), a rank whose peers never start raises
SymmTimeoutError (virtual ranks), and an overflow on rank 0 raises CapacityError naming it on
every rank (gpu_program.check_overflow).
With --backward (instead of the forward's policy x knob sweep), the fused backward (after a
sequential and after a fused forward): every gradient bitwise equal to the sequential
backward's for each backward policy and knob setting (the scale and the token gradients inside the
kernel, the default with the transfers inside, and before / after it); `--replays` replays of one graph of
forward + backward, both fused, bitwise equal; a traced backward gives the same bits and a
record per task. Then the backward's error paths: a counter wait of the fused backward plan
that cannot be met raises KernelTimeoutError; a peer that stops after publishing its reverse-
combine rows makes rank 0's in-kernel wait for its reverse-dispatch flag raise SymmTimeoutError
naming the reverse-dispatch (virtual ranks); a rank whose peers ran the forward but never
start the backward raises SymmTimeoutError naming the reverse-combine and rank 0 (virtual
ranks, each backward policy); after an overflowed forward (fused forward and backward plans),
which raises CapacityError on every rank, every rank refuses the backward (in place of the
forward-only overflow check); then prints `OK fused backward errors ...` (rank 0).
Prints `SHA <case> <digest>` (rank 0) over every rank's fused output, and with --backward
`SHA bwd-<case> <digest>` over every rank's fused gradients, to compare backends.
"""

import hashlib
import re
import sys

import numpy as np

import gpu_program
from mok_proto import abi
from mok_proto.config import MOK_POLICY, MoEShape, RunConfig
from mok_proto.errors import KernelTimeoutError, SymmTimeoutError
from mok_proto.layer.gpu import GpuMoELayer
from mok_proto.plan import FusedKnobs, inside_kernel
from mok_proto.plan.check import ancestors
from mok_proto.problem import make_problem

CASES = {  # name: (H, I, E, K, N, shared, routing)
    "random": (256, 512, 16, 4, 200, 1, "random"),
    "one-expert": (256, 256, 8, 2, 96, 1, "one-expert"),
    "no-shared": (512, 256, 8, 2, 160, 0, "skewed"),
}
FORWARD = ("out", "y_slots", "base")  # what a fused forward must always reproduce
CACHE = ("recv", "g", "u", "h", "y")  # the activations the backward reads


def knob_settings(max_ctas: int):
    """(comm CTAs (0: the spare warps of every CTA), minibatch rows, ring minibatches or None = every
    minibatch, lookahead, other plan knobs: raster, spread_from (the combines every CTA moves), claim
    (tile pairs claimed at run time))."""
    big = min(32, max_ctas - 2)
    return [(0, 256, None, 1, {"claim": 0}), (2, 256, None, 0, {}), (8, 768, None, 1, {"spread_from": 0}),
            (big, 256, None, 2, {"raster": "col"}), (0, 512, None, 0, {"raster": "col"}), (2, 256, 2, 1, {}),
            (0, 256, 1, 0, {}), (2, 256, 2, 1, {"spread_from": 0}), (0, 256, None, 1, {"claim": 5}),
            (2, 256, 2, 1, {"claim": "all"})]


def check_knobs(plan, knobs):
    """The plan has the knobs it was built with (claim: as claim_pairs, "all" = every tile pair)."""
    for key, value in knobs.items():
        if key == "claim":
            assert plan.claim_pairs == value if isinstance(value, int) else plan.claim_pairs > 0, (plan.describe(), knobs)
        else:
            assert getattr(plan, key) == value, (plan.describe(), knobs)


def check_timeline(layer, rank, pass_):
    """A traced pass's rows: one per task, each ending after it starts, each on a CTA of the launch;
    a claimed pair's two halves on the two CTAs of one cluster."""
    plan = layer.fused.plan if pass_ == "fwd" else layer.fused_bwd.plan
    rows = layer.forward_timeline(rank, pass_)  # raises unless every task of the plan wrote its record
    assert len(rows) == len(plan.tasks) and (rows["end_ns"] >= rows["start_ns"]).all()
    assert ((rows["block"] >= 0) & (rows["block"] < plan.num_sms)).all(), rows["block"]
    pooled = np.flatnonzero(plan.tasks["block"] == plan.pool_block)
    static = np.setdiff1d(np.arange(len(rows)), pooled)
    assert (rows["block"][static] == plan.tasks["block"][static]).all(), "a table's task ran on another CTA"
    even, odd = rows["block"][pooled[0::2]], rows["block"][pooled[1::2]]
    assert ((even % 2 == plan.comm_blocks % 2) & (odd == even + 1) & (even >= plan.comm_blocks)).all(), (even, odd)
    return len(np.unique(even))


def forward_bytes(layer, rank, keys) -> bytes:
    return b"".join(layer.bufs[key].instance(rank).get().tobytes() for key in keys if key in layer.bufs)


def grads_bytes(layer, rank) -> bytes:
    return b"".join(v.get().tobytes() for _, v in sorted(layer.grads(rank).items()))


def run(layer, heap, backward: bool, graph=None):
    import cupy

    heap.barrier()
    layer.poison()
    cupy.cuda.Device().synchronize()
    heap.barrier()
    if graph is not None:
        stream = cupy.cuda.Stream(non_blocking=True)
        graph.launch(stream)
        stream.synchronize()
    else:
        layer.enqueue_forward()
        if backward:
            layer.enqueue_backward()
    layer.check()
    heap.barrier()
    out = {}
    for rank in layer.ranks:
        out[rank] = {"fwd": forward_bytes(layer, rank, FORWARD), "cache": forward_bytes(layer, rank, CACHE),
                     "grads": grads_bytes(layer, rank) if backward else b""}
    return out


# (comm CTAs, minibatch rows, other plan knobs) of the fused backward
# (scale, token_grads: dy_slots = w * dout and the slot sum inside the kernel by default, where the
# reverse-combine / reverse-dispatch are; False: before / after it)
BACKWARD_KNOBS = ((0, 256, {"claim": 0}), (2, 512, {"spread_from": 0}), (8, 768, {"raster": "col"}),
                  (0, 512, {"token_grads": False, "scale": False}), (2, 256, {"scale": False}),
                  (0, 256, {"claim": 7}), (2, 512, {"claim": "all"}))


def digest(comm, per_rank: dict) -> str:
    """16 hex digits of SHA-256 over every rank's bytes (this process's {rank: bytes}, gathered), in
    rank order: the same on every backend that computes the same bits."""
    everyone = gpu_program.all_ranks(comm, per_rank)
    return hashlib.sha256(b"".join(v for _, v in sorted(everyone.items()))).hexdigest()[:16]


def check_backward(layer, heap, name, max_ctas, policies, replays) -> tuple[int, int, dict]:
    """The fused backward (after a sequential and after a fused forward): every gradient bitwise
    equal to the sequential backward's, for each (reverse-combine, reverse-dispatch) policy and
    backward knob setting; then forward + backward fused in one graph, `replays` replays bitwise
    equal. Returns (settings checked, replays run, {rank: SHA-256 of its fused gradients})."""
    settings = 0
    for policy in policies:
        layer.policy = dict(policy)
        layer.set_forward_plan(None)
        layer.set_backward_plan(None)
        want = run(layer, heap, backward=True)
        for comm_ctas, minibatch, knobs in BACKWARD_KNOBS:
            comm_ctas = min(comm_ctas, max_ctas - 2)
            if comm_ctas and not any(inside_kernel("bwd", policy)):
                continue  # nothing to move inside the kernel: no communicating CTAs
            if "spread_from" in knobs and not inside_kernel("bwd", policy)[1]:
                continue  # only a reverse-dispatch inside the kernel (push) is spread
            plan = layer.fused_backward_plan(FusedKnobs(comm_ctas, minibatch, **knobs))
            check_knobs(plan, knobs)
            layer.set_backward_plan(plan)
            for fused_forward in (False, True):
                layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(0, 256)) if fused_forward else None)
                got = run(layer, heap, backward=True)
                for rank in layer.ranks:
                    assert got[rank]["grads"] == want[rank]["grads"], (
                        f"{name} rank {rank} {policy} fused backward comm={comm_ctas} minibatch={minibatch} {knobs} "
                        f"(forward {'fused' if fused_forward else 'sequential'}): gradients differ from sequential")
                settings += 1
    layer.policy = dict(MOK_POLICY)
    layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(0, 256)))
    # every pair claimed at run time: which cluster runs a pair varies
    layer.set_backward_plan(layer.fused_backward_plan(FusedKnobs(0, 256, claim="all")))
    first = run(layer, heap, backward=True)
    graph = layer.capture()  # forward + backward, both fused
    done = 0
    for replay in range(replays):
        assert run(layer, heap, backward=True, graph=graph) == first, f"{name}: fused fwd+bwd replay {replay} differs"
        done += 1
    layer.trace = True
    assert run(layer, heap, backward=True) == first, f"{name}: a traced fused backward differs"
    layer.trace = False
    for rank in layer.ranks:
        check_timeline(layer, rank, "bwd")
    layer.set_backward_plan(None)
    return settings, done, {rank: hashlib.sha256(first[rank]["grads"]).digest() for rank in layer.ranks}


def check_case(heap, comm, name, case_id, replays, policies, backward_policies):
    from mok_proto.kernels.fused import default_num_sms

    h, i, e, k, n, shared, routing = CASES[name]
    num_ranks = heap.num_ranks
    shape = MoEShape(name, hidden=h, ffn=i, num_experts=e, top_k=k, num_tokens=n, num_shared=shared)
    prob = make_problem(shape, num_ranks, seed=11 + case_id, routing=routing)
    layer = GpuMoELayer(heap, RunConfig(shape, num_ranks, timeout_s=20), name=f"f{case_id}")
    for rank in layer.ranks:
        layer.set_weights(rank, prob.local_weights(rank))
        layer.set_inputs(rank, prob.x[rank], prob.topk_idx[rank], prob.topk_weights[rank])
        layer.set_dout(rank, prob.dout[rank])
    max_ctas = default_num_sms(len(layer.ranks))
    settings = 0
    for policy in policies:
        layer.policy = dict(policy)
        layer.set_forward_plan(None)
        want = run(layer, heap, backward=True)
        for comm_ctas, minibatch, ring, lookahead, knobs in knob_settings(max_ctas):
            if comm_ctas and not any(inside_kernel("fwd", policy)):
                continue  # nothing to move inside the kernel: no communicating CTAs (plan.fused_forward)
            if "spread_from" in knobs and not inside_kernel("fwd", policy)[1]:
                continue  # only a combine inside the kernel (push) is spread
            full_ring = ring is None
            if not full_ring and not (policy["dispatch"] == "pull" and policy["combine"] == "push"):
                continue  # the ring turns only with both transfers inside the kernel (plan.fused_forward)
            plan = layer.fused_forward_plan(FusedKnobs(comm_ctas, minibatch, ring_minibatches=ring, lookahead=lookahead,
                                                       **knobs))
            check_knobs(plan, knobs)
            layer.set_forward_plan(plan)
            got = run(layer, heap, backward=full_ring)
            if not full_ring:  # the ring kept no activations: a backward is refused, not run on stale rows
                try:
                    layer.enqueue_backward()
                except RuntimeError as e:
                    assert "kept no activations" in str(e), str(e)
                else:
                    raise AssertionError("a backward after a ring forward was not refused")
            for rank in layer.ranks:
                what = f"{name} rank {rank} {policy} comm={comm_ctas} minibatch={minibatch} ring={ring} " \
                       f"lookahead={lookahead} {knobs}"
                assert got[rank]["fwd"] == want[rank]["fwd"], f"{what}: fused output differs from sequential"
                if full_ring:
                    assert got[rank]["cache"] == want[rank]["cache"], f"{what}: fused cache differs"
                    assert got[rank]["grads"] == want[rank]["grads"], f"{what}: backward after fused differs"
            settings += 1
    lines, bwd_replays = [], 0
    if backward_policies:
        bwd_settings, bwd_replays, grads = check_backward(layer, heap, name, max_ctas, backward_policies, replays)
        settings += bwd_settings
        lines.append(f"SHA bwd-{name} {digest(comm, grads)}")
    assert settings, "no knob setting ran"
    # Graph replays of the fused forward (MoK's policy, the first setting, every tile pair claimed at
    # run time: which cluster runs a pair varies from replay to replay, the bits may not).
    layer.policy = dict(MOK_POLICY)
    comm_ctas, minibatch, ring = knob_settings(max_ctas)[0][:3]
    knobs = FusedKnobs(comm_ctas, minibatch, ring_minibatches=ring, claim="all")
    layer.set_forward_plan(layer.fused_forward_plan(knobs))
    first = run(layer, heap, backward=False)
    graph = layer.capture(backward=False)
    fwd_replays = 0
    for replay in range(replays):
        got = run(layer, heap, backward=False, graph=graph)
        assert got == first, f"{name}: fused graph replay {replay} differs"
        fwd_replays += 1
    # The in-kernel timeline: tracing changes no result bit, and every task has a record.
    layer.trace = True
    traced = run(layer, heap, backward=False)
    layer.trace = False
    assert traced == first, f"{name}: a traced forward differs"
    for rank in layer.ranks:
        check_timeline(layer, rank, "fwd")
    lines.insert(0, f"SHA {name} {digest(comm, {rank: first[rank]['fwd'] for rank in layer.ranks})}")
    layer.close()
    return lines, {"settings": settings, "fwd_replays": fwd_replays, "bwd_replays": bwd_replays}


def expect_counter_timeout(layer, heap, comm, plan, i, what: str):
    """After a launch of `plan` whose task i waits for a count it can never reach: layer.check()
    raises KernelTimeoutError naming task i or a task that waits on it (through counters or stream
    order; the first bounded wait to expire is reported); under NVSHMEM a rank may instead time out
    on a peer (SymmTimeoutError) or finish, but the bad wait must have timed out on some rank."""
    after_i = [j for j, a in enumerate(ancestors(plan, plan.execution_order)) if a >> i & 1]
    seen = ""
    try:
        layer.check()
    except KernelTimeoutError as e:
        seen = str(e)
        got = re.search(r"task (\d+) of the plan", seen)
        assert "fused layer task" in seen and got and int(got[1]) in after_i, (seen, i, after_i)
    except SymmTimeoutError as e:
        if len(heap.launch_ranks) == heap.num_ranks:  # one launch of every rank: one record, this task's
            raise AssertionError(f"the {what}'s counter timeout was not the error reported: {e}") from e
    heap.barrier()
    if not any(comm.allgather(bool(seen)) if comm is not None else [bool(seen)]):
        raise AssertionError(f"a counter wait of the {what} that cannot be met did not time out")
    layer.close()


def check_counter_timeout(heap, comm):
    """A plan whose first routed down tile waits for one signal too many: the kernel reports
    kOpFusedWait (KernelTimeoutError) after the timeout instead of hanging."""
    import cupy

    from mok_proto.plan import TaskKind

    layer = gpu_program.small_layer(heap, "ftimeout", seed=5, num_tokens=64, timeout_s=2)
    layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(2, 256)))
    tasks = layer.fused.plan.tasks.copy()
    # a down tile of row tile 0 (it holds rows on every rank; a task past the real rows waits for
    # nothing) waits for one gate/up tile more than its row tile has
    i = int(np.flatnonzero((tasks["kind"] == int(TaskKind.DOWN)) & (tasks["row_tile"] == 0))[0])
    tasks["wait_target"][i, 0] += 1
    layer.fused.tasks = cupy.asarray(tasks.view(np.uint8))
    layer.fused._params.clear()
    layer.enqueue_forward()
    # NOTE: the first bounded wait to expire is reported: the bad one (task i) or one of a task that
    # waits on it (through counters or stream order), all started at about the same time. With one
    # process per rank (NVSHMEM) each rank has its own error record: a rank whose row tile 0 is
    # empty never meets the bad wait and instead times out on a peer's missing rows
    # (SymmTimeoutError), or finishes; the bad wait must have timed out on some rank.
    expect_counter_timeout(layer, heap, comm, layer.fused.plan, i, "fused forward")


def check_missing_peer(heap):
    """Virtual ranks: rank 0 alone runs a fused forward (its peers never start the round): the
    schedule's wait for their routing raises SymmTimeoutError naming the operator, and the fused
    kernel after it runs nothing (no hang)."""
    if heap.num_ranks < 2 or len(heap.launch_ranks) != heap.num_ranks:
        return
    layer = gpu_program.small_layer(heap, "fmissing", seed=9, num_tokens=64, timeout_s=2)
    layer.launch_only([0])
    layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(0, 256)))
    layer.enqueue_forward()
    try:
        layer.check()
    except SymmTimeoutError as e:
        assert "rank 0" in str(e), str(e)
    else:
        raise AssertionError("a fused forward without its peers did not time out")
    layer.close()


def check_backward_counter_timeout(heap, comm):
    """The fused backward's counter waits: after a sound forward, a backward plan whose first
    gate_up_bwd tile of row tile 0 waits for one down_bwd tile more than its row tile has: the
    kernel reports kOpFusedWait (KernelTimeoutError) after the timeout instead of hanging."""
    import cupy

    from mok_proto.plan import TaskKind

    layer = gpu_program.small_layer(heap, "btimeout", seed=5, num_tokens=64, timeout_s=2)
    layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(0, 256)))
    layer.set_backward_plan(layer.fused_backward_plan(FusedKnobs(2, 256)))
    heap.barrier()
    layer.enqueue_forward()
    layer.check()  # the forward is sound: the wait below is the only one that cannot be met
    heap.barrier()
    fused = layer.fused_bwd
    tasks = fused.plan.tasks.copy()
    # a gate_up_bwd tile of row tile 0 (the same routing and receive rows as check_counter_timeout's
    # forward: rows on every rank) waits for one down_bwd tile more than its row tile has
    i = int(np.flatnonzero((tasks["kind"] == int(TaskKind.GATE_UP_BWD)) & (tasks["row_tile"] == 0))[0])
    tasks["wait_target"][i, 0] += 1
    fused.tasks = cupy.asarray(tasks.view(np.uint8))
    fused._params.clear()
    layer.enqueue_backward()
    # NOTE: as in check_counter_timeout: the bad wait (task i) or one of a task that waits on it
    # times out first; under NVSHMEM a rank may instead time out on a peer (SymmTimeoutError) or
    # finish, but the bad wait must have timed out on some rank.
    expect_counter_timeout(layer, heap, comm, fused.plan, i, "fused backward")


def check_backward_peer_flag_timeout(heap) -> bool:
    """Virtual ranks: the fused backward's in-kernel wait for the peers' reverse-dispatch (the
    remote counter SLOTS_ARRIVED, kept as their kFlagCombine flags). Every rank runs the forward,
    then rank 0 alone the backward, its peers' reverse-combine flags raised by hand (as if they had
    published their rows and then stopped): its token-gradient tasks wait for a peer's flag that
    never comes and give up after the timeout with SymmTimeoutError naming the reverse-dispatch
    (push), rank 0 and a peer, instead of hanging. False where it does not apply (NVSHMEM, R = 1)."""
    if heap.num_ranks < 2 or len(heap.launch_ranks) != heap.num_ranks:
        return False
    layer = gpu_program.small_layer(heap, "bflag", seed=5, num_tokens=64, timeout_s=2)
    layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(0, 256)))
    layer.set_backward_plan(layer.fused_backward_plan(FusedKnobs(0, 256)))
    assert layer.fused_bwd.plan.token_grads
    layer.enqueue_forward()
    layer.check()  # every rank ran the forward
    layer.launch_only([0])
    layer.bufs["flags"].instance(0)[abi.FLAG_KIND["kFlagRouting"], 1:] = np.uint64(2 ** 63)  # "their dy rows are in"
    layer.enqueue_backward()
    op = abi.OP.text(abi.OP["kOpRevDispatchPush"])
    try:
        layer.check()
    except SymmTimeoutError as e:
        assert (e.op, e.rank) == (op, 0) and 0 < e.peer < heap.num_ranks, str(e)
    else:
        raise AssertionError("a fused backward whose peers never raise their reverse-dispatch flag did not time out")
    layer.close()
    return True


def check_backward_missing_peer(heap, policies) -> int:
    """Virtual ranks: every rank runs the (fused) forward, then rank 0 alone runs the fused
    backward (its peers never start that round): rank 0's wait for the peers' reverse-combine
    (their flags of the backward's epoch, before the fused kernel) raises SymmTimeoutError naming
    the reverse-combine of the policy, rank 0 and a peer; the fused kernel after it runs nothing
    (no hang). One layer per backward policy (a failed layer is spent); returns how many ran."""
    if heap.num_ranks < 2 or len(heap.launch_ranks) != heap.num_ranks:
        return 0
    for n, policy in enumerate(policies):
        layer = gpu_program.small_layer(heap, f"bmissing{n}", seed=9, num_tokens=64, timeout_s=2)
        layer.policy = dict(policy)
        layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(0, 256)))
        layer.set_backward_plan(layer.fused_backward_plan(FusedKnobs(0, 256)))
        layer.enqueue_forward()
        layer.check()  # every rank ran the forward: only the backward can wait in vain
        layer.launch_only([0])
        layer.enqueue_backward()
        op = abi.OP.text(abi.OP["kOpRevCombinePull" if policy["rev_combine"] == "pull" else "kOpRevCombinePush"])
        try:
            layer.check()
        except SymmTimeoutError as e:
            assert (e.op, e.rank) == (op, 0) and 0 < e.peer < heap.num_ranks, (policy, str(e))
        else:
            raise AssertionError(f"{policy}: a fused backward without its peers did not time out")
        layer.close()
    return len(policies)


def both_fused(layer):
    """The overflow check's layer in --backward mode: forward and backward fused (2 communicating CTAs)."""
    layer.set_forward_plan(layer.fused_forward_plan(FusedKnobs(2, 256)))
    layer.set_backward_plan(layer.fused_backward_plan(FusedKnobs(2, 256)))


def main():
    p = gpu_program.parser(CASES, with_policies=True)
    p.add_argument("--backward", action="store_true", help="the fused backward's checks (gradients, replays, "
                   "errors) instead of the forward's policy x knob sweep (the forward's replays, trace and error "
                   "checks run either way; the overflow check then runs a backward too)")
    args = p.parse_args()
    policies = [] if args.backward else gpu_program.policies(args, forward_only=True)
    backward_policies = gpu_program.policies(args, backward_only=True) if args.backward else []
    heap, comm = gpu_program.open_heap(args)
    try:
        results = [check_case(heap, comm, name, i, args.replays, policies, backward_policies)
                   for i, name in enumerate(args.cases.split(","))]
        check_counter_timeout(heap, comm)
        check_missing_peer(heap)
        if args.backward:
            check_backward_counter_timeout(heap, comm)
            flag = check_backward_peer_flag_timeout(heap)
            missing = check_backward_missing_peer(heap, backward_policies)
            gpu_program.check_overflow(heap, "boverflow", both_fused, backward=True, timeout_s=5)
        else:
            gpu_program.check_overflow(heap, "foverflow", lambda layer: layer.set_forward_plan(
                layer.fused_forward_plan(FusedKnobs(2, 256))))
    finally:
        heap.close()
    if heap.launch_ranks[0] == 0:
        total = {key: sum(done[key] for _, done in results) for key in ("settings", "fwd_replays", "bwd_replays")}
        print(f"OK fused layer backend={args.backend} R={heap.num_ranks}: {len(policies)} forward and "
              f"{len(backward_policies)} backward policies, {total['settings']} (policy, knob) settings bitwise "
              f"equal to sequential, graph replays bitwise equal: {total['fwd_replays']} of the forward, "
              f"{total['bwd_replays']} of forward + backward")
        if args.backward:
            print(f"OK fused backward errors: counter timeout, peer flag timeout {'checked' if flag else 'n/a'}, "
                  f"missing peer ({missing} policies), overflow")
        print("\n".join(line for lines, _ in results for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
