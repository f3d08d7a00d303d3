"""Ceilings measured in the same run as a benchmark: a device copy, a peer pull under NVSHMEM, an
NCCL all-to-all, and a dense BF16 and FP8 (e4m3) matrix multiply."""

from __future__ import annotations

import numpy as np

from mok_proto.bench.timing import time_stages


def copy_ceiling_gbs(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy of nbytes: bytes COPIED per second (read + written is twice that)."""
    import cupy

    src = cupy.ones(nbytes // 4, dtype=np.float32)
    dst = cupy.empty_like(src)
    samples = time_stages(lambda mark: (mark("copy"), dst.__setitem__(Ellipsis, src), mark(None)), iters, 3)
    return nbytes / (np.median(samples["copy"]) * 1e-3) / 1e9


def peer_pull_gbs(heap, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Link ceiling under NVSHMEM: every rank copies nbytes from the next rank's symmetric buffer
    at once (a device copy through the peer mapping), in bytes per second per GPU."""
    import cupy

    buf = heap.alloc("link-ceiling", (nbytes // 4,), np.float32)
    dst = cupy.empty(nbytes // 4, np.float32)
    peer = (heap.rank + 1) % heap.num_ranks
    src = buf.instance(peer)
    heap.barrier()
    samples = time_stages(lambda mark: (mark("pull"), dst.__setitem__(Ellipsis, src), mark(None)), iters, 2)
    heap.free(buf)
    return nbytes / (np.median(samples["pull"]) * 1e-3) / 1e9


def nccl_a2a_gbs(num_ranks, nbytes=1 << 30, iters=10):
    """all_to_all_single of nbytes per rank: bytes that leave each GPU per second."""
    import torch
    import torch.distributed as dist

    send = torch.ones(nbytes // 4, device="cuda")
    recv = torch.empty_like(send)
    samples = time_stages(lambda mark: (mark("a2a"), dist.all_to_all_single(recv, send), mark(None)), iters, 2,
                          api="torch")
    return nbytes * (num_ranks - 1) / num_ranks / (np.median(samples["a2a"]) * 1e-3) / 1e9


DENSE_N = 8192  # the dense GEMM every row's fraction_of_dense is measured against


def of_dense(row: dict, useful_tflops: float | None, dense_tflops: float) -> dict:
    """`row` with `dense_tflops` (the dense DENSE_N^3 BF16 matmul of the same run) and
    `fraction_of_dense`: the row's useful TFLOP/s over it (None where the row has none)."""
    fraction = None if useful_tflops is None else useful_tflops / dense_tflops
    return {**row, "dense_tflops": dense_tflops, "fraction_of_dense": fraction}


def dense_matmul_tflops(n: int = DENSE_N, iters: int = 20, warmup: int = 5) -> float:
    """A dense n x n x n BF16 torch.matmul (cuBLAS) in TFLOP/s: the GPU's GEMM ceiling in this run."""
    import torch

    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    samples = time_stages(lambda mark: (mark("mm"), torch.matmul(a, b), mark(None)), iters, warmup, api="torch")
    return 2 * n ** 3 / (np.median(samples["mm"]) * 1e-3) / 1e12


def dense_fp8_tflops(n: int = DENSE_N, iters: int = 20, warmup: int = 5) -> float | None:
    """A dense n x n x n e4m3 torch._scaled_mm (cuBLASLt, one scale per tensor, bf16 out) in TFLOP/s:
    the GPU's FP8 GEMM ceiling in this run; None where this torch or GPU offers none."""
    import torch

    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes it
    one = torch.ones((), device="cuda")
    try:
        torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    except (AttributeError, RuntimeError, ValueError, NotImplementedError):  # no FP8 GEMM in this torch or GPU
        return None
    samples = time_stages(lambda mark: (mark("mm"), torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16),
                                        mark(None)), iters, warmup, api="torch")
    return 2 * n ** 3 / (np.median(samples["mm"]) * 1e-3) / 1e12
