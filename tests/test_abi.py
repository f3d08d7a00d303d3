"""The kernel ABI has one source (mok_proto/abi.py); these CPU tests fail when either side drifts.

1. The checked-in cuda/abi.cuh must be exactly what the spec generates (a hand edit of the header,
   or a spec change without regenerating, fails here).
2. What the C++ compiler makes of the header must equal what Python packs: a host program built
   with nvcc prints every enum value, constant, struct size and field offset as C++ sees them,
   and each must equal the spec's (so a wrong type, order or value cannot hide behind matching text).
3. No kernel source defines its own copy of a shared constant or enum.
"""

import re
import shutil
import subprocess

import numpy as np
import pytest

from mok_proto import abi
from mok_proto.kernels import build

NVCC = shutil.which("nvcc")


def test_header_is_generated_from_the_spec():
    checked_in = abi.header_path().read_text()
    assert checked_in == abi.render_header(), \
        "cuda/abi.cuh differs from mok_proto/abi.py: edit the spec and run `python -m mok_proto.abi`"


def _host_program() -> str:
    lines = ['#include <cstdio>', '#include <cstddef>', '#include "abi.cuh"', "int main() {"]
    for e in abi.ENUMS:
        for name, _ in e.members:
            lines.append(f'  std::printf("enum {e.name}.{name} %d\\n", static_cast<int>({e.namespace}::{name}));')
    for c in abi.CONSTS:
        lines.append(f'  std::printf("const {c.name} %d\\n", {c.namespace}::{c.name});')
    for s in abi.STRUCTS:
        t = f"{s.namespace}::{s.name}"
        lines.append(f'  std::printf("sizeof {s.name} %zu\\n", sizeof({t}));')
        for name in s.names:
            lines.append(f'  std::printf("offset {s.name}.{name} %zu\\n", offsetof({t}, {name}));')
            lines.append(f'  std::printf("size {s.name}.{name} %zu\\n", sizeof((({t}*)0)->{name}));')
    lines += ["  return 0;", "}"]
    return "\n".join(lines) + "\n"


def _expected() -> dict:
    want = {}
    for e in abi.ENUMS:
        for value, (name, _) in enumerate(e.members):
            want[f"enum {e.name}.{name}"] = value
    for c in abi.CONSTS:
        want[f"const {c.name}"] = c.value
    for s in abi.STRUCTS:
        want[f"sizeof {s.name}"] = s.nbytes
        for name in s.names:
            want[f"offset {s.name}.{name}"] = s.offset(name)
            want[f"size {s.name}.{name}"] = s.dtype.fields[name][0].itemsize
    return want


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (the CUDA toolkit compiles the ABI check)")
def test_cpp_layout_equals_python_packing(tmp_path):
    src = tmp_path / "abi_layout.cu"
    src.write_text(_host_program())
    exe = tmp_path / "abi_layout"
    proc = subprocess.run([NVCC, *build.CXX_OPTIONS, f"-I{build.CUDA_DIR}", str(src), "-o", str(exe)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True).stdout
    seen = {line.rsplit(" ", 1)[0]: int(line.rsplit(" ", 1)[1]) for line in out.splitlines()}
    assert seen == _expected()


def test_structs_have_the_c_layout():
    # every field at a multiple of its element size, the struct a multiple of its largest one
    for s in abi.STRUCTS:
        sizes = []
        for name in s.names:
            dtype, offset = s.dtype.fields[name][:2]
            size = (dtype.base if dtype.subdtype else dtype).itemsize
            assert offset % size == 0, f"{s.name}.{name} at offset {offset}"
            sizes.append(size)
        assert s.nbytes % max(sizes) == 0, s.name
    # the plan's tables are the megakernel's structs (e.g. kind at offset 8, not packed)
    from mok_proto import plan
    assert plan.TASK_DTYPE == abi.TASK.dtype and plan.COUNTER_DTYPE == abi.COUNTER.dtype
    assert abi.TASK.offset("kind") == 8 and abi.TASK.offset("minibatch") == 12
    assert [m.name.lower() for m in plan.TaskKind] == [text for _, text in abi.TASK_KIND.members]


def test_pack_places_each_field_at_its_offset():
    values = {name: i + 1 for i, name in enumerate(abi.GEMM_PARAMS.names)}
    words = abi.GEMM_PARAMS.pack(values)
    assert words.dtype == np.uint64 and words.nbytes == abi.GEMM_PARAMS.nbytes
    for name, value in values.items():
        assert int(words[abi.GEMM_PARAMS.offset(name) // 8]) == value, name
    assert abi.GEMM_PARAMS.unpack(words) == values
    with pytest.raises(ValueError, match="missing fields"):
        abi.COMM_PARAMS.pack({"num_ranks": 1})
    with pytest.raises(ValueError, match="unknown fields"):
        abi.ERROR_RECORD.pack({**dict.fromkeys(abi.ERROR_RECORD.names, 0), "bogus": 1})


def test_no_kernel_source_redefines_a_shared_name():
    names = [c.name for c in abi.CONSTS] + [e.name for e in abi.ENUMS] + [s.name for s in abi.STRUCTS]
    names += [m for e in abi.ENUMS for m, _ in e.members]
    alt = "|".join(names)  # one regex over each file for all names
    pattern = re.compile(rf"constexpr\s+\w+\s+({alt})\b|enum\s+({alt})\b|struct\s+({alt})\s*\{{|\b({alt})\s*=\s*\d")
    for path in sorted(build.CUDA_DIR.glob("*.cuh")):
        if path.name == abi.HEADER:
            continue
        found = pattern.search(path.read_text())
        name = found and next(group for group in found.groups() if group)
        assert not found, f"{path.name} defines {name} again; it belongs to mok_proto/abi.py"


def test_error_record_names_the_operator():
    from mok_proto.errors import CapacityError, KernelTimeoutError, SymmTimeoutError
    from mok_proto.kernels.errors import describe

    base = dict.fromkeys(abi.ERROR_RECORD.names, 0)
    assert describe(base) is None
    timeout = describe({**base, "code": abi.ERROR_CODE["kErrTimeout"], "op": abi.OP["kOpCombinePull"], "rank": 3,
                        "peer": 5, "expected": 7, "seen": 6}, timeout_s=2.0)
    assert isinstance(timeout, SymmTimeoutError) and (timeout.op, timeout.rank, timeout.peer) == \
        ("combine (pull)", 3, 5)
    capacity = describe({**base, "code": abi.ERROR_CODE["kErrCapacity"], "op": abi.OP["kOpSchedule"], "rank": 1,
                         "peer": 900, "expected": 800})
    assert isinstance(capacity, CapacityError) and "rank 1: needs 900 rows, capacity is 800" in str(capacity)
    gemm = describe({**base, "code": abi.ERROR_CODE["kErrTimeout"], "op": abi.OP["kOpGemmLoad"],
                     "detail": abi.GEMM_PROBLEM["kDownBwd"], "block": 12, "thread": 0})
    assert isinstance(gemm, KernelTimeoutError) and "down_bwd" in str(gemm) and "block 12" in str(gemm)
    # the fused kernel's waits on its own counters run twice a peer wait's timeout (cuda/fused.cuh)
    assert abi.CONST["kFusedLocalTimeoutFactor"] == 2
    fused = describe({**base, "code": abi.ERROR_CODE["kErrTimeout"], "op": abi.OP["kOpFusedWait"], "rank": 1,
                      "peer": 15, "expected": 6, "seen": 2, "detail": 124, "block": 14}, timeout_s=2.0)
    assert isinstance(fused, KernelTimeoutError) and str(fused) == (
        "fused layer task (waiting for a ready counter) timed out after 4 s on rank 1: task 124 of the plan "
        "waited for counter 15 to reach 6, saw 2 (block 14)")


def test_a_claim_hand_off_timeout_names_the_ticket():
    from mok_proto.errors import KernelTimeoutError
    from mok_proto.kernels.errors import describe

    base = dict.fromkeys(abi.ERROR_RECORD.names, 0)
    claim = describe({**base, "code": abi.ERROR_CODE["kErrTimeout"], "op": abi.OP["kOpFusedClaim"], "rank": -1,
                      "peer": -1, "expected": 1, "detail": 3, "block": 20, "thread": 128}, timeout_s=2.0)
    assert isinstance(claim, KernelTimeoutError) and str(claim) == (
        "fused layer cluster (handing a claimed tile pair to its CTAs) timed out: ticket 3 of the cluster of block "
        "20 (thread 128, barrier parity 1) was not handed over in time")


def test_a_column_quantizer_timeout_names_the_quantizer():
    from mok_proto.errors import KernelTimeoutError
    from mok_proto.kernels.errors import describe

    base = dict.fromkeys(abi.ERROR_RECORD.names, 0)
    stuck = describe({**base, "code": abi.ERROR_CODE["kErrTimeout"], "op": abi.OP["kOpQuantColumns"], "rank": -1,
                      "peer": -1, "expected": 1, "detail": -1, "block": 7, "thread": 33}, timeout_s=2.0)
    assert isinstance(stuck, KernelTimeoutError) and str(stuck) == (
        "segment column quantizer (waiting for a staged item) timed out after 2 s: its rows never landed in shared "
        "memory (block 7, thread 33, barrier parity 1)")
