"""A fused pass's in-kernel timeline written as JSON lines with a picture beside it, and stored
with its index row under results/timelines/ (mok_proto.results.timelines)."""

from __future__ import annotations

import json
from pathlib import Path

from mok_proto import results
from mok_proto.bench.rows import RESULTS_DIR, stamp


def timeline_path(template: str, shape: str, git: str, link=None) -> str | None:
    """bench_layer.py --timeline's template with {shape}, {git} and {link} replaced ({link}: "" without
    an emulated link, "link<G>_" with one of G GB/s; {pass_} is left for the pass); None for ''."""
    if not template:
        return None
    tag = "" if link is None else f"link{link.gbps:g}_"
    return template.replace("{shape}", shape).replace("{git}", git).replace("{link}", tag)


def write_timeline(records, path, title):
    """Timeline records -> JSON lines at `path` and a picture next to it (.png)."""
    from matplotlib.figure import Figure

    from mok_proto.plan import TaskKind
    from mok_proto.trace import plot_timeline

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:  # comm_bars_from: a communication task's bar starts when its wait is met
            f.write(json.dumps({**{name: (TaskKind(int(r[name])).name.lower() if name == "kind" else r[name].item())
                                   for name in records.dtype.names}, "comm_bars_from": "ready"}) + "\n")
    fig = Figure(figsize=(14, 6))
    plot_timeline(records, ax=fig.subplots(), title=title)
    fig.tight_layout()
    fig.savefig(str(path).rsplit(".", 1)[0] + ".png", dpi=110)
    print(f"#   timeline: {path} (+ .png)", flush=True)



def _free_stem(stem: str, results_dir) -> str:
    """`stem`, or the first `<stem>_N` (N = 2, 3, ...) whose .jsonl.gz the index does not name."""
    taken = {r["file"] for r in results.timeline_index(results_dir)}
    name, n = stem, 1
    while f"{name}.jsonl.gz" in taken:
        n += 1
        name = f"{stem}_{n}"
    return name


def free_timeline_path(path, results_dir=RESULTS_DIR) -> Path:
    """Where to write a timeline meant for `path`: itself, or in results_dir's timelines folder, where
    the index names it already (a run at the same commit, the other dispatch dtype), `<stem>_N.jsonl`:
    written there, its picture does not overwrite the stored timeline's."""
    path, folder = Path(path), results.timelines_dir(results_dir)
    if path.resolve().parent != folder.resolve():
        return path
    return path.with_name(_free_stem(results.plain_name(path).removesuffix(".jsonl"), results_dir) + ".jsonl")


def index_timeline(path, pass_: str, fields: dict, results_dir=RESULTS_DIR) -> dict | None:
    """A timeline write_timeline wrote into results_dir's timelines folder, stored there gzipped with
    its index row (results.add_timeline): the run's time, git, gpu and kernel features, then `fields`
    (bench, shape, the plan's comm_blocks, minibatch_rows, claim_pairs, ...) and its picture; the plain
    file removed. A name the index holds already gets a suffix (_2, _3, ...). A timeline written
    elsewhere stays as it is (None)."""
    path, folder = Path(path), results.timelines_dir(results_dir)
    if path.resolve().parent != folder.resolve():
        return None
    stem = results.plain_name(path).removesuffix(".jsonl")
    name = _free_stem(stem, results_dir)
    png = path.with_name(f"{stem}.png")
    if name != stem:
        path = path.rename(path.with_name(f"{name}.jsonl"))
        png = png.rename(png.with_name(f"{name}.png")) if png.exists() else png
    run = stamp()
    row = {k: fields[k] for k in ("bench", "shape") if k in fields}  # the index's order
    row.update({k: run[k] for k in ("git", "time", "gpu")}, **{k: v for k, v in run.items() if k not in row and
                                                              k not in ("time", "git", "gpu", "command")})
    row.update(fields, **({"png": png.name} if png.exists() else {}))
    row = results.add_timeline(path, results_dir, pass_, **row)
    path.unlink()
    return row
