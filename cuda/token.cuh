// The token owner's arithmetic of the GPU layer (bf16 rows, fp32 accumulation, fixed order):
//   weighted_sum     out[t] = base[t] + sum_j w[t,j] * y_slots[t*K+j]            (forward)
//   scale_to_slots   dy_slots[t*K+j] = w[t,j] * dout[t]                          (backward, before
//                    reverse-combine)
//   slot_sum         dx[t] = dx_base[t] + sum_j dx_slots[t*K+j]                 (backward, after
//                    reverse-dispatch)
//   topk_weight_grad d_topk_w[t,j] = <dout[t], y_slots[t*K+j]>
// Every sum runs j = 0..K-1 in order with separately rounded products and sums (no FMA), so the
// result does not depend on the launch geometry. Memory bound: weighted_sum reads (K + 1) N H
// bf16 and writes N H; scale_to_slots reads N H, writes N K H; slot_sum reads (K + 1) N H, writes
// N H; topk_weight_grad reads (K + 1) N H.
//
// Legend: N tokens/rank, H hidden (even), K top-k, W ranks driven by one launch; `rank` is an EP
// rank (rank_base + blockIdx.y). A *slot* s = t*K + j is token t's j-th choice. Buffers come as
// peer tables (TokenParams, cuda/abi.cuh); each kernel touches only its own rank's instances.
#pragma once
#include "common.cuh"

namespace mok {

__device__ __forceinline__ int token_rank(const TokenParams* p) { return static_cast<int>(p->rank_base) + blockIdx.y; }

// Element pairs (two bf16 in one u32) of one rank's [rows, H] buffer.
__device__ __forceinline__ const u32* pairs(const u64* table, int rank) { return at<const u32>(table, rank); }
__device__ __forceinline__ u32* pairs_out(const u64* table, int rank) { return at<u32>(table, rank); }

// out[t] = base[t] + sum_j w[t,j] * y_slots[t*K+j]: one thread per element pair.  grid (nb, W).
__global__ void __launch_bounds__(kCommThreads) weighted_sum_bf16(const TokenParams* p) {
  const int rank = token_rank(p);
  const i64 hp = p->hidden / 2, k = p->top_k;
  const float* w = at<const float>(p->topk_w, rank);
  const u32* y = pairs(p->y_slots, rank);
  for (i64 i = blockIdx.x * blockDim.x + threadIdx.x; i < p->num_tokens * hp; i += gridDim.x * blockDim.x) {
    const i64 t = i / hp, c = i - t * hp;
    float lo = 0.0f, hi = 0.0f;
    if (p->has_base) {
      const u32 b = pairs(p->base, rank)[i];
      lo = bf16_lo(b), hi = bf16_hi(b);
    }
    for (i64 j = 0; j < k; ++j) {
      const float wj = w[t * k + j];
      const u32 v = y[(t * k + j) * hp + c];
      lo = __fadd_rn(lo, __fmul_rn(wj, bf16_lo(v)));
      hi = __fadd_rn(hi, __fmul_rn(wj, bf16_hi(v)));
    }
    pairs_out(p->out, rank)[i] = pack_bf16x2(lo, hi);
  }
}

// dy_slots[t*K+j] = w[t,j] * dout[t]: one thread per element pair of a slot.  grid (nb, W).
__global__ void __launch_bounds__(kCommThreads) scale_to_slots(const TokenParams* p) {
  const int rank = token_rank(p);
  const i64 hp = p->hidden / 2;
  const float* w = at<const float>(p->topk_w, rank);
  const u32* dout = pairs(p->dout, rank);
  u32* dy = pairs_out(p->dy_slots, rank);
  for (i64 i = blockIdx.x * blockDim.x + threadIdx.x; i < p->num_tokens * p->top_k * hp; i += gridDim.x * blockDim.x) {
    const i64 s = i / hp, c = i - s * hp;
    const float ws = w[s];
    const u32 v = dout[(s / p->top_k) * hp + c];
    dy[i] = pack_bf16x2(__fmul_rn(ws, bf16_lo(v)), __fmul_rn(ws, bf16_hi(v)));
  }
}

// dx[t] = dx_base[t] + sum_j dx_slots[t*K+j]: one thread per element pair.  grid (nb, W).
__global__ void __launch_bounds__(kCommThreads) slot_sum(const TokenParams* p) {
  const int rank = token_rank(p);
  const i64 hp = p->hidden / 2, k = p->top_k;
  const u32* dxs = pairs(p->dx_slots, rank);
  for (i64 i = blockIdx.x * blockDim.x + threadIdx.x; i < p->num_tokens * hp; i += gridDim.x * blockDim.x) {
    const i64 t = i / hp, c = i - t * hp;
    float lo = 0.0f, hi = 0.0f;
    if (p->has_base) {
      const u32 b = pairs(p->dx_base, rank)[i];
      lo = bf16_lo(b), hi = bf16_hi(b);
    }
    for (i64 j = 0; j < k; ++j) {
      const u32 v = dxs[(t * k + j) * hp + c];
      lo = __fadd_rn(lo, bf16_lo(v));
      hi = __fadd_rn(hi, bf16_hi(v));
    }
    pairs_out(p->dx, rank)[i] = pack_bf16x2(lo, hi);
  }
}

// d_topk_w[s] = <dout[s / K], y_slots[s]>: one warp per slot; lane l sums pairs l, l + 32, ... in
// order, then a fixed butterfly adds the lanes.  grid (nb, W), blocks of whole warps.
__global__ void __launch_bounds__(kCommThreads) topk_weight_grad(const TokenParams* p) {
  const int rank = token_rank(p), lane = threadIdx.x & 31;
  const i64 hp = p->hidden / 2;
  const u32* dout = pairs(p->dout, rank);
  const u32* y = pairs(p->y_slots, rank);
  const i64 warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, warps = (gridDim.x * blockDim.x) >> 5;
  for (i64 s = warp; s < p->num_tokens * p->top_k; s += warps) {
    const u32* a = dout + (s / p->top_k) * hp;
    const u32* b = y + s * hp;
    float acc = 0.0f;
    for (i64 c = lane; c < hp; c += 32) {
      const u32 u = a[c], v = b[c];
      acc = __fadd_rn(acc, __fmul_rn(bf16_lo(u), bf16_lo(v)));
      acc = __fadd_rn(acc, __fmul_rn(bf16_hi(u), bf16_hi(v)));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, off));
    if (lane == 0) at<float>(p->d_topk_w, rank)[s] = acc;
  }
}

}  // namespace mok
