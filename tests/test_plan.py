"""Plans: both strategies pass check() on every pass and policy; check() rejects broken plans."""

import collections
import dataclasses

import numpy as np
import pytest

from mok_proto import plan as P
from mok_proto.plan.check import ancestors, execution_order
from mok_proto.plan.cost import past_expected
from mok_proto.config import MOK_POLICY, ep_share, get_shape

SMALL = get_shape("small")
ALL_PUSH = {op: "push" for op in MOK_POLICY}
ALL_PULL = {op: "pull" for op in MOK_POLICY}


def ring_plan(pass_="fwd", policy=MOK_POLICY):
    # 4 minibatches of 128 rows through a ring of 2: the ring turns twice
    return P.fixed_split(SMALL, 4, 2, 128, 2, pass_=pass_, policy=policy, num_sms=6, capacity_rows=512)


@pytest.mark.parametrize("pass_", P.PASSES)
@pytest.mark.parametrize("policy", [MOK_POLICY, ALL_PUSH, ALL_PULL])
def test_strategies_pass_check(pass_, policy):
    for p in (ring_plan(pass_, policy), P.sequential(SMALL, 4, pass_=pass_, policy=policy, num_sms=6)):
        p.check()
        assert len(p.execution_order) == len(p.tasks)


def test_fixed_split_roles_and_counters():
    p = ring_plan()
    comm = np.isin(p.tasks["kind"], [int(k) for k in P.COMM_KINDS])
    assert np.all(p.tasks["block"][comm] < p.comm_blocks)
    gemm = np.isin(p.tasks["kind"], [int(P.TaskKind.GATE_UP), int(P.TaskKind.DOWN)])
    assert np.all(p.tasks["block"][gemm] >= p.comm_blocks)
    # MoK's policy: only the pushed combine's arrival counter is raised by every rank
    remote = {P.CounterKind(int(k)) for k in p.counters["kind"][p.counters["remote"]]}
    assert remote == {P.CounterKind.SLOTS_ARRIVED}
    # a gate/up tile gives 128 columns of h: I / 128 tiles per row tile
    assert P.num_col_tiles(P.TaskKind.GATE_UP, SMALL) == -(-SMALL.ffn // 128)


def test_check_rejects_missing_tile():
    # delete one down tile and repair everything else: its CTA's seq, the target of the counter
    # it signalled and the targets of that counter's waiters; only coverage is then wrong
    p = ring_plan()
    i = int(np.flatnonzero(p.tasks["kind"] == int(P.TaskKind.DOWN))[0])
    t, counters = p.tasks.copy(), p.counters.copy()
    later = (t["block"] == t["block"][i]) & (t["seq"] > t["seq"][i])
    t["seq"][later] -= 1
    for c in t["signal_counter"][i][t["signal_counter"][i] >= 0]:
        counters["target"][c] -= p.num_ranks if counters["remote"][c] else 1
        t["wait_target"][t["wait_counter"] == c] = counters["target"][c]
    broken = P.with_tasks(p, np.delete(t, i), counters)
    with pytest.raises(P.PlanError, match="coverage"):
        broken.check()


def test_check_rejects_duplicate_tile():
    p = ring_plan()
    t = p.tasks.copy()
    down = np.flatnonzero(t["kind"] == int(P.TaskKind.DOWN))
    t["col_tile"][down[1]] = t["col_tile"][down[0]]
    t["row_tile"][down[1]] = t["row_tile"][down[0]]
    with pytest.raises(P.PlanError, match="coverage"):
        P.with_tasks(p, t).check()


def test_check_rejects_circular_wait():
    # the first dispatch waits for the rows its own minibatch's down GEMM produces
    p = ring_plan()
    t = p.tasks.copy()
    first = int(np.flatnonzero(t["kind"] == int(P.TaskKind.DISPATCH))[0])
    second_done = int(np.flatnonzero((p.counters["kind"] == int(P.CounterKind.SECOND_DONE))
                                     & (p.counters["index"] == t["minibatch"][first]))[0])
    t["wait_counter"][first, 0], t["wait_target"][first, 0] = second_done, p.counters["target"][second_done]
    with pytest.raises(P.PlanError, match="deadlock"):
        P.with_tasks(p, t).check()


def test_check_rejects_ring_reuse_before_release():
    p = ring_plan()
    t = p.tasks.copy()
    refill = np.flatnonzero((t["kind"] == int(P.TaskKind.DISPATCH)) & (t["minibatch"] == p.ring_minibatches))
    t["wait_counter"][refill, 0], t["wait_target"][refill, 0] = -1, 0
    with pytest.raises(P.PlanError, match="ring"):
        P.with_tasks(p, t).check()


def test_check_rejects_wrong_target():
    p = ring_plan()
    t = p.tasks.copy()
    i = int(np.flatnonzero(t["wait_counter"][:, 0] >= 0)[0])
    t["wait_target"][i, 0] -= 1
    with pytest.raises(P.PlanError, match="target"):
        P.with_tasks(p, t).check()


def wgrad_pair(t, **same):
    """Indices of two DOWN_WGRAD tasks that agree on the fields in `same` (`block=None`: on
    different CTAs)."""
    w = np.flatnonzero(t["kind"] == int(P.TaskKind.DOWN_WGRAD))
    for a in w:
        for b in w:
            if b != a and all((t[f][a] != t[f][b]) if v is None else (t[f][a] == t[f][b]) == v
                              for f, v in same.items()):
                return int(a), int(b)
    raise AssertionError(f"no pair with {same}")


def test_wgrad_tiles_pinned_in_macrobatch_order():
    p = ring_plan("bwd")
    assert p.num_macrobatches == 2
    t = p.tasks[np.isin(p.tasks["kind"], [int(k) for k in p.kinds.wgrad])]
    assert set(t["macrobatch"].tolist()) == {0, 1} and np.all(t["minibatch"] == -1)
    for kind, e, r, c in {tuple(x) for x in t[["kind", "expert", "row_tile", "col_tile"]].tolist()}:
        tile = t[(t["kind"] == kind) & (t["expert"] == e) & (t["row_tile"] == r) & (t["col_tile"] == c)]
        assert len(set(tile["block"].tolist())) == 1
        assert tile["macrobatch"][np.argsort(tile["seq"])].tolist() == [0, 1]
    # everything else still carries no macrobatch
    assert np.all(p.tasks["macrobatch"][~np.isin(p.tasks["kind"], [int(k) for k in p.kinds.wgrad])] == -1)


def test_check_rejects_wgrad_tile_split_across_ctas():
    # two tiles of macrobatch 1 on different CTAs trade places: each tile's macrobatch 1 now runs
    # on another CTA than its macrobatch 0 (waits, signals, coverage all unchanged)
    p = ring_plan("bwd")
    t = p.tasks.copy()
    a, b = wgrad_pair(t, macrobatch=True, block=None)
    for f in ("row_tile", "col_tile", "expert"):
        t[f][a], t[f][b] = t[f][b], t[f][a]
    with pytest.raises(P.PlanError, match="weight-gradient order: .* runs on CTAs"):
        P.with_tasks(p, t).check()


def test_check_rejects_wgrad_macrobatches_out_of_order():
    # one tile's macrobatch 0 and 1 trade places in its CTA's table: it would add before it stores
    p = ring_plan("bwd")
    t = p.tasks.copy()
    a, b = wgrad_pair(t, block=True, row_tile=True, col_tile=True, expert=True)
    t["macrobatch"][a], t["macrobatch"][b] = t["macrobatch"][b], t["macrobatch"][a]
    with pytest.raises(P.PlanError, match="weight-gradient order: .* runs before macrobatch"):
        P.with_tasks(p, t).check()


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of BM"):
        P.fixed_split(SMALL, 4, 2, 100, pass_="fwd", policy=MOK_POLICY, num_sms=6)
    with pytest.raises(ValueError, match="comm_blocks"):
        P.fixed_split(SMALL, 4, 6, 128, pass_="fwd", policy=MOK_POLICY, num_sms=6)


# ---------------------------------------------------------------------------------------------
# The fused forward's plans (cuda/fused.cuh executes them)
# ---------------------------------------------------------------------------------------------
TILE = get_shape("tile")  # the smallest shape the GEMM tiles allow
PUSH_PULL = {**MOK_POLICY, "dispatch": "push", "combine": "pull"}


def fused_plan(policy=MOK_POLICY, ring=2, comm=2, num_sms=8):
    # 4 minibatches of 256 rows; ring=2: the ring turns twice
    return P.fused_forward(TILE, 2, P.FusedKnobs(comm, 256, ring_minibatches=ring, claim=0), policy=policy,
                           num_sms=num_sms, capacity_rows=1024)


@pytest.mark.parametrize("policy", [MOK_POLICY, ALL_PUSH, ALL_PULL, PUSH_PULL])
def test_fused_forward_passes_check(policy):
    inside = P.inside_kernel("fwd", policy)
    p = fused_plan(policy, ring=2 if inside == (True, True) else None, comm=2 if any(inside) else 0)
    p.check()
    kinds = {P.TaskKind(int(k)) for k in np.unique(p.tasks["kind"])}
    want = {P.TaskKind.SHARED_GATE_UP, P.TaskKind.SHARED_DOWN, P.TaskKind.GATE_UP, P.TaskKind.DOWN}
    want |= {P.TaskKind.DISPATCH} if inside[0] else set()
    want |= {P.TaskKind.COMBINE} if inside[1] else set()
    assert kinds == want  # no weighted-sum task: that launch follows the kernel
    assert not p.counters["remote"].any()  # nothing inside the kernel waits for a peer
    comm = np.isin(p.tasks["kind"], [int(k) for k in P.COMM_KINDS])
    assert np.array_equal(comm, p.tasks["block"] < p.comm_blocks)


def test_fused_forward_pairs_share_a_cluster():
    p = fused_plan()
    tables = p.block_tables()
    for even in range(p.comm_blocks, p.num_sms, 2):
        a, b = tables[even], tables[even + 1]
        assert len(a) == len(b) > 0
        assert np.array_equal(a["row_tile"] + 1, b["row_tile"]) and np.array_equal(a["col_tile"], b["col_tile"])
    # the shared expert first: every shared tile comes before the first routed tile on its CTA
    for t in tables[p.comm_blocks:]:
        shared = np.isin(t["kind"], [int(P.TaskKind.SHARED_GATE_UP), int(P.TaskKind.SHARED_DOWN)])
        assert not shared[np.argmin(shared):].any()


def test_fused_check_rejects_a_broken_pair():
    # the odd CTA of the first compute cluster runs its first two tasks in the other order:
    # every task still exists once, but they no longer pair with the even CTA's
    p = fused_plan()
    t = p.tasks.copy()
    a, b = np.flatnonzero(t["block"] == p.comm_blocks + 1)[:2]
    assert (t["kind"][a], t["col_tile"][a], t["row_tile"][a]) != (t["kind"][b], t["col_tile"][b], t["row_tile"][b])
    fields = [f for f in t.dtype.names if f not in ("block", "seq")]
    for f in fields:
        t[f][a], t[f][b] = t[f][b].copy(), t[f][a].copy()
    with pytest.raises(P.PlanError, match="pairs"):
        P.with_tasks(p, t).check()


def test_fused_check_rejects_refill_before_the_combine():
    p = fused_plan(ring=1)
    t = p.tasks.copy()
    refill = np.flatnonzero((t["kind"] == int(P.TaskKind.DISPATCH)) & (t["minibatch"] == 1))
    t["wait_counter"][refill, 0], t["wait_target"][refill, 0] = -1, 0
    with pytest.raises(P.PlanError, match="ring"):
        P.with_tasks(p, t).check()


def test_fused_forward_bad_arguments():
    with pytest.raises(ValueError, match="multiple of 256"):
        P.fused_forward(TILE, 2, P.FusedKnobs(2, 128), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    with pytest.raises(ValueError, match="even"):
        P.fused_forward(TILE, 2, P.FusedKnobs(3, 256), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    with pytest.raises(ValueError, match="needs dispatch pull and combine push"):
        fused_plan(ALL_PUSH, ring=2)
    with pytest.raises(ValueError, match="lookahead"):
        P.fused_forward(TILE, 2, P.FusedKnobs(2, 256, lookahead=-1), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)


def test_fused_forward_without_comm_ctas_runs_two_streams_per_cta():
    # comm_blocks=0: chunk c of every minibatch on CTA c, beside that CTA's GEMM tiles
    p = fused_plan(comm=0, ring=None)
    p.check()
    comm = np.isin(p.tasks["kind"], [int(k) for k in P.COMM_KINDS])
    assert sorted(set(p.tasks["block"][comm].tolist())) == list(range(p.num_sms)) and p.num_chunks == p.num_sms
    assert len(p.streams()) == p.num_sms + p.num_sms // 2  # each CTA's comm; each cluster's tile pairs
    # as ONE in-order stream per CTA the same tables deadlock (a CTA's gate/up tile would wait
    # for rows its own later dispatch task moves): the two streams are what makes it run
    one_stream = P.with_tasks(p, p.tasks)
    object.__setattr__(one_stream, "strategy", "fused_forward_one_stream")
    with pytest.raises(P.PlanError, match="deadlock"):
        execution_order(one_stream)


def test_fused_forward_lookahead_orders_gate_up_before_the_previous_down():
    def first_seq(p, kind, m):
        t = p.tasks[p.tasks["block"] == p.comm_blocks]
        return int(t["seq"][(t["kind"] == int(kind)) & (t["minibatch"] == m)].min())

    eager = fused_plan(ring=None, num_sms=4)
    strict = P.fused_forward(TILE, 2, P.FusedKnobs(2, 256, lookahead=0, claim=0), policy=MOK_POLICY, num_sms=4,
                             capacity_rows=1024)
    for p in (eager, strict):
        p.check()
    assert first_seq(eager, P.TaskKind.GATE_UP, 1) < first_seq(eager, P.TaskKind.DOWN, 0)
    assert first_seq(strict, P.TaskKind.GATE_UP, 1) > first_seq(strict, P.TaskKind.DOWN, 0)
    # with a ring of one minibatch, minibatch 1's rows need minibatch 0's slot: no lookahead
    ring1 = P.fused_forward(TILE, 2, P.FusedKnobs(2, 256, ring_minibatches=1, claim=0), policy=MOK_POLICY, num_sms=4,
                            capacity_rows=1024)
    ring1.check()
    assert first_seq(ring1, P.TaskKind.GATE_UP, 1) > first_seq(ring1, P.TaskKind.DOWN, 0)
    with pytest.raises(ValueError, match="lookahead must be in"):
        P.fused_forward(TILE, 2, P.FusedKnobs(2, 256, ring_minibatches=1, lookahead=1), policy=MOK_POLICY, num_sms=4,
                        capacity_rows=1024)


def test_fused_check_sees_a_cluster_pair_as_one_stream():
    # the odd CTA's first tile waits for a counter its even partner raises only in a LATER pair:
    # as independent CTAs that runs, but a pair shares its stage barriers and B: it hangs
    p = fused_plan(ring=None)
    t = p.tasks.copy()
    gemm = ~np.isin(t["kind"], [int(k) for k in P.MOVER_KINDS])
    even = np.flatnonzero(gemm & (t["block"] == p.comm_blocks))
    odd = np.flatnonzero(gemm & (t["block"] == p.comm_blocks + 1))
    counter = t["signal_counter"][even[-1], 0]  # raised (in part) by the even CTA's last tile
    assert counter >= 0
    t["wait_counter"][odd[0], 1], t["wait_target"][odd[0], 1] = counter, p.counters["target"][counter]
    with pytest.raises(P.PlanError, match="deadlock"):
        P.with_tasks(p, t).check()


@pytest.mark.parametrize("kind", ["GATE_UP", "DOWN", "COMBINE", "SHARED_DOWN"])
def test_fused_check_rejects_a_reader_without_its_wait(kind):
    # drop the waits of every task of one kind: it may then read rows before they are written
    p = fused_plan(ring=None)
    t = p.tasks.copy()
    sel = t["kind"] == int(P.TaskKind[kind])
    t["wait_counter"][sel], t["wait_target"][sel] = -1, 0
    with pytest.raises(P.PlanError, match="data flow"):
        P.with_tasks(p, t).check()


# ---------------------------------------------------------------------------------------------
# The fused backward's plans
# ---------------------------------------------------------------------------------------------
BACKWARD_POLICIES = [{**MOK_POLICY, "rev_combine": rc, "rev_dispatch": rd} for rc in ("pull", "push")
                     for rd in ("push", "pull")]


@pytest.mark.parametrize("policy", BACKWARD_POLICIES)
def test_fused_backward_passes_check(policy):
    inside = P.inside_kernel("bwd", policy)
    for comm in (0, 2) if any(inside) else (0,):
        p = P.fused_backward(TILE, 2, P.FusedKnobs(comm, 256), policy=policy, num_sms=8, capacity_rows=1024)
        p.check()
        kinds = {P.TaskKind(int(k)) for k in np.unique(p.tasks["kind"])}
        want = {P.TaskKind.SHARED_DOWN_BWD, P.TaskKind.SHARED_GATE_UP_BWD, P.TaskKind.SHARED_DOWN_WGRAD,
                P.TaskKind.SHARED_GATE_UP_WGRAD, P.TaskKind.DOWN_BWD, P.TaskKind.GATE_UP_BWD,
                P.TaskKind.DOWN_WGRAD, P.TaskKind.GATE_UP_WGRAD}
        want |= {P.TaskKind.REV_COMBINE, P.TaskKind.SCALE} if inside[0] else set()  # the scale inside too
        want |= {P.TaskKind.REV_DISPATCH, P.TaskKind.SLOT_SUM} if inside[1] else set()  # token grads inside
        assert kinds == want
        assert (p.scale, p.token_grads) == inside
        # the remote counters (the kernel's peer flags): every rank's dy_slots written, every rank's
        # reverse-dispatch into my slots complete
        remote = {P.CounterKind(int(k)) for k in p.counters[p.counters["remote"]]["kind"]}
        assert remote == ({P.CounterKind.PUBLISHED} if inside[0] else set()) | (
            {P.CounterKind.SLOTS_ARRIVED} if inside[1] else set())


@pytest.mark.parametrize("comm", [0, 2])
def test_fused_backward_runs_the_token_gradients_last_on_every_cta(comm):
    p = P.fused_backward(TILE, 2, P.FusedKnobs(comm, 256), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    p.check()
    t = p.tasks
    sums = t[t["kind"] == int(P.TaskKind.SLOT_SUM)]
    tiles = -(-TILE.num_tokens // P.EPILOGUE_ROWS)
    assert sorted(sums["row_tile"].tolist()) == list(range(tiles))
    assert (sums["block"] == sums["row_tile"] % p.num_sms).all()  # round robin over every CTA
    for blk in np.unique(sums["block"]):  # after the CTA's mover tasks (the movers' stream: table order)
        mine = t[(t["block"] == blk) & np.isin(t["kind"], [int(k) for k in P.MOVER_KINDS])]
        n = int((mine["kind"] == int(P.TaskKind.SLOT_SUM)).sum())
        assert (mine["kind"][len(mine) - n:] == int(P.TaskKind.SLOT_SUM)).all()
    slots = int(np.flatnonzero(p.counters["kind"] == int(P.CounterKind.SLOTS_ARRIVED))[0])
    chunks = int((t["kind"] == int(P.TaskKind.REV_DISPATCH)).sum())
    assert p.counters["target"][slots] == 2 * chunks  # R signals per reverse-dispatch chunk
    assert (t["wait_counter"][t["kind"] == int(P.TaskKind.SLOT_SUM)][:, 0] == slots).all()
    # off: no token-gradient task, no SLOTS_ARRIVED counter
    off = P.fused_backward(TILE, 2, P.FusedKnobs(0, 256, token_grads=False), policy=MOK_POLICY, num_sms=8,
                           capacity_rows=1024)
    off.check()
    assert not off.token_grads and not (off.tasks["kind"] == int(P.TaskKind.SLOT_SUM)).any()
    assert not (off.counters["kind"] == int(P.CounterKind.SLOTS_ARRIVED)).any()
    with pytest.raises(ValueError, match="token_grads"):
        P.fused_backward(TILE, 2, P.FusedKnobs(0, 256, token_grads=True), policy={**MOK_POLICY, "rev_dispatch": "pull"},
                         num_sms=8, capacity_rows=1024)


@pytest.mark.parametrize("comm", [0, 2])
def test_fused_backward_without_routed_weight_gradients(comm):
    """routed_wgrads=False (the FP8 layer: those run after the kernel): every other task as the
    default plan has it, no routed weight-gradient tile and no DATA_GRAD_DONE; the shared expert's
    weight gradients stay; the checker's coverage holds either way, and refuses the one plan
    passed off as the other."""
    knobs = P.FusedKnobs(comm, 256)
    full = P.fused_backward(TILE, 2, knobs, policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    part = P.fused_backward(TILE, 2, dataclasses.replace(knobs, routed_wgrads=False), policy=MOK_POLICY, num_sms=8,
                            capacity_rows=1024)
    part.check()
    assert full.routed_wgrads and not part.routed_wgrads
    routed = [int(k) for k in full.kinds.wgrad]
    kinds = collections.Counter(full.tasks["kind"].tolist())
    assert all(kinds[k] > 0 for k in routed)
    assert collections.Counter(part.tasks["kind"].tolist()) == {k: n for k, n in kinds.items() if k not in routed}
    assert (part.tasks["kind"] == int(P.TaskKind.SHARED_DOWN_WGRAD)).any()
    assert not (part.counters["kind"] == int(P.CounterKind.DATA_GRAD_DONE)).any()
    with pytest.raises(P.PlanError, match="coverage"):
        dataclasses.replace(part, routed_wgrads=True).check()


def test_fused_backward_runs_the_scale_first_on_every_cta():
    p = P.fused_backward(TILE, 2, P.FusedKnobs(2, 256), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    p.check()
    t = p.tasks
    scales = t[t["kind"] == int(P.TaskKind.SCALE)]
    assert sorted(scales["row_tile"].tolist()) == list(range(-(-TILE.num_tokens // P.EPILOGUE_ROWS)))
    assert (scales["block"] == scales["row_tile"] % p.num_sms).all()
    for blk in np.unique(scales["block"]):  # before every other task of the CTA's movers
        mine = t[(t["block"] == blk) & np.isin(t["kind"], [int(k) for k in P.MOVER_KINDS])]
        n = int((mine["kind"] == int(P.TaskKind.SCALE)).sum())
        assert (mine["kind"][:n] == int(P.TaskKind.SCALE)).all()
    published = int(np.flatnonzero(p.counters["kind"] == int(P.CounterKind.PUBLISHED))[0])
    assert p.counters["remote"][published] and p.counters["target"][published] == 2 * len(scales)
    assert (t["wait_counter"][t["kind"] == int(P.TaskKind.REV_COMBINE)][:, 0] == published).all()
    off = P.fused_backward(TILE, 2, P.FusedKnobs(2, 256, scale=False), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    off.check()
    assert not off.scale and not (off.tasks["kind"] == int(P.TaskKind.SCALE)).any()
    with pytest.raises(ValueError, match="scale"):
        P.fused_backward(TILE, 2, P.FusedKnobs(0, 256, scale=True), policy={**MOK_POLICY, "rev_combine": "push"},
                         num_sms=8, capacity_rows=1024)


def _swap_counters(counters, tasks, i, j):
    """Counters i and j trade ids, in the counter table and in every task's waits and signals (in place)."""
    counters[[i, j]] = counters[[j, i]]
    for field in ("wait_counter", "signal_counter"):
        ids = tasks[field].copy()
        tasks[field][ids == i], tasks[field][ids == j] = j, i


@pytest.mark.parametrize("kind", ["PUBLISHED", "SLOTS_ARRIVED"])
def test_fused_backward_check_rejects_a_local_counter_for_every_ranks_rows(kind):
    # the same tasks, waits and signals, but the counter local (its target one rank's signals): each
    # rank would wait for its own scale (reverse-dispatch) only and read a peer's rows too early; the
    # data-flow check sees one rank's writers and passes it, the cross-rank check does not
    p = P.fused_backward(TILE, 2, P.FusedKnobs(2, 256), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    c, t = p.counters.copy(), p.tasks.copy()
    i = int(np.flatnonzero(c["kind"] == int(P.CounterKind[kind]))[0])
    c["remote"][i], c["target"][i] = False, c["target"][i] // 2
    t["wait_target"][t["wait_counter"] == i] = c["target"][i]
    _swap_counters(c, t, i, p.first_remote_counter)  # it takes the first remote id: the remote ones stay last
    with pytest.raises(P.PlanError, match="cross-rank"):
        P.with_tasks(p, t, c).check()


def test_fused_plans_number_their_remote_counters_last():
    """The fused kernel tells a remote counter by its id (FusedParams.first_remote): the builder
    numbers them last, and check() refuses a plan where a remote counter comes before a local one."""
    p = P.fused_backward(TILE, 2, P.FusedKnobs(2, 256), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    remote, first = p.counters["remote"], p.first_remote_counter
    assert remote.sum() == 2 and first == len(remote) - 2 and remote[first:].all() and not remote[:first].any()
    # the ids in the tasks were renumbered with the counters: each remote counter's waiters and signallers
    for cid in range(first, len(remote)):
        kind = P.CounterKind(int(p.counters["kind"][cid]))
        signallers = set(p.tasks["kind"][(p.tasks["signal_counter"] == cid).any(axis=1)].tolist())
        assert signallers == {int(P.TaskKind.SCALE if kind == P.CounterKind.PUBLISHED else P.TaskKind.REV_DISPATCH)}
    f = P.fused_forward(TILE, 2, P.FusedKnobs(2, 256), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    assert f.first_remote_counter == len(f.counters)  # the forward keeps none
    c, t = p.counters.copy(), p.tasks.copy()
    _swap_counters(c, t, first - 1, first)  # the last local counter and the first remote one
    with pytest.raises(P.PlanError, match="remote counters must have the last ids"):
        P.with_tasks(p, t, c).check()


def test_fused_kernel_refuses_remote_counters_it_does_not_keep():
    from mok_proto.kernels import fused

    assert fused.REMOTE_KINDS == {P.CounterKind.SLOTS_ARRIVED, P.CounterKind.PUBLISHED}
    p = P.fused_backward(TILE, 2, P.FusedKnobs(2, 256), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    fused.check_remote_counters(p)
    for what, change in (("keeps only", lambda c, i: c["kind"].__setitem__(i, int(P.CounterKind.ARRIVED))),
                         ("one remote counter per kind", lambda c, i: c["kind"].__setitem__(
                             i, int(P.CounterKind.SLOTS_ARRIVED))),
                         ("counts R", lambda c, i: c["target"].__setitem__(i, c["target"][i] + 1))):
        c = p.counters.copy()
        change(c, int(np.flatnonzero(c["kind"] == int(P.CounterKind.PUBLISHED))[0]))
        with pytest.raises(ValueError, match=what):
            fused.check_remote_counters(P.with_tasks(p, p.tasks, c))


def test_fused_gemm_waits_outlast_the_counter_and_peer_waits():
    # a GEMM stage waits for a producer that waits for a counter or a peer's rows: that wait (naming
    # what is missing) must expire first; before, a missing peer at the default 30 s run timeout was
    # reported by a GEMM consumer's 10 s stage wait
    from mok_proto import abi
    from mok_proto.kernels import fused, gemm

    factor = abi.CONST["kFusedLocalTimeoutFactor"]
    assert fused.gemm_timeout_ns(30 * 10**9) == (factor + 1) * 30 * 10**9 > factor * 30 * 10**9
    assert fused.gemm_timeout_ns(10**9) == gemm.TIMEOUT_NS  # never shorter than the standalone GEMMs'
    fields = {**dict.fromkeys(abi.GEMM_PARAMS.names, 0), "n": 7168, "timeout_ns": gemm.TIMEOUT_NS}
    words = np.concatenate([abi.GEMM_PARAMS.pack({**fields, "m": m}) for m in (1, 2, 3)])
    got = fused.with_gemm_timeout(words, 12345).view(abi.GEMM_PARAMS.dtype)
    assert got["timeout_ns"].tolist() == [12345] * 3 and got["m"].tolist() == [1, 2, 3] and (got["n"] == 7168).all()
    assert words.view(abi.GEMM_PARAMS.dtype)["timeout_ns"].tolist() == [gemm.TIMEOUT_NS] * 3  # a copy


def test_layer_packs_the_fused_gemms_with_the_longer_timeout(monkeypatch):
    # GpuMoELayer._fused_pass on the CPU: a stand-in FusedPass and GEMM packers (no GPU); every
    # packed GemmParams of every launch rank and slot carries fused.gemm_timeout_ns of the run's
    from types import SimpleNamespace

    from mok_proto import abi
    from mok_proto.config import RunConfig
    from mok_proto.kernels import fused, gemm
    from mok_proto.layer import gpu

    monkeypatch.setattr(fused, "FusedPass", lambda plan, w, link=False, fp8=False, wgrads_inside=False:
                        SimpleNamespace(plan=plan, w=w))
    fields = {**dict.fromkeys(abi.GEMM_PARAMS.names, 0), "n": 64, "timeout_ns": gemm.TIMEOUT_NS}
    pack = (lambda *args, error=None, pack_only=False, accumulate=False:
            abi.GEMM_PARAMS.pack({**fields, "accumulate": int(accumulate)}), ())
    run = RunConfig(TILE, 2, timeout_s=30)
    layer = SimpleNamespace(run=run, shape=TILE, capacity=1024, num_turns=1, ring_rows=1024, ranks=[0, 1], error=None,
                            has_shared=True, fp8=None,
                            _gemm=lambda pass_, slot, r, t=0: None if slot == "kSlotSharedDownWgrad" else pack)
    layer._plan_rows = lambda: gpu.GpuMoELayer._plan_rows(layer)
    plan = P.fused_backward(TILE, 2, P.FusedKnobs(0, 256), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    made, words = gpu.GpuMoELayer._fused_pass(layer, plan, "bwd")
    got = words[0].view(abi.GEMM_PARAMS.dtype)
    assert (made.plan, made.w) == (plan, 2) and len(words) == 1 and len(got) == 2 * len(abi.GEMM_SLOT)
    assert not hasattr(made, "rest")  # one turn: no plan for other turns
    assert (got["timeout_ns"] == fused.gemm_timeout_ns(30 * 10**9)).all() and fused.gemm_timeout_ns(30 * 10**9) > 60e9
    assert not got["accumulate"].any()
    # a ring of 2 turns: a plan of one turn's rows, words per turn, the routed weight gradients of
    # the second accumulating (and nothing else); the backward's token-side work outside the kernel
    layer.num_turns, layer.ring_rows = 2, 512
    with pytest.raises(ValueError, match="scale and token gradients must run outside"):
        gpu.GpuMoELayer._fused_pass(layer, P.fused_backward(TILE, 2, P.FusedKnobs(0, 256), policy=MOK_POLICY,
                                                            num_sms=8, capacity_rows=512), "bwd")
    plan = P.fused_backward(TILE, 2, P.FusedKnobs(0, 256, token_grads=False, scale=False), policy=MOK_POLICY,
                            num_sms=8, capacity_rows=512)
    made, words = gpu.GpuMoELayer._fused_pass(layer, plan, "bwd")
    # turns after the first run the same plan without the shared expert's tiles
    shared = {int(k) for k in P.TaskKind if k.name.startswith("SHARED")}
    assert np.isin(plan.tasks["kind"], list(shared)).any() and not np.isin(made.rest.plan.tasks["kind"],
                                                                            list(shared)).any()
    assert made.rest.plan.knobs == plan.knobs and made.rest.plan.capacity_rows == 512
    def routed_kinds(tasks):
        return np.bincount(tasks["kind"][~np.isin(tasks["kind"], list(shared))], minlength=len(P.TaskKind))
    assert (routed_kinds(made.rest.plan.tasks) == routed_kinds(plan.tasks)).all()  # the same routed work
    slots = [name for name, _ in abi.GEMM_SLOT.members] * 2  # GemmSlot order, per launch rank
    accumulating = [s for s, a in zip(slots, words[1].view(abi.GEMM_PARAMS.dtype)["accumulate"]) if a]
    assert len(words) == 2 and not words[0].view(abi.GEMM_PARAMS.dtype)["accumulate"].any()
    assert accumulating == ["kSlotDownWgrad", "kSlotGateUpWgrad"] * 2


def test_fused_backward_check_rejects_a_pull_before_the_scale():
    # a reverse-combine chunk that no longer waits for every rank's scale may pull dy rows before
    # they are written
    p = P.fused_backward(TILE, 2, P.FusedKnobs(2, 256), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    t = p.tasks.copy()
    sel = t["kind"] == int(P.TaskKind.REV_COMBINE)
    t["wait_counter"][sel, 0], t["wait_target"][sel, 0] = -1, 0
    with pytest.raises(P.PlanError, match="cross-rank: REV_COMBINE"):
        P.with_tasks(p, t).check()


@pytest.mark.parametrize("drop,check", [("SLOTS_ARRIVED", "cross-rank"), ("SHARED_SECOND_DONE", "data flow")])
def test_fused_backward_check_rejects_token_gradients_without_their_wait(drop, check):
    # a slot sum that no longer waits for every rank's reverse-dispatch (or the shared expert's dx)
    # may read slot rows before they land: the data-flow check names it (16 clusters: some run
    # shared-expert tiles and none of the reverse-dispatch's, so nothing else orders them)
    p = P.fused_backward(TILE, 2, P.FusedKnobs(0, 256), policy=MOK_POLICY, num_sms=32, capacity_rows=1024)
    p.check()
    t = p.tasks.copy()
    counter = int(np.flatnonzero(p.counters["kind"] == int(P.CounterKind[drop]))[0])
    for j in range(P.MAX_WAITS):
        sel = (t["kind"] == int(P.TaskKind.SLOT_SUM)) & (t["wait_counter"][:, j] == counter)
        t["wait_counter"][sel, j], t["wait_target"][sel, j] = -1, 0
    with pytest.raises(P.PlanError, match=f"{check}: SLOT_SUM"):
        P.with_tasks(p, t).check()


def test_fused_backward_defers_weight_gradients():
    p = P.fused_backward(TILE, 2, P.FusedKnobs(0, 256), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)
    routed_wgrad = np.isin(p.tasks["kind"], [int(P.TaskKind.DOWN_WGRAD), int(P.TaskKind.GATE_UP_WGRAD)])
    data = np.isin(p.tasks["kind"], [int(P.TaskKind.DOWN_BWD), int(P.TaskKind.GATE_UP_BWD)])
    for blk in range(p.num_sms):
        mine = p.tasks["block"] == blk
        if (mine & routed_wgrad).any() and (mine & data).any():
            assert p.tasks["seq"][mine & routed_wgrad].min() > p.tasks["seq"][mine & data].max()
    # every expert's weight tiles once, in cluster pairs, summed whole (one macrobatch)
    w = p.tasks[routed_wgrad]
    assert set(np.unique(w["expert"]).tolist()) == set(range(TILE.num_experts // 2))
    assert (w["macrobatch"] == 0).all()
    with pytest.raises(ValueError, match="lookahead"):
        P.fused_backward(TILE, 2, P.FusedKnobs(0, 256, lookahead=9), policy=MOK_POLICY, num_sms=8, capacity_rows=1024)


def test_fused_backward_check_rejects_an_early_weight_gradient():
    # a routed weight-gradient tile that no longer waits for the data gradients may read dg, du
    # (and dy rows) before they exist (16 clusters: most run no data-gradient tile before it)
    p = P.fused_backward(TILE, 2, P.FusedKnobs(0, 256), policy=MOK_POLICY, num_sms=32, capacity_rows=1024)
    p.check()
    t = p.tasks.copy()
    sel = np.isin(t["kind"], [int(P.TaskKind.DOWN_WGRAD), int(P.TaskKind.GATE_UP_WGRAD)])
    t["wait_counter"][sel], t["wait_target"][sel] = -1, 0
    with pytest.raises(P.PlanError, match="data flow"):
        P.with_tasks(p, t).check()


def test_ancestors_of_tracked_tasks_are_the_full_relation_restricted():
    """ancestors with a `tracked` mask (what Plan.check uses: only the tasks some check needs)
    gives, bit k for the k-th tracked task, exactly the full happens-before relation on them."""
    plan = P.fused_backward(SMALL, 2, P.FusedKnobs(2, 256), policy=dict(MOK_POLICY), num_sms=8)
    order = plan.execution_order
    full = ancestors(plan, order)
    rng = np.random.default_rng(3)
    tracked = rng.random(len(plan.tasks)) < 0.3
    index = np.flatnonzero(tracked)
    restricted = ancestors(plan, order, tracked)
    for i in range(len(plan.tasks)):
        want = {k for k, j in enumerate(index) if full[i] >> int(j) & 1}
        got = {k for k in range(len(index)) if restricted[i] >> k & 1}
        assert got == want, i
    assert any(full[i] >> int(j) & 1 for i in range(len(plan.tasks)) for j in index[:5] if i != j)  # not vacuous


# ---------------------------------------------------------------------------------------------
# Which cluster takes each tile pair (assign)
# ---------------------------------------------------------------------------------------------
PAIR_FIELDS = ["kind", "minibatch", "macrobatch", "col_tile", "expert"]  # with the row pair: one tile pair


def fused_of(pass_, comm=2, minibatch=256, num_sms=8, assign=None, shape=TILE, capacity_rows=1024, **knobs):
    """A fused plan of either pass (the forward's ring turns twice where 4 minibatches allow it)."""
    knobs.setdefault("claim", 0)  # every pair in a cluster's table (the claimed pool: its own tests)
    ring = 2 if pass_ == "fwd" and 1024 // minibatch > 2 else None
    make = P.fused_forward if pass_ == "fwd" else P.fused_backward
    return make(shape, 2, P.FusedKnobs(comm, minibatch, ring_minibatches=ring, assign=assign, **knobs),
                policy=MOK_POLICY, num_sms=num_sms, capacity_rows=capacity_rows)


def cluster_pairs(plan) -> list[list[tuple]]:
    """Per cluster, its tile pairs in table order (the even CTA's GEMM tasks, as PAIR_FIELDS + the
    row pair); asserts that the odd CTA holds the other half of each pair at the same position."""
    comm = [int(k) for k in P.MOVER_KINDS]
    tables = [t[~np.isin(t["kind"], comm)] for t in plan.block_tables()[plan.comm_blocks:]]
    out = []
    for even, odd in zip(tables[::2], tables[1::2]):
        assert np.array_equal(even[PAIR_FIELDS], odd[PAIR_FIELDS])
        assert np.array_equal(even["row_tile"] % 2, np.zeros(len(even))) and np.array_equal(even["row_tile"] + 1,
                                                                                             odd["row_tile"])
        out.append([(*key, rt // 2) for key, rt in zip(even[PAIR_FIELDS].tolist(), even["row_tile"].tolist())])
    return out


def global_order(pass_, comm, minibatch, raster=None):
    """The global pair order: a plan with one cluster takes every pair, in that order."""
    (order,) = cluster_pairs(fused_of(pass_, comm, minibatch, num_sms=comm + 2, raster=raster))
    return order


ASSIGN_CASES = [(pass_, comm, minibatch, num_sms) for pass_ in P.PASSES for comm in (0, 2) for minibatch in (256, 512)
                for num_sms in (8, 14)]


@pytest.mark.parametrize("pass_,comm,minibatch,num_sms", ASSIGN_CASES)
def test_round_robin_is_the_old_assignment(pass_, comm, minibatch, num_sms):
    # the formula before `assign` existed: pair j of the global order on cluster j % clusters
    order = global_order(pass_, comm, minibatch)
    clusters = (num_sms - comm) // 2
    plan = fused_of(pass_, comm, minibatch, num_sms, "round_robin")
    assert plan.assign == "round_robin"
    assert cluster_pairs(plan) == [order[c::clusters] for c in range(clusters)]


@pytest.mark.parametrize("pass_,comm,minibatch,num_sms", ASSIGN_CASES)
def test_default_assignment_is_the_pass_default(pass_, comm, minibatch, num_sms):
    # the forward round robin, the backward balanced (FusedKnobs.PASS_DEFAULTS)
    want = {"fwd": "round_robin", "bwd": "balanced"}[pass_]
    assert P.FusedKnobs().resolved(pass_, MOK_POLICY).assign == want
    default = fused_of(pass_, comm, minibatch, num_sms)
    chosen = fused_of(pass_, comm, minibatch, num_sms, want)
    assert default.assign == want and default.tasks.tobytes() == chosen.tasks.tobytes()


@pytest.mark.parametrize("pass_,comm,minibatch,num_sms", ASSIGN_CASES)
def test_balanced_plans_pass_check_and_keep_the_global_order(pass_, comm, minibatch, num_sms):
    plan = fused_of(pass_, comm, minibatch, num_sms, "balanced")
    plan.check()
    assert plan.assign == "balanced" and "assign=balanced" in plan.describe()
    position = {pair: j for j, pair in enumerate(global_order(pass_, comm, minibatch))}
    got = cluster_pairs(plan)  # (both halves of a pair at the same position of the cluster's two tables)
    assert sorted(position[pair] for pairs in got for pair in pairs) == list(range(len(position)))
    for pairs in got:  # each cluster's pairs: a subsequence of the global order
        assert all(position[a] < position[b] for a, b in zip(pairs, pairs[1:]))


def test_balanced_differs_from_round_robin_and_is_deterministic():
    for pass_ in P.PASSES:
        balanced, again = (fused_of(pass_, 0, 256, 14, "balanced") for _ in range(2))
        assert np.array_equal(balanced.tasks, again.tasks) and np.array_equal(balanced.counters, again.counters)
        rr = fused_of(pass_, 0, 256, 14, "round_robin")
        assert not np.array_equal(balanced.tasks, rr.tasks)  # the tests above are not vacuous


def test_bad_assign():
    for pass_ in P.PASSES:
        with pytest.raises(ValueError, match="assign must be one of round_robin, balanced"):
            fused_of(pass_, assign="greedy")


# ---------------------------------------------------------------------------------------------
# The order of a minibatch's tile pairs (raster)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pass_", P.PASSES)
def test_col_raster_reorders_each_minibatch_by_column(pass_):
    # the same pairs as row order, passing check(); within each (kind, minibatch) the row pair runs
    # fastest instead of the column tile (the shared expert's pairs likewise, as minibatch -1)
    wide = dataclasses.replace(TILE, hidden=512, ffn=512)  # 2+ column tiles of every kind
    row, col = (fused_of(pass_, 2, 512, 8, raster=r, shape=wide) for r in P.RASTERS)
    col.check()
    assert (row.raster, col.raster) == P.RASTERS and "raster=col" in col.describe()
    assert P.FusedKnobs().resolved(pass_, MOK_POLICY).raster == fused_of(pass_, 2, 256, 8).raster == "row"
    orders = {r: cluster_pairs(fused_of(pass_, 2, 512, 4, raster=r, shape=wide))[0]  # one cluster: the global order
              for r in P.RASTERS}  # 2 row pairs a minibatch
    assert sorted(orders["row"]) == sorted(orders["col"]) and orders["row"] != orders["col"]
    data = {P.TaskKind.GATE_UP, P.TaskKind.DOWN, P.TaskKind.SHARED_GATE_UP, P.TaskKind.SHARED_DOWN, P.TaskKind.DOWN_BWD,
            P.TaskKind.GATE_UP_BWD, P.TaskKind.SHARED_DOWN_BWD, P.TaskKind.SHARED_GATE_UP_BWD}
    for raster, order in orders.items():
        groups = {}
        for kind, minibatch, _, col_tile, _, pair in order:
            if P.TaskKind(kind) in data:
                groups.setdefault((kind, minibatch), []).append((pair, col_tile))
        assert len(groups) > 2
        for pairs in groups.values():
            want = sorted(pairs) if raster == "row" else sorted(pairs, key=lambda pc: (pc[1], pc[0]))
            assert pairs == want


@pytest.mark.parametrize("pass_", P.PASSES)
def test_spread_from_splits_the_last_outgoing_transfers_over_every_cta(pass_):
    # minibatches >= spread_from: one outgoing chunk on every CTA (of num_sms); the others and every
    # incoming transfer: one on each communicating CTA (of comm_blocks); chunk counts in col_tile
    base, spread = (fused_of(pass_, 2, 256, 8, spread_from=s) for s in (None, 2))
    spread.check()
    assert base.spread_from is None and spread.spread_from == 2 and "spread_from=2" in spread.describe()
    t, k = spread.tasks, spread.kinds
    for m in range(spread.num_minibatches):
        for kind, outgoing in ((k.comm_in, False), (k.comm_out, True)):
            mine = t[(t["kind"] == int(kind)) & (t["minibatch"] == m)]
            chunks = 8 if outgoing and m >= 2 else 2
            assert spread.chunks_of(m, outgoing) == chunks
            assert sorted(mine["row_tile"].tolist()) == sorted(mine["block"].tolist()) == list(range(chunks))
            assert set(mine["col_tile"].tolist()) == {chunks}
    assert np.array_equal(base.tasks[np.isin(base.tasks["kind"], [int(x) for x in P.COMM_KINDS])]["col_tile"],
                          np.full(int(np.isin(base.tasks["kind"], [int(x) for x in P.COMM_KINDS]).sum()), 2))


def test_bad_spread_from():
    for pass_ in P.PASSES:
        for comm, spread in ((0, 0), (2, 4), (2, -1)):  # no communicating CTAs; past the 4 minibatches
            with pytest.raises(ValueError, match="spread_from"):
                fused_of(pass_, comm, 256, 8, spread_from=spread)
    with pytest.raises(ValueError, match="spread_from"):  # the combine runs after the kernel (pull)
        P.fused_forward(TILE, 2, P.FusedKnobs(2, 256, spread_from=0), policy={**MOK_POLICY, "combine": "pull"},
                        num_sms=8, capacity_rows=1024)


def test_bad_raster():
    for pass_ in P.PASSES:
        with pytest.raises(ValueError, match="raster must be one of row, col"):
            fused_of(pass_, raster="diagonal")


def test_balanced_backward_spreads_experts_of_fewer_rows_than_a_pair():
    # Every local expert's segment is padded to SEGMENT_ROWS, so with fewer rows than that per
    # expert the real rows fill El segments, not N K + half a segment each. Costed that way, the tile
    # pairs of the last experts looked free and the balanced backward piled them on a few
    # clusters: at EP=1 qwen's (512 experts, ~40 rows each) 95 to 694 data-gradient tasks per CTA,
    # and the fused backward took 29.6 ms against the sequential's 13.8 on the H200 (14.9 after).
    shape = get_shape("tile")  # 48 experts, N K = 64 x 4: ~5 rows each, 48 segments of real rows
    assert P.expected_rows(shape, 1, 1 << 20) == 48 * P.SEGMENT_ROWS
    assert P.default_capacity(shape, 1, 256) == 48 * P.SEGMENT_ROWS
    plan = P.fused_backward(shape, 1, P.FusedKnobs(0, 256), policy=MOK_POLICY, num_sms=16,
                            capacity_rows=48 * P.SEGMENT_ROWS)
    kinds = [int(P.TaskKind.DOWN_BWD), int(P.TaskKind.GATE_UP_BWD)]
    counts = [int(np.isin(t["kind"], kinds).sum()) for t in plan.block_tables()]
    # both CTAs of the 48 segments' pairs, down_bwd's I / BN and gate_up_bwd's H / BN column tiles each
    assert sum(counts) == 2 * (48 * P.SEGMENT_ROWS // P.PAIR_ROWS) * (shape.ffn // P.BN + shape.hidden // P.BN)
    assert max(counts) - min(counts) <= 2, counts


def test_expected_rows_follow_the_padded_rows_of_the_routing():
    # where the real rows end, against the sim's routed load padded to segments (the GPU layer's
    # layout): within half a segment a rank at EP=8 and EP=1, where N K + half a segment per expert was
    # 1-4 segments short (kimi at EP=8: 341 rows an expert, two segments each); the EP=64 shares the
    # bench measures keep N K + half a segment (their measured plans do not change)
    from mok_proto.sim.model import routed_load

    for name in ("kimi-k2.7", "qwen3.5-397b"):
        for ranks in (1, 8):
            shape = get_shape(name)
            for s in (P.SEGMENT_ROWS, P.PAIR_ROWS):  # the rule and the measured plans' rule
                real = routed_load(shape, ranks, align=s).expert_offsets[:, -1].mean()
                est = P.expected_rows(shape, ranks, 1 << 30, segment_rows=s)
                # never short by more than half a segment; N K + half a segment each can be a few % over
                assert -s / 2 < est - real < (s / 2 if s == P.PAIR_ROWS else 0.06 * real), (name, ranks, s)
            spread = shape.num_tokens * shape.top_k + shape.num_experts // ranks * P.PAIR_ROWS // 2
            real = routed_load(shape, ranks, align=P.PAIR_ROWS).expert_offsets[:, -1].mean()
            assert real - spread >= P.PAIR_ROWS, (name, ranks)  # the old estimate's shortfall
        share = ep_share(name, 64)
        for s in (P.SEGMENT_ROWS, P.PAIR_ROWS):
            assert P.expected_rows(share, 2, 1 << 30, segment_rows=s) >= (
                share.num_tokens * share.top_k + share.num_experts // 2 * s // 2)


def test_tile_cost_of_pairs_past_the_expected_rows():
    # routed row tiles past the rows a rank fills on average (N K + padding) only signal: cost 1;
    # the shared expert's and the weight gradients' do not depend on a row pair
    shape = ep_share("glm-5.2", 64)  # N 2048, K 8, El 4: 16384 + 4 half segments expected rows
    expected = 2048 * 8 + 4 * P.SEGMENT_ROWS // 2
    assert P.expected_rows(shape, 2, 1 << 20) == expected
    assert P.expected_rows(shape, 2, 8192) == 8192  # at most the capacity
    last_real, first_free = (expected - 1) // P.PAIR_ROWS, -(-expected // P.PAIR_ROWS)
    for kind in (P.TaskKind.GATE_UP, P.TaskKind.DOWN, P.TaskKind.DOWN_BWD, P.TaskKind.GATE_UP_BWD):
        full = P.tile_cost(kind, shape, 2, 20480)
        assert P.tile_cost(kind, shape, 2, 20480, last_real) == full > 1
        assert P.tile_cost(kind, shape, 2, 20480, first_free) == 1
    for kind in (P.TaskKind.SHARED_GATE_UP, P.TaskKind.DOWN_WGRAD):
        assert P.tile_cost(kind, shape, 2, 20480, first_free) == P.tile_cost(kind, shape, 2, 20480) > 1
    # a routed weight-gradient tile reduces over the expected rows per expert, not the capacity's
    assert P.tile_cost(P.TaskKind.DOWN_WGRAD, shape, 2, 20480) == -(-expected // 4 // P.BK) * P.BN


def test_tile_cost_follows_the_kernels_k():
    shape = ep_share("glm-5.2", 64)  # H 6144, I 2048, El 4 of 2 ranks
    cost = {k: P.tile_cost(k, shape, 2, 16384) for k in P.PROBLEM_OF}
    bk, cols = P.BK, P.BN
    assert cost[P.TaskKind.GATE_UP] == cost[P.TaskKind.SHARED_GATE_UP] == 6144 // bk * cols  # K = H
    assert cost[P.TaskKind.DOWN] == 2048 // bk * cols  # K = I: a gate/up tile is 3 down tiles
    assert cost[P.TaskKind.DOWN_BWD] == (6144 // bk + P.DOWN_BWD_AUX_STAGES) * cols  # K = H, + its g, u stages
    assert cost[P.TaskKind.GATE_UP_BWD] == 2 * 2048 // bk * cols  # K = 2I (dg | du)
    assert cost[P.TaskKind.DOWN_WGRAD] == cost[P.TaskKind.GATE_UP_WGRAD] == 16384 // 4 // bk * cols  # rows per expert
    assert cost[P.TaskKind.SHARED_DOWN_WGRAD] == shape.num_tokens // bk * cols  # the shared expert: N tokens


@pytest.mark.parametrize("name", ["glm-5.2", "kimi-k2.7"])
@pytest.mark.parametrize("pass_", P.PASSES)
def test_balanced_evens_out_the_estimated_work(name, pass_):
    # one EP=64 rank's share on an H200 (132 SMs): every cluster's estimated work within one tile
    # of the mean, and the most loaded cluster less loaded than round robin's
    shape = ep_share(name, 64)
    make = P.fused_forward if pass_ == "fwd" else P.fused_backward
    for comm in (0, 8):
        work = {}
        for assign in P.ASSIGNMENTS:
            plan = make(shape, 2, P.FusedKnobs(comm, 2048, assign=assign, claim=0), policy=MOK_POLICY, num_sms=132)
            t = plan.tasks
            even = (t["block"] >= comm) & (t["block"] % 2 == 0) & ~np.isin(t["kind"], [int(k) for k in P.MOVER_KINDS])
            tile = np.array([P.tile_cost(P.TaskKind(k), shape, 2, plan.capacity_rows, rt // 2)
                             for k, rt in zip(t["kind"][even].tolist(), t["row_tile"][even].tolist())])
            work[assign] = np.bincount((t["block"][even] - comm) // 2, tile, minlength=(132 - comm) // 2)
        largest = tile.max()
        assert work["balanced"].max() - work["balanced"].mean() <= largest
        assert work["balanced"].max() < work["round_robin"].max()
        assert work["balanced"].sum() == work["round_robin"].sum()


# ---------------------------------------------------------------------------------------------
# Tile pairs claimed at run time (`claim`: the pool)
# ---------------------------------------------------------------------------------------------
def pool_pairs(plan) -> list[tuple]:
    """The pool's pairs in claim order (as cluster_pairs gives a cluster's); asserts the halves."""
    pool = plan.pool_table()
    even, odd = pool[0::2], pool[1::2]
    assert np.array_equal(even[PAIR_FIELDS], odd[PAIR_FIELDS]) and np.array_equal(even["row_tile"] + 1, odd["row_tile"])
    assert np.array_equal(pool["seq"], np.arange(len(pool)))
    return [(*key, rt // 2) for key, rt in zip(even[PAIR_FIELDS].tolist(), even["row_tile"].tolist())]


@pytest.mark.parametrize("pass_", P.PASSES)
@pytest.mark.parametrize("comm", [0, 2])
def test_claimed_pairs_are_the_tail_of_the_global_order(pass_, comm):
    order = global_order(pass_, comm, 256)
    for claim in (0, 1, 5, len(order) - 1, "all"):
        plan = fused_of(pass_, comm, 256, claim=claim)
        plan.check()
        n = len(order) if claim == "all" else claim
        assert plan.claim_pairs == n and len(plan.execution_order) == len(plan.tasks)
        assert pool_pairs(plan) == order[len(order) - n:]
        static = sorted(p for pairs in cluster_pairs(plan) for p in pairs)
        assert static == sorted(order[:len(order) - n])  # the rest, in the clusters' tables
        assert (plan.claim_counter >= 0) == (n > 0)
        if n:  # the ticket: local, no task waits on or signals it
            assert not plan.counters["remote"][plan.claim_counter]
            assert plan.claim_counter not in plan.tasks["wait_counter"] and plan.claim_counter not in plan.tasks[
                "signal_counter"]


def test_bad_claim():
    for claim in (-1, 10 ** 6, "most", 2.0, True):
        with pytest.raises(ValueError, match="claim"):
            fused_of("fwd", 2, 256, claim=claim)


def test_check_refuses_a_table_task_that_waits_for_a_claimed_pair():
    # the pool is claimed after every cluster's table (check's model): a table pair that needs a
    # claimed pair could hold every cluster, so check() refuses it
    plan = fused_of("fwd", 2, 256, claim=1)
    pool = plan.pool_table()
    (pooled,) = {c for c in pool["signal_counter"].ravel().tolist() if c >= 0} - set(
        plan.tasks["signal_counter"][plan.tasks["block"] != plan.pool_block].ravel().tolist())
    tasks = plan.tasks.copy()
    gemm = np.flatnonzero((tasks["block"] == plan.comm_blocks) & ~np.isin(tasks["kind"], [int(k) for k in P.MOVER_KINDS]))
    i = int(gemm[0])
    tasks["wait_counter"][i, 1], tasks["wait_target"][i, 1] = pooled, plan.counters["target"][pooled]
    with pytest.raises(P.PlanError, match="deadlock"):
        P.with_tasks(plan, tasks).check()


def test_claimed_pairs_are_not_ordered_by_their_claim_order():
    # pairs of the pool run at once on several clusters: only counters order them. A down pair that
    # no longer waits for its row tile's gate/up pairs is refused even though it comes after them
    plan = fused_of("fwd", 2, 512, claim="all")  # a ring of every minibatch: the data-flow check is what fails
    tasks = plan.tasks.copy()
    (i,) = np.flatnonzero((tasks["block"] == plan.pool_block) & (tasks["kind"] == int(P.TaskKind.DOWN)))[:1]
    tasks["wait_counter"][i] = -1
    tasks["wait_target"][i] = 0
    with pytest.raises(P.PlanError, match="data flow"):
        P.with_tasks(plan, tasks).check()


def test_check_rejects_a_broken_pool():
    plan = fused_of("bwd", 2, 256, claim=4)
    with pytest.raises(P.PlanError, match="pool"):  # one pair more than the pool holds
        dataclasses.replace(plan, claim_pairs=5).check()
    tasks = plan.tasks.copy()
    first, second = np.flatnonzero(tasks["block"] == plan.pool_block)[:2]
    tasks["row_tile"][[first, second]] = tasks["row_tile"][[second, first]]  # pair 0's halves swapped
    with pytest.raises(P.PlanError, match="pairs: pool"):
        P.with_tasks(plan, tasks).check()
    with pytest.raises(P.PlanError, match="pool: 8 tasks"):  # a pool the plan does not declare
        dataclasses.replace(plan, claim_pairs=0).check()
    counters = plan.counters.copy()
    counters["kind"][plan.claim_counter] = int(P.CounterKind.DATA_GRAD_DONE)
    with pytest.raises(P.PlanError, match="0 CLAIMED counters"):  # a pool needs its ticket
        P.with_tasks(plan, plan.tasks, counters).check()


def test_default_claims():
    # the forward claims every tile pair, the backward the tail: TAIL_PAIRS_PER_CLUSTER per cluster
    assert {pass_: P.FusedKnobs().resolved(pass_, MOK_POLICY).claim for pass_ in P.PASSES} == {"fwd": "all",
                                                                                               "bwd": "tail"}
    for pass_ in P.PASSES:
        pairs = len(global_order(pass_, 2, 256))
        for num_sms, comm in ((8, 2), (8, 0), (30, 2)):
            clusters = (num_sms - comm) // 2
            plan = fused_of(pass_, comm, 256, num_sms=num_sms, claim=None)
            want = pairs if pass_ == "fwd" else min(pairs, P.TAIL_PAIRS_PER_CLUSTER * clusters)
            assert plan.claim_pairs == want, (pass_, num_sms, comm, plan.claim_pairs, want)
            assert fused_of(pass_, comm, 256, num_sms=num_sms, claim="tail").claim_pairs == min(
                pairs, P.TAIL_PAIRS_PER_CLUSTER * clusters)


def test_parse_claim_takes_a_count_or_a_name():
    assert P.parse_claim("264") == 264 and P.parse_claim("0") == 0
    assert [P.parse_claim(name) for name in P.CLAIMS] == ["all", "tail"]
    for bad in ("-1", "most", "", "2.5", "ALL"):
        with pytest.raises(ValueError, match="claim must be"):
            P.parse_claim(bad)


@pytest.mark.parametrize("pass_", P.PASSES)
def test_balanced_deals_the_pairs_past_the_expected_rows_round_robin(pass_):
    # a capacity 3x the expected rows (as under skewed routing): the tile pairs past the expected
    # rows are real there; balanced spreads them evenly, balanced_all piles them onto few clusters
    shape = ep_share("kimi-k2.7", 64)
    capacity = 3 * 2048 * 8 // 2048 * 2048
    make = P.fused_forward if pass_ == "fwd" else P.fused_backward
    counts = {}
    for assign in ("balanced", "balanced_all"):
        plan = make(shape, 2, P.FusedKnobs(0, 2048, assign=assign, claim=0), policy=MOK_POLICY, num_sms=132,
                    capacity_rows=capacity)
        t = plan.tasks
        even = (t["block"] % 2 == 0) & ~np.isin(t["kind"], [int(k) for k in P.MOVER_KINDS])
        past = np.array([past_expected(P.TaskKind(k), shape, 2, capacity, rt // 2)
                         for k, rt in zip(t["kind"][even].tolist(), t["row_tile"][even].tolist())])
        counts[assign] = np.bincount(t["block"][even][past] // 2, minlength=66)
        assert past.sum() > 66 * 4  # the test is about many such pairs
    assert counts["balanced"].max() - counts["balanced"].min() <= 1
    assert counts["balanced_all"].max() > 2 * counts["balanced_all"].mean()
