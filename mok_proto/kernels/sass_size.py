"""Where a kernel's SASS comes from: its instructions counted by the device functions they were
inlined from (nvcc -lineinfo, nvdisasm -gi), down to a chosen depth of the inlining chain. Code
that does not fit the instruction cache stalls the warps on fetch (ncu's `no_inst`,
mok_proto.bench.ncu_source); this says which functions the code is.

    python -m mok_proto.kernels.sass_size fused.cuh --kernel fused_forward_fp8 --depth 3

Needs nvcc and nvdisasm (the test extra's nvidia-cuda-nvdisasm) on this machine, no GPU. The
module is compiled with CuPy's options (build.CXX_OPTIONS, then -ftz=true) for sm_90a, but by this
machine's nvcc, not the NVRTC CuPy runs: counts may differ a little from the kernels launched.
A frame labelled `(lambda in f)` is a lambda's body (or another inlined call back into f).
"""

from __future__ import annotations

import argparse
import bisect
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from functools import cache
from pathlib import Path

from mok_proto.kernels import build

_FUNCTION = re.compile(r"//-+ \.text\.(\S+) -+")
_LINE = re.compile(r'\s*//## File "([^"]+)", line (\d+)')
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+\S")
_ATTRIBUTES = re.compile(r"__(?:launch_bounds|cluster_dims)__\s*\([^)]*\)")
_DEFINITION = re.compile(r"^\s*(?:template\s*<.*>\s*)?(?:__device__|__global__)\b[^(;]*?\b(\w+)\s*\(")


def nvdisasm() -> str | None:
    """The nvdisasm of the installed nvidia-cuda-nvdisasm package (cuda.pathfinder finds it), else
    one on PATH, else None."""
    try:
        from cuda import pathfinder

        found = pathfinder.find_nvidia_binary_utility("nvdisasm")
    except Exception:  # noqa: BLE001 - no pathfinder, or one that cannot look
        found = None
    return found or shutil.which("nvdisasm")


def listing(key: str, arch: str = "sm_90a") -> str:
    """nvdisasm -c -gi of the registered module `key` (build.MODULES: a header, and its defines for a
    variant), compiled with line info."""
    nvcc, tool = shutil.which("nvcc"), nvdisasm()
    if nvcc is None or tool is None:
        raise RuntimeError("sass_size needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm)")
    module = build.MODULES[key]
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "module.cu", Path(tmp) / "module.cubin"
        src.write_text(module.instantiation_source())
        for command in ([nvcc, *build.CXX_OPTIONS, *(f"-D{d}" for d in module.defines), "-ftz=true", f"-arch={arch}",
                         f"-I{build.CUDA_DIR}", "-lineinfo", "-cubin", str(src), "-o", str(cubin)],
                        [tool, "-c", "-gi", str(cubin)]):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{Path(command[0]).name} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout


def chains(text: str) -> dict:
    """{function: [chain of (file, line), innermost first, per instruction]} of a -gi listing."""
    out, name, chain, fresh = {}, None, [], True
    for line in text.splitlines():
        if m := _FUNCTION.match(line):
            name, chain, fresh = m.group(1), [], True
            out[name] = []
        elif name is None:
            continue
        elif m := _LINE.match(line):
            if fresh:
                chain, fresh = [], False
            chain.append((m.group(1), int(m.group(2))))
        elif _INSTRUCTION.search(line):
            out[name].append(tuple(chain))
            fresh = True
    return out


@cache
def _definitions(path: str) -> tuple:
    """(first lines, names) of the functions defined in a source file, in line order."""
    found = [(i, m.group(1)) for i, text in enumerate(Path(path).read_text().splitlines(), 1)
             if (m := _DEFINITION.match(_ATTRIBUTES.sub("", text))) and not text.rstrip().endswith(";")]
    return tuple(i for i, _ in found), tuple(n for _, n in found)


def owner(path: str, line: int) -> str:
    """file:function that defines source line `line` (the last definition above it)."""
    try:
        starts, names = _definitions(path)
    except OSError:
        return f"{Path(path).name}:?"
    i = bisect.bisect_right(starts, line) - 1
    return f"{Path(path).name}:{names[i] if i >= 0 else '?'}"


def breakdown(function_chains: list, depth: int) -> Counter:
    """Instructions per call path: the `depth` frames below the kernel's own body, outermost first
    ('a < b'); instructions of the body itself, or without line info, under their own labels."""
    counts = Counter()
    for chain in function_chains:
        frames = []  # outermost first: the kernel's body (its name may sit where owner() cannot see it)
        for frame in reversed(chain):
            name = owner(*frame)
            frames.append(f"(lambda in {name})" if name in frames[1:] else name)
        if not frames:
            counts["(no line info)"] += 1
        else:
            counts[" < ".join(frames[1:1 + depth]) or f"{frames[0]} (its own lines)"] += 1
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mok_proto.kernels.sass_size", description=__doc__.split("\n\n")[0])
    p.add_argument("header", help=f"a registered module: {', '.join(build.MODULES) or 'fused.cuh, gemm.cuh, ...'}")
    p.add_argument("--kernel", default="", help="only functions whose (mangled) name contains this")
    p.add_argument("--depth", type=int, default=2, help="call-path frames below the kernel's body")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    from mok_proto.kernels import comm, fp8, fused, gemm, gemm_fp8, token  # noqa: F401 - registers the modules

    if args.header not in build.MODULES:
        p.error(f"{args.header!r} is no registered module: {', '.join(build.MODULES)}")
    found = {name: c for name, c in chains(listing(args.header)).items() if args.kernel in name and c}
    if not found:
        p.error(f"no function of {args.header} whose name contains {args.kernel!r}")
    for name, function_chains in found.items():
        print(f"{name}: {len(function_chains)} instructions")
        for label, n in breakdown(function_chains, args.depth).most_common(args.top):
            print(f"{n:8d}  {label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
