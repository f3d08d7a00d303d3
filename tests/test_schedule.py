"""Tests of mok_proto.schedule against an independent slow loop of the MoK placement formula.

Shape legend: N tokens/rank, E experts, K top-k, R ranks, El = E/R.
"""

import dataclasses
import time

import numpy as np
import pytest

from mok_proto.schedule import (
    PullSchedule,
    build_all_schedules,
    build_pull_schedule,
    max_receive_slots,
)


# ----------------------------------------------------------------------------
# Independent slow oracle: the literal formula, plain Python loops.
# ----------------------------------------------------------------------------


def slow_placement(topk, num_experts, rank, align):
    """Literal MoK formula for one owner rank; returns (offsets, T, src_rank, src_slot)."""
    num_ranks, num_tokens, top_k = topk.shape
    el = num_experts // num_ranks
    slots_of = [[[] for _ in range(num_ranks)] for _ in range(el)]  # [l][r] -> slots s, increasing
    for r in range(num_ranks):
        for t in range(num_tokens):
            for j in range(top_k):
                e = int(topk[r, t, j])
                if e // el == rank:
                    slots_of[e % el][r].append(t * top_k + j)
    counts = [[len(slots_of[l][r]) for r in range(num_ranks)] for l in range(el)]  # M[l][r]
    totals = [sum(row) for row in counts]  # T[l]
    offsets = [0]
    for l in range(el):
        offsets.append(offsets[-1] + -(-totals[l] // align) * align)
    src_rank = [-1] * offsets[-1]
    src_slot = [-1] * offsets[-1]
    for l in range(el):
        m = counts[l]
        for r in range(num_ranks):
            for o, s in enumerate(slots_of[l][r]):
                slot = (
                    offsets[l]
                    + sum(min(m[rp], o) for rp in range(num_ranks))
                    + sum(1 for rp in range(r) if m[rp] > o)
                )
                assert src_rank[slot] == -1, "oracle collision"
                src_rank[slot] = r
                src_slot[slot] = s
    return offsets, totals, src_rank, src_slot


def slow_dst(topk, num_experts, align):
    """For every (rank, source slot): (owner rank, receive row) from the slow oracle."""
    num_ranks, num_tokens, top_k = topk.shape
    dst = {}
    for owner in range(num_ranks):
        _, _, src_rank, src_slot = slow_placement(topk, num_experts, owner, align)
        for slot, (r, s) in enumerate(zip(src_rank, src_slot)):
            if r >= 0:
                assert (r, s) not in dst
                dst[(r, s)] = (owner, slot)
    return dst


# ----------------------------------------------------------------------------
# Checks shared by property and edge-case tests.
# ----------------------------------------------------------------------------


def check_against_oracle(sched, topk, num_experts, align):
    offsets, totals, src_rank, src_slot = slow_placement(topk, num_experts, sched.rank, align)
    np.testing.assert_array_equal(sched.expert_offsets, offsets)
    np.testing.assert_array_equal(sched.tokens_per_expert, totals)
    np.testing.assert_array_equal(sched.src_rank, src_rank)
    np.testing.assert_array_equal(sched.src_slot, src_slot)


def check_properties(sched, topk, num_experts, align):
    """Oracle-free invariants of one owner's schedule."""
    num_ranks, num_tokens, top_k = topk.shape
    el = num_experts // num_ranks
    rank = sched.rank
    offs = sched.expert_offsets
    n = sched.num_slots

    # metadata, dtypes, shapes
    assert (sched.num_ranks, sched.num_local_experts, sched.top_k, sched.align) == (
        num_ranks, el, top_k, align)
    assert offs.dtype == np.int64 and offs.shape == (el + 1,)
    assert sched.tokens_per_expert.dtype == np.int64 and sched.tokens_per_expert.shape == (el,)
    for a in (sched.src_rank, sched.src_slot):
        assert a.dtype == np.int32 and a.shape == (n,)
    for a in (sched.dst_rank, sched.recv_row):
        assert a.dtype == np.int32 and a.shape == (num_tokens * top_k,)
    assert n == offs[-1]
    assert n <= max_receive_slots(num_tokens, top_k, num_ranks, el, align)

    # segments start at multiples of align and are T padded up to align
    assert offs[0] == 0
    assert np.all(offs % align == 0)
    sizes = np.diff(offs)
    t_real = sched.tokens_per_expert
    assert np.all(sizes >= t_real) and np.all(sizes - t_real < align)
    assert np.all(sizes == -(-t_real // align) * align)

    # padding is -1 in both arrays, real rows are >= 0 in both
    real = np.zeros(n, dtype=bool)
    for l in range(el):
        real[offs[l] : offs[l] + t_real[l]] = True
    assert np.all(sched.src_rank[~real] == -1) and np.all(sched.src_slot[~real] == -1)
    assert np.all(sched.src_rank[real] >= 0) and np.all(sched.src_slot[real] >= 0)
    assert np.all(sched.src_token[~real] == -1)
    np.testing.assert_array_equal(sched.src_token[real], sched.src_slot[real] // top_k)

    # every (r, t, j) routed to a local expert appears exactly once
    expected = {
        (r, t * top_k + j)
        for r in range(num_ranks)
        for t in range(num_tokens)
        for j in range(top_k)
        if topk[r, t, j] // el == rank
    }
    got = list(zip(sched.src_rank[real].tolist(), sched.src_slot[real].tolist()))
    assert len(got) == len(set(got))
    assert set(got) == expected

    # slots grouped by expert, in expert order, matching topk_idx
    rows = np.flatnonzero(real)
    r_idx, s_idx = sched.src_rank[real], sched.src_slot[real]
    expert = topk[r_idx, s_idx // top_k, s_idx % top_k] - rank * el  # local expert per real row
    assert np.all((expert >= 0) & (expert < el))
    assert np.all(np.diff(expert) >= 0)
    seg = np.searchsorted(offs, rows, side="right") - 1  # segment each row lies in
    np.testing.assert_array_equal(seg, expert)

    # within each (expert, source rank), src_slot increases
    for l in range(el):
        for r in range(num_ranks):
            sel = (expert == l) & (r_idx == r)
            assert np.all(np.diff(s_idx[sel]) > 0)


def check_inverse(scheds, topk):
    """dst_rank/recv_row of every rank point at the row that pulls that slot."""
    num_ranks, num_tokens, top_k = topk.shape
    for r, sched in enumerate(scheds):
        assert sched.rank == r
        for s in range(num_tokens * top_k):
            d, slot = int(sched.dst_rank[s]), int(sched.recv_row[s])
            owner = scheds[d]
            assert 0 <= slot < owner.num_slots
            assert (owner.src_rank[slot], owner.src_slot[slot]) == (r, s)
            el = owner.num_local_experts
            assert topk[r, s // top_k, s % top_k] // el == d


def random_topk(rng, num_ranks, num_tokens, top_k, num_experts, kind):
    if kind == "distinct":  # usual top-k: K distinct experts per token
        keys = rng.random((num_ranks, num_tokens, num_experts))
        return np.argsort(keys, axis=-1)[..., :top_k].astype(np.int64)
    if kind == "dup":  # independent draws, duplicates allowed
        return rng.integers(0, num_experts, (num_ranks, num_tokens, top_k))
    if kind == "skew":  # hot experts, many empty ones
        p = 1.0 / np.arange(1, num_experts + 1) ** 2
        p = rng.permutation(p / p.sum())
        return rng.choice(num_experts, size=(num_ranks, num_tokens, top_k), p=p)
    raise AssertionError(kind)


CASES = [
    # R, N, K, E, align, kind, seed
    (1, 7, 2, 4, 1, "distinct", 0),
    (1, 16, 3, 5, 4, "dup", 1),
    (2, 5, 2, 4, 1, "distinct", 2),
    (2, 13, 4, 8, 8, "skew", 3),
    (3, 9, 2, 6, 4, "dup", 4),
    (3, 11, 3, 9, 1, "skew", 5),
    (4, 6, 4, 8, 8, "distinct", 6),
    (4, 10, 2, 16, 4, "dup", 7),
    (5, 8, 3, 10, 1, "distinct", 8),
    (5, 12, 6, 20, 8, "skew", 9),
    (4, 20, 8, 32, 4, "distinct", 10),
    (2, 30, 1, 2, 8, "dup", 11),
]


@pytest.mark.parametrize("num_ranks,num_tokens,top_k,num_experts,align,kind,seed", CASES)
def test_random_properties_and_formula(num_ranks, num_tokens, top_k, num_experts, align, kind, seed):
    rng = np.random.default_rng(seed)
    topk = random_topk(rng, num_ranks, num_tokens, top_k, num_experts, kind)
    scheds = [build_pull_schedule(topk, num_experts, r, align=align) for r in range(num_ranks)]
    for sched in scheds:
        check_properties(sched, topk, num_experts, align)
        check_against_oracle(sched, topk, num_experts, align)
    check_inverse(scheds, topk)
    # total real rows over owners is all pairs
    assert sum(int(s.tokens_per_expert.sum()) for s in scheds) == topk.size


@pytest.mark.parametrize("num_ranks,num_tokens,top_k,num_experts,align,kind,seed", CASES)
def test_dst_matches_oracle(num_ranks, num_tokens, top_k, num_experts, align, kind, seed):
    rng = np.random.default_rng(seed + 100)
    topk = random_topk(rng, num_ranks, num_tokens, top_k, num_experts, kind)
    dst = slow_dst(topk, num_experts, align)
    for r, sched in enumerate(build_all_schedules(topk, num_experts, align=align)):
        want = [dst[(r, s)] for s in range(num_tokens * top_k)]
        np.testing.assert_array_equal(sched.dst_rank, [d for d, _ in want])
        np.testing.assert_array_equal(sched.recv_row, [slot for _, slot in want])


# ----------------------------------------------------------------------------
# Hand-worked examples (expected arrays written out).
# ----------------------------------------------------------------------------


def test_hand_worked_docstring_example():
    # R=2, N=3, K=2, E=4 (El=2), align=2; see the module docstring.
    topk = np.array([[[0, 1], [2, 0], [1, 3]], [[0, 2], [0, 1], [3, 0]]])
    s0, s1 = build_all_schedules(topk, 4, align=2)

    np.testing.assert_array_equal(s0.expert_offsets, [0, 6, 10])
    np.testing.assert_array_equal(s0.tokens_per_expert, [5, 3])
    np.testing.assert_array_equal(s0.src_rank, [0, 1, 0, 1, 1, -1, 0, 1, 0, -1])
    np.testing.assert_array_equal(s0.src_slot, [0, 0, 3, 2, 5, -1, 1, 3, 4, -1])
    np.testing.assert_array_equal(s0.src_token, [0, 0, 1, 1, 2, -1, 0, 1, 2, -1])
    np.testing.assert_array_equal(s0.dst_rank, [0, 0, 1, 0, 0, 1])
    np.testing.assert_array_equal(s0.recv_row, [0, 6, 0, 2, 8, 2])
    assert s0.num_slots == 10

    np.testing.assert_array_equal(s1.expert_offsets, [0, 2, 4])
    np.testing.assert_array_equal(s1.tokens_per_expert, [2, 2])
    np.testing.assert_array_equal(s1.src_rank, [0, 1, 0, 1])
    np.testing.assert_array_equal(s1.src_slot, [2, 1, 5, 4])
    np.testing.assert_array_equal(s1.dst_rank, [0, 1, 0, 0, 1, 0])
    np.testing.assert_array_equal(s1.recv_row, [1, 1, 3, 7, 3, 4])
    assert s1.num_slots == 4


def test_hand_worked_two_ranks_two_experts():
    # R=2, N=3, K=2, E=2 (El=1), align=1; token 1 of rank 0 and of rank 1 repeat an expert.
    topk = np.array([[[0, 1], [0, 0], [1, 0]], [[1, 0], [1, 1], [0, 1]]])
    # expert 0 (rank 0): M = [4, 2] -> (o, r) order (0,0)(0,1)(1,0)(1,1)(2,0)(3,0)
    # expert 1 (rank 1): M = [2, 4] -> (0,0)(0,1)(1,0)(1,1)(2,1)(3,1)
    s0 = build_pull_schedule(topk, 2, 0)
    s1 = build_pull_schedule(topk, 2, 1)

    np.testing.assert_array_equal(s0.expert_offsets, [0, 6])
    np.testing.assert_array_equal(s0.tokens_per_expert, [6])
    np.testing.assert_array_equal(s0.src_rank, [0, 1, 0, 1, 0, 0])
    np.testing.assert_array_equal(s0.src_slot, [0, 1, 2, 4, 3, 5])
    np.testing.assert_array_equal(s0.src_token, [0, 0, 1, 2, 1, 2])
    np.testing.assert_array_equal(s0.dst_rank, [0, 1, 0, 0, 1, 0])
    np.testing.assert_array_equal(s0.recv_row, [0, 0, 2, 4, 2, 5])

    np.testing.assert_array_equal(s1.expert_offsets, [0, 6])
    np.testing.assert_array_equal(s1.tokens_per_expert, [6])
    np.testing.assert_array_equal(s1.src_rank, [0, 1, 0, 1, 1, 1])
    np.testing.assert_array_equal(s1.src_slot, [1, 0, 4, 2, 3, 5])
    np.testing.assert_array_equal(s1.dst_rank, [1, 0, 1, 1, 0, 1])
    np.testing.assert_array_equal(s1.recv_row, [1, 1, 3, 4, 3, 5])


# ----------------------------------------------------------------------------
# Edge cases.
# ----------------------------------------------------------------------------


def _check_all(topk, num_experts, align):
    scheds = build_all_schedules(topk, num_experts, align=align)
    for sched in scheds:
        check_properties(sched, topk, num_experts, align)
        check_against_oracle(sched, topk, num_experts, align)
    check_inverse(scheds, topk)
    return scheds


@pytest.mark.parametrize("align", [1, 4])
def test_single_token(align):
    topk = np.array([[[3, 0]], [[1, 2]], [[3, 1]]])  # R=3, N=1, K=2, E=6
    scheds = _check_all(topk, 6, align)
    # rank 0 gets experts 0, 1, 1; rank 1 gets 3, 2, 3; rank 2 nothing
    assert [s.num_slots for s in scheds] == ([3, 3, 0] if align == 1 else [8, 8, 0])


def test_expert_with_no_token():
    rng = np.random.default_rng(21)
    topk = rng.integers(1, 8, size=(2, 9, 2))  # expert 0 (rank 0, local 0) never chosen
    topk[:, :, 0] = np.where(topk[:, :, 0] == 4, 5, topk[:, :, 0])  # expert 4 (rank 1, local 0) neither
    topk[:, :, 1] = np.where(topk[:, :, 1] == 4, 6, topk[:, :, 1])
    for align in (1, 8):
        s0, s1 = _check_all(topk, 8, align)
        assert s0.tokens_per_expert[0] == 0 and s0.expert_offsets[1] == 0
        assert s1.tokens_per_expert[0] == 0 and s1.expert_offsets[1] == 0


def test_all_tokens_on_one_expert():
    topk = np.full((3, 5, 1), 4)  # R=3, E=6 -> expert 4 = rank 2, local 0
    for align in (1, 4):
        s0, s1, s2 = _check_all(topk, 6, align)
        assert s0.num_slots == 0 and s1.num_slots == 0
        assert s2.tokens_per_expert.tolist() == [15, 0]
        # round robin over source ranks: r = 0, 1, 2, 0, 1, 2, ...
        np.testing.assert_array_equal(s2.src_rank[:15], np.tile([0, 1, 2], 5))
        np.testing.assert_array_equal(s2.src_slot[:15], np.repeat(np.arange(5), 3))
        assert s2.num_slots == (15 if align == 1 else 16)
        np.testing.assert_array_equal(s2.expert_offsets, [0, s2.num_slots, s2.num_slots])
        assert np.all(s2.dst_rank == 2) and np.all(s0.dst_rank == 2)
        np.testing.assert_array_equal(s1.recv_row, np.arange(5) * 3 + 1)


def test_top_k_equals_num_experts():
    rng = np.random.default_rng(5)
    topk = np.argsort(rng.random((2, 6, 4)), axis=-1)  # every token picks all E=4 experts
    for align in (1, 4):
        scheds = _check_all(topk, 4, align)
        for s in scheds:
            np.testing.assert_array_equal(s.tokens_per_expert, [12, 12])
            # each (expert, source rank) has M = 6: strict alternation 0, 1, 0, 1, ...
            np.testing.assert_array_equal(s.src_rank[:12], np.tile([0, 1], 6))


def test_single_rank():
    rng = np.random.default_rng(9)
    topk = rng.integers(0, 5, size=(1, 10, 3))
    for align in (1, 8):
        (sched,) = _check_all(topk, 5, align)
        assert np.all(sched.src_rank[sched.src_rank >= 0] == 0)
        assert np.all(sched.dst_rank == 0)
        if align == 1:  # R=1, no padding: rows are a stable sort of the slots by expert
            np.testing.assert_array_equal(sched.src_slot, np.argsort(topk.ravel(), kind="stable"))


def test_duplicate_expert_in_one_token():
    topk = np.array([[[1, 1], [0, 1]], [[1, 0], [1, 1]]])  # R=2, N=2, K=2, E=2
    s0, s1 = _check_all(topk, 2, 1)
    # expert 1: rank 0 slots (0, 1, 3), rank 1 slots (0, 2, 3) -> strict alternation
    np.testing.assert_array_equal(s1.src_rank, [0, 1, 0, 1, 0, 1])
    np.testing.assert_array_equal(s1.src_slot, [0, 0, 1, 2, 3, 3])
    np.testing.assert_array_equal(s0.recv_row, [0, 2, 0, 4])  # slots 0 and 1 get distinct rows
    np.testing.assert_array_equal(s1.src_token, [0, 0, 0, 1, 1, 1])


def test_many_experts_times_ranks():
    # E*R > 65536 takes the general (non-radix) grouping path
    rng = np.random.default_rng(12)
    hot = rng.choice(66000, size=5, replace=False)  # a few experts carry all tokens
    topk = hot[rng.integers(0, 5, size=(2, 40, 3))]
    _check_all(topk, 66000, 4)


def test_zero_tokens():
    topk = np.zeros((2, 0, 3), dtype=np.int32)
    for sched in build_all_schedules(topk, 4, align=4):
        assert sched.num_slots == 0
        np.testing.assert_array_equal(sched.expert_offsets, [0, 0, 0])
        assert sched.dst_rank.shape == (0,) and sched.src_rank.shape == (0,)


# ----------------------------------------------------------------------------
# Input handling.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64])
def test_any_integer_dtype(dtype):
    rng = np.random.default_rng(3)
    topk = rng.integers(0, 6, size=(3, 7, 2))
    want = build_all_schedules(topk, 6, align=4)
    got = build_all_schedules(topk.astype(dtype), 6, align=4)
    assert got == want


def test_device_array_with_get_is_converted():
    class FakeDeviceArray:  # stands in for a CuPy array: .get() returns a host copy
        def __init__(self, host):
            self._host = host

        def get(self):
            return self._host.copy()

    topk = np.random.default_rng(4).integers(0, 4, size=(2, 5, 2))
    assert build_pull_schedule(FakeDeviceArray(topk), 4, 1, align=4) == build_pull_schedule(
        topk, 4, 1, align=4)
    assert build_all_schedules(FakeDeviceArray(topk), 4) == build_all_schedules(topk, 4)


def test_nested_lists_accepted():
    topk = [[[0, 1], [1, 1]], [[1, 0], [0, 0]]]
    assert build_pull_schedule(topk, 2, 0) == build_pull_schedule(np.array(topk), 2, 0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(topk_idx_all=np.zeros((4, 2), dtype=int), num_experts=4, rank=0), "topk_idx_all.*3-D"),
        (dict(topk_idx_all=np.zeros((2, 3, 2, 1), dtype=int), num_experts=4, rank=0), "topk_idx_all.*3-D"),
        (dict(topk_idx_all=np.zeros((0, 3, 2), dtype=int), num_experts=4, rank=0), "topk_idx_all.*rank"),
        (dict(topk_idx_all=np.zeros((2, 3, 2)), num_experts=4, rank=0), "topk_idx_all.*integer"),
        (dict(topk_idx_all=np.zeros((2, 3, 2), dtype=int), num_experts=5, rank=0), "num_experts.*divisible"),
        (dict(topk_idx_all=np.zeros((2, 3, 2), dtype=int), num_experts=0, rank=0), "num_experts"),
        (dict(topk_idx_all=np.full((2, 3, 2), -1), num_experts=4, rank=0), r"topk_idx_all.*\[0, num_experts"),
        (dict(topk_idx_all=np.full((2, 3, 2), 4), num_experts=4, rank=0), r"topk_idx_all.*\[0, num_experts"),
        (dict(topk_idx_all=np.zeros((2, 3, 2), dtype=int), num_experts=4, rank=2), "rank.*range|rank must be in"),
        (dict(topk_idx_all=np.zeros((2, 3, 2), dtype=int), num_experts=4, rank=-1), "rank must be in"),
        (dict(topk_idx_all=np.zeros((2, 3, 2), dtype=int), num_experts=4, rank=0, align=0), "align must be >= 1"),
        (dict(topk_idx_all=np.zeros((2, 3, 2), dtype=int), num_experts=4, rank=0, align=-3), "align must be >= 1"),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_pull_schedule(**kwargs)


def test_bad_inputs_raise_build_all():
    with pytest.raises(ValueError, match="num_experts.*divisible"):
        build_all_schedules(np.zeros((3, 2, 1), dtype=int), 4)
    with pytest.raises(ValueError, match="align must be >= 1"):
        build_all_schedules(np.zeros((2, 2, 1), dtype=int), 4, align=0)
    with pytest.raises(ValueError, match="topk_idx_all.*3-D"):
        build_all_schedules(np.zeros(5, dtype=int), 4)


def test_max_receive_slots():
    assert max_receive_slots(2048, 8, 64, 6) == 64 * 2048 * 8
    assert max_receive_slots(2048, 8, 64, 6, align=8) == 64 * 2048 * 8 + 6 * 7
    assert max_receive_slots(0, 8, 4, 2, align=4) == 2 * 3
    # reached: all pairs on one owner, each expert one row past a multiple of align
    (sched,) = build_all_schedules(np.array([[[0, 1]]]), 2, align=6)  # R=1, N=1, K=2, E=2: T = [1, 1]
    assert sched.num_slots == max_receive_slots(1, 2, 1, 2, align=6) == 12
    with pytest.raises(ValueError, match="align must be >= 1"):
        max_receive_slots(4, 2, 2, 2, align=0)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        max_receive_slots(-1, 2, 2, 2)


# ----------------------------------------------------------------------------
# build_all_schedules and the dataclass.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("align", [1, 4, 8])
def test_build_all_equals_per_rank(align):
    rng = np.random.default_rng(17)
    topk = random_topk(rng, 4, 25, 3, 12, "skew")
    all_scheds = build_all_schedules(topk, 12, align=align)
    assert len(all_scheds) == 4
    for r, sched in enumerate(all_scheds):
        single = build_pull_schedule(topk, 12, r, align=align)
        assert isinstance(sched, PullSchedule)
        for name in ("rank", "num_ranks", "num_local_experts", "top_k", "align"):
            assert getattr(sched, name) == getattr(single, name)
        for name in ("expert_offsets", "tokens_per_expert", "src_rank", "src_slot", "dst_rank", "recv_row"):
            a, b = getattr(sched, name), getattr(single, name)
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
        assert sched == single


def test_schedule_equality_detects_differences():
    topk = np.random.default_rng(2).integers(0, 4, size=(2, 6, 2))
    s0, s1 = build_all_schedules(topk, 4, align=4)
    assert s0 == build_pull_schedule(topk, 4, 0, align=4)
    assert s0 != s1
    changed = s0.src_slot.copy()
    changed[0] += 1
    assert s0 != dataclasses.replace(s0, src_slot=changed)
    assert s0 != dataclasses.replace(s0, recv_row=s0.recv_row.astype(np.int64))  # dtype counts
    assert s0 != dataclasses.replace(s0, align=8)


def test_schedules_do_not_share_buffers():
    topk = np.random.default_rng(8).integers(0, 4, size=(2, 6, 2))
    s0, s1 = build_all_schedules(topk, 4)
    before = s1.src_rank.copy()
    s0.src_rank[:] = 7
    s0.recv_row[:] = 7
    np.testing.assert_array_equal(s1.src_rank, before)


# ----------------------------------------------------------------------------
# Timing at the Kimi shape (loose bound; the actual time is printed with -s).
# ----------------------------------------------------------------------------


def kimi_routing(seed, num_ranks=64, num_tokens=2048, top_k=8, num_experts=384):
    """K distinct uniformly random experts per token (Floyd's sampling, vectorized over tokens)."""
    rng = np.random.default_rng(seed)
    rows = num_ranks * num_tokens
    out = np.empty((rows, top_k), dtype=np.int64)
    for j in range(top_k):
        hi = num_experts - top_k + j
        cand = rng.integers(0, hi + 1, size=rows)
        taken = (out[:, :j] == cand[:, None]).any(axis=1)
        out[:, j] = np.where(taken, hi, cand)
    return out.reshape(num_ranks, num_tokens, top_k)


def test_kimi_shape_timing():
    topk = kimi_routing(0)  # [64, 2048, 8], E = 384
    assert all(len(set(row)) == 8 for row in topk[0, :64].tolist())
    build_pull_schedule(topk, 384, 0)  # warm-up
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        sched = build_pull_schedule(topk, 384, 17)
        best = min(best, time.perf_counter() - t0)
    print(f"\nbuild_pull_schedule Kimi R=64 N=2048 K=8 E=384: {best * 1e3:.1f} ms")
    assert best < 5.0, f"build_pull_schedule took {best:.2f} s at the Kimi shape (bound 5 s)"
    # sanity on the result
    assert sched.num_slots == int(sched.tokens_per_expert.sum())
    np.testing.assert_array_equal(
        sched.tokens_per_expert, np.bincount(topk.ravel(), minlength=384)[17 * 6 : 18 * 6])
