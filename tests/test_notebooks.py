"""The notebooks execute headless on the CPU (so they never rot): no error or warning output, every
expected figure shown inline as a PNG of a readable size under its name (trace.show_figure prints
it on the line before), nothing written into the checkout; and they are stored without outputs."""

import base64
import struct
import subprocess
from pathlib import Path

import pytest

from mok_proto import results, trace

nbformat = pytest.importorskip("nbformat", reason="notebook tests need nbformat/nbclient (./run test installs them)")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need nbformat/nbclient (./run test installs them)")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ("overlap_explorer", "measured")
MAX_WIDTH, MAX_HEIGHT = 2000, 1400  # pixels of one inline figure: fits a screen (not a stack of timelines)
MIN_PNG_BYTES = 10_000  # a drawn figure, not an empty one
# Run after a notebook's cell tagged "parameters": smaller simulated grids than a user's (every figure
# still drawn, from a few simulations instead of dozens).
TEST_PARAMETERS = {
    "overlap_explorer": "SWEEP_COMM_BLOCKS = (0, 16)\nSWEEP_MINIBATCH_ROWS = (2048,)\nPUSH_PULL_EPS = (8, 64)\n"
                        "MEASURED_GRID = ((0, 8), (2048,))",
}

# The figures each notebook shows, by the name it prints before each (a name may go on with ", <GPU>").
EXPECTED = {
    "overlap_explorer": ["timeline: sequential and fused", "sweep: communicating CTAs x minibatch rows",
                         "push vs pull dispatch over EP", "simulated vs measured timeline",
                         "simulated vs measured: fused forward on one H200"],
    "measured": ["GEMMs vs torch._grouped_mm", "layer vs torch and x sequential", "comm against the link and NCCL",
                 "comm on one GPU against the copy ceiling", "layer on several ranks", "power probe", "sweep_overlap"],
}


def newest_timeline_figures() -> list[str]:
    """measured.ipynb's timeline figures: one per shape, pass and precision of bench_layer's timelines in
    the index (a BF16 layer's named without its precision)."""
    return sorted({f"timeline {e['shape']} {e['pass']}" + ("" if e.get("precision", "bf16") == "bf16" else
                                                            f" {e['precision']}")
                   for e in results.timeline_index(bench="bench_layer")})


def figures(outputs: list) -> tuple[dict, list]:
    """({name: PNG bytes} of the inline figures among a notebook's outputs, [problems]): a figure is a
    stdout line trace.FIGURE_LINE + name, the last of its stream output, and the next output an
    image/png; a figure line without that image, or an image without a name line, is a problem."""
    found, problems = {}, []
    for k, out in enumerate(outputs):
        data = out.get("data", {})
        before = outputs[k - 1]["text"].rstrip().splitlines() if k and outputs[k - 1].get("name") == "stdout" else []
        if "image/png" in data and not (before and before[-1].startswith(trace.FIGURE_LINE)):
            problems.append(f"an image without a name line before it (output {k})")
        if out.output_type != "stream" or out.name != "stdout":
            continue
        lines = out.text.rstrip().splitlines()
        for j, line in enumerate(lines):
            if not line.startswith(trace.FIGURE_LINE):
                continue
            name = line[len(trace.FIGURE_LINE):]
            after = outputs[k + 1] if k + 1 < len(outputs) else {}
            if j != len(lines) - 1 or "image/png" not in after.get("data", {}):
                problems.append(f"figure {name!r} is not shown inline as a PNG")
            else:
                found[name] = base64.b64decode(after["data"]["image/png"])
    return found, problems


def coalesced(outputs: list) -> list:
    """The outputs with each run of consecutive stream outputs of one name joined into one: how a
    kernel splits its stdout into messages depends on timing (a loaded machine may send a figure's
    name line and the newline before it apart)."""
    joined = []
    for out in outputs:
        prev = joined[-1] if joined else None
        if (prev is not None and out.output_type == "stream" and prev.output_type == "stream"
                and out.name == prev.name):
            prev["text"] = prev["text"] + out["text"]
        else:
            joined.append(out)
    return joined


def git_status() -> str | None:
    """`git status --porcelain` of the checkout, untracked files included (None outside a git checkout)."""
    done = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                          capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


# One from notebooks/, one from the repository root: both places a notebook is opened from.
@pytest.mark.parametrize("name,cwd", [("overlap_explorer", "notebooks"), ("measured", ".")])
def test_notebook_runs(name, cwd, monkeypatch):
    monkeypatch.delenv(trace.FIGURES_ENV, raising=False)  # the default: no figure files
    before = git_status()
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    if name in TEST_PARAMETERS:
        (at,) = [k for k, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
        nb.cells.insert(at + 1, nbformat.v4.new_code_cell(TEST_PARAMETERS[name]))
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / cwd)}}).execute()
    outputs = coalesced([o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])])
    bad = [o.get("ename", "") + ": " + o.get("evalue", "") if o.output_type == "error" else o.text
           for o in outputs if o.output_type == "error" or o.get("name") == "stderr"]
    assert not bad, f"{name}: error or warning output:\n" + "\n".join(bad)

    found, problems = figures(outputs)
    assert not problems, f"{name}: " + "; ".join(problems)
    expected = EXPECTED[name] + (newest_timeline_figures() if name == "measured" else [])
    missing = [e for e in expected if not any(f == e or f.startswith(e + ", ") for f in found)]
    assert not missing, f"{name} no longer shows {missing} (it shows {list(found)})"
    for figure, png in found.items():
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) >= MIN_PNG_BYTES, f"{name}: {figure!r} is not a drawn PNG"
        width, height = struct.unpack(">II", png[16:24])
        assert width <= MAX_WIDTH and height <= MAX_HEIGHT, f"{name}: {figure!r} is {width} x {height} pixels"

    assert git_status() == before, f"running {name} changed the checkout (git status)"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_stored_without_outputs(name):
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    stored = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not stored, f"{name}: cells {stored} are stored with outputs (clear them before committing)"


def test_show_figure_writes_only_where_told(tmp_path, monkeypatch, capsys):
    pytest.importorskip("IPython", reason="show_figure displays through IPython (ipykernel installs it)")
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.delenv(trace.FIGURES_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    trace.show_figure(plt.figure(), "a b: c")
    assert capsys.readouterr().out.startswith(trace.FIGURE_LINE + "a b: c\n")
    assert not list(tmp_path.iterdir()) and not plt.get_fignums()  # nothing written, the figure closed
    monkeypatch.setenv(trace.FIGURES_ENV, str(tmp_path / "figures"))
    (tmp_path / "figures").mkdir()
    trace.show_figure(plt.figure(), "a b: c")
    assert [p.name for p in (tmp_path / "figures").iterdir()] == ["a_b_c.png"]


def test_plot_grid(monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots()
    values = np.array([[0.5, 1.25], [np.nan, 1.0]])
    image = trace.plot_grid(ax, values, (0, 16), (1024, 2048), cmap="RdYlGn", center=1.0, highlight=(1, 0))
    assert (image.norm.vmin, image.norm.vmax) == (0.5, 1.5)  # symmetric about the centre
    assert [t.get_text() for t in ax.texts] == ["0.50", "1.25", "", "1.00"]  # NaN: no value
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1024", "2048"]
    (outline,) = ax.patches
    assert outline.get_xy() == (-0.5, 0.5)
    plt.close(fig)
