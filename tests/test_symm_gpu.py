"""GPU symmetric memory: the virtual world (W ranks in one process) and NVSHMEM (one process per rank).

gpu-marked tests skip (conftest) without a GPU; the unmarked ones check what needs no GPU: lazy
imports and clear errors.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, gpu_reason, run_ranks

WORLD_SIZES = [1, 2, 4, 8]


def _python(code: str, **env) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


# ---- CPU: no GPU needed ---------------------------------------------------------------------------

def test_gpu_modules_import_lazily():
    proc = _python(
        "import sys\n"
        "import mok_proto.symm, mok_proto.symm.gpu, mok_proto.symm.virtual, mok_proto.symm.nvshmem\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupyx', 'nvshmem', 'cuda')\n"
        "             or m == 'mpi4py.MPI')\n"
        "print('EAGER', bad)\n")
    assert proc.returncode == 0, proc.stderr
    assert "EAGER []" in proc.stdout, proc.stdout


def test_virtual_world_rejects_bad_sizes():
    from mok_proto.symm.virtual import VirtualWorld

    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="ranks"):
            VirtualWorld(bad)


def test_virtual_world_needs_gpu():
    if gpu_reason() is None:
        pytest.skip("a GPU is present: the no-GPU error path cannot be exercised")
    from mok_proto.symm.virtual import VirtualWorld

    with pytest.raises((RuntimeError, ImportError), match="GPU.*cupy|cupy.*GPU"):
        VirtualWorld(2)


def test_nvshmem_heap_needs_gpu():
    if gpu_reason() is None:
        pytest.skip("a GPU is present: the no-GPU error path cannot be exercised")
    # In a subprocess: nothing MPI may be initialised in this one.
    proc = _python(
        "from mok_proto.symm.nvshmem import NvshmemHeap\n"
        "try:\n"
        "    NvshmemHeap()\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n", MPI4PY_RC_INITIALIZE="0")
    assert proc.returncode == 0, proc.stderr
    assert "ERR NvshmemHeap needs an NVIDIA GPU and cupy" in proc.stdout, proc.stdout


def test_shape_and_dtype_validation():
    from mok_proto.symm.gpu import norm_dtype, norm_shape

    assert norm_shape("x", 5) == (5,) and norm_shape("x", [2, np.int64(3)]) == (2, 3)
    for bad in ((), (2, -1), "ab", (1.5, None)):
        with pytest.raises(ValueError, match="'x'"):
            norm_shape("x", bad)
    assert norm_dtype("x", "float32") == np.float32
    with pytest.raises(ValueError, match="'x'"):
        norm_dtype("x", object)


# ---- GPU: virtual world ---------------------------------------------------------------------------

_TABLE_KERNELS = r"""
extern "C" __global__ void read_first(const unsigned long long* table, float* out, int n) {
    const float* src = reinterpret_cast<const float*>(table[blockIdx.x]);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[blockIdx.x * n + i] = src[i];
}
extern "C" __global__ void write_first(const unsigned long long* table, int n) {
    float* dst = reinterpret_cast<float*>(table[blockIdx.x]);
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = 1000.0f * blockIdx.x + i;
}
"""


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_virtual_layout_and_ptr_table(world_size):
    import cupy

    from mok_proto.symm.virtual import ALIGN, VirtualWorld

    mod = cupy.RawModule(code=_TABLE_KERNELS)
    read_first, write_first = mod.get_function("read_first"), mod.get_function("write_first")
    with VirtualWorld(world_size) as world:
        assert world.num_ranks == world_size and world.launch_ranks == list(range(world_size))
        assert world.backend == "virtual"
        a = world.alloc("a", (3, 5), np.float32)  # 60 bytes per rank: padded to one 256-byte stride
        assert a.nbytes == 60 and a.stride_bytes == ALIGN and a.stacked.shape == (world_size, 3, 5)
        table = a.ptr_table.get()
        base = int(a.stacked.data.ptr)
        assert table.dtype == np.uint64 and table.shape == (world_size,)
        assert [int(t) for t in table] == [base + r * a.stride_bytes for r in range(world_size)]
        for r in range(world_size):
            inst = a.instance(r)
            assert inst.shape == (3, 5) and inst.dtype == np.float32 and inst.flags.c_contiguous
            assert inst.data.ptr == int(table[r]) and inst.data.ptr % ALIGN == 0
            assert not inst.any(), "fresh instances start zeroed"
        # Host writes through instance(r) are what a kernel reads at ptr_table[r] ...
        for r in range(world_size):
            a.instance(r)[...] = cupy.arange(15, dtype=cupy.float32).reshape(3, 5) + 100 * r
        out = cupy.zeros((world_size, 15), cupy.float32)
        read_first((world_size,), (32,), (a.ptr_table, out, np.int32(15)))
        expect = np.arange(15, dtype=np.float32)[None, :] + 100 * np.arange(world_size)[:, None]
        np.testing.assert_array_equal(out.get(), expect)
        # ... and a kernel's stores at ptr_table[r] land in instance(r) only.
        write_first((world_size,), (32,), (a.ptr_table, np.int32(15)))
        cupy.cuda.Device().synchronize()
        for r in range(world_size):
            np.testing.assert_array_equal(a.instance(r).get().reshape(-1), 1000 * r + np.arange(15))
        # Larger, odd-sized instances keep the alignment; names are unique.
        b = world.alloc("b", (7, 33), np.int16)
        assert b.stride_bytes % ALIGN == 0 and b.stride_bytes >= b.nbytes == 7 * 33 * 2
        assert all(int(p) % ALIGN == 0 for p in b.ptr_table.get())
        with pytest.raises(ValueError, match="already allocated"):
            world.alloc("a", (3, 5), np.float32)
        f = world.signals("f", 3)
        assert f.array.shape == (3, world_size) and f.array.dtype == np.uint64
        assert not f.array.stacked.any()


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_virtual_conformance_program(world_size):
    # MPI stays uninitialised: the virtual backend runs without mpirun (threads, one per rank).
    proc = subprocess.run([sys.executable, "tests/mpi_programs/check_symm.py", "--backend", "virtual",
                           "--ranks", str(world_size)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, MPI4PY_RC_INITIALIZE="0",
                                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert f"OK symm conformance backend=virtual R={world_size}" in proc.stdout


@pytest.mark.gpu
def test_virtual_rank_views():
    from mok_proto.symm.base import SymmTimeoutError
    from mok_proto.symm.virtual import VirtualWorld

    with VirtualWorld(4) as world:
        assert world.rank_view(2) is world.rank_view(2)
        with pytest.raises(ValueError):
            world.rank_view(4)

        def body(heap):
            x = heap.alloc("x", (4, 2), np.float32)
            x.put_rows((heap.rank + 1) % 4, [heap.rank], np.full((1, 2), heap.rank + 1, np.float32))
            flags = heap.signals("s", 1)
            flags.signal((heap.rank + 1) % 4, 0, 7)
            src = (heap.rank - 1) % 4
            flags.wait(0, src, 7, timeout_s=30, op="ring")
            assert (x.local[src] == src + 1).all()
            with pytest.raises(ValueError, match="already allocated"):
                heap.alloc("x", (4, 2), np.float32)
            heap.barrier()
            return x.ptr_table.get().tolist()

        tables = world.run_threads(body, timeout_s=120)
        assert all(t == tables[0] for t in tables)
        x = world.arrays["x"]
        for r in range(4):
            expect = np.zeros((4, 2), np.float32)
            expect[(r - 1) % 4] = (r - 1) % 4 + 1
            np.testing.assert_array_equal(x.instance(r).get(), expect)

        # Collective shape mismatch: the disagreeing rank gets a ValueError naming the array.
        def mismatch(heap):
            heap.alloc("y", (3,) if heap.rank else (2,), np.float32)

        # (the rank that arrives first decides the shape; some other rank must disagree)
        with pytest.raises(ValueError, match="'y'"):
            world.run_threads(mismatch, timeout_s=60)

    # The timeout names the peer, without threads: a world-level flag table seen by rank 0.
    with VirtualWorld(2) as world:
        flags = world.signals("t", 1)
        with pytest.raises(SymmTimeoutError, match="peer 1") as info:
            flags.for_rank(0).wait(0, 1, 1, timeout_s=0.3, op="missing peer")
        assert (info.value.op, info.value.rank, info.value.peer) == ("missing peer", 0, 1)
        flags.for_rank(1).signal(0, 0, 1)
        flags.for_rank(0).wait(0, 1, 1, timeout_s=5, op="present peer")
        assert int(flags.array.instance(0)[0, 1]) == 1 and not flags.array.instance(1).any()
        with pytest.raises(ValueError, match="world-level"):
            flags.read(0, 1)


@pytest.mark.gpu
def test_virtual_failing_rank_does_not_hang():
    from mok_proto.symm.virtual import VirtualWorld

    def body(heap):
        if heap.rank == 1:
            raise KeyError("rank 1 broke")
        heap.alloc("z", (2,), np.float32)  # the others wait here for rank 1: they must not hang
        heap.barrier()

    with VirtualWorld(3, barrier_timeout_s=60) as world:
        with pytest.raises(KeyError, match="rank 1 broke"):
            world.run_threads(body, timeout_s=30)


# ---- GPU: NVSHMEM, one process per rank ----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_nvshmem_conformance(num_ranks):
    proc = _python("import nvshmem.core")
    if proc.returncode != 0:
        pytest.skip(f"nvshmem4py is not importable: {proc.stderr.strip().splitlines()[-1:]}")
    proc = run_ranks(num_ranks, "tests/mpi_programs/check_symm.py", "--backend", "nvshmem", timeout=300)
    assert f"OK symm conformance backend=nvshmem R={num_ranks}" in proc.stdout
