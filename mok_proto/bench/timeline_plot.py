"""A fused pass's in-kernel timeline written as JSON lines with a picture beside it."""

from __future__ import annotations

import json


def timeline_path(template: str, shape: str, git: str) -> str | None:
    """bench_layer.py --timeline's template with {shape} and {git} replaced ({pass_} is left for the
    pass); None for ''."""
    if not template:
        return None
    return template.replace("{shape}", shape).replace("{git}", git)


def write_timeline(records, path, title):
    """Timeline records -> JSON lines at `path` and a picture next to it (.png)."""
    from matplotlib.figure import Figure

    from mok_proto.plan import TaskKind
    from mok_proto.trace import plot_timeline

    with open(path, "w") as f:
        for r in records:  # comm_bars_from: a communication task's bar starts when its wait is met
            f.write(json.dumps({**{name: (TaskKind(int(r[name])).name.lower() if name == "kind" else r[name].item())
                                   for name in records.dtype.names}, "comm_bars_from": "ready"}) + "\n")
    fig = Figure(figsize=(14, 6))
    plot_timeline(records, ax=fig.subplots(), title=title)
    fig.tight_layout()
    fig.savefig(str(path).rsplit(".", 1)[0] + ".png", dpi=110)
    print(f"#   timeline: {path} (+ .png)", flush=True)
