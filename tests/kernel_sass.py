"""The SASS of a compiled kernel module (kernel_ptx's cubin, disassembled by nvdisasm from the
nvidia-cuda-nvdisasm package of the test extra) and the GEMM k-loops in it: the innermost loops
(a backward branch and the instructions from its target to it) that issue a wgmma (HGMMA, QGMMA)."""

from __future__ import annotations

import base64
import importlib.util
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from kernel_ptx import compile_module

_FUNCTION = re.compile(r"//-+ \.text\.(\S+) -+")
_LABEL = re.compile(r"\s*(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")
_LOCAL = re.compile(r"\b(LDL|STL)\b")


@dataclass(frozen=True)
class Loop:
    start: int  # the address the backward branch goes to
    end: int  # the branch's address
    local: tuple  # the local-memory instructions (LDL, STL) between them


def nvdisasm() -> str | None:
    """The nvdisasm of the installed nvidia-cuda-nvdisasm package, else one on PATH, else None."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for found in sorted(Path(root).glob("cu*/bin/nvdisasm")):
            return str(found)
    return shutil.which("nvdisasm")


def module_sass(key: str, arch: str) -> str:
    """nvdisasm's listing of build.MODULES[key] compiled for `arch` (sm_XX)."""
    tool = nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not available (pip install nvidia-cuda-nvdisasm: the test extra does)")
    compiled = compile_module(key, arch)
    assert compiled.ok and compiled.cubin, compiled.log[-4000:]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(base64.b64decode(compiled.cubin))
        f.flush()
        return subprocess.run([tool, "-c", f.name], check=True, capture_output=True, text=True).stdout


def functions(listing: str) -> dict:
    """{function: ([(address, instruction)], {label: address})} of an nvdisasm -c listing."""
    out, name, pending = {}, None, []
    for line in listing.splitlines():
        if m := _FUNCTION.match(line):
            name, pending = m.group(1), []
            out[name] = ([], {})
        elif name and (m := _LABEL.match(line)):
            pending.append(m.group(1))
        elif name and (m := _INSTRUCTION.search(line)):
            address = int(m.group(1), 16)
            out[name][1].update((label, address) for label in pending)
            pending = []
            out[name][0].append((address, m.group(2)))
    return out


def gemm_loops(instructions: list, labels: dict) -> list:
    """The innermost loops of one function that issue a wgmma, each with its local-memory accesses."""
    at = {address: i for i, (address, _) in enumerate(instructions)}
    loops = []
    for i, (address, op) in enumerate(instructions):
        m = _BRANCH.search(op)
        target = labels.get(m.group(1)) if m else None
        if target is None or target >= address:
            continue
        body = [o for _, o in instructions[at[target]:i + 1]]
        if any("GMMA" in o for o in body):
            loops.append(Loop(target, address, tuple(o for o in body if _LOCAL.search(o))))
    return [loop for loop in loops
            if not any(o is not loop and loop.start <= o.start and o.end <= loop.end for o in loops)]
