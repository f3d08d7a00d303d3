"""Timeline records: one row per task execution, from the simulator or the in-kernel trace of
the fused layer (`GpuMoELayer.forward_timeline`), and one plotting function for both; and the
notebooks' two small helpers: a heatmap of a sweep (`plot_grid`) and showing a figure inline
under its name (`show_figure`).

A record is one TRACE_DTYPE row: the CTA (one per SM) that ran the task, its role, the task's
kind, minibatch, expert (local expert of the row tile or weight tile, -1 when none), tile,
start/end in nanoseconds from the start of the pass, and whether it was claimed at run time (a
pair of the plan's pool: `block` is then the CTA that claimed it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from mok_proto.plan import TaskKind

ROLES = ("comm", "compute")  # record "role": 0 communicates, 1 computes
FIGURES_ENV = "MOK_PLOTS_DIR"  # a folder: show_figure also saves each figure there (unset: nothing is written)
FIGURE_LINE = "figure: "  # show_figure prints this and the figure's name on the line before the figure

TRACE_DTYPE = np.dtype([
    ("rank", np.int32),
    ("block", np.int32),  # CTA = SM
    ("role", np.int8),  # index into ROLES
    ("kind", np.int8),  # TaskKind
    ("minibatch", np.int32),
    ("expert", np.int32),
    ("row_tile", np.int32),
    ("col_tile", np.int32),
    ("start_ns", np.float64),
    ("end_ns", np.float64),
    ("claimed", np.bool_),  # a tile pair of the plan's pool (plan claim): its CTA was claimed at run time
])

# One colour per task kind (forward and backward kinds of the same role share a hue family).
KIND_COLORS = {
    TaskKind.DISPATCH: "#1f77b4", TaskKind.COMBINE: "#17becf", TaskKind.WEIGHTED_SUM: "#7f7f7f",
    TaskKind.SHARED_GATE_UP: "#bcbd22", TaskKind.SHARED_DOWN: "#8c564b",
    TaskKind.GATE_UP: "#2ca02c", TaskKind.DOWN: "#d62728",
    TaskKind.REV_COMBINE: "#1f77b4", TaskKind.REV_DISPATCH: "#17becf", TaskKind.SLOT_SUM: "#7f7f7f",
    TaskKind.SHARED_DOWN_BWD: "#8c564b", TaskKind.SHARED_GATE_UP_BWD: "#bcbd22",
    TaskKind.DOWN_BWD: "#d62728", TaskKind.GATE_UP_BWD: "#2ca02c",
    TaskKind.DOWN_WGRAD: "#ff7f0e", TaskKind.GATE_UP_WGRAD: "#9467bd",
    TaskKind.SHARED_DOWN_WGRAD: "#e377c2", TaskKind.SHARED_GATE_UP_WGRAD: "#c5b0d5",
    TaskKind.SCALE: "#aec7e8",
}


def empty(num: int) -> np.ndarray:
    return np.zeros(num, TRACE_DTYPE)


def lanes(records: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The drawn tasks of plot_timeline (those that take time) and each one's bar centre and height on
    its SM's lane: a lane that holds both roles (the fused kernel's spare warps move rows beside the
    GEMMs) has communication in its top third, compute below."""
    records = records[records["end_ns"] > records["start_ns"]]  # tasks past the real rows take no time
    comm = records["role"] == ROLES.index("comm")
    mixed = np.isin(records["block"], np.intersect1d(records["block"][comm], records["block"][~comm]))
    height = np.where(mixed, np.where(comm, 1 / 3, 2 / 3), 1.0)
    center = records["block"] + np.where(mixed, np.where(comm, -1 / 3, 1 / 6), 0.0)
    return records, center, height


def finish_timeline(ax, legend: list, title: str | None, time_unit: str):
    """Axes labels, title and legend of a timeline (lanes top down)."""
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({time_unit})")
    ax.set_ylabel("SM (communication SMs first)")
    if title:
        ax.set_title(title)
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def plot_timeline(records: np.ndarray, ax=None, title: str | None = None, time_unit: str = "us"):
    """One lane per SM (block), one bar per task, coloured by task kind; comm lanes on top.
    Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(12, 5))
    scale = {"ns": 1.0, "us": 1e-3, "ms": 1e-6}[time_unit]
    records, center, height = lanes(records)
    legend = []
    for kind in np.unique(records["kind"]):
        sel = records["kind"] == kind
        color = KIND_COLORS[TaskKind(int(kind))]
        # One PolyCollection per kind, not ax.barh: barh makes one Rectangle artist per task (minutes
        # for the ~10^5 tasks of the stored timelines); these are the same rectangles (barh's
        # vertices, align="center"), colour, zero edge width, draw order and sticky left edges, so
        # the figure renders the same (tests/test_trace.py).
        left = records["start_ns"][sel] * scale
        right = left + (records["end_ns"][sel] - records["start_ns"][sel]) * scale
        bottom = center[sel] - height[sel] / 2
        top = bottom + height[sel]
        bars = PolyCollection(np.stack([np.stack([left, bottom], axis=1), np.stack([right, bottom], axis=1),
                                        np.stack([right, top], axis=1), np.stack([left, top], axis=1)], axis=1),
                              facecolors=color, linewidths=0)
        bars.sticky_edges.x[:] = left.tolist()  # as barh's bars: no x margin past the first task's start
        ax.add_collection(bars)
        legend.append(Patch(color=color, label=TaskKind(int(kind)).name.lower()))
    ax.autoscale_view()  # add_collection updates the data limits; the view, too, only from matplotlib 3.11
    return finish_timeline(ax, legend, title, time_unit)


def plot_grid(ax, values, rows, cols, labels=None, cmap: str = "viridis", center: float | None = None,
              highlight=None):
    """A heatmap of values[i, j] (a sweep over rows x cols, their tick labels), each cell annotated
    with labels[i][j] (default: the value to two decimals) in black or white, whichever reads on
    the cell; NaN cells blank but for their label. center: a value the colours are symmetric about
    (e.g. 1.0 for a speedup, with a diverging cmap such as "RdYlGn"). highlight: (i, j) of one cell
    to outline. Returns the image (for a colorbar)."""
    from matplotlib.colors import Normalize
    from matplotlib.patches import Rectangle

    values = np.asarray(values, dtype=float)
    norm = None
    if center is not None and not np.isnan(values).all():
        span = max(np.nanmax(values) - center, center - np.nanmin(values), 1e-3)
        norm = Normalize(center - span, center + span)
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto")
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    for (i, j), v in np.ndenumerate(values):
        text = labels[i][j] if labels is not None else ("" if np.isnan(v) else f"{v:.2f}")
        r, g, b, _ = (1.0, 1.0, 1.0, 1.0) if np.isnan(v) else image.cmap(image.norm(v))
        ax.text(j, i, text, ha="center", va="center", fontsize=8, color="k" if 0.3 * r + 0.6 * g + 0.1 * b > 0.5 else "w")
    if highlight is not None:
        i, j = highlight
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="k", linewidth=2.5))
    return image


def show_figure(fig, name: str):
    """Show a notebook's figure inline (IPython's display), on the line after FIGURE_LINE + name
    (the notebook tests find each figure by that line), then close it; with $MOK_PLOTS_DIR set,
    also save it there as <name>.png (spaces and other characters as _)."""
    import matplotlib.pyplot as plt
    from IPython.display import display

    print(FIGURE_LINE + name, flush=True)
    folder = os.environ.get(FIGURES_ENV)
    if folder:
        fig.savefig(Path(folder) / (re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_") + ".png"), dpi=80)
    display(fig)
    plt.close(fig)
