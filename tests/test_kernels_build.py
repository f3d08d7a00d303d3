"""CPU checks of the kernel layer: every registered kernel compiles with the local nvcc for each
architecture its module is written for (the ABI itself: tests/test_abi.py)."""

import shutil
import subprocess

import pytest

from mok_proto.kernels import build, comm, gemm  # noqa: F401 - registers the modules

NVCC = shutil.which("nvcc")


def _modules():
    return sorted(build.MODULES)


def _targets():
    return [(header, arch) for header in _modules() for arch in build.MODULES[header].archs]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit needed to compile kernels)")
@pytest.mark.parametrize("header,arch", _targets())
def test_every_kernel_compiles_with_nvcc(tmp_path, header, arch):
    src = tmp_path / "instantiate.cu"
    src.write_text(build.MODULES[header].instantiation_source())
    virtual = arch.replace("sm_", "compute_")  # sm_90a needs compute_90a PTX (wgmma, setmaxnreg)
    proc = subprocess.run([NVCC, *build.CXX_OPTIONS, "-gencode", f"arch={virtual},code={arch}", f"-I{build.CUDA_DIR}",
                           "-c", str(src), "-o", str(tmp_path / "out.o"), "-Xptxas", "-v"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "out.o").stat().st_size > 0
    assert "Used" in proc.stderr  # ptxas reported registers for the kernels


def test_source_digest_covers_every_header(tmp_path, monkeypatch):
    (tmp_path / "a.cuh").write_text("// a\n")
    monkeypatch.setattr(build, "CUDA_DIR", tmp_path)
    before = build.source_digest()
    (tmp_path / "b.cuh").write_text("// b\n")
    assert build.source_digest() != before
    with_b = build.source_digest()
    (tmp_path / "b.cuh").write_text("// b changed\n")
    assert build.source_digest() != with_b


def test_unregistered_name_is_refused():
    with pytest.raises(KeyError, match="not registered"):
        comm.MODULE.function("mok::no_such_kernel")
