"""The simulator with bench_layer's emulated link (mok_proto/sim/linked.py): without a link every
prediction is what it was; with one, a small plan's transfers priced by hand (one budget per rank
and direction, a pull's round trips per batch of its mover's loads, the copy as a floor); the
validation of results/bench_layer_link.jsonl; the command line's --link-gbps."""

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from mok_proto import plan as P
from mok_proto import sim
from mok_proto.config import MOK_POLICY, ep_share, get_shape
from mok_proto.link import LinkModel
from mok_proto.sim import __main__ as cli
from mok_proto.sim import fused, layer, linked, model, validate
from mok_proto.sim.params import PROBLEMS, GpuParams

ROOT = Path(__file__).resolve().parents[1]
# A parameter set of round numbers near the H200's, not the calibration: the pinned predictions
# below stay what they are when someone refits calibration/h200.json.
GPU = GpuParams(
    name="pinned", num_sms=132, tile_tflops_per_sm={p: 5.0 + 0.25 * i for i, p in enumerate(PROBLEMS)},
    hbm_read_gbs=9000.0, hbm_write_gbs=2700.0, link_gbs=370.0, link_efficiency={"push": 0.98, "pull": 0.86},
    rtt_ns=1000.0, pull_window_bytes=65536, sm_push_gbs=100.0, launch_ns=10000.0, fence_ns=7000.0,
    signal_ns_per_peer=1000.0, nccl_link_efficiency={"dispatch": 0.66, "combine": 0.58}, sustained_gemm=0.875,
    row_move_efficiency=0.92, sum_slots_efficiency=0.94, busy_kernel_ns=7600.0, comm_cta_gbs=22.0,
    comm_task_ns=3400.0, bulk_row_ns=605.0, bulk_task_ns=3660.0, spare_cta_gbs=7.0, spare_task_ns=2440.0,
    token_read_gbs=4.6, token_write_gbs=7.1)
SHARE = ep_share("medium", 24)  # a small one-rank share for the emulation (2 virtual ranks)
# ... with 10 KB rows: a standalone warp's row is 20 batches of loads, a communicating CTA's warp's 3,
# a spare warp's 2
WIDE = dataclasses.replace(SHARE, name="wide", hidden=5120)

# Without a link: the predictions of the code before the link was modelled, on GPU (bit for bit).
PINNED = {
    'pinned fwd sequential': 96433.49921970571,
    'pinned fwd fixed_split': 34817.802894076885,
    'pinned fwd fused C=0': 127834.62981588252,
    'pinned fwd fused C=8': 157410.0033526757,
    'pinned bwd sequential': 147634.72379000284,
    'pinned bwd fixed_split': 35977.69581922544,
    'pinned bwd fused C=0': 151531.56940146882,
    'pinned bwd fused C=8': 181106.94293826204,
    'gb300-nvl72 fwd sequential': 89519.15413742997,
    'gb300-nvl72 fwd fixed_split': 35080.295221171364,
    'gb300-nvl72 fwd fused C=0': 131419.55928392542,
    'gb300-nvl72 fwd fused C=8': 164366.19399097358,
    'gb300-nvl72 bwd sequential': 133866.43425092415,
    'gb300-nvl72 bwd fixed_split': 35530.45845248913,
    'gb300-nvl72 bwd fused C=0': 157160.30823121386,
    'gb300-nvl72 bwd fused C=8': 190106.94293826207,
    'emulated fwd schedule': 38000.0,
    'emulated fwd shared': 20860.883765986397,
    'emulated fwd dispatch': 8874.385829307568,
    'emulated fwd experts': 20860.883765986397,
    'emulated fwd combine': 15474.385829307568,
    'emulated fwd weighted_sum': 9261.639716312064,
    'emulated fwd total': 113332.1789069,
    'emulated bwd scale': 15357.771851851852,
    'emulated bwd shared': 43484.27066446828,
    'emulated bwd rev_combine': 24074.38582930757,
    'emulated bwd experts': 22020.776691134957,
    'emulated bwd rev_dispatch': 15474.385829307568,
    'emulated bwd wgrad': 27726.987946666675,
    'emulated bwd token_grads': 17019.41156816391,
    'emulated bwd total': 165157.9903809008,
    'emulated fwd fused C=0': 103231.92543059777,
    'emulated fwd fused C=8': 117619.45789813023,
}


def test_predictions_without_a_link_are_unchanged():
    got = {}
    medium = get_shape("medium")
    for gpu in (GPU, sim.gb300_nvl72(GPU)):
        for pass_ in P.PASSES:
            kw = dict(pass_=pass_, policy=MOK_POLICY, num_sms=gpu.num_sms)
            make = P.fused_forward if pass_ == "fwd" else P.fused_backward
            plans = {"sequential": P.sequential(medium, 4, **kw), "fixed_split": P.fixed_split(medium, 4, 8, 256, **kw)}
            for c in (0, 8):
                # (the pinned plans' segment rule: a tile pair, as when the values were pinned)
                plans[f"fused C={c}"] = make(medium, 4, P.FusedKnobs(c, 256, segment_rows=P.PAIR_ROWS),
                                             policy=MOK_POLICY, num_sms=gpu.num_sms - gpu.num_sms % 2)
            for name, p in plans.items():
                got[f"{gpu.name} {pass_} {name}"] = sim.simulate(p, gpu).time_ns
                assert sim.simulate(p, gpu, link=None).time_ns == got[f"{gpu.name} {pass_} {name}"]
    for pass_ in P.PASSES:
        for stage, ns in layer.sequential_stages_ns(SHARE, pass_, layer.one_gpu(GPU)).items():
            got[f"emulated {pass_} {stage}"] = ns
    for c in (0, 8):
        got[f"emulated fwd fused C={c}"] = fused.pass_ns(SHARE, GPU, c, 256, 132, "all")
    assert got == PINNED  # exact: a change of the link-free pricing or of the visiting order shows here


def _durations(result, kind):
    sel = result.plan.tasks["kind"] == int(kind)
    return (result.end_ns - result.start_ns)[sel, 0]


def test_sequential_transfers_priced_by_hand():
    # 4 CTAs: each transfer stage is 4 chunks that start together; the standalone kernel's warps
    # (kernels.comm.Launch's default grid) outnumber the rows, so its busiest warp moves one row
    plan = P.sequential(WIDE, 2, pass_="fwd", policy=MOK_POLICY, num_sms=4)
    gpu, load = layer.one_gpu(GPU), layer.emulated_load(WIDE)
    row = WIDE.hidden * 2
    assert linked.standalone_warps(plan.capacity_rows, gpu.num_sms) >= load.expert_offsets[0, -1]
    chunk = load.tokens_per_expert[0].sum() / 4 * row  # bytes of one chunk
    copy = gpu.row_copy_ns(4 * chunk)  # a chunk's share of the stage's copy
    base = sim.simulate(plan, gpu, load)
    dispatch, combine = P.TaskKind.DISPATCH, P.TaskKind.COMBINE
    assert _durations(base, dispatch) == pytest.approx(copy + gpu.rtt_ns)
    # 1 GB/s (1 ns a byte), no round trips: one budget per rank and direction, the chunks reserve
    # it one after the other from the stage's start; the first sees the whole link (a per-CTA
    # share would give each 4 x its bytes)
    slow = sim.simulate(plan, gpu, load, link=LinkModel(1, 0.0, every_row=True))
    want = [k * chunk for k in (1, 2, 3, 4)]
    assert sorted(_durations(slow, dispatch)) == pytest.approx(want)
    assert sorted(_durations(slow, combine)) == pytest.approx(want)  # the other clock: out of the rank
    # the pass: both stages take their bytes at the link's rate instead of their copies
    assert slow.time_ns == pytest.approx(base.time_ns - (copy + gpu.rtt_ns) - copy + 2 * 4 * chunk)
    # a fast link, 20 us round trips: the pull waits one per batch of its busiest warp's loads (a
    # 10 KB row: 20 batches of 512 bytes); the push pays the bytes, then its flag's round trip
    trips = sim.simulate(plan, gpu, load, link=LinkModel(1e6, 20.0, every_row=True))
    assert _durations(trips, dispatch) == pytest.approx(20 * 20_000)
    assert _durations(trips, combine) == pytest.approx(copy + 20_000)
    # a fast link, no round trips: the copy is the floor (a pull no longer pays GpuParams.rtt_ns:
    # the link's round trips stand for it)
    fast = sim.simulate(plan, gpu, load, link=LinkModel(1e6, 0.0, every_row=True))
    assert _durations(fast, dispatch) == pytest.approx(copy)
    assert _durations(fast, combine) == pytest.approx(_durations(base, combine))


@pytest.mark.parametrize("comm_blocks,minibatch,movers,batches", [(8, 256, linked.COMM_CTA_MOVERS, 3),
                                                                 (0, 1024, linked.SPARE_MOVERS, 2)])
def test_fused_movers_priced_by_hand(comm_blocks, minibatch, movers, batches):
    # a pull chunk: at least one round trip per batch of loads of its busiest warp (a communicating
    # CTA: 12 warps of 4 KB loads each; spare warps: 3 of 8 KB), its real rows spread over them
    plan = P.fused_forward(WIDE, 2, P.FusedKnobs(comm_blocks, minibatch), policy=MOK_POLICY, num_sms=132,
                           capacity_rows=2048)
    gpu, load = layer.one_gpu(GPU), fused.emulated_load(WIDE)
    base = sim.simulate(plan, gpu, load)
    got = sim.simulate(plan, gpu, load, link=LinkModel(1e6, 20.0, every_row=True))
    t = plan.tasks
    sel = t["kind"] == int(P.TaskKind.DISPATCH)
    real, _ = model.fused_chunk_rows(plan, load)
    rows = real[t["minibatch"][sel], t["row_tile"][sel], 0]
    warps, batch = movers
    assert -(-WIDE.hidden * 2 // batch) == batches
    fixed = gpu.fused_task_ns(comm_blocks)
    want = np.maximum(_durations(base, P.TaskKind.DISPATCH), fixed + np.ceil(rows / warps) * batches * 20_000)
    assert (rows > warps).any() and _durations(got, P.TaskKind.DISPATCH) == pytest.approx(want)
    # 1 GB/s (1 ns a byte), no round trips: one budget for every mover of the rank; the first
    # minibatch's chunks start together and reserve it one after the other, in CTA order: the first
    # sees the whole link, the k-th waits for those before it (a per-CTA share would give every
    # chunk its bytes x the movers)
    slow = sim.simulate(plan, gpu, load, link=LinkModel(1, 0.0, every_row=True))
    first = sel & (t["minibatch"] == 0)
    order = np.argsort(t["block"][first])
    assert len(order) > 2 and np.all(slow.start_ns[first, 0] == slow.start_ns[first, 0][0])
    floor = (base.end_ns - base.start_ns)[first, 0][order]
    want = np.maximum(floor, fixed + np.cumsum(real[0, t["row_tile"][first], 0][order]) * WIDE.hidden * 2)
    assert (slow.end_ns - slow.start_ns)[first, 0][order] == pytest.approx(want)
    assert want[0] < want[1] < want[-1] and want[0] > floor[0]


def test_fused_remote_flags_pay_a_round_trip():
    # the fused backward raises remote counters' flags inside its kernel: the last signaller's round
    # trip comes first, so a waiter sees the flag after it (and the pass ends after it)
    plan = P.fused_backward(WIDE, 2, P.FusedKnobs(0, 256), policy=MOK_POLICY, num_sms=132, capacity_rows=1280)
    gpu, load = layer.one_gpu(GPU), fused.emulated_load(WIDE)
    remote = np.flatnonzero(plan.counters["remote"])
    assert len(remote)
    got = sim.simulate(plan, gpu, load, link=LinkModel(1e6, 50.0, every_row=True))
    t = plan.tasks
    assert plan.token_grads  # the pass ends with its kernel
    for c in remote:
        signals = (t["signal_counter"] == c).any(axis=1)
        waiters = (t["wait_counter"] == c).any(axis=1)
        assert got.time_ns >= got.end_ns[signals, 0].max() + 50_000 - 1e-6
        if waiters.any():
            assert got.start_ns[waiters, 0].min() >= got.end_ns[signals, 0].max() + 50_000 - 1e-6
    assert all((t["wait_counter"] == c).any() for c in remote)  # (so the kernel's end is a waiter's)


def test_emulated_stages_pay_their_flags():
    # a link as fast as can be (1 fs a byte) with 50 us round trips: a stage whose kernels raise a
    # flag pays one each (the schedule's all-gather and placement; a push kernel's last block; the
    # backward's raise_flag before its pull), the stages without transfers or flags nothing
    one, link = layer.one_gpu(GPU), LinkModel(1e6, 50.0, every_row=True)
    for pass_, flags in (("fwd", {"schedule": 2, "combine": 1}), ("bwd", {"rev_dispatch": 1})):
        base = layer.sequential_stages_ns(SHARE, pass_, one)
        got = layer.sequential_stages_ns(SHARE, pass_, one, link=link)
        pulled = "dispatch" if pass_ == "fwd" else "rev_combine"  # its round trips replace its copy
        for stage in base:
            if stage not in ("total", pulled):
                assert got[stage] == pytest.approx(base[stage] + flags.get(stage, 0) * 50_000), stage
        assert got[pulled] > base[pulled] + (pass_ == "bwd") * 50_000  # (the backward's publish: a flag)
    # the fused forward: the schedule's two flags, the one after its kernel, and its pulls' round trips
    knobs = P.FusedKnobs(8, 256)
    assert fused.fused_pass_ns(SHARE, GPU, "fwd", knobs, 132, link) > fused.fused_pass_ns(SHARE, GPU, "fwd", knobs,
                                                                                          132) + 3 * 50_000


def test_the_link_is_priced_for_the_kernels_this_project_runs():
    split = P.fixed_split(get_shape("medium"), 4, 8, 256, pass_="fwd", policy=MOK_POLICY, num_sms=132)
    with pytest.raises(ValueError, match="sequential or fused"):
        sim.simulate(split, GPU, link=LinkModel(368, every_row=True))


def test_movers_match_the_kernels():
    # the geometry sim/linked.py prices with is the kernels': cuda/fused.cuh's movers, cuda/comm.cuh's
    # standalone transfers (16-byte loads, one batch of 32 of them per warp)
    src = (ROOT / "cuda" / "fused.cuh").read_text()
    consts = dict(re.findall(r"constexpr int (k(?:Comm|Side)(?:Warps|Unroll)) = ([^;]+);", src))
    assert consts == {"kCommWarps": "gemm::kThreads / 32", "kCommUnroll": "8", "kSideWarps": "3", "kSideUnroll": "16"}
    assert "linked_rows<32 * 16 * kUnroll>" in src
    # (the FP8 passes' spare warps keep kSideUnrollFp8[kPass] in flight: the simulator prices BF16 passes only)
    assert "mover_task<kPass, kCommWarps, kCommUnroll, kFp8>" in src and "kFp8 ? kSideUnrollFp8[kPass] : kSideUnroll" in src
    assert linked.COMM_CTA_MOVERS == (384 // 32, 32 * 16 * 8) and linked.SPARE_MOVERS == (3, 32 * 16 * 16)
    comm = (ROOT / "cuda" / "comm.cuh").read_text()
    batches = re.findall(r"(?:linked_rows|for_my_slots)<(32 \* \w+)>\(", comm)
    assert len(batches) == 4 and set(batches) == {"32 * kVec"} and linked.STANDALONE_BATCH == 32 * 16


# ---------------------------------------------------------------------------------------------
# bench_layer.py --link-gbps's rows against the simulator
# ---------------------------------------------------------------------------------------------
def _link_row(pass_, schedule, factor, knobs=None, **fields):
    """A row as bench_layer.py --link-gbps writes it for SHARE at 368 GB/s, its median `factor` x
    the simulator's prediction on GPU."""
    link = LinkModel(368, every_row=True)
    ran = GPU.recorded_at({})
    if schedule == "sequential":
        ns = layer.sequential_stages_ns(SHARE, pass_, layer.one_gpu(ran), link=link)["total"]
        extra = {}
    else:
        ns = fused.fused_pass_ns(SHARE, ran, pass_, knobs, 132, link)
        extra = {**knobs.describe(pass_, MOK_POLICY), "num_sms": 132}
    return {"shape": "medium", "ep": 24, "pass": pass_, "schedule": schedule, "median_ms": factor * ns / 1e6,
            "git": "abc", "time": "2027-01-02T03:04:05+00:00", "gpu": "NVIDIA H200", **link.describe(), **extra,
            **fields}


def _write(folder, rows):
    folder.mkdir(exist_ok=True)
    (folder / f"{layer.LINK_RESULTS}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_validate_judges_the_link_rows(tmp_path):
    assert layer.LINK_RESULTS == __import__("mok_proto.bench.layer_rows", fromlist=["LINK_FILE"]).LINK_FILE
    assert validate.link_rows(GPU, tmp_path) == [] and "no bench_layer_link.jsonl" in validate.link_note(tmp_path)
    fwd, bwd = P.FusedKnobs(0, 256), P.FusedKnobs(8, 256, claim=3)
    rows = [_link_row("fwd", "sequential", 1.10), _link_row("bwd", "sequential", 0.90),
            _link_row("fwd", "fused", 1.0, fwd), _link_row("bwd", "fused", 1.30, bwd),  # outside 15%
            # not compared: an older run, another GPU, another policy, a run left out
            _link_row("fwd", "sequential", 3.0, time="2026-01-01T00:00:00+00:00", git="old"),
            _link_row("fwd", "sequential", 3.0, gpu="NVIDIA H100 80GB HBM3"),
            _link_row("fwd", "sequential", 3.0, policy=dict(MOK_POLICY, combine="pull")),
            _link_row("fwd", "sequential", 3.0, sim_left_out="a test")]
    got = validate.link_rows(GPU, _write(tmp_path, rows))
    assert validate.link_note(tmp_path) is None
    assert [(r.quantity, r.check) for r in got] == [
        ("fwd sequential medium link 368 GB/s", "judged"), ("bwd sequential medium link 368 GB/s", "judged"),
        ("fwd fused medium link 368 GB/s C=0 MB=256", "judged"), ("bwd fused medium link 368 GB/s C=8 MB=256", "judged")]
    assert [r.ok(validate.MEASURED_TOLERANCE) for r in got] == [True, True, True, False]
    assert [round(r.error, 3) for r in got] == [round(1 / f - 1, 3) for f in (1.1, 0.9, 1.0, 1.3)]
    table = validate.format_table(got, validate.tolerance_of)
    assert "# h200 link: 3 of 4 judged rows pass" in table and "MISS" in table
    # none of them compared: said so
    assert "no row of bench_layer_link.jsonl" in validate.link_note(_write(tmp_path / "other", rows[5:]))


def validate_links_only(monkeypatch, folder, sets: dict) -> None:
    """Make `sim --validate` judge only the link rows of results folder `folder`, with the parameter
    sets `sets` ({calibrated set name: GpuParams}, each described by its GpuParams name)."""
    monkeypatch.setattr(cli, "calibrated_sets", lambda: (list(sets), []))
    monkeypatch.setattr(cli, "get_params", lambda name: sets[name])
    for name in ("kernel_rows", "sequential_layer_rows", "fused_rows", "fused_backward_rows"):
        monkeypatch.setattr(validate, name, lambda gpu, results_dir, measured_on: [])
    monkeypatch.setattr(cli, "measured_rows", lambda name, gpu: validate.measured_rows(name, gpu, folder))
    monkeypatch.setattr(cli, "link_note", lambda measured_on: validate.link_note(folder, measured_on))
    monkeypatch.setattr(cli.calibrate, "describe", lambda gpu: gpu.name)


def test_validate_command_fails_on_a_link_row_outside_the_bar(tmp_path, monkeypatch, capsys):
    folder = _write(tmp_path, [_link_row("fwd", "sequential", 1.05)])
    validate_links_only(monkeypatch, folder, {"h200": GPU})
    assert cli.main(["--validate", "--measured-only"]) == 0
    assert "fwd sequential medium link 368 GB/s" in capsys.readouterr().out
    _write(tmp_path, [_link_row("fwd", "sequential", 1.25)])
    assert cli.main(["--validate", "--h200-only"]) == 1  # the old name of --measured-only
    out = capsys.readouterr().out
    assert "# 1 measured rows outside 15% (h200 1)" in out and "# paper" not in out
    monkeypatch.setattr(cli, "link_note", lambda measured_on: validate.link_note(tmp_path / "none", measured_on))
    (tmp_path / f"{layer.LINK_RESULTS}.jsonl").unlink()
    assert cli.main(["--validate", "--measured-only"]) == 0
    assert "# h200 link: no bench_layer_link.jsonl" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------
def test_cli_emulates_bench_layer_at_link_speed(capsys):
    args = ["--link-gbps", "368,900", "--shape", "medium", "--ep", "24", "--minibatch", "256"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# shape medium, ep 24, gpu h200 (default), one GPU") and "link-gbps 368,900" in out[0]
    assert out[1].startswith("# fused fwd: comm_blocks 0, minibatch_tokens 256") and out[2].startswith("# fused bwd")
    table = [line.split() for line in out[4:]]
    assert [(r[0], r[2]) for r in table] == [("368", "fwd"), ("368", "bwd"), ("900", "fwd"), ("900", "bwd")]
    for gbps, _, pass_, seq, seq_link, fus, fus_link, x_seq, eff in table:
        assert float(seq_link) > float(seq) and float(fus_link) >= float(fus)  # the link adds time
        # x seq is the ratio of the times, each printed to 0.001 ms and x seq to 0.01
        num, den, half_ms = float(seq_link), float(fus_link), 0.0005
        assert (num - half_ms) / (den + half_ms) - 0.005 <= float(x_seq) <= (num + half_ms) / (den - half_ms) + 0.005
    assert float(table[0][4]) > float(table[2][4])  # the slower link, the longer sequential pass
    assert cli.main(args + ["--pass", "bwd", "--link-latency-us", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "link-latency-us 1," in out[0] and len(out) == 3 + 2 and out[-1].split()[2] == "bwd"


def test_cli_link_rate_of_a_projection(capsys):
    base = ["--sequential", "--shape", "medium", "--ep", "4", "--gpu", "h200"]
    times = {}
    for gbps in (None, "50"):
        assert cli.main(base + (["--link-gbps", gbps] if gbps else [])) == 0
        out = capsys.readouterr().out.splitlines()
        times[gbps] = float(out[2].split(":")[1].split()[0])
        assert ("link-gbps 50 (the parameter set's link_gbs)" in out[0]) == (gbps is not None)
    assert times["50"] > times[None]  # a slower link than the H200's


@pytest.mark.parametrize("args,message", [
    (["--link-gbps", "0"], "link gbps must be a finite number > 0"),
    (["--link-gbps", "fast"], "is not G[,G...]"),
    (["--link-gbps", "368", "--link-latency-us", "-1"], "latency_us"),
    (["--link-gbps", "368", "--policy", "dispatch=push"], "MoK's directions"),
    (["--link-gbps", "450,900", "--fused"], "a projection takes one link rate"),
    (["--link-gbps", "450", "--fused", "--link-latency-us", "1"], "keeps its parameter set's round trips"),
    (["--link-latency-us", "1", "--fused"], "keeps its parameter set's round trips"),
])
def test_cli_refuses_bad_link_settings(args, message, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.parametrize("link", [None, LinkModel(368, 2.0, every_row=True)])
@pytest.mark.parametrize("make,comm_blocks", [("sequential", None), ("fused_forward", 0), ("fused_backward", 0),
                                              ("fused_forward", 8), ("fused_backward", 8)])
def test_ranks_alike_take_the_general_paths_times(monkeypatch, make, comm_blocks, link):
    """simulate computes rank 0 alone where every rank runs the plan alike (the emulation); the
    general paths (every rank: a level at a time without a link, the per-step loop with one) give
    the same bits, claimed pool included (8 communicating CTAs: a chained step graph, which rank 0
    alone runs one step at a time without a link too)."""
    gpu, load = layer.one_gpu(GPU), layer.emulated_load(SHARE)
    if make == "sequential":
        plan = P.sequential(SHARE, 2, pass_="fwd", policy=MOK_POLICY, num_sms=132)
    else:
        plan = getattr(P, make)(SHARE, 2, P.FusedKnobs(comm_blocks, 256, claim="all"), policy=MOK_POLICY, num_sms=132)
    fast = sim.simulate(plan, gpu, load, link=link)
    monkeypatch.setattr(model, "_alike", lambda *args: False)
    general = sim.simulate(plan, gpu, load, link=link)
    for name in ("start_ns", "end_ns", "pass_end_ns", "block"):
        assert np.array_equal(getattr(fast, name), getattr(general, name)), name
    assert fast.time_ns == general.time_ns
