"""Does a warpgroup's FP32 promotion run at full speed while the tensor cores run another's MMAs?

    python experiments/wgmma_ffma_overlap/probe.py [--iters 4096]          (on the GPU machine)

One CTA an SM, two warpgroups, operands in shared memory (zeros), nothing read from global memory,
224 registers a thread at most (the FP8 GEMM consumers' budget). A "group" is the FP8 GEMMs' MMA
unit, four m64n128k32 e4m3 wgmma (an n128 half of a 128-deep k-block, cuda/gemm_fp8.cuh),
committed and waited for; a "promotion" adds such a half's 64 values a thread into fp32
accumulators, as gemm_fp8's promote_quarter does, in one of three kinds:
  wgrad         block * (sa * sb): a FMUL and a FFMA a value, the 32 column scales read as eight
                16-byte shared loads and the 2 row scales as two 4-byte ones (the weight
                gradients); in a chain the row scales and two of the eight loads are issued under
                the group's MMAs, as consume_kblocks does
  wgrad-regs    the same arithmetic with every scale in registers (no shared loads; with 64
                accumulators only: the kernels' 128 leave no room for 32 scales)
  row           block * s, one FFMA a value, s in registers (the row problems)
Modes:
  mma           warpgroup 0 runs groups back to back; warpgroup 1 idles
  mma-two       both warpgroups run groups back to back (how busy two keep the tensor cores)
  promote       warpgroup 1 runs promotions back to back; warpgroup 0 idles
  both          warpgroup 0 runs --iters groups while warpgroup 1 runs promotions until it is
                done (does one slow the other?)
  chain         each warpgroup: group, wait, promotion, repeated (the FP8 GEMMs' k-loop)
  chain-one     the chain on warpgroup 0 alone
Each runs with 64 accumulators a thread (one group an iteration) and with the FP8 GEMMs' 128 (two
groups an iteration, each promoted into its half: their register pressure). Prints cycles a group
or promotion (median over the SMs; clock64 and the iteration count of thread 0 of each warpgroup)
and the tensor cores' share of their FP8 peak (8,192 FLOP a cycle an SM) over the warpgroups that
run groups."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
MODES = ("mma", "mma-two", "promote", "both", "chain", "chain-one")
KINDS = ("wgrad", "wgrad-regs", "row")
MMA_WARPGROUPS = {"mma": (0,), "mma-two": (0, 1), "both": (0,), "chain": (0, 1), "chain-one": (0,)}
MAX_REGISTERS = 224

SOURCE = r"""
#include "hopper.cuh"
using namespace mok;

__device__ __forceinline__ u64 desc_add(u64 d, u32 add) {
  return (d & 0xFFFFFFFF00000000ull) | static_cast<u32>(static_cast<u32>(d) + add);
}
// x as if changed: keeps a register value from being hoisted out of the loop, at no instruction.
__device__ __forceinline__ float opaque(float x) {
  asm volatile("" : "+f"(x));
  return x;
}
__device__ __forceinline__ float4 as_float4(uint4 w) {
  return make_float4(__uint_as_float(w.x), __uint_as_float(w.y), __uint_as_float(w.z), __uint_as_float(w.w));
}

// kMode: MODES' index (0 mma, 1 mma-two, 2 promote, 3 both, 4 chain, 5 chain-one); kKind: KINDS'
// index; kAcc / 64 groups an iteration, group g promoted into accumulators 64 g .. 64 g + 63.
template <int kAcc, int kKind, int kMode>
__device__ __forceinline__ void probe(int iters, long long* cycles, int* counts, float* sink) {
  extern __shared__ char smem_raw[];
  char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127, lane = tid & 31;
  for (int i = threadIdx.x; i < (24 * 1024 + 1024) / 16; i += 256)  // A 8 KB, B 16 KB, scales 1 KB
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0u, 0u, 0u, 0u);
  __syncthreads();
  float* scales = reinterpret_cast<float*>(smem + 24 * 1024);
  scales[threadIdx.x] = 1.0f + 1e-3f * threadIdx.x;  // 256 of them
  volatile int* done = reinterpret_cast<int*>(smem + 25 * 1024);  // mode both: warpgroup 0 finished
  if (threadIdx.x == 0) *done = 0;
  fence_proxy_async();
  __syncthreads();
  const u32 base = smem_addr(smem), s_b = base + 24 * 1024;
  const u64 da = wgmma_desc(base, 16, 1024), db = wgmma_desc(base + 8192, 16, 1024);
  float blk[64], acc[kAcc], reg_b[kKind == 1 ? 32 : 1];
#pragma unroll
  for (int i = 0; i < 64; ++i) blk[i] = 1e-3f * i;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 1e-3f * tid;
#pragma unroll
  for (int i = 0; i < (kKind == 1 ? 32 : 1); ++i) reg_b[i] = 1.0f + 1e-3f * (i + lane);
  const float reg_a0 = 1.0f + 1e-4f * tid, reg_a1 = 1.0f - 1e-4f * tid;
  const bool mma = kMode == 1 || kMode == 4 || (wg == 0 && (kMode == 0 || kMode == 3 || kMode == 5));
  const bool promote = kMode == 4 || (wg == 0 && kMode == 5) || (wg == 1 && (kMode == 2 || kMode == 3));
  const bool until_done = kMode == 3 && wg == 1;  // runs until warpgroup 0 is done
  int it = 0;
  __syncthreads();
  const long long t0 = clock64();
  if (mma || promote) {
#pragma unroll 1
    for (; until_done ? *done == 0 : it < iters; ++it) {
#pragma unroll
      for (int g = 0; g < kAcc / 64; ++g) {
        const u32 at = s_b + 4 * ((it & 1) * 64);  // two stages' scales, as a ring alternates
        float sa0 = 0.0f, sa1 = 0.0f;
        float4 early[2];  // kind wgrad: its first two column-scale chunks
        if (mma) {
          wgmma_fence();
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) wgmma_m64n128k32_e4m3(blk, desc_add(da, 2 * ks), desc_add(db, 2 * ks), ks);
          wgmma_commit();
        }
        if (promote && kKind == 0) {  // under the MMAs, where there are any
          sa0 = ld_shared_f32(at + 4 * (lane >> 2)), sa1 = ld_shared_f32(at + 4 * (8 + (lane >> 2)));
#pragma unroll
          for (int m = 0; m < 2; ++m) early[m] = as_float4(ld_shared_u32x4(at + 4 * (16 * m + 4 * (lane & 3))));
        }
        if (mma) {
          wgmma_wait<0>();
          fence_accumulators(blk);
        }
        if (promote && kKind == 2) {
          const float s0 = opaque(reg_a0), s1 = opaque(reg_a1);
#pragma unroll
          for (int e = 0; e < 64; ++e) acc[64 * g + e] = __fmaf_rn(blk[e], (e & 2) ? s1 : s0, acc[64 * g + e]);
        } else if (promote) {
          if (kKind == 1) sa0 = opaque(reg_a0), sa1 = opaque(reg_a1);
#pragma unroll
          for (int m = 0; m < 8; ++m) {
            float4 b;
            if (kKind == 0) b = m < 2 ? early[m] : as_float4(ld_shared_u32x4(at + 4 * (16 * m + 4 * (lane & 3))));
            else b = make_float4(opaque(reg_b[4 * m]), opaque(reg_b[4 * m + 1]), opaque(reg_b[4 * m + 2]), opaque(reg_b[4 * m + 3]));
            const float bs[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int c = 0; c < 8; ++c) {
              const int e = 8 * m + c;
              acc[64 * g + e] = __fmaf_rn(blk[e], __fmul_rn((c & 2) ? sa1 : sa0, bs[(c >> 2) * 2 + (c & 1)]), acc[64 * g + e]);
            }
          }
        }
      }
    }
  }
  const long long t1 = clock64();
  if (kMode == 3 && wg == 0 && tid == 0) *done = 1;
  if (tid == 0) cycles[2 * blockIdx.x + wg] = t1 - t0, counts[2 * blockIdx.x + wg] = it;
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 64; ++i) s += blk[i];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) s += acc[i];
  sink[blockIdx.x * 256 + threadIdx.x] = s;
}

#define MOK_PROBE(ACC, KIND, MODE)                                                                   \
  extern "C" __global__ void                                                                         \
      probe_##ACC##_##KIND##_##MODE(int iters, long long* cycles, int* counts, float* sink) {        \
    probe<ACC, KIND, MODE>(iters, cycles, counts, sink);                                             \
  }
#define MOK_PROBE_KIND(ACC, KIND) MOK_PROBE(ACC, KIND, 2) MOK_PROBE(ACC, KIND, 3) MOK_PROBE(ACC, KIND, 4) MOK_PROBE(ACC, KIND, 5)
MOK_PROBE(64, 0, 0) MOK_PROBE(64, 0, 1) MOK_PROBE_KIND(64, 0) MOK_PROBE_KIND(64, 1) MOK_PROBE_KIND(64, 2)
MOK_PROBE(128, 0, 0) MOK_PROBE(128, 0, 1) MOK_PROBE_KIND(128, 0) MOK_PROBE_KIND(128, 2)
"""


def kernels():
    """(accumulators, kind, mode, kernel name) in the order printed; the MMA-only modes once."""
    for n_acc in (64, 128):
        for k, kind in enumerate(KINDS):
            for m, mode in enumerate(MODES):
                if (mode.startswith("mma") and k) or (n_acc == 128 and kind == "wgrad-regs"):
                    continue  # no promotion: the same for every kind; 128 + 32 scales: no room
                yield n_acc, kind, mode, f"probe_{n_acc}_{k}_{m}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=4096)
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error("--iters must be at least 1")
    try:
        import cupy as cp
    except ImportError:
        print("probe.py: needs CuPy and a GPU", file=sys.stderr)
        return 2
    try:
        gpus = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError:
        gpus = 0
    if gpus == 0:
        print("probe.py: no GPU", file=sys.stderr)
        return 2
    module = cp.RawModule(code=SOURCE, options=("-std=c++17", "--gpu-architecture=sm_90a", f"-I{CUDA_DIR}",
                                                f"--maxrregcount={MAX_REGISTERS}"))
    smem = 26 * 1024 + 1024
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    cycles = cp.zeros(2 * sms, dtype=cp.int64)
    counts = cp.zeros(2 * sms, dtype=cp.int32)
    sink = cp.zeros(256 * sms, dtype=cp.float32)
    flop_group = 2 * 64 * 128 * 128
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {sms} SMs, {args.iters} iterations")
    print(f"{'acc':>3} {'kind':10} {'mode':9} {'wg0 cyc':>8} {'wg1 cyc':>8} {'tensor':>7}")
    for n_acc, kind, mode, name in kernels():
        kernel = module.get_function(name)
        for _ in range(2):  # the first launch warms up
            kernel((sms,), (256,), (cp.int32(args.iters), cycles, counts, sink), shared_mem=smem)
        cp.cuda.Device().synchronize()
        per = cycles.get().reshape(sms, 2) / (counts.get().reshape(sms, 2).clip(min=1) * (n_acc // 64))
        wg = [statistics.median(per[:, 0]), statistics.median(per[:, 1])]
        mma_wgs = MMA_WARPGROUPS.get(mode, ())
        busy = len(mma_wgs) * flop_group / (max(wg[i] for i in mma_wgs) * 8192) if mma_wgs else 0.0
        shown = [f"{c:8.0f}" if c else f"{'-':>8}" for c in wg]
        print(f"{n_acc:3} {kind if not mode.startswith('mma') else '-':10} {mode:9} {shown[0]} {shown[1]} {busy:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
