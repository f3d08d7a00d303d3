"""The SASS of a compiled kernel module (kernel_ptx's cubin, disassembled by nvdisasm from the
nvidia-cuda-nvdisasm package of the test extra) and the GEMM k-loops in it: the innermost loops
(a backward branch and the instructions from its target to it) that issue a wgmma (HGMMA, QGMMA)."""

from __future__ import annotations

import base64
import re
import subprocess
import tempfile
from dataclasses import dataclass

import pytest

from kernel_ptx import compile_module
from mok_proto.kernels.sass_size import nvdisasm

_FUNCTION = re.compile(r"//-+ \.text\.(\S+) -+")
_LABEL = re.compile(r"\s*(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")
_LOCAL = re.compile(r"\b(LDL|STL)\b")
_CALL = re.compile(r"\bCALL\b")


@dataclass(frozen=True)
class Loop:
    start: int  # the address its backward branches go to
    end: int  # the last such branch's address
    local: tuple  # the local-memory instructions (LDL, STL) between them
    mmas: tuple  # the wgmma instructions' opcodes (HGMMA.64x256x16.F32.BF16, ...), in order
    calls: tuple  # subroutine calls between them (their code lies elsewhere: not scanned)


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
    """The innermost loops of one function that issue a wgmma: from a backward branch's target to
    the last branch back to it (a loop's `continue`s are one loop)."""
    at = {address: i for i, (address, _) in enumerate(instructions)}
    ends = {}  # target -> its last backward branch
    for address, op in instructions:
        m = _BRANCH.search(op)
        target = labels.get(m.group(1)) if m else None
        if target is not None and target < address:
            ends[target] = max(ends.get(target, address), address)
    loops = []
    for start, end in sorted(ends.items()):
        body = [o for _, o in instructions[at[start]:at[end] + 1]]
        mmas = tuple(_opcode(o) for o in body if "GMMA" in o)
        if mmas:
            loops.append(Loop(start, end, tuple(o for o in body if _LOCAL.search(o)), mmas,
                              tuple(o for o in body if _CALL.search(o))))
    return [loop for loop in loops
            if not any(o is not loop and loop.start <= o.start and o.end <= loop.end for o in loops)]


def _opcode(op: str) -> str:
    return op.split()[1] if op.startswith("@") else op.split()[0]
