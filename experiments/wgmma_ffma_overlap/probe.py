"""Does a warpgroup's FP32 promotion run at full speed while the tensor cores run another's MMAs?

    python experiments/wgmma_ffma_overlap/probe.py [--iters 4096]          (on the GPU machine)

One CTA an SM, two warpgroups, operands in shared memory (zeros), nothing loaded from global
memory. A "group" is the FP8 weight gradients' MMA unit, four m64n128k32 e4m3 wgmma (an n128 half
of a 128-deep k-block, cuda/gemm_fp8.cuh), committed and waited for; a "promotion" is what
gemm_fp8's promote_quarter does to such a half: 64 accumulators += block * (sa * sb), its 32 column
scales read as eight 16-byte shared loads and its 2 row scales as two 4-byte ones. Modes:
  mma         warpgroup 0 runs groups back to back; warpgroup 1 idles
  promote     warpgroup 1 runs promotions back to back; warpgroup 0 idles
  both        the two at once, each on its own (does one slow the other?)
  chain       each warpgroup: group, wait, promotion, repeated (the weight gradients' k-loop)
  chain-one   the chain on warpgroup 0 alone
Each mode runs twice: with 64 accumulators a thread (one group an iteration) and with the weight
gradients' 128 (two groups an iteration, each promoted into its half: their register pressure).
Prints each mode's cycles a group (median over the SMs; clock64 of thread 0 of each warpgroup) and
the tensor cores' share of their FP8 peak (8,192 FLOP a cycle an SM)."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
MODES = ("mma", "promote", "both", "chain", "chain-one")

SOURCE = r"""
#include "hopper.cuh"
using namespace mok;

__device__ __forceinline__ u64 desc_add(u64 d, u32 add) {
  return (d & 0xFFFFFFFF00000000ull) | static_cast<u32>(static_cast<u32>(d) + add);
}

// mode: 0 mma, 1 promote, 2 both, 3 chain, 4 chain-one (MODES' order); kAcc / 64 groups an
// iteration, group g promoted into accumulators 64 g .. 64 g + 63.
template <int kAcc>
__device__ __forceinline__ void probe(int mode, int iters, long long* cycles, float* sink) {
  extern __shared__ char smem_raw[];
  char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127, lane = tid & 31;
  for (int i = threadIdx.x; i < (24 * 1024 + 1024) / 16; i += 256)  // A 8 KB, B 16 KB, scales 1 KB
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0u, 0u, 0u, 0u);
  __syncthreads();
  float* scales = reinterpret_cast<float*>(smem + 24 * 1024);
  for (int i = threadIdx.x; i < 256; i += 256) scales[i] = 1.0f + 1e-3f * i;
  fence_proxy_async();
  __syncthreads();
  const u32 base = smem_addr(smem), s_b = base + 24 * 1024;
  const u64 da = wgmma_desc(base, 16, 1024), db = wgmma_desc(base + 8192, 16, 1024);
  float blk[64], acc[kAcc];
#pragma unroll
  for (int i = 0; i < 64; ++i) blk[i] = 1e-3f * i;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 1e-3f * tid;
  const bool mma = mode == 3 || (mode == 4 && wg == 0) || ((mode == 0 || mode == 2) && wg == 0);
  const bool promote = mode == 3 || (mode == 4 && wg == 0) || ((mode == 1 || mode == 2) && wg == 1);
  __syncthreads();
  const long long t0 = clock64();
  if (mma || promote) {
#pragma unroll 1
    for (int it = 0; it < iters; ++it) {
#pragma unroll
     for (int g = 0; g < kAcc / 64; ++g) {
      if (mma) {
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) wgmma_m64n128k32_e4m3(blk, desc_add(da, 2 * ks), desc_add(db, 2 * ks), ks);
        wgmma_commit();
        wgmma_wait<0>();
        fence_accumulators(blk);
      }
      if (promote) {
        const u32 at = s_b + 4 * ((it & 1) * 64);  // two stages' scales, as a ring would alternate
        const float sa0 = ld_shared_f32(at + 4 * (lane >> 2)), sa1 = ld_shared_f32(at + 4 * (8 + (lane >> 2)));
#pragma unroll
        for (int m = 0; m < 8; ++m) {
          const uint4 w = ld_shared_u32x4(at + 4 * (16 * m + 4 * (lane & 3)));
          const float b[4] = {__uint_as_float(w.x), __uint_as_float(w.y), __uint_as_float(w.z), __uint_as_float(w.w)};
#pragma unroll
          for (int c = 0; c < 8; ++c) {
            const int e = 8 * m + c;
            acc[64 * g + e] = __fmaf_rn(blk[e], __fmul_rn((c & 2) ? sa1 : sa0, b[(c >> 2) * 2 + (c & 1)]), acc[64 * g + e]);
          }
        }
      }
     }
    }
  }
  const long long t1 = clock64();
  if (tid == 0) cycles[2 * blockIdx.x + wg] = t1 - t0;
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 64; ++i) s += blk[i];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) s += acc[i];
  sink[blockIdx.x * 256 + threadIdx.x] = s;
}

extern "C" __global__ void __launch_bounds__(256, 1) probe64(int mode, int iters, long long* cycles, float* sink) {
  probe<64>(mode, iters, cycles, sink);
}
// The weight gradients' registers: 128 accumulators (both n128 halves of a k-block) and the temporary.
extern "C" __global__ void __launch_bounds__(256, 1) probe128(int mode, int iters, long long* cycles, float* sink) {
  probe<128>(mode, iters, cycles, sink);
}
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=4096)
    args = p.parse_args(argv)
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
    module = cp.RawModule(code=SOURCE, options=("-std=c++17", "--gpu-architecture=sm_90a", f"-I{CUDA_DIR}"))
    smem = 24 * 1024 + 1024 + 1024
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    cycles = cp.zeros(2 * sms, dtype=cp.int64)
    sink = cp.zeros(256 * sms, dtype=cp.float32)
    flop_group = 2 * 64 * 128 * 128
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {sms} SMs, {args.iters} iterations")
    print(f"{'acc':>3} {'mode':10} {'wg0 cyc/grp':>11} {'wg1 cyc/grp':>11} {'tensor':>7}")
    for n_acc in (64, 128):
        kernel = module.get_function(f"probe{n_acc}")
        groups_it = n_acc // 64  # groups (and promotions) a warpgroup runs an iteration
        for index, mode in enumerate(MODES):
            for _ in range(2):  # the first launch warms up
                kernel((sms,), (256,), (cp.int32(index), cp.int32(args.iters), cycles, sink), shared_mem=smem)
            cp.cuda.Device().synchronize()
            c = cycles.get().reshape(sms, 2) / (args.iters * groups_it)
            wg0, wg1 = statistics.median(c[:, 0]), statistics.median(c[:, 1])
            wgs = {"mma": 1, "both": 1, "chain": 2, "chain-one": 1}.get(mode, 0)  # warpgroups running MMAs
            busy = wgs * flop_group / (max(wg0, wg1) * 8192) if wgs else 0.0
            print(f"{n_acc:3} {mode:10} {wg0:11.0f} {wg1:11.0f} {busy:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
