"""One-off migration of results/ to one JSON-lines file per benchmark and machine, the timelines under
results/timelines/ with an index, pictures under results/figures/ (issue 31). Run once from the
repository root (python3 experiments/migrate_results.py); deleted in the next commit (git keeps it).

What it does:
* every benchmark row gets `gpu` (all runs below matched, figure for figure, a result text file of the
  H200: EVIDENCE) and the kernel features the simulator tells rows apart by (`features`: comm_mover,
  wait_spin, scale_traffic, from the commit lists sim/params.py held), rows of the runs sim --validate
  did not compare get `sim_left_out` (why);
* bench_layer_<commit>.jsonl and bench_layer_directions.jsonl merge into bench_layer.jsonl (sorted by
  time, exact duplicates dropped); the 2-GPU rows (bench_comm's nvshmem backend, bench_nccl_baseline)
  go to results/x2/; bench_layer_mpi's rows (R processes on ONE GPU) to results/bench_layer_mpi.jsonl;
* the timelines the simulator compares or calibrates on, the newest per benchmark, pass and shape,
  and their index; the README's pictures; everything else (text logs, runs/, the other timelines and
  pictures) is removed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from mok_proto import results as res
from mok_proto.config import ep_share
from mok_proto.sim import fused

R = Path("results")
H200 = "NVIDIA H200"

# The kernels behind each git stamp (formerly sim/params.py's lists).
BULK_MOVER = {"9ca73bf", "5022408", "62f5296", "a679599", "b905f19", "ec6738a", "d689e07"}
ACQUIRE_SPIN = BULK_MOVER | {"1685ef1"}
SCALE_PER_SLOT = ACQUIRE_SPIN | {"e48bf6e", "300fa34", "a1db532"}


def features(git: str) -> dict:
    return {"comm_mover": "bulk" if git in BULK_MOVER else "warps",
            "wait_spin": "acquire" if git in ACQUIRE_SPIN else "backoff",
            "scale_traffic": "scatter" if git in SCALE_PER_SLOT else "stream"}


# Each run's figures (medians to the printed digits) are all in one version of a result text file of
# the H200 (the commit that wrote it : the file); every run of results/ has one.
EVIDENCE = {
    ("bench_comm", "unknown", "virtual"): "0ed0e11:results/bench_comm_h200.txt",
    ("bench_comm", "9ca73bf", "virtual"): "67d60b0:results/bench_comm_h200_after_layer.txt",
    ("bench_comm", "unknown", "nvshmem"): "ab7aaa8:results/x2/bench_comm_x2.log (+ bench_nccl_x2.log: 2 ranks on NVIDIA H200)",
    ("bench_nccl_baseline", "unknown", None): "ab7aaa8:results/x2/bench_nccl_x2.log",
    ("bench_gemm", "unknown", None): "3305eba:results/bench_gemm_h200.txt",
    ("bench_gemm", "6f6f9a6", None): "c6ce379:results/bench_gemm_h200.txt",
    ("bench_gemm", "32dca6f", None): "1ad0251:results/bench_gemm_h200.txt",
    ("bench_gemm", "8a55a42", None): "ec54f30:results/bench_gemm_h200_before_e7e9bd0.txt",
    ("bench_gemm", "b273f77", None): "3373260:results/bench_gemm_h200.txt",
    ("bench_layer", "9ca73bf", None): "67d60b0:results/bench_layer_h200.txt",
    ("bench_layer", "5022408", None): "5bbf26a:results/bench_layer_h200.txt",
    ("bench_layer", "b905f19", None): "4bdc28c:results/bench_layer_h200.txt",
    ("bench_layer", "ec6738a", None): "8d56ea3:results/bench_layer_h200.txt",
    ("bench_layer", "d689e07", None): "ab9897b:results/bench_layer_h200.txt",
    ("bench_layer", "1685ef1", None): "25c9370:results/bench_layer_h200.txt",
    ("bench_layer", "300fa34", None): "803caf6:results/runs/e48bf6e/directions_qwen_h200.txt",
    ("bench_layer", "e48bf6e", None): "de44c57:results/bench_layer_h200.txt",
    ("bench_layer", "a1db532", None): "99309d2:results/bench_layer_h200.txt",
    ("bench_layer", "e7e9bd0", None): "bef1f41:results/bench_layer_h200.txt",
    ("bench_layer", "491ec86", None): "a65d823:results/runs/491ec86/bench_layer_h200.txt",
    ("bench_layer", "99c90df", None): "50ad39a:results/runs/99c90df/bench_layer_h200.txt",
    ("bench_layer", "b0e48a6", None): "50ad39a:results/runs/b0e48a6/bench_layer_h200.txt",
    ("bench_layer", "249b630", None): "c747ea8:results/bench_layer_h200.txt",
    ("power_probe", "a1db532", None): "88037d6:results/runs/a1db532/power_probe_h200.txt",
    ("power_probe", "ace2eb4", None): "88037d6:results/power_probe_h200.txt",
    ("sweep_overlap", "a679599", None): "8d56ea3:results/sweep_overlap_h200.txt",
    ("bench_layer_mpi", "2c1dcf2", None): "751f736:results/x2_one_gpu/mpi.txt",
    ("bench_layer_mpi", "781f1fa", None): "434b2d8:results/x1_one_gpu/mpi.txt",
}

# The bench_layer runs sim --validate did not compare (sim/layer.py's BENCH_FILES_LEFT_OUT, and the
# runs of bench_layer.jsonl its newest run replaced); the directions run is told apart by its policy.
REPLACED = "an older run of the running file bench_layer.jsonl: sim --validate compared its newest run (ec6738a's)"
CLAIMED = ("its fused rows claim tile pairs at run time (plan claim), which the compared fused rows (claim 0) do "
           "not; sim --validate compared the runs before the claimed pools")
LEFT_OUT = {
    "9ca73bf": REPLACED, "5022408": REPLACED, "b905f19": REPLACED,
    "d689e07": "its comm-0 fused forwards ran a slowdown never explained; its sequential rows are older than "
               "e7e9bd0's",
    "99c90df": CLAIMED, "b0e48a6": CLAIMED, "249b630": CLAIMED,
}
LAYER_FILES = ["bench_layer", "bench_layer_1685ef1", "bench_layer_d689e07", "bench_layer_e48bf6e",
               "bench_layer_directions", "bench_layer_a1db532", "bench_layer_e7e9bd0", "bench_layer_491ec86",
               "bench_layer_99c90df", "bench_layer_b0e48a6", "bench_layer_249b630"]
KERNEL_BENCHES = ("bench_layer", "sweep_overlap", "power_probe", "bench_layer_mpi")  # rows of our layer's kernels


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def stamp(bench: str, row: dict) -> dict:
    key = (bench, row["git"], row.get("backend"))
    assert key in EVIDENCE, key
    out = {"time": row["time"], "git": row["git"], "gpu": H200}
    if bench in KERNEL_BENCHES:
        out.update(features(row["git"]))
    out.update((k, v) for k, v in row.items() if k not in out)
    if bench == "bench_layer" and row["git"] in LEFT_OUT:
        out["sim_left_out"] = LEFT_OUT[row["git"]]
    return out


def merged(rows: list[dict]) -> list[dict]:
    """Sorted by time (stable), exact duplicates dropped."""
    seen, out = set(), []
    for r in sorted(rows, key=lambda r: r["time"]):
        key = json.dumps(r, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def migrate_rows() -> dict:
    counts = {}
    layer = [stamp("bench_layer", r) for name in LAYER_FILES for r in read(R / f"{name}.jsonl")]
    counts["bench_layer"] = (len(layer), len(merged(layer)))
    write(R / "bench_layer.jsonl", merged(layer))
    for name in LAYER_FILES[1:]:
        (R / f"{name}.jsonl").unlink()
    comm = [stamp("bench_comm", r) for r in read(R / "bench_comm.jsonl")]
    write(R / "bench_comm.jsonl", [r for r in comm if r["backend"] == "virtual"])
    write(R / "x2" / "bench_comm.jsonl", [r for r in comm if r["backend"] == "nvshmem"])
    write(R / "x2" / "bench_nccl_baseline.jsonl", [stamp("bench_nccl_baseline", r)
                                                    for r in read(R / "bench_nccl_baseline.jsonl")])
    (R / "bench_nccl_baseline.jsonl").unlink()
    for name in ("bench_gemm", "power_probe", "sweep_overlap"):
        write(R / f"{name}.jsonl", [stamp(name, r) for r in read(R / f"{name}.jsonl")])
    mpi = [stamp("bench_layer_mpi", r) for d in ("x2_one_gpu", "x1_one_gpu") for r in read(R / d / "bench_layer_mpi.jsonl")]
    write(R / "bench_layer_mpi.jsonl", merged(mpi))
    counts["bench_layer_mpi"] = (len(mpi), len(merged(mpi)))
    return counts


# --- timelines ------------------------------------------------------------------------------------
JUDGED_BWD = ("timeline_fused_bwd_deepseek-v4-pro_d689e07", "timeline_fused_bwd_kimi-k2.7_d689e07",
              "timeline_fused_bwd_deepseek-v4-pro_1685ef1", "timeline_fused_bwd_glm-5.2_1685ef1",
              "timeline_fused_bwd_kimi-k2.7_1685ef1", "timeline_fused_bwd_qwen3.5-397b_1685ef1",
              "timeline_fused_bwd_deepseek-v4-pro_e48bf6e", "timeline_fused_bwd_glm-5.2_e48bf6e",
              "timeline_fused_bwd_kimi-k2.7_e48bf6e", "timeline_fused_bwd_qwen3.5-397b_e48bf6e",
              "timeline_fused_bwd_deepseek-v4-pro_491ec86", "timeline_fused_bwd_glm-5.2_491ec86",
              "timeline_fused_bwd_kimi-k2.7_491ec86", "timeline_fused_bwd_qwen3.5-397b_491ec86")
CALIBRATES = {"timeline_fused_fwd_kimi-k2.7_1685ef1": "fused", "timeline_fused_fwd_kimi-k2.7_62f5296": "fused_bulk",
              "timeline_fused_fwd_kimi-k2.7_e48bf6e": "fused_spare", "timeline_fused_bwd_kimi-k2.7_491ec86": "fused_token"}
PER_BYTE_SPARE_COPY = (
    "the spare warps' copy is priced per byte (fitted on kimi's 14 KB rows), but a warp moves a row in "
    "rounds of 8 KB (kSideUnroll x 16 B x 32 lanes): glm's 12 KB rows take two rounds like kimi's, its "
    "dispatch chunks 31.8 us against kimi's 32.6 (0.98x; its bytes say 0.86x); the same event of e48bf6e's "
    "glm timeline is judged at -14.5%, a1db532's and e7e9bd0's (same forward kernel) are -16.8% and -15.8%, "
    "491ec86's (the same forward work) -19.9%: glm's chunks 27.0 us against kimi's 28.8 on average (0.94x; "
    "medians 32.1 and 33.2 us) in a run whose kimi and deepseek passes ran 4-7% slower than e7e9bd0's (kimi's "
    "sequential forward 2.864 ms against 2.765)")
EXPLAINED = {f"timeline_fused_fwd_glm-5.2_{git}": {"dispatch end": PER_BYTE_SPARE_COPY}
             for git in ("a1db532", "e7e9bd0", "491ec86")}
# the pictures the README shows besides the newest per benchmark, pass and shape
README_PNGS = {"timeline_fused_fwd_kimi-k2.7_491ec86", "timeline_fused_bwd_deepseek-v4-pro_491ec86"}
ADDED_AT = {"62f5296": "2026-12-01T08:45:48+00:00"}  # no bench rows of that run: when its timeline was committed


def run_start(bench_rows: dict, bench: str, git: str) -> str:
    times = [r["time"] for r in bench_rows[bench] if r["git"] == git]
    return min(times) if times else ADDED_AT[git]


def migrate_timelines() -> list[dict]:
    bench_rows = {"bench_layer": read(R / "bench_layer.jsonl"), "sweep_overlap": read(R / "sweep_overlap.jsonl")}
    stems = {}
    for path in sorted(R.glob("**/*timeline_fused_*.jsonl.gz")):
        stem = path.name.removesuffix(".jsonl.gz")
        bench = "sweep_overlap" if stem.startswith("sweep_") else "bench_layer"
        pass_, shape, git = stem.removeprefix("sweep_").removeprefix("timeline_fused_").split("_")
        stems[stem] = dict(path=path, bench=bench, pass_=pass_, shape=shape, git=git,
                           time=run_start(bench_rows, bench, git))
    compared = {s for s, e in stems.items() if e["pass_"] == "fwd" and e["bench"] == "bench_layer"
                and e["path"].parent == R} | set(JUDGED_BWD)
    newest = {}
    for s, e in stems.items():
        key = (e["bench"], e["pass_"], e["shape"])
        if key not in newest or e["time"] > stems[newest[key]]["time"]:
            newest[key] = s
    keep = compared | set(newest.values())
    newest_png = {}
    for s in sorted(keep, key=lambda s: stems[s]["time"]):
        if stems[s]["path"].with_name(s + ".png").exists():
            e = stems[s]
            newest_png[(e["bench"], e["pass_"], e["shape"])] = s
    pngs = set(newest_png.values()) | README_PNGS
    out = R / "timelines"
    out.mkdir(exist_ok=True)
    index = []
    for s in sorted(keep, key=lambda s: (stems[s]["bench"], stems[s]["pass_"], stems[s]["shape"], stems[s]["time"])):
        e = stems[s]
        shutil.copy(e["path"], out / e["path"].name)
        records = res.load_timeline(e["path"])
        plan = fused.timeline_plan(records, ep_share(e["shape"], fused.EP))
        row = {"file": e["path"].name, "bench": e["bench"], "pass": e["pass_"], "shape": e["shape"], "git": e["git"],
               "time": e["time"], "gpu": None if e["git"] in ADDED_AT else H200, **features(e["git"]),
               "comm_blocks": plan.comm_blocks, "minibatch_rows": plan.minibatch_rows, "claim_pairs": plan.claim_pairs}
        if s in pngs:
            shutil.copy(e["path"].with_name(s + ".png"), out / (s + ".png"))
            row["png"] = s + ".png"
        if s in compared:
            row["sim_compared"] = True
        if s in CALIBRATES:
            row["sim_calibrates"] = CALIBRATES[s]
        if s in EXPLAINED:
            row["sim_explained"] = EXPLAINED[s]
        index.append(row)
    assert set(JUDGED_BWD) | set(CALIBRATES) | set(EXPLAINED) <= keep
    write(out / "index.jsonl", index)
    return index


FIGURES = ("sim_heatmap", "sim_push_pull", "sim_timeline", "measured_comm", "measured_gemm", "measured_layer")
KEPT = {"bench_comm.jsonl", "bench_gemm.jsonl", "bench_layer.jsonl", "bench_layer_mpi.jsonl", "power_probe.jsonl",
        "sweep_overlap.jsonl", "x2", "timelines", "figures"}


def main() -> None:
    counts = migrate_rows()
    index = migrate_timelines()
    (R / "figures").mkdir(exist_ok=True)
    for name in FIGURES:
        shutil.move(R / f"{name}.png", R / "figures" / f"{name}.png")
    for path in R.iterdir():
        if path.name not in KEPT:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in (R / "x2").iterdir():
        if path.suffix != ".jsonl":
            path.unlink()
    print("rows (read, written):", counts)
    print(len(index), "timelines,", sum("png" in r for r in index), "pictures beside them")
    assert np.all([(R / "timelines" / r["file"]).exists() for r in index])


if __name__ == "__main__":
    main()
