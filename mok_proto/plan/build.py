"""The strategies: functions that return a Plan. `sequential` (stage by stage), `fixed_split`
(MoK's restructured overlap, for the simulator), `fused_forward` / `fused_backward` (what the
megakernels of cuda/fused.cuh execute)."""

from __future__ import annotations

import bisect
import functools

import numpy as np

from mok_proto.config import OPERATORS, MoEShape
from mok_proto.plan.core import ROW_WIDTH, WAITS_AT, Builder, Plan
from mok_proto.plan.cost import default_capacity, num_col_tiles, past_expected, tile_cost, wgrad_grid
from mok_proto.plan.kinds import (BM, FUSED_STRATEGIES, MAX_SIGNALS, MAX_WAITS, PAIR_ROWS, PASS_KINDS, PASSES,
                                  SEGMENT_ROWS, CounterKind, PassKinds, PlanError, TaskKind, cdiv, inside_kernel,
                                  token_tiles)
from mok_proto.plan.knobs import FusedKnobs


def sequential(shape: MoEShape, num_ranks: int, *, pass_: str = "fwd", policy: dict, num_sms: int,
               capacity_rows: int | None = None) -> Plan:
    """Stage by stage, every CTA in every stage, a barrier counter between stages (what separate
    kernel launches do): comm in, shared first, shared second, first GEMM, second GEMM, comm
    out, [weight gradients, shared weight gradients], epilogue. One minibatch (the whole
    capacity), ring of one. A stage's barrier is remote when its data crosses ranks."""
    capacity_rows = capacity_rows or default_capacity(shape, num_ranks)
    _check_common(shape, num_ranks, policy, num_sms, capacity_rows, capacity_rows, pass_)
    k = PASS_KINDS[pass_]
    remote = _remote_counters(pass_, policy)
    el = shape.num_experts // num_ranks
    shared_tiles = cdiv(shape.num_tokens, BM) if shape.num_shared else 0
    row_tiles = capacity_rows // BM
    # stage: (work items as dicts, is the barrier after it remote)
    stages = [([dict(kind=k.comm_in, minibatch=0, row_tile=c, col_tile=num_sms) for c in range(num_sms)],
               CounterKind.ARRIVED in remote)]
    for kind in (k.shared_first, k.shared_second):
        stages.append(([dict(kind=kind, row_tile=r, col_tile=c) for r in range(shared_tiles)
                        for c in range(num_col_tiles(kind, shape))], False))
    stages.append(([dict(kind=k.first, minibatch=0, row_tile=r, col_tile=c) for r in range(row_tiles)
                    for c in range(num_col_tiles(k.first, shape))], False))
    stages.append(([dict(kind=k.second, minibatch=0, row_tile=r, col_tile=c) for r in range(row_tiles)
                    for c in range(num_col_tiles(k.second, shape))], CounterKind.SECOND_DONE in remote))
    stages.append(([dict(kind=k.comm_out, minibatch=0, row_tile=c, col_tile=num_sms) for c in range(num_sms)],
                   CounterKind.SLOTS_ARRIVED in remote))
    for kind in k.wgrad:
        rows, cols = wgrad_grid(kind, shape)
        stages.append(([dict(kind=kind, macrobatch=0, row_tile=r, col_tile=c, expert=e) for e in range(el)
                        for r in range(rows) for c in range(cols)], False))
    for kind in (k.shared_wgrad if shared_tiles else ()):
        rows, cols = wgrad_grid(kind, shape)
        stages.append(([dict(kind=kind, row_tile=r, col_tile=c) for r in range(rows) for c in range(cols)], False))
    stages.append(([dict(kind=k.epilogue, row_tile=r) for r in token_tiles(shape)], False))
    stages = [(items, rem) for items, rem in stages if items]

    b = Builder(num_ranks)
    for s, (_, rem) in enumerate(stages):
        b.counter(CounterKind.STAGE_DONE, s, rem)
    for s, (items, _) in enumerate(stages):
        waits = [b.counter(CounterKind.STAGE_DONE, s - 1)] if s else []
        for i, item in enumerate(items):
            b.add(i % num_sms, item.pop("kind"), waits, [b.counter(CounterKind.STAGE_DONE, s)], **item)
    return b.build(pass_=pass_, shape=shape, num_ranks=num_ranks, policy=dict(policy), num_sms=num_sms,
                   comm_blocks=num_sms, minibatch_rows=capacity_rows, ring_minibatches=1,
                   capacity_rows=capacity_rows, strategy="sequential")


def fixed_split(shape: MoEShape, num_ranks: int, comm_blocks: int, minibatch_rows: int,
                ring_minibatches: int | None = None, *, pass_: str = "fwd", policy: dict,
                num_sms: int, capacity_rows: int | None = None) -> Plan:
    """MoK's restructured overlap: CTAs 0..comm_blocks-1 run every dispatch, then combines and
    later dispatches interleaved (ring permitting); the other CTAs take compute tasks in one
    global order, round robin: shared expert first (it fills the wait for the first rows), then
    per minibatch the first GEMM's tiles and the second GEMM's tiles, in the backward the weight
    gradients at the end of each macrobatch (each output tile pinned to one CTA; shared weight
    gradients last); the epilogue sum
    (weighted sum / slot sum) on every CTA at the end."""
    capacity_rows = capacity_rows or default_capacity(shape, num_ranks, minibatch_rows)
    ring = ring_minibatches or capacity_rows // minibatch_rows
    _check_common(shape, num_ranks, policy, num_sms, minibatch_rows, capacity_rows, pass_)
    if not 1 <= ring:
        raise ValueError(f"ring_minibatches must be >= 1, got {ring}")
    if not 1 <= comm_blocks < num_sms:
        raise ValueError(f"comm_blocks must be in [1, num_sms={num_sms}), got {comm_blocks}")
    k = PASS_KINDS[pass_]
    remote = _remote_counters(pass_, policy)
    b = Builder(num_ranks)
    num_mb = capacity_rows // minibatch_rows
    tpm = minibatch_rows // BM
    num_macro = cdiv(num_mb, ring)
    el = shape.num_experts // num_ranks
    shared_tiles = cdiv(shape.num_tokens, BM) if shape.num_shared else 0
    wgrad = bool(k.wgrad)

    def ctr(kind, index=0):
        return b.counter(kind, index, kind in remote)

    # Counters first, so that targets are known when tasks reference them (ids in a fixed order).
    for m in range(num_mb):
        ctr(CounterKind.ARRIVED, m), ctr(CounterKind.SECOND_DONE, m), ctr(CounterKind.RELEASED, m)
    for rt in range(num_mb * tpm):
        ctr(CounterKind.FIRST_DONE, rt)
    for rt in range(shared_tiles):
        ctr(CounterKind.SHARED_FIRST_DONE, rt)
    ctr(CounterKind.SHARED_DONE), ctr(CounterKind.SLOTS_ARRIVED)
    for j in range(num_macro if wgrad else 0):
        ctr(CounterKind.DATA_GRAD_DONE, j), ctr(CounterKind.WGRAD_DONE, j)

    # Compute tasks in one global order; tasks are assigned round robin to compute CTAs.
    compute: list[dict] = []
    n1, n2 = num_col_tiles(k.shared_first, shape), num_col_tiles(k.shared_second, shape)
    for rt in range(shared_tiles):
        compute += [dict(kind=k.shared_first, row_tile=rt, col_tile=c,
                         signals=[ctr(CounterKind.SHARED_FIRST_DONE, rt)]) for c in range(n1)]
    for rt in range(shared_tiles):
        compute += [dict(kind=k.shared_second, row_tile=rt, col_tile=c,
                         waits=[ctr(CounterKind.SHARED_FIRST_DONE, rt)], signals=[ctr(CounterKind.SHARED_DONE)])
                    for c in range(n2)]
    f1, f2 = num_col_tiles(k.first, shape), num_col_tiles(k.second, shape)
    for j in range(num_macro):
        mbs = range(j * ring, min((j + 1) * ring, num_mb))
        for m in mbs:
            for rt in range(m * tpm, (m + 1) * tpm):
                sig = [ctr(CounterKind.FIRST_DONE, rt)] + ([ctr(CounterKind.DATA_GRAD_DONE, j)] if wgrad else [])
                compute += [dict(kind=k.first, minibatch=m, row_tile=rt, col_tile=c,
                                 waits=[ctr(CounterKind.ARRIVED, m)], signals=sig) for c in range(f1)]
            for rt in range(m * tpm, (m + 1) * tpm):
                compute += [dict(kind=k.second, minibatch=m, row_tile=rt, col_tile=c,
                                 waits=[ctr(CounterKind.FIRST_DONE, rt)],
                                 signals=[ctr(CounterKind.SECOND_DONE, m)]) for c in range(f2)]
        # Weight-gradient output tile `pin` (the same numbering in every macrobatch) runs on
        # compute CTA pin % num_compute in every macrobatch: one CTA stores (macrobatch 0), then
        # adds in macrobatch order, in program order (check() proves it).
        grids = {kind: wgrad_grid(kind, shape) for kind in k.wgrad}  # (row tiles, col tiles)
        tiles = [(kind, e, r, c) for kind, (rows, cols) in grids.items() for e in range(el)
                 for r in range(rows) for c in range(cols)]
        compute += [dict(kind=kind, macrobatch=j, row_tile=r, col_tile=c, expert=e, pin=pin,
                         waits=[ctr(CounterKind.DATA_GRAD_DONE, j)], signals=[ctr(CounterKind.WGRAD_DONE, j)])
                    for pin, (kind, e, r, c) in enumerate(tiles)]
    if shared_tiles:
        for kind in k.shared_wgrad:
            rows, cols = wgrad_grid(kind, shape)
            compute += [dict(kind=kind, row_tile=r, col_tile=c, waits=[ctr(CounterKind.SHARED_DONE)])
                        for r in range(rows) for c in range(cols)]

    # Communication CTAs: chunk c of every minibatch, in MoK's order.
    def comm_in(c, m):
        waits = []
        if m >= ring:
            waits.append(ctr(CounterKind.RELEASED, m - ring))
            if wgrad:
                waits.append(ctr(CounterKind.WGRAD_DONE, (m - ring) // ring))
        b.add(c, k.comm_in, waits, [ctr(CounterKind.ARRIVED, m)], minibatch=m, row_tile=c, col_tile=comm_blocks)

    def comm_out(c, m):
        b.add(c, k.comm_out, [ctr(CounterKind.SECOND_DONE, m)],
              [ctr(CounterKind.RELEASED, m), ctr(CounterKind.SLOTS_ARRIVED)], minibatch=m, row_tile=c,
              col_tile=comm_blocks)

    # Tables in CTA order (targets are filled in by build(), once every signal is known).
    for c in range(comm_blocks):
        for m in range(min(ring, num_mb)):
            comm_in(c, m)
        for m in range(num_mb):
            comm_out(c, m)
            if m + ring < num_mb:
                comm_in(c, m + ring)
    # Compute tasks round robin over the compute CTAs, except pinned weight-gradient tiles.
    num_compute = num_sms - comm_blocks
    turn = 0
    for t in compute:
        pin = t.pop("pin", None)
        if pin is None:
            pin, turn = turn, turn + 1
        b.add(comm_blocks + pin % num_compute, t.pop("kind"), t.pop("waits", ()), t.pop("signals", ()), **t)
    for block, kind, rt, waits in _epilogue_tasks(k, shape, num_sms, ctr):
        b.add(block, kind, waits, (), row_tile=rt)
    return b.build(pass_=pass_, shape=shape, num_ranks=num_ranks, policy=dict(policy), num_sms=num_sms,
                   comm_blocks=comm_blocks, minibatch_rows=minibatch_rows, ring_minibatches=ring,
                   capacity_rows=capacity_rows, strategy="fixed_split")


def fused_forward(shape: MoEShape, num_ranks: int, knobs: FusedKnobs, *, policy: dict, num_sms: int,
                  capacity_rows: int | None = None) -> Plan:
    """The forward megakernel's plan (cuda/fused.cuh) with `knobs` (FusedKnobs; None fields: their
    defaults, FusedKnobs.resolved). CTAs 0 .. comm_blocks - 1 pull the
    dispatched rows of minibatch after minibatch (chunk b of each: CTA b), then push the combine
    of each minibatch once its down tiles are done, a ring slot's next dispatch right after the
    combine that releases it; the other CTAs, in 2-CTA clusters, take GEMM tile pairs in one
    global order: the shared expert's gate/up then down tiles, then per minibatch routed
    gate/up (after its rows arrived), then down (after its row tile's gate/up tiles). assign
    (ASSIGNMENTS): which cluster takes each pair, round robin or
    load-balanced (`_assign_clusters`); raster (RASTERS): the order of a
    minibatch's pairs of one kind (and of the shared expert's), row pair by row pair or column
    tile by column tile; the backward's weight-gradient pairs keep their order (expert, row pair,
    column tile) either way.
    spread_from (None: no minibatch): the combine of every minibatch >= spread_from is split over
    all num_sms CTAs (chunk c on CTA c: the communicating CTAs with every warp, the compute CTAs
    with their spare warps), not just the communicating ones: the last combines run when the
    GEMM tiles are (nearly) done, so the whole GPU can move them.
    comm_blocks = 0: no CTA is set aside; chunk c of every minibatch goes to CTA c of all
    num_sms, whose spare warps move it while its GEMM tasks run (two independent in-order
    streams per CTA: `Plan.streams`).
    lookahead (default 1, or 0 with a ring of one minibatch): the gate/up tiles of minibatch
    m + lookahead come before the down tiles of minibatch m in the global order (0: strictly
    per minibatch), so a cluster whose next down
    tile still waits for other clusters' gate/up tiles has gate/up work queued before it instead
    (the minibatches' gate/up and down phases no longer alternate in lockstep).
    At most ring - 1 (a later minibatch's rows may need this one's slot).

    A tile pair is one task on each CTA of a cluster, at the same position of both tables:
    row_tile 2p on the even CTA, 2p + 1 on the odd one (row pair p: rows PAIR_ROWS p ..).
    Every counter is local (no peer signals inside the kernel). The weighted sum is not in the
    plan: it runs after the kernel (MoK's epilogue kernel). With dispatch push / combine pull
    (see inside_kernel) those transfers run outside and the ring cannot turn (ring = every
    minibatch).
    claim: the last `claim` tile pairs of the global order go to no
    cluster: they are the pool (`Plan.pool_table`), which the clusters claim at run time, in
    order, each once its producer issued its own table's GEMM loads (MoK's ticket scheduler): the cluster
    that finishes first takes the next pair, whatever the routing made each pair cost. "all":
    every pair (MoK's scheduler over the whole kernel); "tail": TAIL_PAIRS_PER_CLUSTER per
    cluster; 0: none (every pair in a cluster's table). check() proves the plan deadlock free
    with the pool claimed after every cluster's table (`check.execution_order`)."""
    return _fused("fwd", shape, num_ranks, knobs, policy, num_sms, capacity_rows)


def fused_backward(shape: MoEShape, num_ranks: int, knobs: FusedKnobs, *, policy: dict, num_sms: int,
                   capacity_rows: int | None = None) -> Plan:
    """The backward megakernel's plan (cuda/fused.cuh, fused_backward) with `knobs` (as
    fused_forward's; ring_minibatches does not apply), the forward's structure
    with the backward's kinds: chunk tasks pull the reverse-combine (w * dout rows, into the
    receive rows) and push the reverse-dispatch (input-gradient rows into the owners' slots);
    the tile pairs run the shared expert's data and weight gradients first, then per minibatch
    down_bwd (after its rows arrived; SwiGLU backward fused) and gate_up_bwd (after its row
    tile's down_bwd tiles), then every routed weight-gradient tile (deferred: after every
    down_bwd tile, so they overlap the last reverse-dispatches), each (expert, row pair, column
    tile) one pair task that stores its fp32 sum over the expert's rows in order: the same sums,
    in the same order, as the sequential launches. One macrobatch: the ring holds every
    minibatch (a smaller ring would need the forward's activations again). assign, raster,
    spread_from (the reverse-dispatch): as fused_forward's.
    token_grads (default: whenever the reverse-dispatch is pushed inside the kernel): the token
    gradients run inside it too, as SLOT_SUM tasks of EPILOGUE_ROWS tokens (dx = the shared
    expert's dx + the K slots' sum, and d topk_weights of their slots), round robin over every
    CTA after its transfers: the movers run them beside the deferred weight-gradient tiles. Each
    waits for SLOTS_ARRIVED, a remote counter raised by every reverse-dispatch chunk of every
    rank (the kernel keeps it as the peers' kFlagCombine flags), and for SHARED_SECOND_DONE (the
    shared expert's dx). False: the slot sum and d topk_weights run after the kernel.
    scale (default: whenever the reverse-combine is pulled inside the kernel): dy_slots = w * dout
    runs inside it too, as SCALE tasks of EPILOGUE_ROWS tokens, first in every CTA's table (the
    movers write this rank's rows while the shared expert's tiles run), each raising PUBLISHED, a
    remote counter (the kernel keeps it as the peers' kFlagRouting flags) that every
    reverse-combine chunk waits for. False: the scale kernel and the publish (a flag, a wait for
    every peer's) run before the kernel.
    claim: the last `claim` tile pairs (the tail of the deferred weight gradients) are claimed at
    run time, as fused_forward's.
    routed_wgrads (default True): False leaves the routed experts' weight gradients out of the
    plan, to run after the kernel (the FP8 layer: their operands' transposed quantizations go
    with them); the shared expert's stay."""
    return _fused("bwd", shape, num_ranks, knobs, policy, num_sms, capacity_rows)


def _fused(pass_: str, shape: MoEShape, num_ranks: int, knobs: FusedKnobs, policy: dict, num_sms: int,
           capacity_rows: int | None) -> Plan:
    comm_blocks, minibatch_rows = knobs.comm_blocks, knobs.minibatch_rows
    segment_rows = knobs.segment_rows or SEGMENT_ROWS
    capacity_rows = capacity_rows or default_capacity(shape, num_ranks, minibatch_rows, segment_rows=segment_rows)
    _check_common(shape, num_ranks, policy, num_sms, minibatch_rows, capacity_rows, pass_)
    if num_sms % 2 or comm_blocks % 2 or not 0 <= comm_blocks < num_sms:
        raise ValueError(f"num_sms ({num_sms}) and comm_blocks ({comm_blocks}) must be even (2-CTA clusters), "
                         f"0 <= comm_blocks < num_sms")
    num_mb = capacity_rows // minibatch_rows
    knobs = knobs.resolved(pass_, policy, num_mb)
    ring, lookahead, spread_from = knobs.ring_minibatches, knobs.lookahead, knobs.spread_from
    token_grads, scale = bool(knobs.token_grads), bool(knobs.scale)
    routed_wgrads = pass_ == "bwd" and bool(knobs.routed_wgrads)
    comm_in, comm_out = inside_kernel(pass_, policy)
    k = PASS_KINDS[pass_]

    b = Builder(num_ranks)
    tpm = minibatch_rows // BM
    shared_pairs = cdiv(shape.num_tokens, PAIR_ROWS) if shape.num_shared else 0
    n_first, n_second = num_col_tiles(k.first, shape), num_col_tiles(k.second, shape)
    arrived = [b.counter(CounterKind.ARRIVED, m) for m in range(num_mb)] if comm_in else None
    first_done = [b.counter(CounterKind.FIRST_DONE, rt) for rt in range(num_mb * tpm)]
    shared_first = [b.counter(CounterKind.SHARED_FIRST_DONE, rt) for rt in range(2 * shared_pairs)]
    second_done = [b.counter(CounterKind.SECOND_DONE, m) for m in range(num_mb)] if comm_out else None
    released = [b.counter(CounterKind.RELEASED, m) for m in range(num_mb)] if ring < num_mb else None
    wgrad = bool(k.wgrad)
    shared_done = [b.counter(CounterKind.SHARED_DONE, 0)] if wgrad and shared_pairs else []
    data_grad_done = [b.counter(CounterKind.DATA_GRAD_DONE, 0)] if routed_wgrads else []
    slots_arrived = [b.counter(CounterKind.SLOTS_ARRIVED, 0, remote=True)] if token_grads else []
    shared_second_done = [b.counter(CounterKind.SHARED_SECOND_DONE, 0)] if token_grads and shared_pairs else []
    published = [b.counter(CounterKind.PUBLISHED, 0, remote=True)] if scale else []
    if scale:  # first in every CTA's table: its movers write this rank's dy_slots before any pull
        for r in token_tiles(shape):
            b.add(r % num_sms, TaskKind.SCALE, [], published, row_tile=r)

    chunks = comm_blocks or num_sms
    spread = range(num_mb if spread_from is None else spread_from, num_mb)
    def comm_out_task(c, m):
        b.add(c, k.comm_out, [second_done[m]], ([released[m]] if released else []) + slots_arrived, minibatch=m,
              row_tile=c, col_tile=num_sms if m in spread else chunks)

    for c in range(chunks):  # chunk c of every minibatch (of num_chunks), on CTA c
        def comm_in_task(m, c=c):
            waits = ([released[m - ring]] if m >= ring else []) + published
            b.add(c, k.comm_in, waits, [arrived[m]], minibatch=m, row_tile=c, col_tile=chunks)
        if comm_in:
            for m in range(min(ring, num_mb)):
                comm_in_task(m)
        for m in range(num_mb):
            if comm_out:
                comm_out_task(c, m)
            if comm_in and m + ring < num_mb:
                comm_in_task(m + ring)
    for c in range(chunks, num_sms):  # the spread minibatches' other chunks: the compute CTAs' spare warps
        for m in spread:
            comm_out_task(c, m)

    # Tile pairs in one global order, as runs of pairs (_pair_run)
    run = _pair_run
    first_done_of, shared_first_of = np.array(first_done, np.int64), np.array(shared_first, np.int64)
    runs = [run(k.shared_first, range(shared_pairs), num_col_tiles(k.shared_first, shape), knobs.raster,
                signal_rt=shared_first_of, signals=shared_done),
            run(k.shared_second, range(shared_pairs), num_col_tiles(k.shared_second, shape), knobs.raster,
                wait_rt=shared_first_of, signals=shared_second_done)]
    for kind in (k.shared_wgrad if shared_pairs else ()):  # shared weight gradients: its data gradients' rows
        rows, cols = wgrad_grid(kind, shape)
        runs.append(run(kind, range(cdiv(rows, 2)), cols,
                        waits=shared_done if kind == TaskKind.SHARED_GATE_UP_WGRAD else []))
    for step in range(num_mb + lookahead):
        m = step  # the first GEMM of minibatch step, then the second of minibatch step - lookahead
        if m < num_mb:
            runs.append(run(k.first, range(m * tpm // 2, (m + 1) * tpm // 2), n_first, knobs.raster,
                            waits=[arrived[m]] if comm_in else [], signal_rt=first_done_of,
                            signals=data_grad_done, minibatch=m))
        m = step - lookahead
        if m >= 0:
            runs.append(run(k.second, range(m * tpm // 2, (m + 1) * tpm // 2), n_second, knobs.raster,
                            wait_rt=first_done_of, signals=[second_done[m]] if comm_out else [], minibatch=m))
    el = shape.num_experts // num_ranks
    for kind in (k.wgrad if routed_wgrads else ()):  # deferred: after every data-gradient tile of every minibatch
        rows, cols = wgrad_grid(kind, shape)  # (expert, row pair, column tile), each expert's pairs row by row
        row_pairs = cdiv(rows, 2)
        runs.append(run(kind, np.tile(np.arange(row_pairs), el), cols, waits=data_grad_done, macrobatch=0,
                        expert=np.repeat(np.arange(el), row_pairs * cols)))
    pairs = {name: np.concatenate([r[name] for r in runs]) for name in runs[0]}
    # Each pair goes to one cluster, appended to both its CTAs' tables: every table is a
    # subsequence of the global order (what keeps the plan deadlock free: every counter a pair
    # waits on is raised by pairs earlier in it), both halves of a pair at the same position.
    # The last `claim` pairs go to the pool instead (block num_sms, claimed at run time).
    num_pairs = len(pairs["kind"])
    claim = knobs.claim_pairs(num_pairs, (num_sms - comm_blocks) // 2)
    if claim:
        b.counter(CounterKind.CLAIMED, 0)
    static = num_pairs - claim
    clusters = _assign_clusters(
        knobs.assign, {name: col[:static] for name, col in pairs.items()}, (num_sms - comm_blocks) // 2,
        functools.cache(lambda kind, p: tile_cost(TaskKind(kind), shape, num_ranks, capacity_rows, p, segment_rows)),
        functools.cache(lambda kind, p: past_expected(TaskKind(kind), shape, num_ranks, capacity_rows, p,
                                                      segment_rows)))
    block = np.concatenate([comm_blocks + 2 * np.asarray(clusters, np.int64), np.full(claim, num_sms, np.int64)])
    rows = np.empty((num_pairs, 2, ROW_WIDTH), np.int64)  # both halves of each pair, the even CTA's first
    for cta in (0, 1):
        rows[:, cta, :WAITS_AT] = np.stack([block + (block < num_sms) * cta, pairs["kind"], pairs["minibatch"],
                                            pairs["macrobatch"], 2 * pairs["p"] + cta, pairs["col"], pairs["expert"]],
                                           axis=1)
    rows[:, :, WAITS_AT:WAITS_AT + MAX_WAITS], rows[:, :, WAITS_AT + MAX_WAITS:] = pairs["waits"], pairs["signals"]
    b.add_rows(rows)
    if token_grads:  # last in every CTA's table: its movers run them after their transfers
        for r in token_tiles(shape):
            b.add(r % num_sms, k.epilogue, slots_arrived + shared_second_done, [], row_tile=r)
    return b.build(pass_=pass_, shape=shape, num_ranks=num_ranks, policy=dict(policy), num_sms=num_sms,
                   comm_blocks=comm_blocks, minibatch_rows=minibatch_rows, ring_minibatches=ring,
                   capacity_rows=capacity_rows, strategy=FUSED_STRATEGIES[pass_], assign=knobs.assign,
                   raster=knobs.raster, spread_from=spread_from, token_grads=token_grads, scale=scale,
                   routed_wgrads=routed_wgrads or pass_ != "bwd", claim_pairs=claim, knobs=knobs)


def _assign_clusters(assign: str, pairs: dict, clusters: int, cost, past=lambda kind, p: False) -> list[int]:
    """The cluster (0 .. clusters - 1) of every tile pair of `_fused`'s global order `pairs` (the
    columns of `_pair_run`: kind, p, waits, signals).

    round_robin: pair j on cluster j % clusters (equal pair counts, whatever their work).
    balanced: a greedy list schedule over the same order, on estimated times (`cost(kind, row
    pair)`, the pair's tile_cost): a pair can start once the pairs that raise the counters it waits on have
    finished (per counter, the latest estimated finish of the pairs assigned so far that signal
    it: they all come earlier in the order); the counters only communication tasks raise
    (ARRIVED: the rows of a minibatch) count as ready at 0, as the transfers have no estimate in
    these units. Each pair goes to the cluster that can start it earliest (max of its free time
    and the pair's ready time), and among those that start it at the same time, the one that
    became free last (the least idle gap: clusters free earlier stay free for later pairs that
    are ready earlier), then the lowest index. That cluster's free time becomes the pair's
    estimated finish. Deterministic (integer costs, no randomness). The estimate takes the
    rows up to expected_rows as real and the tile pairs past them as free (tile_cost): costed
    as full tiles, free tiles would be balanced against real ones.
    balanced: the pairs past expected_rows (`past(kind, p)`) go round robin instead, in order,
    each finishing 1 after it is ready and taking no cluster's time: under even routing they
    exit at once wherever they are, and under skewed routing, where they are real, no cluster
    gets more than its share of them. balanced_all: they too go where the estimate says, i.e.
    onto the clusters free earliest (what skewed routing punishes)."""
    if assign == "round_robin":
        return np.arange(len(pairs["kind"])) % clusters
    finish_of: dict[int, int] = {}  # counter -> latest estimated finish of the pairs signalling it so far
    by_free = sorted((0, -cluster) for cluster in range(clusters))  # (free time, -cluster), ascending
    out = []
    spilled = 0
    num = len(pairs["kind"])
    waits, signals = (pairs[name].reshape(num, 2 * pairs[name].shape[2]).tolist() for name in ("waits", "signals"))
    for kind, p, wait, signal in zip(pairs["kind"].tolist(), pairs["p"].tolist(), waits, signals):
        ready = max((finish_of.get(c, 0) for c in wait if c >= 0), default=0)
        signal = {c for c in signal if c >= 0}
        if assign == "balanced" and past(kind, p):
            for c in signal:
                finish_of[c] = max(finish_of.get(c, 0), ready + 1)
            out.append(spilled % clusters)
            spilled += 1
            continue
        # the latest free time <= max(ready, earliest free time); among equal ones the lowest cluster
        j = bisect.bisect_right(by_free, (max(ready, by_free[0][0]), 0)) - 1
        free, neg_cluster = by_free.pop(j)
        finish = max(free, ready) + cost(kind, p)
        bisect.insort(by_free, (finish, neg_cluster))
        for c in signal:
            finish_of[c] = max(finish_of.get(c, 0), finish)
        out.append(-neg_cluster)
    return out


def _pair_run(kind: TaskKind, ps, cols: int, raster: str = "row", wait_rt=None, waits=(), signal_rt=None,
              signals=(), minibatch=-1, macrobatch=-1, expert=-1) -> dict:
    """A run of `_fused`'s global order: the tile pairs of `kind` over row pairs ps and cols column
    tiles, row pair by row pair (raster "row") or column tile by column tile, as columns: kind, p,
    col, minibatch, macrobatch, expert [n], and each half's (row tile 2p + cta) waits [n, 2, MAX_WAITS]
    and signals [n, 2, MAX_SIGNALS] (-1: none): wait_rt[row tile] if given, then `waits`; the same
    for signals."""
    ps = np.asarray(ps, np.int64)
    if raster == "row":
        p, col = np.repeat(ps, cols), np.tile(np.arange(cols), len(ps))
    else:
        p, col = np.tile(ps, cols), np.repeat(np.arange(cols), len(ps))
    n = len(p)
    rt = 2 * p[:, None] + np.arange(2)

    def slots(per_rt, listed, width):
        columns = ([per_rt[rt]] if per_rt is not None else []) + [np.full((n, 2), c, np.int64) for c in listed]
        if n and len(columns) > width:
            raise PlanError(f"a task has more than {MAX_WAITS} waits or {MAX_SIGNALS} signals")
        columns += [np.full((n, 2), -1, np.int64)] * (width - len(columns))
        return np.stack(columns, axis=2) if width else np.zeros((n, 2, 0), np.int64)

    return {"kind": np.full(n, int(kind), np.int64), "p": p, "col": col,
            "minibatch": np.broadcast_to(np.asarray(minibatch, np.int64), (n,)),
            "macrobatch": np.broadcast_to(np.asarray(macrobatch, np.int64), (n,)),
            "expert": np.broadcast_to(np.asarray(expert, np.int64), (n,)),
            "waits": slots(wait_rt, waits, MAX_WAITS), "signals": slots(signal_rt, signals, MAX_SIGNALS)}


def _epilogue_tasks(k: PassKinds, shape: MoEShape, num_sms: int, ctr) -> list:
    """Weighted sum (fwd) / slot sum (bwd) per EPILOGUE_ROWS tokens, round robin over every CTA."""
    waits = [ctr(CounterKind.SLOTS_ARRIVED)] + ([ctr(CounterKind.SHARED_DONE)] if shape.num_shared else [])
    return [(rt % num_sms, k.epilogue, rt, waits) for rt in token_tiles(shape)]


def _remote_counters(pass_: str, policy: dict) -> set:
    """Counter kinds whose value depends on every rank's tasks, under this policy."""
    k = PASS_KINDS[pass_]
    push_in, pull_out = policy[k.in_op] == "push", policy[k.out_op] == "pull"
    remote = set()
    if push_in:  # senders push rows: the receiver waits for every peer; senders need its free slot
        remote |= {CounterKind.ARRIVED, CounterKind.RELEASED}
    if pull_out:  # the token owner pulls: it waits for the peers' results, which wait for its reads
        remote |= {CounterKind.SECOND_DONE, CounterKind.RELEASED}
    else:  # pushed results: the token owner waits for every peer's signal
        remote |= {CounterKind.SLOTS_ARRIVED}
    return remote


def _check_common(shape, num_ranks, policy, num_sms, minibatch_rows, capacity_rows, pass_):
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
    if set(policy) != set(OPERATORS) or any(v not in ("push", "pull") for v in policy.values()):
        raise ValueError(f"policy must map each of {OPERATORS} to push or pull, got {policy!r}")
    if num_ranks < 1 or shape.num_experts % num_ranks:
        raise ValueError(f"num_ranks={num_ranks} must divide E={shape.num_experts}")
    if minibatch_rows < BM or minibatch_rows % BM:
        raise ValueError(f"minibatch_rows must be a positive multiple of BM={BM}, got {minibatch_rows}")
    if capacity_rows < minibatch_rows or capacity_rows % minibatch_rows:
        raise ValueError(f"capacity_rows ({capacity_rows}) must be a positive multiple of "
                         f"minibatch_rows ({minibatch_rows})")
    if num_sms < 2:
        raise ValueError(f"num_sms must be >= 2, got {num_sms}")

