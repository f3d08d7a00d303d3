"""CPU checks of the GPU experiments under experiments/ (that their patches apply: test_house.py):
the probe's CUDA compiles against today's headers with nvcc (NVRTC on the GPU machine may refuse
what nvcc takes: tests/test_kernels_build.py's offsetof check), into kernels whose timings mean what
the probe says."""

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
def test_the_wgmma_ffma_probe_compiles_every_kernel_it_runs_as_it_means(tmp_path):
    probe = _load(ROOT / "experiments" / "wgmma_ffma_overlap" / "probe.py")
    source = tmp_path / "probe.cu"
    source.write_text(probe.SOURCE)
    proc = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90a", "-cubin", f"-maxrregcount={probe.MAX_REGISTERS}",
                           f"-I{probe.CUDA_DIR}", "-Xptxas", "-v", str(source), "-o", str(tmp_path / "probe.cubin")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = proc.stdout + proc.stderr
    # e.g. C7518: wgmma serialized by a warpgroup-divergent path (the timings would be the serialization's)
    assert "Potential Performance Loss" not in report, [l for l in report.splitlines() if "Loss" in l]
    assert "warning" not in report, [l for l in report.splitlines() if "warning" in l]
    per_kernel = dict(re.findall(r"Compiling entry function '(\w+)'(.*?)(?=Compiling entry function|\Z)", report, re.S))
    wanted = list(probe.kernels())
    missing = sorted(name for *_, name in wanted if name not in per_kernel)
    assert not missing, f"kernels main() launches that the source does not define: {missing}"
    for n_acc, kind, mode, name in wanted:
        info = per_kernel[name]
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
        assert spills == [("0", "0")], f"{name} spills (its timings would be the spills'): {spills}"
        assert re.findall(r"(\d+) bytes stack frame", info) == ["0"], f"{name} keeps an array in local memory"
        used = int(re.search(r"Used (\d+) registers", info).group(1))
        if not mode.startswith("mma"):  # it promotes: its temporary and accumulators live in registers
            assert used >= 64 + n_acc, f"{name} uses {used} registers: a constant was folded into its promotion?"
        # within what a consumer could have (launch bounds would override -maxrregcount), and the SM's
        threads = 128 * probe.warpgroups(mode)
        assert used <= probe.MAX_REGISTERS and used * threads <= 65536, f"{name} uses {used} registers"
