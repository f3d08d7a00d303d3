"""Run-time compilation of the CUDA headers under cuda/ with CuPy RawModule (NVRTC).

A `CudaModule` names one header and every template instantiation ("name expression") its
wrappers launch. It compiles on first use for the current GPU's architecture (sm_90a on Hopper,
so wgmma is available) and is cached in memory by (source digest, options); the digest covers
the header and every header it includes (`#include "..."`, followed through cuda/), and it is
written into the compiled code, so CuPy's on-disk cache can never serve a binary built from an
older header, and an edit recompiles only the modules that include the edited file. Every
module registers itself in MODULES, which the CPU tests compile with NVRTC for each architecture
the module is written for (tests/kernel_ptx.py).
"""

from __future__ import annotations

import functools
import hashlib
import re
import time
from pathlib import Path

import numpy as np

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
CXX_OPTIONS = ("-std=c++17",)
MODULES: dict[str, "CudaModule"] = {}
RECHECK_S = 1.0  # how often a launch looks for edited headers


_DIGEST: dict = {}  # (header, file stamps) -> (digest, included headers): a stat per header per launch
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def includes(header: str) -> list[Path]:
    """`header` and every header it includes with `#include "..."`, directly or not, that exists
    under cuda/ (system headers and missing files are the compiler's business), sorted."""
    seen, todo = set(), [CUDA_DIR / header]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        todo += [path.parent / name for name in _INCLUDE.findall(path.read_text())]
    return sorted(seen)


def source_digest(header: str) -> str:
    """SHA-256 over `header` and the headers it includes (names and contents). Recomputed only
    when one of those files' size or mtime changed, so an edited header recompiles on the next
    launch, even in Jupyter, and only in the modules that include it."""
    cached = _DIGEST.get(header)
    if cached is not None:
        stamps, digest, paths = cached
        try:
            if stamps == _stamps(paths):
                return digest
        except FileNotFoundError:
            pass
    paths = includes(header)
    h = hashlib.sha256()
    for path in paths:
        h.update(path.relative_to(CUDA_DIR).as_posix().encode())
        h.update(path.read_bytes())
    _DIGEST[header] = (_stamps(paths), h.hexdigest(), paths)
    return _DIGEST[header][1]


def _stamps(paths) -> tuple:
    return (str(CUDA_DIR),) + tuple((p.as_posix(), p.stat().st_mtime_ns, p.stat().st_size) for p in paths)


@functools.lru_cache(maxsize=None)
def _device_facts(device_id: int):
    import cupy

    dev = cupy.cuda.Device(device_id)
    return dev.compute_capability, dev.attributes["MultiProcessorCount"]


def num_sms() -> int:
    """Streaming multiprocessors of the current device (cached)."""
    import cupy

    return _device_facts(cupy.cuda.runtime.getDevice())[1]


def gpu_arch(device=None) -> str:
    """'sm_90a' on Hopper, 'sm_100a' on Blackwell (arch-specific features), else 'sm_XY'."""
    import cupy

    cc = _device_facts(device if device is not None else cupy.cuda.runtime.getDevice())[0]
    return f"sm_{cc}a" if cc in ("90", "100", "103") else f"sm_{cc}"


@functools.lru_cache(maxsize=None)
def _compile(header: str, names: tuple, arch: str, digest: str, defines: tuple = ()):
    import cupy

    code = f"// mok_proto source digest {digest}\n#include \"{header}\"\n"
    options = CXX_OPTIONS + tuple(f"-D{d}" for d in defines) + (f"--gpu-architecture={arch}", f"-I{CUDA_DIR}")
    return cupy.RawModule(code=code, options=options, name_expressions=names)


class CudaModule:
    """One header and the name expressions its wrappers launch. `archs`: the architectures it is
    written for (the CPU tests compile each; wgmma code exists on sm_90a only). `defines`: macros
    of a variant of the same header (e.g. MOK_LINK), compiled and cached apart."""

    def __init__(self, header: str, names: tuple[str, ...], archs=("sm_90a", "sm_100a"), defines=()):
        if not (CUDA_DIR / header).is_file():
            raise FileNotFoundError(f"no CUDA header {header!r} under {CUDA_DIR}")
        self.header, self.names, self.archs, self.defines = header, tuple(names), tuple(archs), tuple(defines)
        self._functions: dict = {}  # name -> (time looked up, kernel, compiled module)
        self._sizes: dict = {}  # size-export kernel name -> (compiled module it was read from, sizes)
        MODULES[self.key] = self

    @property
    def key(self) -> str:
        """Its name in MODULES: the header, and its defines for a variant (`fused.cuh -DMOK_LINK`)."""
        return " ".join((self.header, *(f"-D{d}" for d in self.defines)))

    def variant(self, *defines: str) -> "CudaModule":
        """The same header and names compiled with these macros (one object per variant)."""
        key = " ".join((self.header, *(f"-D{d}" for d in defines)))
        return MODULES.get(key) or CudaModule(self.header, self.names, self.archs, defines)

    def function(self, name: str):
        """The compiled kernel for one registered name expression (compiles on first use). Launch
        paths call this per launch: the headers are looked at (stat, no hashing) at most every
        RECHECK_S seconds, so an edited header still recompiles on a later launch."""
        return self._lookup(name)[0]

    def _lookup(self, name: str):
        """(kernel, the compiled module it belongs to), re-checked at most every RECHECK_S."""
        if name not in self.names:
            raise KeyError(f"{name!r} is not registered in {self.header}; add it to its CudaModule names")
        now = time.monotonic()
        cached = self._functions.get(name)
        if cached is not None and now - cached[0] < RECHECK_S:
            return cached[1:]
        arch = gpu_arch()
        if arch not in self.archs:
            raise RuntimeError(f"{self.header} is written for {', '.join(self.archs)}; this GPU is {arch}")
        module = _compile(self.header, self.names, arch, source_digest(self.header), self.defines)  # cached per digest
        self._functions[name] = (now, module.get_function(name), module)
        return self._functions[name][1:]

    def read_sizes(self, name: str, count: int) -> tuple:
        """Compile-time sizes only C++ knows (a kernel's shared memory, ...): launches the
        registered kernel `name(int* out)`, which writes `count` ints, once per compiled module
        (a host readback: call it once outside any graph capture; later calls cost a dict lookup)."""
        kernel, module = self._lookup(name)
        cached = self._sizes.get(name)
        if cached is None or cached[0] is not module:
            import cupy

            out = cupy.zeros(count, np.int32)
            kernel((1,), (1,), (out,))
            cached = self._sizes[name] = (module, tuple(int(v) for v in out.get()))
        return cached[1]

    def instantiation_source(self) -> str:
        """A .cu translation unit that makes nvcc instantiate every registered kernel."""
        refs = ",\n  ".join(f"(void*)&{name}" for name in self.names)
        return f'#include "{self.header}"\nvoid* mok_instantiate[] = {{\n  {refs}}};\n'
