"""Routing specs (mok_proto.routing): parsing, the routing drawn for a real layout, the timed rank's
expected rows; bench_layer's emulation of a skewed EP=64 rank (bench.emulation: W virtual ranks);
the simulator under a spec (sim --routing)."""

import dataclasses

import numpy as np
import pytest

from mok_proto import routing
from mok_proto.bench import emulation
from mok_proto.config import MoEShape, ep_share, get_shape
from mok_proto.routing import FORMS, UNIFORM, RoutingSpec
from mok_proto.schedule import build_pull_schedule

KIMI = get_shape("kimi-k2.7")  # E = 384, K = 8: El = 6 at EP = 64


@pytest.mark.parametrize("text,spec,canonical", [
    ("uniform", UNIFORM, "uniform"),
    (" uniform ", UNIFORM, "uniform"),
    ("zipf:1", RoutingSpec("zipf", 1.0), "zipf:1"),
    ("zipf:1.0", RoutingSpec("zipf", 1.0), "zipf:1"),
    ("zipf:0.5", RoutingSpec("zipf", 0.5), "zipf:0.5"),
    ("zipf:2e-3", RoutingSpec("zipf", 0.002), "zipf:0.002"),
    ("hot:.25", RoutingSpec("hot", 0.25), "hot:0.25"),
    ("hot:1", RoutingSpec("hot", 1.0), "hot:1"),
    ("hot:0.1234567891", RoutingSpec("hot", 0.1234567891), "hot:0.1234567891"),  # no digit lost
])
def test_parse_and_canonical_text(text, spec, canonical):
    got = RoutingSpec.parse(text)
    assert got == spec and str(got) == canonical and RoutingSpec.parse(str(got)) == got
    assert got.is_uniform == (canonical == "uniform")


@pytest.mark.parametrize("text", ["", "random", "Uniform", "uniform:1", "zipf", "zipf:", "zipf:0", "zipf:-1",
                                  "zipf:nan", "zipf:inf", "zipf:x", "hot", "hot:0", "hot:-0.5", "hot:1.5", "hot:nan",
                                  "hot:0.25:1", "skewed"])
def test_bad_spec_is_one_line_naming_the_forms(text):
    with pytest.raises(ValueError) as e:
        RoutingSpec.parse(text)
    assert str(e.value) == f"routing must be {FORMS}, got {text!r}"
    with pytest.raises(ValueError, match="routing must be"):
        RoutingSpec("hot", 2.0)


SPECS = [UNIFORM, RoutingSpec("zipf", 1.2), RoutingSpec("hot", 0.3)]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_routing_is_distinct_in_range_and_seeded(spec):
    draw = lambda seed: routing.topk(spec, 8, 500, 48, 5, np.random.default_rng(seed), timed_rank=2)  # noqa: E731
    topk = draw(7)
    assert topk.shape == (8, 500, 5) and topk.dtype == np.int32 and topk.min() >= 0 and topk.max() < 48
    rows = np.sort(topk.reshape(-1, 5), axis=1)
    assert not (rows[:, 1:] == rows[:, :-1]).any()  # K distinct experts per token
    assert np.array_equal(topk, draw(7)) and not np.array_equal(topk, draw(8))


def test_uniform_is_the_simulators_uniform_routing():
    from mok_proto import sim

    shape = get_shape("glm-5.2").with_tokens(256)
    topk = routing.topk(UNIFORM, 8, 256, shape.num_experts, shape.top_k, np.random.default_rng(4))
    assert np.array_equal(topk, sim.route(shape, 8, seed=4))


def test_hot_fraction_of_first_choices_and_the_rows_it_sends():
    """hot:F on a paper layout (EP=64): exactly round(F R N) first choices on the timed rank's
    experts, uniform among them; every other first choice elsewhere; the later choices as uniform;
    the timed rank's rows are expected_rows' (~ (64 F + K - 1) N)."""
    spec, timed, n, el = RoutingSpec.parse("hot:0.25"), 5, KIMI.num_tokens, KIMI.num_experts // 64
    topk = routing.topk(spec, 64, n, KIMI.num_experts, KIMI.top_k, np.random.default_rng(0), timed_rank=timed)
    owner = topk // el
    assert (owner[..., 0] == timed).sum() == round(0.25 * 64 * n)
    first = np.bincount(topk[..., 0][owner[..., 0] == timed] - timed * el, minlength=el)
    assert first.min() > 0.9 * first.mean()  # uniform over the timed rank's experts
    later = (owner[..., 1:] == timed).mean()  # K - 1 later choices: ~El / E of them on the timed rank
    assert later == pytest.approx(el / KIMI.num_experts, rel=0.05)
    rows = (owner == timed).sum()
    assert rows == pytest.approx(routing.expected_rows(spec, KIMI, 64), rel=0.01)
    assert routing.expected_rows(spec, KIMI, 64) == pytest.approx((64 * 0.25 + KIMI.top_k - 1) * n, rel=0.02)
    assert routing.expected_rows(UNIFORM, KIMI, 64) == n * KIMI.top_k


def test_zipf_skew_follows_popularity_and_the_hottest_is_the_timed_ranks():
    spec, n, e, k, el = RoutingSpec("zipf", 1.0), 2000, 64, 4, 8
    for seed in range(4):
        for timed in (0, 5):
            pop = routing.zipf_popularity(1.0, e, el, timed, np.random.default_rng(seed))
            assert np.argmax(pop) // el == timed and pop.sum() == pytest.approx(1.0)
            assert np.allclose(np.sort(pop)[::-1], (np.arange(1, e + 1) ** -1.0) / (np.arange(1, e + 1) ** -1.0).sum())
    topk = routing.topk(spec, 8, n, e, k, np.random.default_rng(1), timed_rank=3)
    pop = routing.zipf_popularity(1.0, e, el, 3, np.random.default_rng(1))  # the same first draws: the same order
    counts = np.bincount(topk.reshape(-1), minlength=e)
    assert np.argmax(counts) == np.argmax(pop) and np.argmax(counts) // el == 3
    by_rank = counts[np.argsort(-pop)]  # counts in popularity order fall, 8 experts at a time
    means = by_rank.reshape(8, 8).mean(axis=1)
    assert np.all(np.diff(means) < 0), means
    assert (topk[..., 0] == np.argmax(pop)).mean() > 0.15  # the hottest is the most frequent first choice


def test_zipf_chances_and_expected_rows():
    """Each popularity rank's chance to be among a token's K (zipf_chances, an approximation) against
    a large draw; expected_rows is R N times the mean over the timed rank's experts' random ranks."""
    e, k, el = 128, 4, 8
    for alpha in (0.5, 1.0):
        spec = RoutingSpec("zipf", alpha)
        chance = routing.zipf_chances(alpha, e, k)
        assert chance.sum() == pytest.approx(k) and np.all(np.diff(chance) < 0)
        topk = routing.topk(spec, 16, 2048, e, k, np.random.default_rng(0))
        pop = routing.zipf_popularity(alpha, e, el, 0, np.random.default_rng(0))
        seen = np.bincount(topk.reshape(-1), minlength=e)[np.argsort(-pop)] / (16 * 2048)
        assert np.abs(seen - chance).max() < 0.015 and np.abs(seen[:8] / chance[:8] - 1).max() < 0.06
        shape = MoEShape("z", hidden=8, ffn=8, num_experts=e, top_k=k, num_tokens=1024)
        others = [chance[1 + np.random.default_rng(s).permutation(e - 1)[:el - 1]].sum() for s in range(4000)]
        assert routing.expected_rows(spec, shape, 16) == pytest.approx(16 * 1024 * (chance[0] + np.mean(others)),
                                                                       rel=0.01)
        assert routing.expected_rows(spec, shape, 16) > 1.5 * 1024 * k  # more than uniform's N K


@pytest.mark.parametrize("paper,ep,text", [
    (KIMI, 64, "hot:0.25"), (get_shape("glm-5.2"), 64, "hot:0.25"), (get_shape("deepseek-v4-pro"), 64, "hot:1"),
    (MoEShape("z", hidden=8, ffn=8, num_experts=128, top_k=4, num_tokens=512), 16, "zipf:0.5"),
], ids=["kimi-hot", "glm-hot", "deepseek-hot1", "zipf"])
def test_emulated_rank_0_receives_the_real_layouts_rows(paper, ep, text):
    """The skewed emulation's W ranks: rank 0's receive rows per local expert are those of rank 0 of
    the real layout (EP=64 for the paper shapes) drawn with the same seed (and the device schedule's
    counts with them), rank 0's own tokens keep their choices of its experts, every token's choices
    stay distinct, and W is the fewest ranks that can carry the rows."""
    spec = RoutingSpec.parse(text)
    n, k, el = paper.num_tokens, paper.top_k, paper.num_experts // ep
    topk = emulation.emulated_topk(paper, spec, seed=3, ep=ep)
    layout = routing.topk(spec, ep, n, paper.num_experts, k, np.random.default_rng(3))
    num = len(topk)
    assert topk.shape == (num, n, k) and topk.dtype == np.int32 and topk.min() >= 0 and topk.max() < num * el
    rows = np.sort(topk.reshape(-1, k), axis=1)
    assert not (rows[:, 1:] == rows[:, :-1]).any()
    assert np.array_equal(np.bincount(topk[topk < el], minlength=el), np.bincount(layout[layout < el], minlength=el))
    assert np.array_equal(build_pull_schedule(topk, num * el, 0).tokens_per_expert,
                          build_pull_schedule(layout, paper.num_experts, 0).tokens_per_expert)
    mine = layout[0] < el
    assert np.array_equal(topk[0][mine], layout[0][mine]) and (topk[0][~mine] >= el).all()
    from_others = np.bincount(layout[1:][layout[1:] < el], minlength=el)
    fewer = num - 2  # one peer less cannot carry them, or cannot take a token's K choices
    assert (from_others.sum() > fewer * n * min(k, el) or from_others.max() > fewer * n or fewer * el < k)
    assert np.array_equal(topk, emulation.emulated_topk(paper, spec, seed=3, ep=ep))


def test_uniform_emulation_is_todays_inputs(monkeypatch):
    """Uniform routing keeps today's emulation bit for bit: 2 ranks, make_inputs' draws as they were
    (written out here), the same shape; a skewed spec gets W ranks and E' = W El experts."""
    shape = MoEShape("share", hidden=16, ffn=8, num_experts=12, top_k=4, num_tokens=40)
    data = emulation.make_inputs(shape, seed=5)
    rng = np.random.default_rng(5)  # today's make_inputs
    n, h, i, e, k = 40, 16, 8, 12, 4
    topk = np.argsort(rng.random((2 * n, e)), axis=1)[:, :k].astype(np.int32)
    w = rng.random((2 * n, k)).astype(np.float32)
    w /= w.sum(axis=1, keepdims=True)
    normal = lambda *s, scale=1.0: (rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
    weights = {"w_gate": normal(e, h, i, scale=h ** -0.5), "w_up": normal(e, h, i, scale=h ** -0.5),
               "w_down": normal(e, i, h, scale=i ** -0.5), "shared_gate": normal(h, i, scale=h ** -0.5),
               "shared_up": normal(h, i, scale=h ** -0.5), "shared_down": normal(i, h, scale=i ** -0.5)}
    want = dict(x=normal(2, n, h), topk_idx=topk.reshape(2, n, k), topk_w=w.reshape(2, n, k), dout=normal(2, n, h))
    for key, value in want.items():
        assert data[key].tobytes() == value.tobytes() and data[key].shape == value.shape, key
    assert list(data["weights"]) == list(weights)
    assert all(data["weights"][key].tobytes() == v.tobytes() for key, v in weights.items())
    # rank r's weights as staged_layer gives them: its slice of E' = 2 El experts, as before
    for r in range(2):
        local = emulation.local_weights(data, r)
        assert all(local[key].tobytes() == weights[key][r * 6:(r + 1) * 6].tobytes() for key in ("w_gate", "w_down"))
        assert local["shared_up"] is data["weights"]["shared_up"]
    fields = emulation.row_fields(data)
    assert fields == {"emulation": emulation.EMULATION, "routing": "uniform",
                      "received_rows": int((want["topk_idx"] < 6).sum())}
    calls = []
    monkeypatch.setattr(emulation, "make_inputs", lambda *a: calls.append(a) or "inputs")
    assert emulation.emulated_inputs("glm-5.2") == (emulation.emulated_shape("glm-5.2"), "inputs")
    assert calls == [(emulation.emulated_shape("glm-5.2"), 0)]
    spec = RoutingSpec.parse("hot:0.25")
    got_shape, _ = emulation.emulated_inputs("glm-5.2", spec, seed=2)
    skewed = emulation.emulated_topk(get_shape("glm-5.2"), spec, seed=2)
    assert got_shape == dataclasses.replace(emulation.emulated_shape("glm-5.2"), num_experts=len(skewed) * 4)
    assert calls[1][:2] == (got_shape, 2) and np.array_equal(calls[1][2], skewed) and calls[1][3] == spec


def test_skewed_inputs_give_every_peer_the_same_experts():
    shape = MoEShape("share", hidden=16, ffn=8, num_experts=4 * 3, top_k=2, num_tokens=10)  # W = 4, El = 3
    topk = routing.topk(UNIFORM, 4, 10, 12, 2, np.random.default_rng(0))  # any routing of the W ranks
    data = emulation.make_inputs(shape, 1, topk, RoutingSpec("hot", 0.5))
    assert data["x"].shape == (4, 10, 16) and data["topk_w"].shape == (4, 10, 2) and data["weights"]["w_up"].shape[0] == 6
    for r in (1, 2, 3):  # the peers hold the second block, rank 0 the first
        assert emulation.local_weights(data, r)["w_gate"].tobytes() == data["weights"]["w_gate"][3:].tobytes()
    assert emulation.local_weights(data, 0)["w_gate"].tobytes() == data["weights"]["w_gate"][:3].tobytes()
    assert emulation.row_fields(data) == {"emulation": "4 virtual ranks, rank 0 timed", "routing": "hot:0.5",
                                          "received_rows": int((topk < 3).sum())}


def test_sim_emulation_under_a_spec_is_bench_layers():
    """sim/layer.py's emulated load under a spec: rank 0 of the EP=64 layout (bench_layer's draw) for
    each of the W ranks; the plans sized for it; the predicted passes longer than uniform's."""
    from mok_proto.sim import fused, layer
    from mok_proto.sim.params import h200

    share, spec = ep_share("glm-5.2", 64), RoutingSpec.parse("hot:0.25")
    topk = emulation.emulated_topk(get_shape("glm-5.2"), spec)
    load = layer.emulated_load(share, routing=spec)
    want = np.bincount(topk[topk < 4], minlength=4)
    assert load.num_ranks == len(topk) and all(np.array_equal(t, want) for t in load.tokens_per_expert)
    wide, num, need = layer.emulation(share, spec)
    assert (num, wide.num_experts) == (len(topk), 4 * len(topk)) and need >= fused.emulated_load(
        share, routing=spec).expert_offsets[0, -1]
    assert layer.emulation(share) == (share, 2, None)
    one = layer.one_gpu(h200())
    uniform, hot = (layer.sequential_stages_ns(share, "fwd", one, routing=r) for r in (UNIFORM, spec))
    assert hot["experts"] > 2 * uniform["experts"] and hot["total"] > uniform["total"]
    assert hot["shared"] == pytest.approx(uniform["shared"])  # the shared expert sees N tokens either way


def test_sim_cli_records_the_routing_and_hot_takes_longer(capsys):
    from mok_proto.sim.__main__ import main

    times = {}
    for text in ("uniform", "hot:0.25"):
        assert main(["--shape", "glm-5.2", "--ep", "8", "--gpu", "h200", "--sequential", "--routing", text]) == 0
        out = capsys.readouterr().out.splitlines()
        assert f"routing {text}" in out[0]
        times[text] = float(next(line for line in out if line.startswith("h200: ")).split()[1])
    assert times["hot:0.25"] > 1.03 * times["uniform"]
    assert main(["--shape", "tile", "--ep", "8", "--pass", "fwd", "--link-gbps", "368", "--routing", "hot:1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "routing hot:1" in out[0] and "virtual ranks" in out[0] and "2 virtual ranks" not in out[0]
