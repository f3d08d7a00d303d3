"""The registered kernel modules compiled by NVRTC with the GPU path's options and name expressions
(mok_proto.kernels.build; CuPy also appends -ftz=true, which these compiles leave out), each at most once per test process: test_kernels_build
checks the compile and what ptxas reports, test_link reads the PTX of both builds. Their tests
share the xdist group GROUP, so one worker compiles each."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest

from mok_proto.kernels import build

GROUP = "kernel_ptx"  # pytest.mark.xdist_group of every test that compiles through compile_module


def nvrtc():
    """cuda.bindings.nvrtc, or None when it or libnvrtc is missing."""
    try:
        from cuda.bindings import nvrtc as module
    except ImportError:
        return None
    try:
        module.nvrtcVersion()
    except Exception:  # noqa: BLE001 - the bindings import, but no libnvrtc is found
        return None
    return module


def need_nvrtc():
    module = nvrtc()
    if module is None:
        pytest.skip("NVRTC not available (pip install cuda-bindings nvidia-cuda-nvrtc: the test extra does)")
    return module


@dataclass(frozen=True)
class Compiled:
    ok: bool
    log: str  # NVRTC's log; compiled for a real architecture, what ptxas -v prints too
    ptx: str
    lowered: dict  # name expression -> lowered (mangled) name, "" where NVRTC gave none


@functools.cache
def compile_module(key: str, target: str) -> Compiled:
    """build.MODULES[key] compiled by NVRTC for `target`: compute_XX (PTX only, with NVRTC's
    --Ofast-compile=mid: what a variant's macro adds is checked there, code quality on the sm_XX
    builds) or sm_XX (PTX and SASS, full optimization, NVRTC's ptxas run with -v, as when the GPU
    path compiles to a cubin)."""
    lib = need_nvrtc()
    module = build.MODULES[key]
    err, prog = lib.nvrtcCreateProgram(f'#include "{module.header}"\n'.encode(), b"module.cu", 0, [], [])
    assert err == lib.nvrtcResult.NVRTC_SUCCESS
    for name in module.names:
        assert lib.nvrtcAddNameExpression(prog, name.encode())[0] == lib.nvrtcResult.NVRTC_SUCCESS
    options = [o.encode() for o in (*build.CXX_OPTIONS, *(f"-D{d}" for d in module.defines),
                                     f"--gpu-architecture={target}", f"-I{build.CUDA_DIR}",
                                     *(["--ptxas-options=-v"] if target.startswith("sm_") else
                                       ["--Ofast-compile=mid"]))]
    (result,) = lib.nvrtcCompileProgram(prog, len(options), options)
    _, size = lib.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    lib.nvrtcGetProgramLog(prog, log)
    ok = result == lib.nvrtcResult.NVRTC_SUCCESS
    ptx, lowered = b"", {}
    if ok:
        _, size = lib.nvrtcGetPTXSize(prog)
        ptx = b" " * size
        lib.nvrtcGetPTX(prog, ptx)
        for name in module.names:
            err, low = lib.nvrtcGetLoweredName(prog, name.encode())
            lowered[name] = low.decode() if err == lib.nvrtcResult.NVRTC_SUCCESS and low else ""
    lib.nvrtcDestroyProgram(prog)
    return Compiled(ok, log.decode(errors="replace").rstrip("\x00 "), ptx.decode(errors="replace").rstrip("\x00"),
                    lowered)


def ptxas_report(key: str, arch: str) -> str:
    """What ptxas -v prints assembling build.MODULES[key] for `arch` (sm_XX); it must compile."""
    compiled = compile_module(key, arch)
    assert compiled.ok, compiled.log[-4000:]
    return compiled.log
