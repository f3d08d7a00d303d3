"""trace.plot_timeline draws what one ax.barh per task kind drew (its former code, kept here as the
reference): the same pixels and the same axis limits, for lanes of one role and mixed lanes."""

import io

import numpy as np
import pytest

from mok_proto import trace
from mok_proto.plan import TaskKind

matplotlib = pytest.importorskip("matplotlib", reason="the plot test needs matplotlib (./run test installs it)")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.image import imread  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402


def barh_timeline(records, ax, title=None, time_unit="us"):
    """plot_timeline's drawing as it was: one ax.barh call per task kind (one Rectangle per task),
    on the same lanes (trace.lanes) and with the same labels (trace.finish_timeline)."""
    scale = {"ns": 1.0, "us": 1e-3, "ms": 1e-6}[time_unit]
    records, center, height = trace.lanes(records)
    legend = []
    for kind in np.unique(records["kind"]):
        sel = records["kind"] == kind
        color = trace.KIND_COLORS[TaskKind(int(kind))]
        ax.barh(center[sel], (records["end_ns"][sel] - records["start_ns"][sel]) * scale,
                left=records["start_ns"][sel] * scale, height=height[sel], color=color, linewidth=0)
        legend.append(Patch(color=color, label=TaskKind(int(kind)).name.lower()))
    return trace.finish_timeline(ax, legend, title, time_unit)


def _records(seed, num_blocks=24, per_block=12, spare_from=None):
    """Random tasks on num_blocks CTAs: CTAs below 4 communicate; from spare_from on, compute CTAs
    also run communication tasks (mixed lanes); some tasks take no time (not drawn)."""
    rng = np.random.default_rng(seed)
    comm_kinds, gemm_kinds = [TaskKind.DISPATCH, TaskKind.COMBINE], [TaskKind.GATE_UP, TaskKind.DOWN,
                                                                     TaskKind.SHARED_GATE_UP, TaskKind.DOWN_WGRAD]
    rows = []
    for block in range(num_blocks):
        t = rng.uniform(0, 3e3)
        for _ in range(per_block):
            comm = block < 4 or (spare_from is not None and block >= spare_from and rng.random() < 0.4)
            kind = rng.choice(comm_kinds if comm else gemm_kinds)
            length = 0.0 if rng.random() < 0.1 else rng.uniform(200, 9e3)
            role = trace.ROLES.index("comm" if comm else "compute")
            rows.append((block, role, int(kind), t, t + length))
            t += length + rng.uniform(0, 500)
    rec = trace.empty(len(rows))
    for r, (block, role, kind, start, end) in zip(rec, rows):
        r["block"], r["role"], r["kind"], r["start_ns"], r["end_ns"] = block, role, kind, start, end
    return rec


def _render(plot, recs, time_unit):
    fig, axes = plt.subplots(len(recs), 1, figsize=(10, 3 * len(recs)), sharex=True, squeeze=False)
    for i, (ax, rec) in enumerate(zip(axes[:, 0], recs)):
        assert plot(rec, ax=ax, title=f"timeline {i}", time_unit=time_unit) is ax
    fig.tight_layout()
    limits = [(ax.get_xlim(), ax.get_ylim()) for ax in axes[:, 0]]
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=60)
    plt.close(fig)
    buf.seek(0)
    return imread(buf), limits


@pytest.mark.parametrize("time_unit", ["us", "ms"])
def test_plot_timeline_draws_what_barh_drew(time_unit):
    recs = [_records(1), _records(2, spare_from=4), _records(3, num_blocks=8, per_block=40)]
    got, got_limits = _render(trace.plot_timeline, recs, time_unit)
    want, want_limits = _render(barh_timeline, recs, time_unit)
    assert got_limits == want_limits
    assert got.shape == want.shape and np.array_equal(got, want)


def test_plot_timeline_makes_its_own_axes():
    ax = trace.plot_timeline(_records(4), title="own axes")
    assert ax.get_title() == "own axes" and ax.yaxis_inverted() and len(ax.get_legend().get_texts()) >= 4
    plt.close(ax.figure)


def test_every_task_kind_has_its_colour():
    # a timeline of any plan draws (a kind without a colour raised KeyError: the backward's SCALE
    # tasks, new in 8cd190a, had none), and no two kinds of one pass share a colour
    assert set(trace.KIND_COLORS) == set(TaskKind)
    from mok_proto.plan import PASS_KINDS

    for pass_, k in PASS_KINDS.items():
        kinds = [k.comm_in, k.shared_first, k.shared_second, k.first, k.second, k.comm_out, k.epilogue,
                 *k.wgrad, *k.shared_wgrad] + ([TaskKind.SCALE] if pass_ == "bwd" else [])
        colours = [trace.KIND_COLORS[kind] for kind in kinds]
        assert len(set(colours)) == len(colours), pass_
