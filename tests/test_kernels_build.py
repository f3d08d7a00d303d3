"""CPU checks of the kernel layer: every registered kernel compiles with the local nvcc for each
architecture its module is written for (the ABI itself: tests/test_abi.py)."""

import re
import shutil
import subprocess

import pytest

from mok_proto import abi
from mok_proto.kernels import build, comm, features, fp8, fused, gemm, gemm_fp8, token  # noqa: F401 - registers the modules

NVCC = shutil.which("nvcc")
SPILL_FREE = ("gemm.cuh", "gemm_fp8.cuh")  # the standalone GEMM tiles: ptxas -v must show no spills


def _modules():
    return sorted(build.MODULES)


def _targets(variants: bool = True):
    """(module key, arch) pairs; variants=False: the plain modules only (a variant differs by a macro)."""
    return [(key, arch) for key in _modules() for arch in build.MODULES[key].archs
            if variants or not build.MODULES[key].defines]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit needed to compile kernels)")
@pytest.mark.parametrize("header,arch", _targets(variants=False))
def test_every_kernel_compiles_with_nvcc(tmp_path, header, arch):
    _compile_clean(tmp_path, header, arch)


def _compile_clean(tmp_path, header, arch):
    src = tmp_path / "instantiate.cu"
    src.write_text(build.MODULES[header].instantiation_source())
    virtual = arch.replace("sm_", "compute_")  # sm_90a needs compute_90a PTX (wgmma, setmaxnreg)
    proc = subprocess.run([NVCC, *build.CXX_OPTIONS, "-gencode",
                           f"arch={virtual},code={arch}", f"-I{build.CUDA_DIR}",
                           "-c", str(src), "-o", str(tmp_path / "out.o"), "-Xptxas", "-v"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "out.o").stat().st_size > 0
    assert "Used" in proc.stderr  # ptxas reported registers for the kernels
    # e.g. C7515: wgmma serialized because non-wgmma instructions define its accumulators mid-pipeline
    assert "Potential Performance Loss" not in proc.stderr, [l for l in proc.stderr.splitlines() if "Loss" in l]
    if header in SPILL_FREE:  # their register budgets (setmaxnreg) are chosen so that nothing spills
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", proc.stderr)
        assert spills and all(s == ("0", "0") for s in spills), f"{header} spills registers: {spills}"


def test_source_digest_covers_the_header_and_its_includes(tmp_path, monkeypatch):
    (tmp_path / "a.cuh").write_text('#include "b.cuh"\n// a\n')
    (tmp_path / "b.cuh").write_text('#include "c.cuh"\n#include <cstdint>\n')
    (tmp_path / "c.cuh").write_text("// c\n")
    (tmp_path / "d.cuh").write_text("// d\n")
    monkeypatch.setattr(build, "CUDA_DIR", tmp_path)
    assert [p.name for p in build.includes("a.cuh")] == ["a.cuh", "b.cuh", "c.cuh"]
    before = {h: build.source_digest(h) for h in ("a.cuh", "c.cuh", "d.cuh")}
    (tmp_path / "c.cuh").write_text("// c changed\n")  # a includes c through b: its digest moves too
    after = {h: build.source_digest(h) for h in before}
    assert after["a.cuh"] != before["a.cuh"] and after["c.cuh"] != before["c.cuh"] and after["d.cuh"] == before["d.cuh"]
    (tmp_path / "d.cuh").write_text('#include "c.cuh"\n// d now includes c\n')
    assert build.source_digest("d.cuh") != after["d.cuh"] and build.includes("d.cuh")[0].name == "c.cuh"


def test_editing_a_header_recompiles_only_the_modules_that_include_it(tmp_path, monkeypatch):
    copy = tmp_path / "cuda"
    shutil.copytree(build.CUDA_DIR, copy)
    monkeypatch.setattr(build, "CUDA_DIR", copy)
    headers = sorted({m.header for m in build.MODULES.values()})
    before = {h: build.source_digest(h) for h in headers}
    with (copy / "fused.cuh").open("a") as f:
        f.write("// a comment\n")
    changed = {h for h in headers if build.source_digest(h) != before[h]}
    assert changed == {"fused.cuh"}
    with (copy / "common.cuh").open("a") as f:  # every kernel module includes common.cuh
        f.write("// a comment\n")
    assert {h for h in headers if build.source_digest(h) != before[h]} == set(headers)


def test_unregistered_name_is_refused():
    with pytest.raises(KeyError, match="not registered"):
        comm.MODULE.function("mok::no_such_kernel")


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return None
    try:
        nvrtc.nvrtcVersion()
    except Exception:  # noqa: BLE001 - the bindings import, but no libnvrtc is found
        return None
    return nvrtc


@pytest.mark.parametrize("header,arch", _targets())
def test_every_kernel_compiles_with_nvrtc(header, arch):
    """The GPU path compiles with NVRTC (CuPy RawModule), not nvcc: no standard headers, no
    offsetof builtin, name expressions. Same options and name expressions as build._compile, to
    PTX (compute_XX): the assembler's half, ptxas, runs in the nvcc test above."""
    nvrtc = _nvrtc()
    if nvrtc is None:
        pytest.skip("NVRTC not available (pip install cuda-bindings nvidia-cuda-nvrtc: the test extra does)")
    module = build.MODULES[header]
    err, prog = nvrtc.nvrtcCreateProgram(f'#include "{module.header}"\n'.encode(), b"module.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    for name in module.names:
        assert nvrtc.nvrtcAddNameExpression(prog, name.encode())[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
    options = [o.encode() for o in (*build.CXX_OPTIONS, *(f"-D{d}" for d in module.defines),
                                     f"--gpu-architecture={arch.replace('sm_', 'compute_')}", f"-I{build.CUDA_DIR}")]
    (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert result == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")[-4000:]
    for name in module.names:
        err, lowered = nvrtc.nvrtcGetLoweredName(prog, name.encode())
        assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS and lowered, name
    nvrtc.nvrtcDestroyProgram(prog)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit needed to compile kernels)")
def test_linked_movers_of_two_ranks_fit_an_sm_together(tmp_path):
    """With the emulated link (MOK_LINK) two virtual ranks each launch 4 mover blocks of kCommThreads
    per SM: 8 blocks must be resident at once (at most 32 registers a thread), or the second rank's
    blocks wait for a second wave and every round trip is paid twice."""
    src = tmp_path / "comm.cu"
    src.write_text(build.MODULES["comm.cuh"].instantiation_source())
    proc = subprocess.run([NVCC, *build.CXX_OPTIONS, "-DMOK_LINK", "-gencode", "arch=compute_90a,code=sm_90a",
                           f"-I{build.CUDA_DIR}", "-c", str(src), "-o", str(tmp_path / "out.o"), "-Xptxas", "-v"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    regs = {}
    for name, used in re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", proc.stderr, re.S):
        regs[name] = int(used)
    movers = {n: r for n, r in regs.items() if re.search(r"(dispatch|combine)_(pull|push)", n)}
    assert len(movers) == 8 and max(movers.values()) <= 65536 // (8 * abi.CONST["kCommThreads"]), movers


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit needed to compile kernels)")
def test_the_quantizers_keep_subnormals_under_ftz(tmp_path):
    """CuPy compiles every module with -ftz=true after our options (a later -ftz wins), which turns
    C++ float operations into their flushing PTX forms; the quantization rule keeps float32
    subnormals. Compiled so, no instruction of a quantizer kernel (cuda/fp8.cuh) flushes."""
    src = tmp_path / "fp8.cu"
    src.write_text(build.MODULES["fp8.cuh"].instantiation_source())
    ptx = tmp_path / "fp8.ptx"
    proc = subprocess.run([NVCC, *build.CXX_OPTIONS, "-ftz=true", "-arch=sm_90a", f"-I{build.CUDA_DIR}", "-ptx",
                           str(src), "-o", str(ptx)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kernels = ptx.read_text().split(".entry ")[1:]
    assert len(kernels) >= 10  # the row, block and segment quantizers of each input type
    flushing = {k.split("(")[0]: sorted(set(re.findall(r"\b\w+(?:\.\w+)*\.ftz\b(?:\.\w+)*", k))) for k in kernels}
    assert not any(flushing.values()), {k: v for k, v in flushing.items() if v}


def test_rows_of_experimental_variants_stay_out_of_what_results_load(tmp_path):
    import json

    from mok_proto import results

    rows = [{"time": "2026-12-06T05:00:00+00:00", "git": "a", "problem": "down"},
            {"time": "2026-12-06T05:01:00+00:00", "git": "a", "problem": "down", "gemm_variant": 0},
            {"time": "2026-12-06T05:02:00+00:00", "git": "a", "problem": "down", "gemm_variant": 3},
            {"time": "2026-12-06T05:03:00+00:00", "git": "a", "problem": "down", "fused_variant": 2},
            {"time": "2026-12-06T05:04:00+00:00", "git": "a", "problem": "down", "fp8_mainloop": 1},
            # the variants the default kernels adopted (features.ADOPTED) measured today's kernels
            {"time": "2026-12-06T05:05:00+00:00", "git": "a", "problem": "down", "gemm_variant": 1},
            {"time": "2026-12-06T05:06:00+00:00", "git": "a", "problem": "down", "gemm_variant": 1, "fp8_mainloop": 3},
            {"time": "2026-12-06T05:07:00+00:00", "git": "a", "problem": "down", "gemm_variant": 1, "fused_variant": 4},
            {"time": "2026-12-06T05:08:00+00:00", "git": "a", "problem": "down", "fp8_variant": 1},
            # an adopted field recorded with the value it replaced: the old code, not today's
            {"time": "2026-12-06T05:09:00+00:00", "git": "a", "problem": "down", "fp8_mainloop": 0},
            {"time": "2026-12-06T05:10:00+00:00", "git": "a", "problem": "down", "fp8_mainloop": 3}]
    (tmp_path / "bench_gemm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["time"][11:16] for r in results.load("bench_gemm", tmp_path)] == ["05:00", "05:05", "05:06", "05:10"]
    assert len(results.load("bench_gemm", tmp_path, experimental=True)) == 11
    assert not set(features.VARIANT_FIELDS) & set(features.CURRENT)
