"""CPU checks of the GPU experiments under experiments/ (their patches: test_house.py): each one's
CUDA still compiles against today's headers, as the run on a GPU would compile it."""

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NVCC = shutil.which("nvcc")


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit needed to compile kernels)")
def test_the_wgmma_ffma_probe_compiles_every_kernel_it_runs_without_spills(tmp_path):
    probe = _load(ROOT / "experiments" / "wgmma_ffma_overlap" / "probe.py")
    source = tmp_path / "probe.cu"
    source.write_text(probe.SOURCE)
    cubin = tmp_path / "probe.cubin"
    proc = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90a", "-cubin", f"-maxrregcount={probe.MAX_REGISTERS}",
                           f"-I{probe.CUDA_DIR}", "-Xptxas", "-v", str(source), "-o", str(cubin)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = proc.stdout + proc.stderr
    # e.g. C7518: wgmma serialized by a warpgroup-divergent path (the timings would be the serialization's)
    assert "Potential Performance Loss" not in report, [l for l in report.splitlines() if "Loss" in l]
    assert "warning" not in report, [l for l in report.splitlines() if "warning" in l]
    compiled = set(re.findall(r"Compiling entry function '(\w+)'", report))
    wanted = {name for *_, name in probe.kernels()}
    assert wanted <= compiled, f"kernels main() launches that the source does not define: {sorted(wanted - compiled)}"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(s == ("0", "0") for s in spills), f"the probe spills (its timings would be the spills'): {spills}"
    used = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    assert used and max(used) <= probe.MAX_REGISTERS, used
