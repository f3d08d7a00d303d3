"""Does a warpgroup's FP32 promotion run at full speed while the tensor cores run another's MMAs?

    python experiments/wgmma_ffma_overlap/probe.py [--iters 4096]          (on the GPU machine)

One CTA an SM, two warpgroups (chain-three: three), operands in shared memory (zeros), nothing read from global memory,
at most 232 registers a thread (what a consumer could have beside a 40-register producer; the FP8
GEMMs' consumers have 224). A "group" is the FP8 GEMMs' MMA unit, four m64n128k32 e4m3 wgmma (an
n128 half of a 128-deep k-block, cuda/gemm_fp8.cuh), committed and waited for; a "promotion" adds
such a half's 64 values a thread into fp32 accumulators, as gemm_fp8's promote_quarter does, in
one of three kinds:
  wgrad         block * (sa * sb): a FMUL and a FFMA a value, the 32 column scales read as eight
                16-byte shared loads and the 2 row scales as two 4-byte ones (the weight
                gradients); in a chain the row scales and two of the eight loads are issued under
                the group's MMAs (the kernel reads its row scales before the MMAs, and two loads
                under them)
  wgrad-regs    the same arithmetic with every scale in registers (no shared loads; with 64
                accumulators only: 128 leave no room for 32 scales)
  row           block * s, one FFMA a value, s in registers (the row problems)
Modes:
  mma           warpgroup 0 runs groups back to back; warpgroup 1 idles
  mma-two       both warpgroups run groups back to back (how busy two keep the tensor cores)
  promote       warpgroup 1 runs promotions back to back; warpgroup 0 idles
  both          warpgroup 0 runs --iters groups while warpgroup 1 runs promotions until it is
                done (does one slow the other?)
  chain         each warpgroup: group, wait, promotion, repeated (the FP8 GEMMs' k-loop)
  chain-one     the chain on warpgroup 0 alone
  pair          each warpgroup: two groups into two temporaries, the first promoted while the second
                runs, then the second with no MMA under it (64 accumulators only: a 128 x 128
                tile's warpgroup over two k-blocks); what a second temporary would buy
  pair-one      the pair on warpgroup 0 alone
  chain-three   the chain on three warpgroups (384 threads, at most 168 registers: 64 accumulators;
                what a kernel of three consumer warpgroups could keep the tensor cores doing)
The modes that promote run with 64 accumulators a thread (one group an iteration); promote, chain
and chain-one also with the FP8 GEMMs' 128 (two groups an iteration, each promoted into its half:
their register pressure; with 128, a mode whose MMA warpgroup promotes nothing would never read its
first group, which ptxas then drops); the
promotions' temporaries and scales are run-time values (no constant folded in). Prints
cycles a group or promotion (median over the SMs; clock64 and the iteration count of thread 0 of
each warpgroup; "-": the warpgroup idles) and the tensor cores' share of their FP8 peak (8,192
FLOP a cycle an SM) over the warpgroups that run groups."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
MODES = ("mma", "mma-two", "promote", "both", "chain", "chain-one", "pair", "pair-one", "chain-three")
KINDS = ("wgrad", "wgrad-regs", "row")
MMA_WARPGROUPS = {"mma": (0,), "mma-two": (0, 1), "both": (0,), "chain": (0, 1), "chain-one": (0,), "pair": (0, 1),
                  "pair-one": (0,), "chain-three": (0, 1, 2)}
MAX_WARPGROUPS = 3
MAX_REGISTERS = 232  # the FP8 GEMM consumers' with a 40-register producer

SOURCE = r"""
#include "gemm_fp8.cuh"
using namespace mok;
using gemm_fp8::desc_plus;
// x as if changed: keeps a register value from being hoisted out of the loop, at no instruction.
__device__ __forceinline__ float opaque(float x) {
  asm volatile("" : "+f"(x));
  return x;
}
__device__ __forceinline__ float4 as_float4(uint4 w) {
  return make_float4(__uint_as_float(w.x), __uint_as_float(w.y), __uint_as_float(w.z), __uint_as_float(w.w));
}

// Four m64n128k32 into t (the first with scale-d 0), committed as one group.
__device__ __forceinline__ void issue_group(float (&t)[64], u64 da, u64 db) {
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) wgmma_m64n128k32_e4m3(t, desc_plus(da, 2 * ks), desc_plus(db, 2 * ks), ks);
  wgmma_commit();
}

// A promotion's row scales and (kind wgrad) its first two column-scale chunks, read from the stage's
// scales at `at` where the caller places this (under the MMAs), or taken from registers.
struct FirstScales {
  float sa0, sa1;
  float4 early[2];
};
template <int kKind>
__device__ __forceinline__ FirstScales first_scales(u32 at, int lane, float reg_a0, float reg_a1) {
  FirstScales f{opaque(reg_a0), opaque(reg_a1), {}};
  if (kKind == 0) {
    f.sa0 = ld_shared_f32(at + 4 * (lane >> 2)), f.sa1 = ld_shared_f32(at + 4 * (8 + (lane >> 2)));
#pragma unroll
    for (int m = 0; m < 2; ++m) f.early[m] = as_float4(ld_shared_u32x4(at + 4 * (16 * m + 4 * (lane & 3))));
  }
  return f;
}

// acc[0 .. 63] += t * scale, as KINDS[kKind] (acc: 64 accumulators of the caller's array).
template <int kKind>
__device__ __forceinline__ void promote(float* acc, const float (&t)[64], const FirstScales& f, u32 at, int lane,
                                        const float* reg_b) {
  if constexpr (kKind == 2) {
#pragma unroll
    for (int e = 0; e < 64; ++e) acc[e] = __fmaf_rn(t[e], (e & 2) ? f.sa1 : f.sa0, acc[e]);
  } else {
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    float4 b;
    if (kKind == 0) b = m < 2 ? f.early[m] : as_float4(ld_shared_u32x4(at + 4 * (16 * m + 4 * (lane & 3))));
    else b = make_float4(opaque(reg_b[4 * m]), opaque(reg_b[4 * m + 1]), opaque(reg_b[4 * m + 2]), opaque(reg_b[4 * m + 3]));
    const float bs[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const int e = 8 * m + c;
      acc[e] = __fmaf_rn(t[e], __fmul_rn((c & 2) ? f.sa1 : f.sa0, bs[(c >> 2) * 2 + (c & 1)]), acc[e]);
    }
  }
  }
}

// kMode: MODES' index (0 mma, 1 mma-two, 2 promote, 3 both, 4 chain, 5 chain-one, 6 pair, 7
// pair-one, 8 chain-three: 384 threads); kKind: KINDS' index; kAcc / 64 groups an iteration (pair
// modes: 2 and kAcc 64), group g promoted into accumulators 64 g .. 64 g + 63.
template <int kAcc, int kKind, int kMode>
__device__ __forceinline__ void probe(int iters, long long* cycles, int* counts, float* sink) {
  constexpr bool kPair = kMode == 6 || kMode == 7;
  static_assert(!kPair || kAcc == 64, "two temporaries and 128 accumulators do not fit the registers");
  extern __shared__ char smem_raw[];
  char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127, lane = tid & 31;
  for (int i = threadIdx.x; i < (24 * 1024 + 1024) / 16; i += blockDim.x)  // A 8 KB, B 16 KB, scales 1 KB
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0u, 0u, 0u, 0u);
  __syncthreads();
  float* scales = reinterpret_cast<float*>(smem + 24 * 1024);
  if (threadIdx.x < 256) scales[threadIdx.x] = 1.0f + 1e-3f * threadIdx.x;  // 256 of them
  volatile int* done = reinterpret_cast<int*>(smem + 25 * 1024);  // mode both: warpgroup 0 finished
  if (threadIdx.x == 0) *done = 0;
  fence_proxy_async();
  __syncthreads();
  const u32 base = smem_addr(smem), s_b = base + 24 * 1024;
  const u64 da = wgmma_desc(base, 16, 1024), db = wgmma_desc(base + 8192, 16, 1024);
  float blk[64], blk2[kPair ? 64 : 1], acc[kAcc], reg_b[kKind == 1 ? 32 : 1];
#pragma unroll
  for (int i = 0; i < 64; ++i) blk[i] = 1e-3f * (i + tid);  // run-time values: ptxas folds no constant in
#pragma unroll
  for (int i = 0; i < (kPair ? 64 : 1); ++i) blk2[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 1e-3f * tid;
#pragma unroll
  for (int i = 0; i < (kKind == 1 ? 32 : 1); ++i) reg_b[i] = 1.0f + 1e-3f * (i + lane);
  const float reg_a0 = 1.0f + 1e-4f * tid, reg_a1 = 1.0f - 1e-4f * tid;
  const bool mma = kMode == 1 || kMode == 4 || kMode == 6 || kMode == 8 || (wg == 0 && (kMode == 0 || kMode == 3 || kMode == 5 || kMode == 7));
  const bool promote_here = kMode == 4 || kMode == 6 || kMode == 8 || (wg == 0 && (kMode == 5 || kMode == 7)) ||
                            (wg == 1 && (kMode == 2 || kMode == 3));
  const bool until_done = kMode == 3 && wg == 1;  // runs until warpgroup 0 is done
  int it = 0;
  __syncthreads();
  const long long t0 = clock64();
  // One loop a role, so that no warpgroup-divergent path holds a wgmma (ptxas would serialize them).
  const bool chain = mma && promote_here;
  if (kPair && chain) {  // two groups in flight, the first promoted while the second runs
#pragma unroll 1
    for (; it < iters; ++it) {
      const u32 at = s_b + 4 * ((it & 1) * 64);
      issue_group(blk, da, db);
      issue_group(reinterpret_cast<float(&)[64]>(blk2), da, db);
      const FirstScales f = first_scales<kKind>(at, lane, reg_a0, reg_a1);
      wgmma_wait<1>();
      fence_accumulators(blk);
      promote<kKind>(acc, blk, f, at, lane, reg_b);
      const u32 at2 = s_b + 4 * (((it & 1) ^ 1) * 64);  // the next k-block's scales: the other stage's
      const FirstScales f2 = first_scales<kKind>(at2, lane, reg_a0, reg_a1);
      wgmma_wait<0>();
      fence_accumulators(reinterpret_cast<float(&)[64]>(blk2));
      promote<kKind>(acc, reinterpret_cast<const float(&)[64]>(blk2), f2, at2, lane, reg_b);
    }
  } else if (chain) {
#pragma unroll 1
    for (; it < iters; ++it) {
#pragma unroll
      for (int g = 0; g < kAcc / 64; ++g) {
        const u32 at = s_b + 4 * ((it & 1) * 64);  // two stages' scales, as a ring alternates
        issue_group(blk, da, db);
        const FirstScales f = first_scales<kKind>(at, lane, reg_a0, reg_a1);  // under the MMAs
        wgmma_wait<0>();
        fence_accumulators(blk);
        promote<kKind>(acc + 64 * g, blk, f, at, lane, reg_b);
      }
    }
  } else if (mma) {
#pragma unroll 1
    for (; it < iters; ++it) {
#pragma unroll
      for (int g = 0; g < kAcc / 64; ++g) {
        issue_group(blk, da, db);
        wgmma_wait<0>();
        fence_accumulators(blk);
      }
    }
  } else if (promote_here) {
#pragma unroll 1
    for (; until_done ? *done == 0 : it < iters; ++it) {
#pragma unroll
      for (int g = 0; g < kAcc / 64; ++g) {
        const u32 at = s_b + 4 * ((it & 1) * 64);
        const FirstScales f = first_scales<kKind>(at, lane, reg_a0, reg_a1);
        promote<kKind>(acc + 64 * g, blk, f, at, lane, reg_b);
      }
    }
  }
  const long long t1 = clock64();
  if (kMode == 3 && wg == 0 && tid == 0) *done = 1;
  if (tid == 0) cycles[3 * blockIdx.x + wg] = t1 - t0, counts[3 * blockIdx.x + wg] = it;
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 64; ++i) s += blk[i];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) s += acc[i];
  sink[blockIdx.x * 384 + threadIdx.x] = s;
}

// (No launch bounds on the two-warpgroup kernels: they would lift --maxrregcount's cap to 255.)
#define MOK_PROBE(ACC, KIND, MODE)                                                                   \
  extern "C" __global__ void                                                                         \
      probe_##ACC##_##KIND##_##MODE(int iters, long long* cycles, int* counts, float* sink) {        \
    probe<ACC, KIND, MODE>(iters, cycles, counts, sink);                                             \
  }
#define MOK_PROBE_THREE(ACC, KIND)                                                                   \
  extern "C" __global__ void __launch_bounds__(384, 1)                                               \
      probe_##ACC##_##KIND##_8(int iters, long long* cycles, int* counts, float* sink) {             \
    probe<ACC, KIND, 8>(iters, cycles, counts, sink);                                                \
  }
#define MOK_PROBE_KIND(ACC, KIND) MOK_PROBE(ACC, KIND, 2) MOK_PROBE(ACC, KIND, 3) MOK_PROBE(ACC, KIND, 4) MOK_PROBE(ACC, KIND, 5)
#define MOK_PROBE_PAIR(KIND) MOK_PROBE(64, KIND, 6) MOK_PROBE(64, KIND, 7)
MOK_PROBE(64, 0, 0) MOK_PROBE(64, 0, 1) MOK_PROBE_KIND(64, 0) MOK_PROBE_KIND(64, 1) MOK_PROBE_KIND(64, 2)
MOK_PROBE_PAIR(0) MOK_PROBE_PAIR(2) MOK_PROBE_THREE(64, 0) MOK_PROBE_THREE(64, 2)
#define MOK_PROBE_KIND128(KIND) MOK_PROBE(128, KIND, 2) MOK_PROBE(128, KIND, 4) MOK_PROBE(128, KIND, 5)
MOK_PROBE_KIND128(0) MOK_PROBE_KIND128(2)
"""


def warpgroups(mode: str) -> int:
    """Warpgroups of a mode's CTA (the kernel's launch bounds say the same for chain-three)."""
    return 3 if mode == "chain-three" else 2


def fits(n_acc: int, kind: str, mode: str) -> bool:
    """Whether a probe's registers fit: 128 accumulators leave no room for 32 scales (wgrad-regs) or
    a second temporary (the pair modes), nor do two temporaries for 32 scales; three warpgroups'
    168 registers only 64 accumulators and the temporary beside scales read from shared memory."""
    pair = mode.startswith("pair")
    if mode == "chain-three":
        return n_acc == 64 and kind != "wgrad-regs"
    return not ((n_acc == 128 and (kind == "wgrad-regs" or pair)) or (kind == "wgrad-regs" and pair))


def kernels():
    """(accumulators, kind, mode, kernel name) in the order printed; the MMA-only modes once."""
    for n_acc in (64, 128):
        for k, kind in enumerate(KINDS):
            for m, mode in enumerate(MODES):
                if (mode.startswith("mma") and k) or not fits(n_acc, kind, mode):
                    continue  # no promotion: the same for every kind; or no room
                if n_acc == 128 and mode in ("mma", "mma-two", "both"):
                    continue  # its MMA warpgroup never reads its first group (module docstring)
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
    cycles = cp.zeros(MAX_WARPGROUPS * sms, dtype=cp.int64)
    counts = cp.zeros(MAX_WARPGROUPS * sms, dtype=cp.int32)
    sink = cp.zeros(128 * MAX_WARPGROUPS * sms, dtype=cp.float32)
    flop_group = 2 * 64 * 128 * 128
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {sms} SMs, {args.iters} iterations")
    print(f"{'acc':>3} {'kind':10} {'mode':11} {'wg0 cyc':>8} {'wg1 cyc':>8} {'wg2 cyc':>8} {'tensor':>7}")
    for n_acc, kind, mode, name in kernels():
        kernel = module.get_function(name)
        counts.fill(0)
        for _ in range(2):  # the first launch warms up
            kernel((sms,), (128 * warpgroups(mode),), (cp.int32(args.iters), cycles, counts, sink), shared_mem=smem)
        cp.cuda.Device().synchronize()
        groups = 2 if mode.startswith("pair") else n_acc // 64  # a warpgroup's groups an iteration
        ran = counts.get().reshape(sms, MAX_WARPGROUPS)
        per = cycles.get().reshape(sms, MAX_WARPGROUPS) / (ran.clip(min=1) * groups)
        wg = [statistics.median(per[:, w]) if ran[:, w].all() else None for w in range(MAX_WARPGROUPS)]  # None: idle
        mma_wgs = MMA_WARPGROUPS.get(mode, ())
        busy = len(mma_wgs) * flop_group / (max(wg[i] for i in mma_wgs) * 8192) if mma_wgs else 0.0
        shown = [f"{c:8.0f}" if c is not None else f"{'-':>8}" for c in wg]
        print(f"{n_acc:3} {kind if not mode.startswith('mma') else '-':10} {mode:11} {' '.join(shown)} {busy:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
