"""The CPU proof that a plan can run (Plan.check calls `prove`): structure, coverage, pairs,
weight-gradient order, cross-rank waits, no deadlock, order, ring and data flow."""

from __future__ import annotations

import numpy as np

from mok_proto.plan.cost import num_col_tiles, wgrad_grid
from mok_proto.plan.kinds import (BM, COUNTER_DTYPE, FUSED_STRATEGIES, MAX_SIGNALS, MAX_WAITS, MOVER_KINDS, PAIR_ROWS,
                                  TASK_DTYPE, CounterKind, PlanError, TaskKind, cdiv, inside_kernel, token_tiles)


def prove(plan) -> None:
    """Prove on the CPU that the plan can run: raise PlanError otherwise.

    1. Structure: blocks, seq, kinds, counter ids in range (a fused plan's pool: `claim_pairs`
       tile pairs at block num_sms, with its one CLAIMED counter no task touches); every wait target equals its
       counter's target, and every counter's target equals the signals it will get
       (R per signalling task for a remote counter); the remote counters have the last ids
       (first_remote_counter: the fused kernel tells them by their id).
    2. Coverage: every task the pass needs (each GEMM tile, each chunk of each minibatch,
       each epilogue tile, each weight-gradient tile per macrobatch) exists exactly once.
    3. Weight-gradient order: each routed weight-gradient output tile runs on one CTA, its
       macrobatches in increasing table order (a store, then adds in a fixed order).
    4. No deadlock: an in-order execution per stream (`streams`: a CTA, or in a fused plan a
       CTA's movers (MOVER_KINDS) and a cluster's tile pairs; all co-resident) finishes, the
       pool's pairs taken in claim order only once every cluster's own tile pairs ran (at run
       time a cluster claims once its producer issued its table's loads: see execution_order).
    5. Order: every counter a task waits on is raised only by tasks earlier in that global
       topological order.
    6. Ring: the task that refills the slot of minibatch m happens after every task that
       uses the rows of minibatch m - ring (transitively through counters and CTA order).
    7. Pairs (fused plans): every GEMM task is one half of a 2-CTA cluster's tile pair.
    8. Data flow (fused plans): every task runs after the tasks that write what it reads
       (the first GEMM after its minibatch's incoming chunks, the second after its row
       tile's first-GEMM tiles, the outgoing chunks after their minibatch's second-GEMM
       tiles, the shared second after its row tile's shared first; backward: the weight
       gradients after every first-GEMM tile, the shared gate/up weight gradient after every
       shared first tile, the token gradients after every outgoing chunk and every shared
       second tile, the incoming chunks after every scale tile), transitively through counters
       and stream order (none among the pool's pairs: they run at once on several clusters).
    9. Cross-rank (fused backward): a task that reads rows every rank's tasks write (a
       reverse-combine chunk pulls every rank's dy_slots, written by its scale tiles; a
       token-gradient task reads the slot rows every rank's reverse-dispatch pushed) waits
       for a remote counter that every one of those writers signals (8 sees this rank's
       writers only; inside the kernel a remote counter is what waits for the other ranks').

    (Plan.check keeps the proof: a second call costs nothing.)
    """
    _check_structure(plan)
    _check_coverage(plan)
    _check_pairs(plan)
    _check_wgrad_order(plan)
    _check_cross_rank(plan)
    order = plan.execution_order
    _check_topological(plan, order)
    needs = _ring_needs(plan) + _dataflow_needs(plan)  # (check, reader, tasks that must precede it)
    if needs:
        tracked = np.zeros(len(plan.tasks), bool)
        for _, _, need in needs:
            tracked[need] = True
        index = np.flatnonzero(tracked)
        _check_needs(plan, needs, ancestors(plan, order, tracked), index)


def _check_structure(plan) -> None:
    t, c = plan.tasks, plan.counters
    if t.dtype != TASK_DTYPE or c.dtype != COUNTER_DTYPE:
        raise PlanError("tasks/counters must use TASK_DTYPE/COUNTER_DTYPE")
    if len(t) and (t["block"].min() < 0 or t["block"].max() > plan.num_sms):
        raise PlanError(f"task blocks must lie in [0, num_sms={plan.num_sms}) (or be the pool's, num_sms)")
    if np.any(np.diff(t["block"]) < 0):
        raise PlanError("tasks must be sorted by block")
    for b, table in enumerate(plan.block_tables() + [plan.pool_table()]):
        if not np.array_equal(table["seq"], np.arange(len(table))):
            raise PlanError(f"block {b}: seq must be 0, 1, ... in table order")
    _check_pool(plan)
    valid = set(int(x) for x in TaskKind)
    if not set(np.unique(t["kind"]).tolist()) <= valid:
        raise PlanError("unknown task kind")
    for field in ("wait_counter", "signal_counter"):
        ids = t[field]
        if np.any((ids < -1) | (ids >= len(c))):
            raise PlanError(f"{field} out of range [-1, {len(c)})")
    used = t["wait_counter"] >= 0
    if np.any(t["wait_target"][used] != c["target"][t["wait_counter"][used]]):
        bad = np.argwhere(used & (t["wait_target"] != c["target"][np.maximum(t["wait_counter"], 0)]))[0][0]
        raise PlanError(f"task {_name(plan, bad)} waits for a target other than its counter's")
    if np.any(c["remote"][:plan.first_remote_counter]):
        raise PlanError(f"the remote counters must have the last ids (from {plan.first_remote_counter}): the fused "
                        "kernel tells a remote counter by its id")
    sig = t["signal_counter"]
    weight = np.where(c["remote"], plan.num_ranks, 1)
    got = np.zeros(len(c), np.int64)
    np.add.at(got, sig[sig >= 0], weight[sig[sig >= 0]])
    if np.any(got != c["target"]):
        i = int(np.argmax(got != c["target"]))
        raise PlanError(f"counter {_counter_name(plan, i)}: target {c['target'][i]} but {got[i]} signals")


def _check_pool(plan) -> None:
    """The claimed tile pairs (check(), 1): claim_pairs pairs of GEMM tasks at block pool_block
    (a fused plan only), claimed through one local CLAIMED counter that no task waits on or
    signals (the kernel's ticket: the kernel adds to it, not the tasks)."""
    pool, claim = plan.pool_table(), plan.claim_pairs
    if not isinstance(claim, (int, np.integer)) or claim < 0:
        raise PlanError(f"claim_pairs must be an int >= 0, got {claim!r}")
    if claim and plan.strategy not in FUSED_STRATEGIES.values():
        raise PlanError(f"only fused plans claim tile pairs at run time, got {plan.strategy} with claim_pairs={claim}")
    if len(pool) != 2 * claim:
        raise PlanError(f"pool: {len(pool)} tasks at block {plan.pool_block}, expected 2 x claim_pairs = {2 * claim}")
    if np.isin(pool["kind"], [int(k) for k in MOVER_KINDS]).any():
        raise PlanError("pool: only GEMM tile pairs are claimed at run time (a mover task has its CTA)")
    c = plan.counters
    claimed = np.flatnonzero(c["kind"] == int(CounterKind.CLAIMED))
    if len(claimed) != (1 if claim else 0):
        raise PlanError(f"pool: {len(claimed)} CLAIMED counters, expected {1 if claim else 0} (claim_pairs={claim})")
    if len(claimed):
        i = int(claimed[0])
        used = np.isin(plan.tasks["wait_counter"], [i]).any() or np.isin(plan.tasks["signal_counter"], [i]).any()
        if used or c["remote"][i] or c["target"][i] != 0:
            raise PlanError("pool: the CLAIMED counter is the kernel's ticket: local, target 0, no task waits on or "
                            "signals it")


KEY_FIELDS = ("kind", "minibatch", "macrobatch", "row_tile", "col_tile", "expert")  # what a task computes


def _expected_keys(plan) -> np.ndarray:
    """[num_tasks, len(KEY_FIELDS)] the KEY_FIELDS of every task the pass needs."""
    k, shape = plan.kinds, plan.shape
    el = shape.num_experts // plan.num_ranks
    shared_tiles = cdiv(shape.num_tokens, BM) if shape.num_shared else 0
    tpm = plan.tiles_per_minibatch

    def key(kind, minibatch=-1, macrobatch=-1, row_tile=-1, col_tile=-1, expert=-1):
        return (int(kind), minibatch, macrobatch, row_tile, col_tile, expert)

    keys = []
    if plan.strategy in FUSED_STRATEGIES.values():
        return _expected_fused_keys(plan, key)
    for m in range(plan.num_minibatches):
        for kind in (k.comm_in, k.comm_out):
            keys += [key(kind, m, row_tile=c, col_tile=plan.num_chunks) for c in range(plan.num_chunks)]
        for kind in (k.first, k.second):
            keys += [key(kind, m, row_tile=rt, col_tile=c) for rt in range(m * tpm, (m + 1) * tpm)
                     for c in range(num_col_tiles(kind, shape))]
    for kind in (k.shared_first, k.shared_second):
        keys += [key(kind, row_tile=r, col_tile=c) for r in range(shared_tiles)
                 for c in range(num_col_tiles(kind, shape))]
    for kind in k.wgrad:
        rows, cols = wgrad_grid(kind, shape)
        keys += [key(kind, macrobatch=j, row_tile=r, col_tile=c, expert=e) for j in range(plan.num_macrobatches)
                 for e in range(el) for r in range(rows) for c in range(cols)]
    for kind in (k.shared_wgrad if shared_tiles else ()):
        rows, cols = wgrad_grid(kind, shape)
        keys += [key(kind, row_tile=r, col_tile=c) for r in range(rows) for c in range(cols)]
    keys += [key(k.epilogue, row_tile=r) for r in token_tiles(shape)]
    return np.array(keys, np.int64).reshape(-1, len(KEY_FIELDS))


def _expected_fused_keys(plan, key) -> np.ndarray:
    """A fused pass: the transfers inside the kernel (a chunk per chunk), the tile pairs (shared
    expert: both tiles of every token row pair; weight gradients: both tiles of every row pair
    of every expert's weights), the epilogue tiles if the plan runs them (token_grads; else a launch
    after it), the scale tiles if it runs them (scale; else a launch before it)."""
    k, shape = plan.kinds, plan.shape
    comm_in, comm_out = inside_kernel(plan.pass_, plan.policy)
    tpm = plan.tiles_per_minibatch
    shared_tiles = 2 * cdiv(shape.num_tokens, PAIR_ROWS) if shape.num_shared else 0
    keys = []
    for m in range(plan.num_minibatches):
        for kind, inside in ((k.comm_in, comm_in), (k.comm_out, comm_out)):
            chunks = plan.chunks_of(m, kind == k.comm_out)
            keys += [key(kind, m, row_tile=c, col_tile=chunks) for c in range(chunks)] if inside else []
        for kind in (k.first, k.second):
            keys += [key(kind, m, row_tile=rt, col_tile=c) for rt in range(m * tpm, (m + 1) * tpm)
                     for c in range(num_col_tiles(kind, shape))]
    for kind in (k.shared_first, k.shared_second):
        keys += [key(kind, row_tile=r, col_tile=c) for r in range(shared_tiles) for c in range(num_col_tiles(kind, shape))]
    # weight gradients (backward): every tile of every expert's weights, row tiles in pairs
    routed = k.wgrad if plan.routed_wgrads else ()  # (else they run after the kernel)
    for kinds, experts, macro in ((routed, range(shape.num_experts // plan.num_ranks), 0),
                                  (k.shared_wgrad if shared_tiles else (), (-1,), -1)):
        for kind in kinds:
            rows, cols = wgrad_grid(kind, shape)
            keys += [key(kind, macrobatch=macro, row_tile=r, col_tile=c, expert=e) for e in experts
                     for r in range(2 * cdiv(rows, 2)) for c in range(cols)]
    if plan.token_grads:
        keys += [key(k.epilogue, row_tile=r) for r in token_tiles(shape)]
    if plan.scale:
        keys += [key(TaskKind.SCALE, row_tile=r) for r in token_tiles(shape)]
    return np.array(keys, np.int64).reshape(-1, len(KEY_FIELDS))


def _check_pairs(plan) -> None:
    """A fused plan's GEMM tasks come in cluster pairs: the GEMM tasks of CTAs 2j and 2j + 1
    (past the communicating CTAs), in table order, are one tile pair at each position: same
    kind, minibatch and column tile, row tiles 2p and 2p + 1 (the kernel runs them as one 2-CTA
    cluster tile sharing B). Their communication tasks (comm_blocks == 0) may differ."""
    if plan.strategy not in FUSED_STRATEGIES.values():
        return
    tables = plan.block_tables()
    comm_kinds = [int(x) for x in MOVER_KINDS]
    for blk in range(plan.comm_blocks):
        if not np.isin(tables[blk]["kind"], comm_kinds).all():
            raise PlanError(f"pairs: communicating CTA {blk} has a GEMM task")
    for blk in range(plan.comm_blocks, plan.num_sms, 2):
        even, odd = (table[~np.isin(table["kind"], comm_kinds)] for table in (tables[blk], tables[blk + 1]))
        if len(even) != len(odd):
            raise PlanError(f"pairs: CTAs {blk} and {blk + 1} (one cluster) have {len(even)} and {len(odd)} tasks")
        same = _one_pair(even, odd)
        if not same.all():
            i = int(np.argmin(same))
            raise PlanError(f"pairs: CTAs {blk}, {blk + 1}, GEMM task {i}: seq {even['seq'][i]} and {odd['seq'][i]} "
                            f"are not one tile pair")
    pool = plan.pool_table()
    same = _one_pair(pool[0::2], pool[1::2])
    if not same.all():
        i = int(np.argmin(same))
        raise PlanError(f"pairs: pool tasks seq {2 * i} and {2 * i + 1} are not one tile pair")


def _one_pair(even: np.ndarray, odd: np.ndarray) -> np.ndarray:
    """Per position: the two tasks are one tile pair (the same tile but for row tiles 2p, 2p + 1)."""
    return (even["kind"] == odd["kind"]) & (even["minibatch"] == odd["minibatch"]) & (
        even["col_tile"] == odd["col_tile"]) & (even["expert"] == odd["expert"]) & (
        even["macrobatch"] == odd["macrobatch"]) & (even["row_tile"] % 2 == 0) & (odd["row_tile"] == even["row_tile"] + 1)


def _check_coverage(plan) -> None:
    t = plan.tasks
    got = np.stack([t[name] for name in KEY_FIELDS], axis=1).astype(np.int64)
    want = _expected_keys(plan)
    if got.shape == want.shape and np.array_equal(_sorted_rows(got), _sorted_rows(want)):
        return  # the same rows, as many times each (else the counts below say which differ)
    got_u, got_n = np.unique(got, axis=0, return_counts=True)
    want_u, want_n = np.unique(want, axis=0, return_counts=True)
    if got_u.shape == want_u.shape and np.array_equal(got_u, want_u) and np.array_equal(got_n, want_n):
        return
    got_d = {tuple(r): n for r, n in zip(got_u.tolist(), got_n.tolist())}
    want_d = {tuple(r): n for r, n in zip(want_u.tolist(), want_n.tolist())}
    for key in sorted(set(got_d) | set(want_d)):
        if got_d.get(key, 0) != want_d.get(key, 0):
            fields = " ".join(f"{name}={v}" for name, v in zip(KEY_FIELDS[1:], key[1:]))
            raise PlanError(f"coverage: task {TaskKind(key[0]).name} {fields} appears {got_d.get(key, 0)} times, "
                            f"expected {want_d.get(key, 0)}")


def _sorted_rows(keys: np.ndarray) -> np.ndarray:
    return keys[np.lexsort(keys.T[::-1])]


def _check_wgrad_order(plan) -> None:
    """Every routed weight-gradient output tile (kind, expert, row tile, col tile) runs on one CTA,
    its macrobatches in increasing order in that CTA's table: the CTA stores macrobatch 0 and adds
    the others in program order, so the fp32 sums are the same on every run. (Coverage already
    holds: each macrobatch of each tile exists once.)"""
    t = plan.tasks
    sel = np.flatnonzero(np.isin(t["kind"], [int(x) for x in plan.kinds.wgrad]))
    if not len(sel):
        return
    w = t[sel].copy()
    pooled = w["block"] == plan.pool_block  # its CTA is known at run time only: a CTA of its own here
    w["block"][pooled] = -1 - np.flatnonzero(pooled)
    by_tile = np.lexsort((w["macrobatch"], w["col_tile"], w["row_tile"], w["expert"], w["kind"]))
    w = w[by_tile]
    tile = np.stack([w["kind"], w["expert"], w["row_tile"], w["col_tile"]], axis=1)
    same_tile = np.all(tile[1:] == tile[:-1], axis=1)  # pairs (macrobatch j, j + 1) of one tile
    split = same_tile & (w["block"][1:] != w["block"][:-1])
    late = same_tile & ~split & (w["seq"][1:] <= w["seq"][:-1])
    for bad, what in ((split, "runs on CTAs {a} and {b}"), (late, "runs before macrobatch {j} on CTA {a}")):
        if bad.any():
            i = int(np.argmax(bad))
            kind, e, r, c = tile[i].tolist()
            raise PlanError(f"weight-gradient order: {TaskKind(kind).name} tile expert={e} row_tile={r} col_tile={c}: "
                            f"macrobatch {w['macrobatch'][i + 1]} "
                            + what.format(a=w["block"][i], b=w["block"][i + 1], j=w["macrobatch"][i]))


def _check_cross_rank(plan) -> None:
    """check(), 9: each reader of rows written by every rank waits for a remote counter that all
    their writers signal."""
    if plan.strategy not in FUSED_STRATEGIES.values():
        return
    t, c, k = plan.tasks, plan.counters, plan.kinds
    pairs = ([(k.comm_in, TaskKind.SCALE)] if plan.scale else []) + (
        [(k.epilogue, k.comm_out)] if plan.token_grads else [])
    for reader, writer in pairs:
        signals = t["signal_counter"][t["kind"] == int(writer)]
        every = set(range(len(c))) if len(signals) else set()
        for row in signals.tolist():
            every &= {x for x in row if x >= 0}
        remote = {x for x in every if c["remote"][x]}
        for i in np.flatnonzero(t["kind"] == int(reader)).tolist():
            if not remote & set(t["wait_counter"][i].tolist()):
                raise PlanError(f"cross-rank: {_name(plan, i)} reads rows every rank's {TaskKind(int(writer)).name} "
                                f"tasks write, but waits for no remote counter they all signal")


def execution_order(plan) -> np.ndarray:
    t, c = plan.tasks, plan.counters
    none = len(c)  # "no counter" (-1) as an extra counter, always complete, signalled by weight 0
    weight = np.where(c["remote"], plan.num_ranks, 1).tolist() + [0]
    target = c["target"].tolist() + [0]
    wait0, wait1 = np.where(t["wait_counter"] >= 0, t["wait_counter"], none).T.tolist()
    sig0, sig1 = np.where(t["signal_counter"] >= 0, t["signal_counter"], none).T.tolist()
    wait = t["wait_counter"].tolist()
    streams = [x.tolist() for x in plan.streams()]
    ptr = [0] * len(streams)
    value = [0] * (len(c) + 1)
    order = []
    # The pool (the last stream) is modelled as claimed only after every cluster's own GEMM tasks
    # are done, in claim order: a static task that needs a pool pair could leave no cluster free to
    # claim it, and this refuses it. (At run time a cluster's producer claims once it issued its
    # table's loads, and pool pairs run concurrently, each waiting only for earlier ones: if this
    # order finishes, so does that one.)
    movers = [int(k) for k in MOVER_KINDS]
    pool = len(streams) - 1 if plan.claim_pairs else -1
    static_gemm = [blk for blk, stream in enumerate(streams) if blk != pool and t["kind"][stream[0]] not in movers]
    progress = True
    while progress:
        progress = False
        for blk, stream in enumerate(streams):
            if blk == pool and any(ptr[g] < len(streams[g]) for g in static_gemm):
                continue
            start = j = ptr[blk]
            end = len(stream)
            while j < end:
                i = stream[j]
                a, b = wait0[i], wait1[i]
                if value[a] < target[a] or value[b] < target[b]:
                    break
                value[sig0[i]] += weight[sig0[i]]
                value[sig1[i]] += weight[sig1[i]]
                j += 1
            if j > start:
                order += stream[start:j]
                ptr[blk] = j
                progress = True
    stuck = [blk for blk, stream in enumerate(streams) if ptr[blk] < len(stream)]
    if stuck:
        lines = []
        for blk in stuck[:4]:
            i = streams[blk][ptr[blk]]
            w = [x for x in wait[i] if x >= 0 and value[x] < target[x]]
            lines.append(f"block {plan.tasks['block'][i]} at {_name(plan, i)} waits for "
                         + ", ".join(f"{_counter_name(plan, x)} ({value[x]}/{target[x]})" for x in w))
        raise PlanError(f"deadlock: {len(stuck)} CTAs cannot progress; " + "; ".join(lines))
    return np.array(order, np.int64)


def _check_topological(plan, order: np.ndarray) -> None:
    t = plan.tasks
    pos = np.empty(len(t), np.int64)
    pos[order] = np.arange(len(order))
    last_signal = np.full(len(plan.counters), -1, np.int64)
    for j in range(MAX_SIGNALS):
        s = t["signal_counter"][:, j]
        np.maximum.at(last_signal, s[s >= 0], pos[s >= 0])
    for j in range(MAX_WAITS):
        w = t["wait_counter"][:, j]
        bad = (w >= 0) & (last_signal[np.maximum(w, 0)] >= pos)
        if bad.any():
            i = int(np.argmax(bad))
            raise PlanError(f"order: {_name(plan, i)} waits on {_counter_name(plan, int(w[i]))}, "
                            f"raised by a task at or after it")


def ancestors(plan, order: np.ndarray, tracked: np.ndarray | None = None) -> list:
    """Happens-before: per task, the bitset (a Python int) of the tasks that precede it through
    counters (every signaller of a counter it waits on) and stream order (none within the pool:
    its pairs run at once on whichever clusters claim them), itself included.
    tracked (a [num_tasks] mask): only those tasks are recorded, bit k standing for the k-th
    tracked task (np.flatnonzero(tracked)[k]); a task whose set does not grow shares its
    predecessor's int, so the sets of the many tasks after the last tracked one cost nothing."""
    t = plan.tasks
    bit = np.full(len(t), -1, np.int64)
    sel = np.arange(len(t)) if tracked is None else np.flatnonzero(tracked)
    bit[sel] = np.arange(len(sel))
    anc = [0] * len(t)
    prev_in_stream = np.full(len(t), -1, np.int64)
    for stream in plan.streams():
        prev_in_stream[stream[1:]] = stream[:-1]
    # claimed pairs run on whichever cluster claims them, concurrently: nothing precedes one by order
    prev_in_stream[t["block"] == plan.pool_block] = -1
    # "no counter" (-1): waits read counter none, which nothing signals; signals go to none + 1
    none = len(plan.counters)
    wait0, wait1 = np.where(t["wait_counter"] >= 0, t["wait_counter"], none).T.tolist()
    sig0, sig1 = np.where(t["signal_counter"] >= 0, t["signal_counter"], none + 1).T.tolist()
    signalers = [0] * (none + 2)
    prev, bit = prev_in_stream.tolist(), bit.tolist()
    for i in order.tolist():
        p, b = prev[i], bit[i]
        base = anc[p] if p >= 0 else 0
        extra = signalers[wait0[i]] | signalers[wait1[i]]
        if b >= 0:
            extra |= 1 << b
        a = base | extra if extra & ~base else base
        anc[i] = a
        for s in (sig0[i], sig1[i]):
            got = signalers[s]
            if a & ~got:
                signalers[s] = got | a
    return anc


def _ring_needs(plan) -> list:
    """(refill, the tasks that use the rows of the minibatch whose ring slot it refills): see
    check(), 6. Weight-gradient tiles of macrobatch j read the rows of all its minibatches."""
    ring, k = plan.ring_minibatches, plan.kinds
    if plan.num_minibatches <= ring:
        return []
    t = plan.tasks
    kind, mb = t["kind"], t["minibatch"]
    user = np.isin(kind, [int(x) for x in (k.first, k.second, k.comm_out)]) & (mb >= 0)
    users_of = [[np.flatnonzero(user & (mb == m))] for m in range(plan.num_minibatches)]
    wgrad = np.flatnonzero(np.isin(kind, [int(x) for x in k.wgrad]))
    macro = t["macrobatch"][wgrad]
    for j in np.unique(macro).tolist():
        for m in range(j * ring, min((j + 1) * ring, plan.num_minibatches)):
            users_of[m].append(wgrad[macro == j])
    need = [np.concatenate(u) for u in users_of]
    return [("ring", int(i), need[int(mb[i]) - ring])
            for i in np.flatnonzero((kind == int(k.comm_in)) & (mb >= ring))]


def _dataflow_needs(plan) -> list:
    """Fused plans: (reader, every writer of the rows it reads): see check(), 8."""
    if plan.strategy not in FUSED_STRATEGIES.values():
        return []
    t, k = plan.tasks, plan.kinds
    kind, mb, rt = t["kind"], t["minibatch"], t["row_tile"]
    writers = {}  # (reader kind, key) -> the writers it needs
    for m in np.unique(mb[mb >= 0]).tolist():
        writers[(int(k.first), "mb", m)] = np.flatnonzero((kind == int(k.comm_in)) & (mb == m))
        writers[(int(k.comm_out), "mb", m)] = np.flatnonzero((kind == int(k.second)) & (mb == m))
    for r in np.unique(rt[kind == int(k.second)]).tolist():
        writers[(int(k.second), "rt", r)] = np.flatnonzero((kind == int(k.first)) & (rt == r))
    for r in np.unique(rt[kind == int(k.shared_second)]).tolist():
        writers[(int(k.shared_second), "rt", r)] = np.flatnonzero((kind == int(k.shared_first)) & (rt == r))
    # weight gradients read the rows of every minibatch's first GEMM (dg, du; the arrived dy rows)
    # and the shared gate/up weight gradient the shared first GEMM's (sdg, sdu)
    for w in k.wgrad:
        writers[(int(w), "all", -1)] = np.flatnonzero(kind == int(k.first))
    if k.shared_wgrad:
        writers[(int(k.shared_wgrad[1]), "all", -1)] = np.flatnonzero(kind == int(k.shared_first))
    # the token gradients read every slot row (every rank's outgoing chunks: by symmetry, this
    # rank's) and the shared expert's dx (its second GEMM's tiles)
    writers[(int(k.epilogue), "all", -1)] = np.flatnonzero((kind == int(k.comm_out)) | (kind == int(k.shared_second)))
    # the backward's pulls read every rank's dy_slots (by symmetry: this rank's scale tiles), where
    # the kernel writes them
    if plan.scale:
        writers[(int(k.comm_in), "all", -1)] = np.flatnonzero(kind == int(TaskKind.SCALE))
    # a task's key: its row tile (the second GEMMs), else "all" where its kind has one, else its minibatch
    by_rt = {int(k.second), int(k.shared_second)}
    every = {kd for kd, how, _ in writers if how == "all"} - by_rt
    value = np.where(np.isin(kind, list(by_rt)), rt, np.where(np.isin(kind, list(every)), -1, mb))
    keys, group = np.unique(kind.astype(np.int64) << 32 | (value + 1), return_inverse=True)  # value >= -1
    need_of = [writers.get((kd, "rt" if kd in by_rt else "all" if kd in every else "mb", v))
               for kd, v in zip((keys >> 32).tolist(), ((keys & 0xFFFFFFFF) - 1).tolist())]
    has = [need is not None and len(need) > 0 for need in need_of]
    return [("data flow", i, need_of[g]) for i, g in enumerate(group.ravel().tolist()) if has[g]]


def _check_needs(plan, needs: list, anc: list, index: np.ndarray) -> None:
    """Every (check, reader, tasks) of `needs` has all those tasks among the reader's ancestors
    (`anc` over the tracked tasks `index`, as ancestors gives them)."""
    bit = np.full(len(plan.tasks), -1, np.int64)
    bit[index] = np.arange(len(index))
    masks: dict[int, int] = {}  # id of a need array -> its bitset (readers share their writers' arrays)
    for what, i, need in needs:
        m = masks.get(id(need))
        if m is None:
            member = np.zeros(len(index), bool)
            member[bit[need]] = True
            m = masks[id(need)] = int.from_bytes(np.packbits(member, bitorder="little").tobytes(), "little")
        if anc[i] & m != m:
            missing = m & ~anc[i]
            j = int(index[(missing & -missing).bit_length() - 1])
            if what == "ring":
                raise PlanError(f"ring: {_name(plan, i)} refills the slot of minibatch "
                                f"{int(plan.tasks['minibatch'][i]) - plan.ring_minibatches} before every task using "
                                f"its rows finished ({_name(plan, j)})")
            raise PlanError(f"data flow: {_name(plan, i)} may run before {_name(plan, j)}, which writes rows it reads")


def _name(plan, i: int) -> str:
    r = plan.tasks[i]
    macro = f" macrobatch={r['macrobatch']} expert={r['expert']}" if r["macrobatch"] >= 0 else ""
    return (f"{TaskKind(int(r['kind'])).name}(block={r['block']} seq={r['seq']} minibatch={r['minibatch']}{macro} "
            f"row_tile={r['row_tile']} col_tile={r['col_tile']})")


def _counter_name(plan, i: int) -> str:
    c = plan.counters[i]
    return f"{CounterKind(int(c['kind'])).name}[{c['index']}]"
