"""Tests of mok_proto.config: shapes, presets, policies and run configuration.

Legend: N tokens/rank, H hidden, I expert FFN, E experts, K top-k, R ranks, Is shared FFN.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from mok_proto.config import (
    DIRECTIONS,
    MOK_POLICY,
    OPERATORS,
    PAPER_SHAPES,
    PRESETS,
    MoEShape,
    RunConfig,
    format_policy,
    get_shape,
    parse_policy,
)

GOOD = dict(name="g", hidden=16, ffn=8, num_experts=12, top_k=2, num_tokens=6)
DEFAULT_POLICY = {"dispatch": "pull", "combine": "push", "rev_combine": "pull", "rev_dispatch": "push"}


# ----------------------------------------------------------------------------
# MoEShape
# ----------------------------------------------------------------------------
def test_shape_good_defaults():
    s = MoEShape(**GOOD)
    assert s.num_shared == 1 and s.shared_ffn is None and s.shared_ffn_size == 8
    assert MoEShape(**GOOD, shared_ffn=5).shared_ffn_size == 5
    assert MoEShape(**GOOD, num_shared=0).num_shared == 0
    assert MoEShape(**{**GOOD, "top_k": GOOD["num_experts"]}).top_k == 12  # K == E is fine


@pytest.mark.parametrize("field", ["hidden", "ffn", "num_experts", "top_k", "num_tokens", "shared_ffn"])
@pytest.mark.parametrize("value", [0, -1, -100])
def test_shape_nonpositive_field(field, value):
    with pytest.raises(ValueError, match=field):
        MoEShape(**{**GOOD, field: value})


@pytest.mark.parametrize("field", ["hidden", "ffn", "num_experts", "top_k", "num_tokens"])
@pytest.mark.parametrize("value", [2.0, "4", None, True])
def test_shape_non_integer_field(field, value):
    with pytest.raises(ValueError, match=field):
        MoEShape(**{**GOOD, field: value})


@pytest.mark.parametrize("top_k,num_experts", [(13, 12), (2, 1), (9, 8)])
def test_shape_k_greater_than_e(top_k, num_experts):
    with pytest.raises(ValueError, match="top_k"):
        MoEShape(**{**GOOD, "top_k": top_k, "num_experts": num_experts})


@pytest.mark.parametrize("num_shared", [2, -1, 3, 10])
def test_shape_num_shared_not_0_or_1(num_shared):
    with pytest.raises(ValueError, match="num_shared"):
        MoEShape(**GOOD, num_shared=num_shared)


def test_shape_is_frozen_and_with_tokens():
    s = MoEShape(**GOOD)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.hidden = 3
    t = s.with_tokens(99)
    assert t.num_tokens == 99 and s.num_tokens == 6
    assert dataclasses.replace(t, num_tokens=6) == s
    with pytest.raises(ValueError, match="num_tokens"):
        s.with_tokens(0)


def test_shape_describe_names_fields():
    text = MoEShape(**GOOD).describe()
    for part in ("g", "N=6", "H=16", "I=8", "E=12", "K=2", "shared=1"):
        assert part in text


# ----------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------
PAPER = {
    "kimi-k2.7": (7168, 2048, 384, 8),
    "glm-5.2": (6144, 2048, 256, 8),
    "qwen3.5-397b": (4096, 1024, 512, 10),
    "deepseek-v4-pro": (7168, 3072, 384, 6),
}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_presets(name):
    h, i, e, k = PAPER[name]
    s = PRESETS[name]
    assert get_shape(name) is s
    assert s.name == name
    assert (s.hidden, s.ffn, s.num_experts, s.top_k) == (h, i, e, k)
    assert s.num_tokens == 2048
    assert s.num_shared == 1
    assert s.shared_ffn_size == i


def test_paper_shapes_list():
    assert set(PAPER_SHAPES) == set(PAPER)
    assert len(PAPER_SHAPES) == 4


@pytest.mark.parametrize("name", sorted(PAPER))
def test_forward_flops_formula(name):
    s = PRESETS[name]
    n, h, i, k = s.num_tokens, s.hidden, s.ffn, s.top_k
    assert s.forward_flops() == 6 * (n + n * k) * h * i
    assert isinstance(s.forward_flops(), int)


def test_forward_flops_small_and_no_shared():
    s = MoEShape("f", hidden=3, ffn=5, num_experts=4, top_k=2, num_tokens=7)
    assert s.forward_flops() == 6 * (7 + 7 * 2) * 3 * 5
    s0 = dataclasses.replace(s, num_shared=0)
    assert s0.forward_flops() == 6 * (7 * 2) * 3 * 5


def test_presets_all_valid_and_named():
    for key, s in PRESETS.items():
        assert isinstance(s, MoEShape)
        assert s.name == key
        assert 1 <= s.top_k <= s.num_experts


@pytest.mark.parametrize("name", ["", "kimi", "KIMI-K2.7", "gpt", "tiny "])
def test_get_shape_unknown(name):
    with pytest.raises(ValueError, match="unknown preset"):
        get_shape(name)


# ----------------------------------------------------------------------------
# parse_policy / format_policy
# ----------------------------------------------------------------------------
def test_policy_defaults():
    assert MOK_POLICY == DEFAULT_POLICY
    assert parse_policy(None) == DEFAULT_POLICY
    assert parse_policy("") == DEFAULT_POLICY
    assert parse_policy(" , ,") == DEFAULT_POLICY
    assert set(OPERATORS) == set(DEFAULT_POLICY) and set(DIRECTIONS) == {"push", "pull"}


def test_parse_policy_returns_a_fresh_dict():
    p = parse_policy(None)
    p["dispatch"] = "push"
    assert MOK_POLICY["dispatch"] == "pull"
    assert parse_policy("")["dispatch"] == "pull"


@pytest.mark.parametrize("text,changes", [
    ("dispatch=push", {"dispatch": "push"}),
    ("combine=pull", {"combine": "pull"}),
    ("rev_combine=push,rev_dispatch=pull", {"rev_combine": "push", "rev_dispatch": "pull"}),
    (" dispatch = push ,  combine=pull ", {"dispatch": "push", "combine": "pull"}),
    ("dispatch=push,", {"dispatch": "push"}),
    ("dispatch=pull", {}),
    ("dispatch=push,dispatch=pull", {}),  # last one wins
    ("\tcombine =\tpull\n", {"combine": "pull"}),
])
def test_parse_policy_subsets(text, changes):
    assert parse_policy(text) == {**DEFAULT_POLICY, **changes}


@pytest.mark.parametrize("text,word", [
    ("dispach=push", "unknown operator"),
    ("Dispatch=push", "unknown operator"),
    ("=push", "unknown operator"),
    ("dispatch=pus", "push or pull"),
    ("dispatch=PUSH", "push or pull"),
    ("dispatch=", "push or pull"),
    ("dispatch", "operator=direction"),
    ("dispatch:push", "operator=direction"),
    ("combine=pull,rev_dispatch", "operator=direction"),
])
def test_parse_policy_errors(text, word):
    with pytest.raises(ValueError, match=word):
        parse_policy(text)


def test_parse_policy_error_names_the_bad_part():
    with pytest.raises(ValueError, match="dispach"):
        parse_policy("dispach=push")
    with pytest.raises(ValueError, match="sideways"):
        parse_policy("combine=sideways")
    with pytest.raises(ValueError, match="combine"):
        parse_policy("combine=sideways")


@pytest.mark.parametrize("dirs", list(itertools.product(DIRECTIONS, repeat=4)))
def test_format_policy_round_trip(dirs):
    policy = dict(zip(OPERATORS, dirs))
    text = format_policy(policy)
    assert parse_policy(text) == policy
    assert format_policy(parse_policy(text)) == text
    assert text.count(",") == 3
    assert text.split(",")[0].startswith("dispatch=")


def test_format_policy_default_text():
    assert format_policy(DEFAULT_POLICY) == "dispatch=pull,combine=push,rev_combine=pull,rev_dispatch=push"


# ----------------------------------------------------------------------------
# RunConfig
# ----------------------------------------------------------------------------
SHAPE = MoEShape(**GOOD)  # E = 12


def test_runconfig_defaults():
    c = RunConfig(SHAPE)
    assert c.num_ranks == 1 and c.policy == DEFAULT_POLICY and c.minibatch == 0
    assert c.dtype == "float32" and c.timeout_s > 0
    assert c.num_local_experts == 12
    # default policies are independent objects
    assert RunConfig(SHAPE).policy is not c.policy


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 6, 12])
def test_runconfig_divisible_ranks(ranks):
    assert RunConfig(SHAPE, num_ranks=ranks).num_local_experts == 12 // ranks


@pytest.mark.parametrize("ranks", [5, 7, 8, 24])
def test_runconfig_e_not_divisible(ranks):
    with pytest.raises(ValueError, match="num_ranks"):
        RunConfig(SHAPE, num_ranks=ranks)


@pytest.mark.parametrize("ranks", [0, -2, 1.0])
def test_runconfig_bad_num_ranks(ranks):
    with pytest.raises(ValueError, match="num_ranks"):
        RunConfig(SHAPE, num_ranks=ranks)


@pytest.mark.parametrize("policy", [
    {},
    {"dispatch": "pull", "combine": "push", "rev_combine": "pull"},  # missing one
    {**DEFAULT_POLICY, "extra": "push"},  # unknown operator
    {**DEFAULT_POLICY, "combine": "sideways"},  # bad direction
    {**DEFAULT_POLICY, "rev_dispatch": "PULL"},
    {**DEFAULT_POLICY, "dispatch": None},
])
def test_runconfig_bad_policy(policy):
    with pytest.raises(ValueError, match="policy"):
        RunConfig(SHAPE, policy=policy)


def test_runconfig_good_policies():
    for dirs in itertools.product(DIRECTIONS, repeat=4):
        policy = dict(zip(OPERATORS, dirs))
        assert RunConfig(SHAPE, policy=policy).policy == policy


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "fp32", "", None, "FLOAT32"])
def test_runconfig_bad_dtype(dtype):
    with pytest.raises(ValueError, match="dtype"):
        RunConfig(SHAPE, dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_runconfig_good_dtype(dtype):
    assert RunConfig(SHAPE, dtype=dtype).dtype == dtype


@pytest.mark.parametrize("minibatch", [-1, -64, 1.5, "8", None])
def test_runconfig_bad_minibatch(minibatch):
    with pytest.raises(ValueError, match="minibatch"):
        RunConfig(SHAPE, minibatch=minibatch)


@pytest.mark.parametrize("minibatch", [0, 1, 64])
def test_runconfig_good_minibatch(minibatch):
    assert RunConfig(SHAPE, minibatch=minibatch).minibatch == minibatch


@pytest.mark.parametrize("timeout", [0, 0.0, -1, -1e-9, float("nan")])
def test_runconfig_bad_timeout(timeout):
    with pytest.raises(ValueError, match="timeout_s"):
        RunConfig(SHAPE, timeout_s=timeout)


def test_runconfig_good_timeout_and_frozen():
    c = RunConfig(SHAPE, timeout_s=0.5, seed=7)
    assert c.timeout_s == 0.5 and c.seed == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_ranks = 2


def test_runconfig_paper_presets_on_8_ranks():
    for name in PAPER_SHAPES:
        c = RunConfig(get_shape(name), num_ranks=8, policy=parse_policy("dispatch=push"))
        assert c.num_local_experts * 8 == c.shape.num_experts
        assert c.policy["dispatch"] == "push" and c.policy["combine"] == "push"


def test_bool_is_not_an_integer_field():
    with pytest.raises(ValueError, match="num_shared"):
        MoEShape("b", hidden=4, ffn=4, num_experts=4, top_k=2, num_tokens=2, num_shared=True)
    shape = MoEShape("b", hidden=4, ffn=4, num_experts=4, top_k=2, num_tokens=2)
    with pytest.raises(ValueError, match="minibatch"):
        RunConfig(shape, minibatch=True)


def test_timeout_must_be_finite():
    shape = MoEShape("t", hidden=4, ffn=4, num_experts=4, top_k=2, num_tokens=2)
    with pytest.raises(ValueError, match="timeout_s"):
        RunConfig(shape, timeout_s=float("inf"))
    with pytest.raises(ValueError, match="timeout_s"):
        RunConfig(shape, timeout_s=float("nan"))


def test_forward_flops_counts_the_shared_ffn_size():
    shape = MoEShape("t", hidden=8, ffn=4, num_experts=4, top_k=2, num_tokens=3, shared_ffn=6)
    assert shape.forward_flops() == 6 * 8 * (3 * 2 * 4 + 3 * 6)
