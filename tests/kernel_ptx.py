"""The registered kernel modules compiled by NVRTC with the GPU path's options and name expressions
(mok_proto.kernels.build; CuPy also appends -ftz=true, which these compiles leave out), each at most
once per test process: test_kernels_build checks the compile, what ptxas reports and the SASS
(kernel_sass), test_link reads the PTX of both builds. Their tests share the xdist group GROUP, so
one worker compiles each.

A compile's result is kept on disk by what it is made of (CACHE_ENV; like CuPy's kernel cache on the
GPU path): the sources, options, name expressions and compiler versions. Unchanged kernels are not
recompiled by the next test run; an edited header recompiles the modules that include it."""

from __future__ import annotations

import base64
import contextlib
import functools
import gzip
import hashlib
import json
import os
import tempfile
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from mok_proto.kernels import build

GROUP = "kernel_ptx"  # pytest.mark.xdist_group of every test that compiles through compile_module
# the folder of kept compiles (default $XDG_CACHE_HOME or ~/.cache, then mok_proto/nvrtc); "0": keep none
CACHE_ENV = "MOK_NVRTC_CACHE"
CACHE_KEEP = 200  # compiles kept, the least recently used dropped first
KEPT_FORMAT = 2  # of a kept compile's fields (Compiled): older checkouts keep theirs under other names


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
    cubin: str = ""  # base64 of the cubin (sm_XX targets; "" for compute_XX)


@functools.cache
def compile_module(key: str, target: str) -> Compiled:
    """build.MODULES[key] compiled by NVRTC for `target`: compute_XX (PTX only, with NVRTC's
    --Ofast-compile=mid: what a variant's macro adds is checked there, code quality on the sm_XX
    builds) or sm_XX (PTX and SASS, full optimization, NVRTC's ptxas run with -v, as when the GPU
    path compiles to a cubin)."""
    lib = need_nvrtc()
    module = build.MODULES[key]
    options = [o.encode() for o in (*build.CXX_OPTIONS, *(f"-D{d}" for d in module.defines),
                                     f"--gpu-architecture={target}", f"-I{build.CUDA_DIR}",
                                     *(["--ptxas-options=-v"] if target.startswith("sm_") else
                                       ["--Ofast-compile=mid"]))]
    kept = _cache_file(lib, module, options)
    if kept is not None and kept.is_file():
        try:
            with gzip.open(kept, "rt") as f:
                compiled = Compiled(**json.load(f))
        except (OSError, EOFError, ValueError, TypeError, zlib.error):  # unreadable: compiled again, and replaced
            compiled = None
        if compiled is not None:
            with contextlib.suppress(OSError):  # recently used (a folder this run may not write: read only)
                os.utime(kept)
            return compiled
    compiled = _compile(lib, module, options, target.startswith("sm_"))
    if kept is not None and compiled.ok:
        _keep(kept, compiled)
    return compiled


def _compile(lib, module, options: list, with_cubin: bool) -> Compiled:
    err, prog = lib.nvrtcCreateProgram(f'#include "{module.header}"\n'.encode(), b"module.cu", 0, [], [])
    assert err == lib.nvrtcResult.NVRTC_SUCCESS
    for name in module.names:
        assert lib.nvrtcAddNameExpression(prog, name.encode())[0] == lib.nvrtcResult.NVRTC_SUCCESS
    (result,) = lib.nvrtcCompileProgram(prog, len(options), options)
    _, size = lib.nvrtcGetProgramLogSize(prog)
    log = b" " * size
    lib.nvrtcGetProgramLog(prog, log)
    ok = result == lib.nvrtcResult.NVRTC_SUCCESS
    ptx, lowered, cubin = b"", {}, b""
    if ok:
        _, size = lib.nvrtcGetPTXSize(prog)
        ptx = b" " * size
        lib.nvrtcGetPTX(prog, ptx)
        if with_cubin:
            _, size = lib.nvrtcGetCUBINSize(prog)
            cubin = b" " * size
            lib.nvrtcGetCUBIN(prog, cubin)
        for name in module.names:
            err, low = lib.nvrtcGetLoweredName(prog, name.encode())
            lowered[name] = low.decode() if err == lib.nvrtcResult.NVRTC_SUCCESS and low else ""
    lib.nvrtcDestroyProgram(prog)
    return Compiled(ok, log.decode(errors="replace").rstrip("\x00 "), ptx.decode(errors="replace").rstrip("\x00"),
                    lowered, base64.b64encode(cubin).decode())


def _cache_file(lib, module, options: list) -> Path | None:
    """Where the compile of `module` with `options` is kept (None: CACHE_ENV is "0"), named by a
    digest of everything it depends on: the header and what it includes (build.source_digest), the
    options, the name expressions, NVRTC's version and the library loaded (not where the checkout
    is: a clone elsewhere of the same sources reads the same file)."""
    where = os.environ.get(CACHE_ENV)
    if where == "0":
        return None
    try:
        root = Path(where) if where else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mok_proto" / "nvrtc"
    except RuntimeError:  # no home folder: nothing kept
        return None
    include = f"-I{build.CUDA_DIR}".encode()  # the folder's contents are in the digest, not its place
    flags = ["-I<cuda>" if o == include else o.decode() for o in options]
    what = [build.source_digest(module.header), module.header, list(module.names), flags,
            list(lib.nvrtcVersion()[1:]), _nvrtc_library(), KEPT_FORMAT]
    return root / (hashlib.sha256(json.dumps(what).encode()).hexdigest() + ".json.gz")


@functools.cache
def _nvrtc_library() -> str:
    """SHA-256 of the NVRTC library loaded and its builtins library beside it ("" where it cannot be
    located): the version names only major.minor."""
    try:
        from cuda import pathfinder

        path = pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path
    except Exception:  # noqa: BLE001 - no pathfinder, or a library it cannot name
        return ""
    if not path:
        return ""
    h = hashlib.sha256()
    for lib in (Path(path), *sorted(Path(path).parent.glob("libnvrtc-builtins*"))):
        with open(lib, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def _keep(path: Path, compiled: Compiled) -> None:
    """Write the compile (atomically: a test run beside this one may read it) and drop the least
    recently used beyond CACHE_KEEP; a folder that cannot be written keeps nothing."""
    partial = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as raw, gzip.open(raw, "wt", compresslevel=1) as f:
            json.dump(asdict(compiled), f)
        os.replace(partial, path)
        partial = None
        kept = sorted(path.parent.glob("*.json.gz"), key=lambda p: p.stat().st_mtime)
        for old in kept[:-CACHE_KEEP]:
            old.unlink(missing_ok=True)
    except OSError:
        pass
    finally:
        if partial is not None:
            with contextlib.suppress(OSError):
                os.unlink(partial)


def ptxas_report(key: str, arch: str) -> str:
    """What ptxas -v prints assembling build.MODULES[key] for `arch` (sm_XX); it must compile."""
    compiled = compile_module(key, arch)
    assert compiled.ok, compiled.log[-4000:]
    return compiled.log
