"""Run-time compilation of the CUDA headers under cuda/ with CuPy RawModule (NVRTC).

A `CudaModule` names one header and every template instantiation ("name expression") its
wrappers launch. It compiles on first use for the current GPU's architecture (sm_90a on Hopper,
so wgmma is available) and is cached in memory by (source digest, options); the digest covers
every file under cuda/, and it is written into the compiled code, so CuPy's on-disk cache can
never serve a binary built from an older header. Every module registers itself in MODULES, which
the CPU test compiles with the local nvcc for sm_90a and sm_100a.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
CXX_OPTIONS = ("-std=c++17",)
MODULES: dict[str, "CudaModule"] = {}


def source_digest() -> str:
    """SHA-256 over every header under cuda/ (names and contents)."""
    h = hashlib.sha256()
    for path in sorted(CUDA_DIR.glob("**/*")):
        if path.is_file():
            h.update(path.relative_to(CUDA_DIR).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def gpu_arch(device=None) -> str:
    """'sm_90a' on Hopper, 'sm_100a' on Blackwell (arch-specific features), else 'sm_XY'."""
    import cupy

    cc = (cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()).compute_capability
    return f"sm_{cc}a" if cc in ("90", "100", "103") else f"sm_{cc}"


@functools.lru_cache(maxsize=None)
def _compile(header: str, names: tuple, arch: str, digest: str):
    import cupy

    code = f"// mok_proto source digest {digest}\n#include \"{header}\"\n"
    options = CXX_OPTIONS + (f"--gpu-architecture={arch}", f"-I{CUDA_DIR}")
    return cupy.RawModule(code=code, options=options, name_expressions=names)


class CudaModule:
    def __init__(self, header: str, names: tuple[str, ...]):
        if not (CUDA_DIR / header).is_file():
            raise FileNotFoundError(f"no CUDA header {header!r} under {CUDA_DIR}")
        self.header, self.names = header, tuple(names)
        MODULES[header] = self

    def function(self, name: str):
        """The compiled kernel for one registered name expression (compiles on first use)."""
        if name not in self.names:
            raise KeyError(f"{name!r} is not registered in {self.header}; add it to its CudaModule names")
        module = _compile(self.header, self.names, gpu_arch(), source_digest())
        return module.get_function(name)

    def instantiation_source(self) -> str:
        """A .cu translation unit that makes nvcc instantiate every registered kernel."""
        refs = ",\n  ".join(f"(void*)&{name}" for name in self.names)
        return f'#include "{self.header}"\nvoid* mok_instantiate[] = {{\n  {refs}}};\n'
