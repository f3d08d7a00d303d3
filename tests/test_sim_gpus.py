"""The simulator's parameter sets per GPU (mok_proto/sim/gpus.py): each set is fitted on its own GPU's
rows only (an H100 run never moves the h200 fit, nor H200 rows the h100 fit), the h100 set takes the
2 x H200 link and, without H100 calibration timelines, the h200 set's fused-kernel rates (its sources
say so), a fit without its rows names them and their commands, and --validate judges each GPU's rows
with its own set, leaving out (in one line) a set without a calibration file."""

import dataclasses
import gzip
import json
import shutil

import pytest
from test_sim_link import GPU, SHARE, validate_links_only

from mok_proto import plan as P
from mok_proto import results, sim
from mok_proto.config import MOK_POLICY, ep_share
from mok_proto.link import LinkModel
from mok_proto.sim import __main__ as cli
from mok_proto.sim import calibrate, fused, gpus, layer, params, validate
from mok_proto.sim.params import PROBLEMS

H100 = "NVIDIA H100 80GB HBM3"
LATER, LATEST = "2099-01-01T00:00:00+00:00", "2099-06-01T00:00:00+00:00"
FUSED_FIELDS = [f for _, fits in fused.FUSED_CALIBRATION.values() for f in fits]


def _scaled(obj, factor):
    """A results row (or part of one) with every time (median_ms, stages_ms) times factor."""
    if isinstance(obj, dict):
        return {k: v * factor if k == "median_ms" else {s: t * factor for s, t in v.items()} if k == "stages_ms"
                else _scaled(v, factor) for k, v in obj.items()}
    return [_scaled(v, factor) for v in obj] if isinstance(obj, list) else obj


def _append(folder, name, rows):
    with open(folder / f"{name}.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _copies(rows, gpu, factor, time):
    """rows as a newer run on `gpu`, every time `factor` x."""
    return [dict(_scaled({k: v for k, v in r.items() if k != "run"}, factor), gpu=gpu, time=time, git="synthetic")
            for r in rows]


def _fitted_rows(folder, measured_on):
    """The rows of kimi-k2.7 a set's fit reads from bench_gemm, bench_comm (one GPU) and bench_layer
    (sequential stages; the fused passes a fused_gemm fit reads)."""
    return {"bench_gemm": [r for r in calibrate.newest_gemm_rows(folder, measured_on) if r["shape"] == "kimi-k2.7"],
            "bench_comm": [r for r in calibrate.newest_comm_rows(folder, measured_on)
                           if r["backend"] == "virtual" and r["shape"] == "kimi-k2.7"],
            "bench_layer": [r for r in layer.measured_rows(folder, measured_on) if r["shape"] == "kimi-k2.7"]
            + fused.fused_gemm_rows("kimi-k2.7", folder, measured_on)}


def _results_without_h100(tmp_path):
    """results/ (JSON lines of every machine folder, the timelines and their index) in tmp_path, every
    row of an H100 left out."""
    root = results.RESULTS_DIR
    for src in results.jsonl_files(root, "**/*"):
        dst = tmp_path / src.relative_to(root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".gz":
            shutil.copy(src, dst)
            continue
        rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
        dst.write_text("".join(json.dumps(r) + "\n" for r in rows if not gpus.SPECS["h100"].measured(r)))
    return tmp_path


@pytest.fixture
def h100_results(tmp_path):
    """results/ without its H100 rows, plus an H100 run of the rows the fit reads: the H200's, 1.2x
    slower; and a 2 x H100 run of the link and NCCL rows (which no set's fit takes: the 2 x H200's)."""
    folder = _results_without_h100(tmp_path / "results")
    for name, rows in _fitted_rows(folder, "h200").items():
        _append(folder, name, _copies(rows, H100, 1.2, LATER))
    x2 = results.machine_dir(2, folder)
    _append(x2, "bench_comm", _copies([r for r in calibrate.newest_comm_rows(folder) if r["backend"] == "nvshmem"],
                                      H100, 1.2, LATER))
    nccl = _copies(results.newest(results.load("bench_nccl_baseline", x2)), H100, 1.2, LATER)
    _append(x2, "bench_nccl_baseline", [dict(r, pct_of_link={k: v / 2 for k, v in r["pct_of_link"].items()})
                                        for r in nccl])
    return folder


def test_each_fit_reads_only_its_gpus_rows(h100_results):
    h200 = sim.h200()
    h100 = calibrate.fit("h100", h100_results)
    assert (h100.name, h100.num_sms) == ("h100", 132)
    # the H100's GEMMs 1.2x slower than the H200's: tile rates 1/1.2 of h200's
    for p in PROBLEMS:
        assert h100.tile_tflops_per_sm[p] == pytest.approx(h200.tile_tflops_per_sm[p] / 1.2, rel=1e-9)
    # the link: the 2 x H200 rows, as the h200 set's
    link = ("link_gbs", "link_efficiency", "launch_ns", "fence_ns", "nccl_link_efficiency")
    assert all(getattr(h100, f) == getattr(h200, f) for f in link)
    # the h200 file, refitted beside a newer H100 run of every row it reads, is what it was, byte for byte
    document = json.dumps(calibrate.calibration("h200", h100_results), indent=1) + "\n"
    assert document == params.calibration_file("h200").read_text()
    # a newer H200 run, 2x slower: the h200 fit moves, the h100 fit does not
    for name, rows in _fitted_rows(h100_results, "h200").items():
        _append(h100_results, name, _copies(rows, "NVIDIA H200", 2.0, LATEST))
    assert calibrate.fit("h100", h100_results) == h100
    moved = calibrate.fit("h200", h100_results)
    assert all(moved.tile_tflops_per_sm[p] == pytest.approx(h200.tile_tflops_per_sm[p] / 2) for p in PROBLEMS)
    assert moved.hbm_write_gbs != h200.hbm_write_gbs and moved.busy_kernel_ns != h200.busy_kernel_ns


def test_h100_takes_the_h200_fused_rates_without_its_own_timeline(h100_results):
    h200 = sim.h200()
    document = calibrate.calibration("h100", h100_results)
    h100, sources = params.params_from_json(document["params"]), document["sources"]
    assert all(getattr(h100, f) == getattr(h200, f) for f in FUSED_FIELDS)
    carried = "assumed from h200: no H100 calibration timeline"
    assert [sources[key].get("from") for key in fused.FUSED_CALIBRATION] == [carried] * len(fused.FUSED_CALIBRATION)
    assert "2 x H200" in sources["link"]["from"] and "2 x H200" in sources["nccl"]["from"]
    assert not any("from" in v for v in json.loads(params.calibration_file("h200").read_text())["sources"].values()
                   if isinstance(v, dict))
    assert carried in h100.note and "H100 results" in h100.note
    # an H100 calibration timeline of the warp movers (the H200's, dispatch tasks 1.25x longer): that key
    # is fitted on it, the others still carried; the h200 fit ignores it
    entry = fused.calibration_timeline("fused", h100_results)
    rows = [json.loads(line) for line in results.read_text(entry["path"]).splitlines()]
    for r in rows:
        if r["kind"] == "dispatch":
            r["end_ns"] = r["start_ns"] + 1.25 * (r["end_ns"] - r["start_ns"])
    name = "timeline_fused_fwd_kimi-k2.7_h100test.jsonl.gz"
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (h100_results / results.TIMELINES / name).write_bytes(gzip.compress(text.encode()))
    index = {k: v for k, v in entry.items() if k != "path"}
    _append(h100_results / results.TIMELINES, "index", [dict(index, file=name, gpu=H100)])
    document = calibrate.calibration("h100", h100_results)
    fitted, sources = params.params_from_json(document["params"]), document["sources"]
    assert fitted.comm_task_ns == pytest.approx(1.25 * h200.comm_task_ns, rel=1e-6)
    assert fitted.comm_cta_gbs == pytest.approx(h200.comm_cta_gbs / 1.25, rel=1e-6)
    assert all(getattr(fitted, f) == getattr(h200, f) for f in FUSED_FIELDS
               if f not in ("comm_task_ns", "comm_cta_gbs"))
    assert "from" not in sources["fused"] and sources["fused_token"]["from"] == carried
    assert calibrate.fit("h200", h100_results) == h200


def test_calibrate_names_the_missing_h100_rows_and_their_commands(tmp_path, capsys):
    folder = _results_without_h100(tmp_path / "results")
    out = tmp_path / "h100.json"
    assert cli.main(["calibrate", "--gpu", "h100", "--results", str(folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not out.exists()
    assert ("bench_gemm kimi-k2.7 uniform (" + ", ".join(PROBLEMS) + ") and bench_comm virtual kimi-k2.7 EP=8 "
            "(dispatch push, dispatch pull, combine push, combine pull) and bench_layer kimi-k2.7 sequential "
            "(fwd, bwd) on an H100 with `python scripts/bench_gemm.py --shapes kimi-k2.7` and "
            "`python scripts/bench_comm.py --shapes kimi-k2.7 --ep 8,64` and "
            "`python scripts/bench_layer.py --shapes kimi-k2.7`") in err[0]
    assert "x2/bench_comm" not in err[0]  # the link's rows (2 x H200) are there
    # with the H100 layer rows (the real run's), the gemm and comm rows only; without the 2 x H200 link, that too
    _append(folder, "bench_layer", [r for r in results.load("bench_layer") if gpus.SPECS["h100"].measured(r)]
            or _copies(_fitted_rows(folder, "h200")["bench_layer"], H100, 1.0, LATER))
    (folder / "x2" / "bench_comm.jsonl").unlink()
    assert cli.main(["calibrate", "--gpu", "h100", "--results", str(folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "bench_layer" not in err and "bench_comm virtual kimi-k2.7 EP=8" in err
    assert err.endswith("; x2/bench_comm nvshmem kimi-k2.7 EP=2 (dispatch push, dispatch pull) on 2 H200s "
                        f"with `{calibrate.MEASURES['x2/bench_comm']}`")


def test_compared_rows_are_one_gpus():
    for name, spec in gpus.SPECS.items():
        for bench in ("bench_layer", layer.LINK_RESULTS):
            rows = layer.compared_rows(bench=bench, measured_on=name)
            assert all(spec.match in r.get("gpu", "NVIDIA H200") for r in rows)
    h200, h100 = ({r["run"] for r in layer.compared_rows(measured_on=n)} for n in ("h200", "h100"))
    assert h200 and h100 and not h200 & h100  # results/ holds both GPUs' bench_layer runs
    assert layer.compared_rows() == layer.compared_rows(measured_on="h200")
    with pytest.raises(ValueError, match="calibrated sets: h200, h100"):
        layer.compared_rows(measured_on="a100")


H200_SET = GPU
H100_SET = dataclasses.replace(GPU, name="slower", hbm_read_gbs=0.7 * GPU.hbm_read_gbs,
                               hbm_write_gbs=0.7 * GPU.hbm_write_gbs, busy_kernel_ns=2 * GPU.busy_kernel_ns,
                               tile_tflops_per_sm={p: 0.8 * v for p, v in GPU.tile_tflops_per_sm.items()})


def _link_row(gpu_set, gpu, pass_, schedule, factor):
    """A bench_layer.py --link-gbps row of SHARE at 368 GB/s measured on `gpu`, its median `factor` x
    the prediction of gpu_set."""
    link, extra = LinkModel(368, every_row=True), {}
    if schedule == "sequential":
        ns = layer.sequential_stages_ns(SHARE, pass_, layer.one_gpu(gpu_set.recorded_at({})), link=link)["total"]
    else:
        knobs = P.FusedKnobs(0, 256)
        ns = fused.fused_pass_ns(SHARE, gpu_set.recorded_at({}), pass_, knobs, 132, link)
        extra = {**knobs.describe(pass_, MOK_POLICY), "num_sms": 132}
    return {"shape": "medium", "ep": 24, "pass": pass_, "schedule": schedule, "median_ms": factor * ns / 1e6,
            "git": "abc", "time": "2027-01-02T03:04:05+00:00", "gpu": gpu, **link.describe(), **extra}


def test_validate_judges_each_gpus_link_rows_with_its_own_set(tmp_path, monkeypatch, capsys):
    rows = [_link_row(H200_SET, "NVIDIA H200", "fwd", "sequential", 1.0),
            _link_row(H200_SET, "NVIDIA H200", "bwd", "sequential", 1.05),
            _link_row(H100_SET, H100, "fwd", "sequential", 1.0), _link_row(H100_SET, H100, "bwd", "sequential", 1.3),
            _link_row(H100_SET, H100, "fwd", "fused", 0.9)]
    _append(tmp_path, layer.LINK_RESULTS, rows)
    got = validate.link_rows(H100_SET, tmp_path, "h100")
    assert [(r.group, r.quantity) for r in got] == [
        ("h100 link", "fwd sequential medium link 368 GB/s"), ("h100 link", "bwd sequential medium link 368 GB/s"),
        ("h100 link", "fwd fused medium link 368 GB/s C=0 MB=256")]
    assert [round(r.error, 6) for r in got] == [0.0, round(1 / 1.3 - 1, 6), round(1 / 0.9 - 1, 6)]
    assert [r.ok(validate.tolerance_of(r.group)) for r in got] == [True, False, True]
    # the same rows judged with the other set's parameters: other predictions
    assert all(a.predicted != b.predicted for a, b in zip(got, validate.link_rows(H200_SET, tmp_path, "h100")))
    assert [round(r.error, 6) for r in validate.link_rows(H200_SET, tmp_path, "h200")] == [0.0, round(1 / 1.05 - 1, 6)]
    # the command: each set its own rows, labelled, the bar 15% each; exit 1 for the H100 row outside it
    validate_links_only(monkeypatch, tmp_path, {"h200": H200_SET, "h100": H100_SET})
    assert cli.main(["--validate", "--measured-only"]) == 1
    out = capsys.readouterr().out
    assert "# h200 parameters: pinned\n# h100 parameters: slower\n" in out
    assert "# h200 link (bar: within 15%)" in out and "# h100 link (bar: within 15%)" in out
    assert "# h200 link: 2 of 2 judged rows pass" in out and "# h100 link: 2 of 3 judged rows pass" in out
    assert out.rstrip().endswith("# 1 measured rows outside 15% (h200 0, h100 1)")
    assert validate.tolerance_of("h100 fused") == validate.MEASURED_TOLERANCE == 0.15
    assert validate.tolerance_of("paper gb300") == validate.PAPER_TOLERANCE


def test_a_set_without_its_calibration_file_is_left_out(tmp_path, monkeypatch, capsys):
    shutil.copy(params.calibration_file("h200"), tmp_path / "h200.json")
    monkeypatch.setattr(params, "CALIBRATION_DIR", tmp_path)
    line = "# h100: no h100.json: the H100 rows are left out (python -m mok_proto.sim calibrate --gpu h100 writes it)"
    assert validate.calibrated_sets() == (["h200"], [line])
    with pytest.raises(ValueError, match="calibrate --gpu h100"):
        sim.get_params("h100")
    assert cli.main(["--gpu", "h100", "--sequential", "--shape", "tile", "--ep", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "calibrate --gpu h100" in err[0]
    judged = []
    monkeypatch.setattr(cli, "measured_rows", lambda name, gpu: judged.append(name) or [])
    monkeypatch.setattr(cli, "link_note", lambda measured_on: None)
    assert cli.main(["--validate", "--measured-only"]) == 0
    out = capsys.readouterr().out
    assert judged == ["h200"] and out.count(line) == 1 and "(h200 0)" in out
    # with its file, the set is read and judged
    document = json.loads((tmp_path / "h200.json").read_text())
    document["params"].update(name="h100", busy_kernel_ns=4321.0)
    (tmp_path / "h100.json").write_text(json.dumps(document))
    assert validate.calibrated_sets() == (["h200", "h100"], [])
    assert sim.h100().busy_kernel_ns == 4321.0 and sim.get_params("h100").name == "h100"
    assert cli.main(["--validate", "--measured-only"]) == 0
    assert judged == ["h200", "h200", "h100"] and "(h200 0, h100 0)" in capsys.readouterr().out


def _fused_sum(gpu, rows):
    """The simulated fused passes of `rows` (bench_layer fused rows), summed, in ms."""
    return sum(fused.fused_pass_ns(ep_share(r["shape"], r["ep"]), gpu.recorded_at(r), r["pass"],
                                   P.FusedKnobs.from_row(r), r["num_sms"]) for r in rows) / 1e6


def test_h100_fits_its_fused_tiles_rate_on_one_shapes_fused_passes(h100_results):
    """Without H100 timelines, the h100 set's fused GEMM tiles' rate (fused_gemm) is fitted so that the
    newest kimi-k2.7 fused passes of an H100 take their measured time in sum; the h200 set fits none
    (1.0); --validate calls the rows of the fit calibration rows."""
    rows = fused.fused_gemm_rows("kimi-k2.7", h100_results, "h100")
    assert rows and {r["pass"] for r in rows} == {"fwd", "bwd"} and all(r["gpu"] == H100 for r in rows)
    h100 = calibrate.fit("h100", h100_results)
    assert _fused_sum(h100, rows) == pytest.approx(sum(r["median_ms"] for r in rows), rel=2e-3)
    assert sim.h200().fused_gemm == 1.0 and "fused_gemm" not in calibrate.sources("h200", h100_results)
    assert calibrate.sources("h100", h100_results)["fused_gemm"]["fits"] == ["fused_gemm"]
    # a newer H100 run whose fused passes are 1.15x slower (its sequential ones unchanged): slower tiles
    _append(h100_results, "bench_layer", _copies(rows, H100, 1.15, LATEST))
    slower = calibrate.fit("h100", h100_results)
    assert slower.fused_gemm < h100.fused_gemm / 1.1
    newest = fused.fused_gemm_rows("kimi-k2.7", h100_results, "h100")
    assert {r["time"] for r in newest} == {LATEST}
    assert _fused_sum(slower, newest) == pytest.approx(sum(r["median_ms"] for r in newest), rel=2e-3)
    # --validate: the forward rows of the fit are calibration rows; the older run's are judged
    kimi = [r for r in validate.fused_rows(slower, h100_results, "h100") if "kimi-k2.7 " in r.quantity
            and r.quantity.endswith("synthetic")]
    fitted = [r for r in kimi if r.check == "calibration"]
    assert len(fitted) == sum(r["pass"] == "fwd" for r in newest) and {r.note for r in fitted} == {"fits fused_gemm"}
    assert len(kimi) == 2 * len(fitted) and all(r.check == "judged" for r in kimi if r not in fitted)
