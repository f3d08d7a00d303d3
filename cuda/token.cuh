// The token owner's arithmetic of the GPU layer (bf16 rows, fp32 accumulation, fixed order):
//   weighted_sum     out[t] = base[t] + sum_j w[t,j] * y_slots[t*K+j]            (forward)
//   scale_to_slots   dy_slots[t*K+j] = w[t,j] * dout[t]                          (backward, before
//                    reverse-combine)
//   slot_sum         dx[t] = dx_base[t] + sum_j dx_slots[t*K+j]                 (backward, after
//                    reverse-dispatch)
//   topk_weight_grad d_topk_w[t,j] = <dout[t], y_slots[t*K+j]>
// weighted_sum also checks that every slot got a result (recv_row >= 0: its expert owner did not
// overflow) and reports kErrCapacity / kOpWeightedSum otherwise (common.cuh sum_checking_slots,
// report_unplaced_slots: the check comm.cuh's fp32 weighted_sum shares).
// Every sum runs j = 0..K-1 in order with separately rounded products and sums (no FMA), so the
// result does not depend on the launch geometry. Memory bound: weighted_sum reads (K + 1) N H
// bf16 and writes N H; scale_to_slots reads N H, writes N K H; slot_sum reads (K + 1) N H, writes
// N H; topk_weight_grad reads (K + 1) N H.
//
// Legend: N tokens/rank, H hidden (a multiple of 8: rows move as 16-byte octets), K top-k, W ranks driven by one launch; `rank` is an EP
// rank (rank_base + blockIdx.y). A *slot* s = t*K + j is token t's j-th choice. Buffers come as
// peer tables (TokenParams, cuda/abi.cuh); each kernel touches only its own rank's instances.
#pragma once
#include "common.cuh"

namespace mok {

__device__ __forceinline__ int token_rank(const TokenParams* p) { return static_cast<int>(p->rank_base) + blockIdx.y; }

// Octets (eight bf16, 16 bytes) of one rank's [rows, H] buffer: every access is 16 bytes wide.
__device__ __forceinline__ const uint4* octets(const u64* table, int rank) { return at<const uint4>(table, rank); }
__device__ __forceinline__ uint4* octets_out(const u64* table, int rank) { return at<uint4>(table, rank); }

// Octets [begin, end) of the rank's N H / 8 output octets (this thread's share: `threads`): octet
// i of token t = base[t] (has_base, else 0) + sum_j w[t,j] * slots[t*K+j] (kWeighted) or
// + sum_j slots[t*K+j], j in order; written to out.
// NOTE: kept as plain loops (nvcc unrolls them and ptxas issues the loads ahead of the adds):
// loading a batch of slot octets into an array first makes the fused kernel's mover warps (120
// registers) spill.
template <bool kWeighted>
__device__ __forceinline__ void sum_slots(const TokenParams* p, int rank, const u64* base, const u64* slots,
                                          const u64* out, i64 begin, i64 end, Workers threads) {
  const i64 h8 = p->hidden / 8, k = p->top_k;
  const float* w = at<const float>(p->topk_w, rank);
  const uint4* rows = octets(slots, rank);
  for (i64 i = begin + threads.id; i < end; i += threads.count) {
    const i64 t = i / h8, c = i - t * h8;
    float acc[8], f[8];
    if (p->has_base) {
      unpack8(octets(base, rank)[i], acc);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
    }
    for (i64 j = 0; j < k; ++j) {
      unpack8(rows[(t * k + j) * h8 + c], f);
      const float wj = kWeighted ? w[t * k + j] : 1.0f;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], kWeighted ? __fmul_rn(wj, f[e]) : f[e]);
    }
    octets_out(out, rank)[i] = pack8(acc);
  }
}

// d_topk_w[s] = <dout[s / K], y_slots[s]> for slots [begin, end), one warp per slot (`warps`, lane
// `lane`): lane l sums octets l, l + 32, ... element by element in order, then a fixed butterfly
// adds the lanes.
__device__ __forceinline__ void topk_weight_grad_part(const TokenParams* p, int rank, i64 begin, i64 end,
                                                      Workers warps, int lane) {
  const i64 h8 = p->hidden / 8;
  const uint4* dout = octets(p->dout, rank);
  const uint4* y = octets(p->y_slots, rank);
  for (i64 s = begin + warps.id; s < end; s += warps.count) {
    const uint4* a = dout + (s / p->top_k) * h8;
    const uint4* b = y + s * h8;
    float acc = 0.0f, fa[8], fb[8];
    for (i64 c = lane; c < h8; c += 32) {
      unpack8(a[c], fa);
      unpack8(b[c], fb);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc = __fadd_rn(acc, __fmul_rn(fa[e], fb[e]));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
    if (lane == 0) at<float>(p->d_topk_w, rank)[s] = acc;
  }
}

// The token gradients of tokens [t0, t1) (the fused backward's token-gradient task; the standalone
// slot_sum and topk_weight_grad are the whole range): dx = dx_base + the K slots' sum, then
// d topk_weights of their slots. `threads` / `warps`: the caller's share, `lane` its lane.
__device__ __forceinline__ void token_grads(const TokenParams* p, int rank, i64 t0, i64 t1, Workers threads,
                                            Workers warps, int lane) {
  const i64 h8 = p->hidden / 8;
  sum_slots<false>(p, rank, p->dx_base, p->dx_slots, p->dx, t0 * h8, t1 * h8, threads);
  topk_weight_grad_part(p, rank, t0 * p->top_k, t1 * p->top_k, warps, lane);
}

// out[t] = base[t] + sum_j w[t,j] * y_slots[t*K+j].  grid (nb, W).
// Also the forward's check that every slot got its expert's result (see report_unplaced_slots):
// a slot whose expert owner overflowed has recv_row < 0 and its y_slots row was never written;
// the sum runs anyway (nothing waits on this kernel), the error record says so. The check reads
// N*K int32 once per launch rank (each thread a share, the first issued before the sum): common.cuh
// sum_checking_slots, whose share (grid_threads) sum_slots strides.
__global__ void __launch_bounds__(kCommThreads) weighted_sum_bf16(const TokenParams* p) {
  const int rank = token_rank(p);
  sum_checking_slots(p, rank, [&](Workers threads) {
    sum_slots<true>(p, rank, p->base, p->y_slots, p->out, 0, p->num_tokens * (p->hidden / 8), threads);
  });
}

// dy_slots[t*K+j] = w[t,j] * dout[t] for dout octets [begin, end) (this thread's share:
// `threads`): a thread reads each of its dout octets once and writes it scaled into the token's K
// slots (a warp's writes of one slot are 512 contiguous bytes). (One thread per slot octet
// instead, with a 64-bit division per octet written and K reads of each dout octet, reaches half
// of a copy's rate.)
__device__ __forceinline__ void scale_part(const TokenParams* p, int rank, i64 begin, i64 end, Workers threads) {
  const i64 h8 = p->hidden / 8, k = p->top_k;
  const float* w = at<const float>(p->topk_w, rank);
  const uint4* dout = octets(p->dout, rank);
  uint4* dy = octets_out(p->dy_slots, rank);
  for (i64 i = begin + threads.id; i < end; i += threads.count) {
    const i64 t = i / h8, c = i - t * h8;
    float f[8], g[8];
    unpack8(dout[i], f);
    for (i64 j = 0; j < k; ++j) {
      const float ws = w[t * k + j];
#pragma unroll
      for (int e = 0; e < 8; ++e) g[e] = __fmul_rn(ws, f[e]);
      dy[(t * k + j) * h8 + c] = pack8(g);
    }
  }
}

// dy_slots = w * dout of every token (scale_part).  grid (nb, W).
__global__ void __launch_bounds__(kCommThreads) scale_to_slots(const TokenParams* p) {
  scale_part(p, token_rank(p), 0, p->num_tokens * (p->hidden / 8), grid_threads());
}

// dx[t] = dx_base[t] + sum_j dx_slots[t*K+j].  grid (nb, W).
__global__ void __launch_bounds__(kCommThreads) slot_sum(const TokenParams* p) {
  sum_slots<false>(p, token_rank(p), p->dx_base, p->dx_slots, p->dx, 0, p->num_tokens * (p->hidden / 8),
                   grid_threads());
}

// d_topk_w[s] = <dout[s / K], y_slots[s]> (topk_weight_grad_part over every slot).  grid (nb, W).
__global__ void __launch_bounds__(kCommThreads) topk_weight_grad(const TokenParams* p) {
  topk_weight_grad_part(p, token_rank(p), 0, p->num_tokens * p->top_k, grid_warps(), threadIdx.x & 31);
}

}  // namespace mok
