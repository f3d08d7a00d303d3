"""The notebooks execute headless on the CPU (so they never rot) and save their plots."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="notebook tests need nbformat/nbclient (./run test installs them)")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need nbformat/nbclient (./run test installs them)")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name,plots", [
    ("overlap_explorer", ["sim_timeline.png", "sim_heatmap.png", "sim_push_pull.png", "sim_vs_measured_timeline.png"]),
    ("measured", ["measured_gemm.png", "measured_comm.png", "measured_layer.png", "measured_timeline.png"]),
])
def test_notebook_runs(name, plots, tmp_path, monkeypatch):
    monkeypatch.setenv("MOK_PLOTS_DIR", str(tmp_path))  # fresh folder: a plot the notebook no longer saves fails
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    # NOTE: on a 2-core CI machine the slowest cell (overlap_explorer's grid of 25 simulations) takes ~25 s;
    # the timeline plots took minutes while trace.plot_timeline drew one matplotlib Rectangle per task
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    for png in plots:
        assert (tmp_path / png).stat().st_size > 1000, f"{name} did not save {png}"
