// Grouped BF16 GEMMs of the expert FFNs on Hopper: a producer warp issuing TMA tile loads into a
// 4-stage mbarrier pipeline, two consumer warpgroups issuing wgmma (fp32 accumulators), fused
// epilogues. CTAs run in clusters of two that share the B operand: the pair's tiles are stacked
// along M (same expert, same columns), each CTA loads half of B and multicasts it to both, which
// halves B's L2 -> SM traffic (a small gain: the mainloop is not L2-bound).
// The epilogue runs with the tensor cores idle, so it is lean: elementwise math in the fragment
// layout, stmatrix / shared-memory staging so every global access is 16 bytes wide, fast sigmoid
// (an IEEE division makes down_bwd much slower), and
// kDownBwd's g, u arrive through the same TMA ring as the operands instead of as global loads.
//
// Legend: T_e rows of expert e (ragged, read from device memory), H hidden, I expert FFN,
//         El experts in the group. Row buffers are [rows, *] with expert e's rows at
//         row_offsets[e] .. row_offsets[e] + row_counts[e] (the receive layout of the schedule).
//
//   problem       C[M,N] per tile                    A (major)            B (major)              epilogue
//   kGateUp       [T_e, I]  h = silu(x Wg) * (x Wu)   x [rows,H]   (K)     Wg|Wu [E,H,I]  (MN)     h (+ g, u) bf16
//   kDown         [T_e, H]  y = s_row * (h Wd)        h [rows,I]   (K)     Wd [E,I,H]     (MN)     y bf16
//   kDownBwd      [T_e, I]  dh = dy Wd^T -> dg, du    dy [rows,H]  (K)     Wd [E,I,H]     (K)      dg, du bf16
//   kGateUpBwd    [T_e, H]  dx = dg Wg^T + du Wu^T    dg|du        (K)     Wg|Wu          (K)      dx bf16
//   kDownWgrad    [I, H]    dWd = h^T dy              h^T          (MN)    dy             (MN)     fp32
//   kGateUpWgrad  [H, I]x2  dWg = x^T dg, dWu = x^T du x^T         (MN)    dg|du          (MN)     fp32
//
// Tile: BM=128 rows (one 64-row half per consumer warpgroup) x BN=256 columns (dual problems:
// 128 columns of each of two matrices) x BK=64. Rows past an expert's end only reach masked output
// rows. In the weight gradients K is the expert's rows: the consumers zero the k rows of its last,
// partial k-block that lie past its end (zero_tail_k_rows), so no expert sums another's rows and
// ragged sizes (0, 1, 129, ...) need no padding. Weight gradients: one CTA owns one output tile and sums K in
// order: deterministic, no atomics.
// Clusters: tile t of the pair grid (tile pairs along M) is run by both CTAs of one cluster; the
// CTA with cluster rank `cta` takes M tile 2i + cta. Where an expert has an odd number of M tiles
// the last pair's cta 1 recomputes its partner's tile (its loads stay in bounds, its half of B is
// still needed) and stores nothing. A fused plan's pair may hold two experts' tiles
// (Tile.multicast false): each CTA then loads all of its B itself. (`cta` is the CTA's rank in its
// cluster; this header has no EP rank.)
//
// Building blocks, so that a persistent kernel can run any sequence of tiles (gemm_tiles.cuh: the
// sizes, SharedStorage, the tile naming, the stage loads, the MMAs; here the rest):
//   SharedStorage   the shared-memory layout; sizeof + 1 KB of alignment slack is the launch's
//                   dynamic shared memory (kSmemBytes, read by Python through export_sizes)
//   gemm_setup      barriers, the pair prefix, the cluster's abort decision; returns the tile count
//   Ring            stage and phase of the mbarrier ring, advanced in the same order by the
//                   producer and the consumers
//   produce_tile    the producer warpgroup's loads of one tile into the ring
//   consume_tile    one consumer warpgroup's wgmma over one tile, then its epilogue
//   run_tiles       both roles over the tiles a scheduler yields (`bool Tiles::next(int& t)`)
//   StridedTiles    the standalone kernel's scheduler: cluster c takes t = c, c + clusters, ...
// The tile naming (group_tile, tile_of, banded_tile: the standalone kernel's order), the ring
// helpers, gemm_setup and the epilogues are
// templates over the params and shared-storage types, so gemm_fp8.cuh's FP8 tiles reuse them
// (a type with the fields they read: GemmParams, mok::gemm_fp8::Fp8GemmParams).
//
// Per tile (BM x BN x K): 2 * BM * BN * K FLOPs; each CTA loads (BM + BN / 2) * K * 2 bytes and
// receives BN / 2 * K * 2 more from its partner.
#pragma once
#include "gemm_tiles.cuh"

namespace mok {
namespace gemm {

// Epilogues. Accumulator layout of m64nNk16: thread (warp w, lane l) holds rows 16w + l/4 (+8) and
// columns 8j + 2(l%4) (+1) in acc[4j + 2*(row half) + (column)].
// fp32-staged paths (kDownBwd, weight gradients): each warp stages 32 columns of its 8 rows of one
// row half (a "group") in shared memory, then reads them back in the layout its global stores want:
//   kDownBwd          lane l holds the 8 consecutive columns 8(l%4) .. +7 of row l/4, so every
//                     bf16 store of dg, du (and every read of g, u from the aux stage) is 16 bytes;
//   weight gradients  lane l holds the 16-byte chunk l%8 of rows l/8 and l/8 + 4: each store
//                     instruction writes 4 whole 128-byte lines (fp32 outputs are 2x the bytes of
//                     bf16 ones, and this is faster for them than the kDownBwd layout).
// An area is 8 rows x 32 fp32; 16-byte chunk c of row r sits at chunk c ^ (2r % 8), so the float2
// writes and the weight gradients' float4 reads (a quarter warp: one row) are free of bank
// conflicts; kDownBwd's (a quarter warp: rows 2i and 2i + 1, chunks c and c ^ 2) are 2-way.
__device__ __forceinline__ int staged_at(int row, int col) {
  return row * 32 + ((((col >> 2) ^ (row << 1)) & 7) << 2) + (col & 3);
}

template <int kRowHalf, int kGroup>
__device__ __forceinline__ void stage_group(float* stg, const float (&acc)[128], int lane) {
  const int r = lane >> 2, q = lane & 3;
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    constexpr int kBase = 4 * 4 * kGroup + 2 * kRowHalf;  // acc index of j = 4 kGroup, this row half
    *reinterpret_cast<float2*>(stg + staged_at(r, 8 * jj + 2 * q)) =
        make_float2(acc[kBase + 4 * jj], acc[kBase + 4 * jj + 1]);
  }
}

__device__ __forceinline__ void unstage8(const float* stg, int lane, float (&f)[8]) {
  const int r = lane >> 2, c = lane & 3;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float4 v = *reinterpret_cast<const float4*>(stg + staged_at(r, 8 * c + 4 * i));
    f[4 * i] = v.x, f[4 * i + 1] = v.y, f[4 * i + 2] = v.z, f[4 * i + 3] = v.w;
  }
}

constexpr int kAuxU = kBM * 128;  // bytes from g to u in an aux stage

// A diagnostic build (MOK_GEMM_NO_EPILOGUE, bench_gemm.py --epilogue-share): each tile runs its
// k-loop (and a weight gradient's accumulator load) and stores nothing (skip_epilogue).
#ifdef MOK_GEMM_NO_EPILOGUE
enum : bool { kEpilogue = false };  // (an enum: no device variable)
#else
enum : bool { kEpilogue = true };
#endif

// 1 / (1 + e^-x) with the fast reciprocal (2 SFU operations; relative error ~1e-6, far below bf16's).
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

// Eight columns of one row of dg and du, as stored (bf16).
struct DgDu8 {
  uint4 dg, du;
};

// kDownBwd's epilogue of 8 consecutive columns of one row, at element offset `at` of dg and du:
// f = dh there; g and u of those columns are read from the aux stage at `aux`. Returns what it stored.
template <class Params>
__device__ __forceinline__ DgDu8 emit8_down_bwd(const Params* p, i64 at, const float (&f)[8], const char* aux) {
  float g[8], u[8], dg[8], du[8];
  unpack8(*reinterpret_cast<const uint4*>(aux), g);
  unpack8(*reinterpret_cast<const uint4*>(aux + kAuxU), u);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float sig = sigmoid(g[i]);
    du[i] = f[i] * g[i] * sig;
    dg[i] = f[i] * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
  }
  const DgDu8 v{pack8(dg), pack8(du)};
  *ptr<uint4>(p->out1 + 2 * at) = v.dg;
  *ptr<uint4>(p->out2 + 2 * at) = v.du;
  return v;
}

// A constant as a type, so that calls taking it unroll into registers (an enum: no device variable).
template <int kV>
struct Int {
  enum : int { kValue = kV };
};
// What kDownBwd's epilogue hands on besides its stores (FP8: the 1 x 128 blocks quantized from
// registers): keep(Int<row half>, Int<group>, v) gets each stored group of 8 columns of a valid row;
// block(Int<b>) follows columns 128 b .. +127 in every thread, after a __syncwarp, so it may shuffle.
struct NoKeep {
  template <class RowHalf, class Group>
  __device__ __forceinline__ void operator()(RowHalf, Group, const DgDu8&) const {}
  template <class Block>
  __device__ __forceinline__ void block(Block) const {}
};

// kDownBwd: where this lane's row of one row half goes.
struct RowOut {
  i64 base;     // element offset of the lane's first column in dg, du; group g adds 32 g
  int row;      // row within the tile (0 .. BM-1)
  bool valid;   // inside the expert (and the tile is stored)
};

template <class Params>
__device__ __forceinline__ RowOut row_out(const Params* p, const Tile& tile, int row_half, int half, int wg_tid) {
  const int warp = wg_tid >> 5, lane = wg_tid & 31;
  RowOut r;
  r.row = half * 64 + warp * 16 + (lane >> 2) + row_half * 8;
  const int m = tile.m0 + r.row;
  r.valid = tile.store && m < tile.rows;
  r.base = (tile.row0 + m) * p->ldo + tile.n0 + 8 * (lane & 3);
  return r;
}

// This lane's 8 columns of group kGroup in an aux stage (128 rows x 64 columns of g, then of u;
// 128B swizzle).
template <int kGroup>
__device__ __forceinline__ const char* aux_at(const char* aux, int row, int lane) {
  const int chunk = ((kGroup & 1) * 4 + (lane & 3)) ^ (row & 7);
  return aux + row * 128 + chunk * 16;
}

// One round of the fp32-staged paths: row half kRowHalf of groups kFirst and kSecond into the
// warp's two staging areas (256 floats apart), once the previous round's reads are done.
template <int kRowHalf, int kFirst, int kSecond>
__device__ __forceinline__ void stage_round(float* staging, const float (&acc)[128], int lane) {
  __syncwarp();  // the previous round's reads are done
  stage_group<kRowHalf, kFirst>(staging, acc, lane);
  stage_group<kRowHalf, kSecond>(staging + 256, acc, lane);
  __syncwarp();
}

// kDownBwd, one round: row half kRowHalf of groups kGroup, kGroup + 1 (64 columns: one aux stage)
// through the warp's two staging areas.
template <int kRowHalf, int kGroup, class Params, class Keep>
__device__ __forceinline__ void store_down_bwd_round(const Params* p, const Tile& tile, const float (&acc)[128],
                                                     float* staging, int half, int wg_tid, const char* aux,
                                                     Keep& keep) {
  const int lane = wg_tid & 31;
  stage_round<kRowHalf, kGroup, kGroup + 1>(staging, acc, lane);
  float f[8], f2[8];
  unstage8(staging, lane, f);
  unstage8(staging + 256, lane, f2);
  const RowOut r = row_out(p, tile, kRowHalf, half, wg_tid);
  if (!r.valid) return;
  keep(Int<kRowHalf>{}, Int<kGroup>{}, emit8_down_bwd(p, r.base + 32 * kGroup, f, aux_at<kGroup>(aux, r.row, lane)));
  keep(Int<kRowHalf>{}, Int<kGroup + 1>{},
       emit8_down_bwd(p, r.base + 32 * (kGroup + 1), f2, aux_at<kGroup + 1>(aux, r.row, lane)));
}

// kDownBwd, both row halves of groups kGroup, kGroup + 1. (Whole 128-byte lines per store, as the
// weight gradients do, are no faster here.)
template <int kGroup, class Params, class Keep>
__device__ __forceinline__ void store_down_bwd_columns(const Params* p, const Tile& tile, const float (&acc)[128],
                                                       float* staging, int half, int wg_tid, const char* aux,
                                                       Keep& keep) {
  store_down_bwd_round<0, kGroup>(p, tile, acc, staging, half, wg_tid, aux, keep);
  store_down_bwd_round<1, kGroup>(p, tile, acc, staging, half, wg_tid, aux, keep);
}

// Weight gradients (fp32 [M, N] per expert; only stored tiles get here), one round: row half
// kRowHalf of group kGroup and of kSecond (kGateUpWgrad: the same columns of dWu; else the next
// group) through the two staging areas, then whole 128-byte lines to the outputs.
template <int kP, int kRowHalf, int kGroup, class Params>
__device__ __forceinline__ void store_wgrad_round(const Params* p, const Tile& tile, const float (&acc)[128],
                                                  float* staging, int half, int wg_tid) {
  using Tr = Traits<kP>;
  constexpr int kSecond = Tr::kDualB ? kGroup + 4 : kGroup + 1;
  const int warp = wg_tid >> 5, lane = wg_tid & 31, chunk = lane & 7;
  stage_round<kRowHalf, kGroup, kSecond>(staging, acc, lane);
  float* out2 = ptr<float>(Tr::kDualB ? p->out2 : p->out1);
  const int col2 = Tr::kDualB ? 32 * kGroup : 32 * kSecond;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = (lane >> 3) + 4 * i;  // row within the warp's 8 rows of this row half
    const i64 m = tile.m0 + half * 64 + warp * 16 + kRowHalf * 8 + r;
    const i64 at = tile.group * p->o_group_stride + m * p->ldo + tile.n0 + 4 * chunk;
    *reinterpret_cast<float4*>(ptr<float>(p->out1) + at + 32 * kGroup) =
        *reinterpret_cast<const float4*>(staging + staged_at(r, 4 * chunk));
    *reinterpret_cast<float4*>(out2 + at + col2) =
        *reinterpret_cast<const float4*>(staging + 256 + staged_at(r, 4 * chunk));
  }
}

// Weight gradients with GemmParams::accumulate: the accumulators start from the stored fp32 output
// (the layout above: acc[4j + 2 rh + c] is row 16w + l/4 + 8 rh, column 8j + 2(l%4) + c; kGateUpWgrad's
// j >= 16 are dWu's columns 8(j - 16) ..). The k-loop then goes on where an earlier launch over the
// rows before these stopped, so rows split at a multiple of kBK give the bits of one launch.
template <int kP, class Params>
__device__ __forceinline__ void load_wgrad_accumulators(const Params* p, const Tile& tile, float (&acc)[128],
                                                        int half, int wg_tid) {
  constexpr bool kDual = Traits<kP>::kDualB;
  const int warp = wg_tid >> 5, lane = wg_tid & 31;
  const float* out1 = ptr<const float>(p->out1);
  const float* out2 = ptr<const float>(kDual ? p->out2 : p->out1);
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const i64 m = tile.m0 + half * 64 + warp * 16 + (lane >> 2) + 8 * rh;
    const i64 at = tile.group * p->o_group_stride + m * p->ldo + tile.n0 + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const bool second = kDual && j >= 16;
      const float2 v = *reinterpret_cast<const float2*>((second ? out2 : out1) + at + 8 * (second ? j - 16 : j));
      acc[4 * j + 2 * rh] = v.x;
      acc[4 * j + 2 * rh + 1] = v.y;
    }
  }
}

template <int kP, int kGroup, class Params>
__device__ __forceinline__ void store_wgrad_columns(const Params* p, const Tile& tile, const float (&acc)[128],
                                                    float* staging, int half, int wg_tid) {
  store_wgrad_round<kP, 0, kGroup>(p, tile, acc, staging, half, wg_tid);
  store_wgrad_round<kP, 1, kGroup>(p, tile, acc, staging, half, wg_tid);
}

// ---------------------------------------------------------------------------------------------
// bf16 outputs computed from the accumulators alone (gate_up, down, gate_up_bwd): the fused
// elementwise step runs in the fragment layout, stmatrix writes a warp's 16 rows x 64 columns to
// its 2 KB staging area (16-byte chunk c of row r at c ^ (r % 8)), and each lane stores 16-byte
// chunks of whole 128-byte row segments.
// ---------------------------------------------------------------------------------------------
enum BlockOp : int { kCopy = 0, kScaleRows = 1, kSwiGLU = 2 };

// Columns 64 kBlock .. +63 of the matrix whose 8-column block j sits at acc[4 (kJ0 + j) ...]; with
// kSwiGLU, silu(that) * (the matrix at kJ0 + 16), i.e. h from g (columns 0..127) and u (128..255).
template <int kBlock, int kJ0, int kOp, class Params>
__device__ __forceinline__ void store_block_bf16(const Params* p, const Tile& tile, const float (&acc)[128],
                                                 char* stg, int half, int wg_tid, i64 out, float scale0,
                                                 float scale1) {
  const int warp = wg_tid >> 5, lane = wg_tid & 31;
  const u32 s_stg = smem_addr(stg);
  __syncwarp();  // the previous block's reads of the staging area are done
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    u32 v[4];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {  // matrix mi: row half mi % 2, 8-column block 2k + mi / 2
      const int rh = mi & 1, j = kJ0 + 8 * kBlock + 2 * k + (mi >> 1);
      float a = acc[4 * j + 2 * rh], b = acc[4 * j + 2 * rh + 1];
      if (kOp == kSwiGLU) {
        a = a * sigmoid(a) * acc[4 * (j + 16) + 2 * rh];
        b = b * sigmoid(b) * acc[4 * (j + 16) + 2 * rh + 1];
      } else if (kOp == kScaleRows) {
        a *= rh ? scale1 : scale0;
        b *= rh ? scale1 : scale0;
      }
      v[mi] = pack_bf16x2(a, b);
    }
    const int mi = lane >> 3, row = (lane & 7) + 8 * (mi & 1), chunk = 2 * k + (mi >> 1);
    stmatrix_x4(s_stg + row * 128 + ((chunk ^ (row & 7)) << 4), v);
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = (lane >> 3) + 4 * i, c = lane & 7;
    const uint4 v = *reinterpret_cast<const uint4*>(stg + row * 128 + ((c ^ (row & 7)) << 4));
    const int m = tile.m0 + half * 64 + warp * 16 + row;
    if (m < tile.rows)
      *ptr<uint4>(out + 2 * ((tile.row0 + m) * p->ldo + tile.n0 + 64 * kBlock + 8 * c)) = v;
  }
}

template <int kP, class Params>
__device__ __forceinline__ void store_tile_bf16(const Params* p, const Tile& tile, const float (&acc)[128],
                                                char* stg, int half, int wg_tid) {
  if (kP == kGateUp) {  // h (128 columns); g and u too where asked for
    store_block_bf16<0, 0, kSwiGLU>(p, tile, acc, stg, half, wg_tid, p->out1, 1.0f, 1.0f);
    store_block_bf16<1, 0, kSwiGLU>(p, tile, acc, stg, half, wg_tid, p->out1, 1.0f, 1.0f);
    if (p->out2) {
      store_block_bf16<0, 0, kCopy>(p, tile, acc, stg, half, wg_tid, p->out2, 1.0f, 1.0f);
      store_block_bf16<1, 0, kCopy>(p, tile, acc, stg, half, wg_tid, p->out2, 1.0f, 1.0f);
    }
    if (p->out3) {
      store_block_bf16<0, 16, kCopy>(p, tile, acc, stg, half, wg_tid, p->out3, 1.0f, 1.0f);
      store_block_bf16<1, 16, kCopy>(p, tile, acc, stg, half, wg_tid, p->out3, 1.0f, 1.0f);
    }
  } else {  // kDown (optional row scale), kGateUpBwd
    float scale0 = 1.0f, scale1 = 1.0f;
    if (kP == kDown && p->row_scale) {
      const int m = tile.m0 + half * 64 + (wg_tid >> 5) * 16 + ((wg_tid & 31) >> 2);
      const float* scale = ptr<const float>(p->row_scale) + tile.row0;
      if (m < tile.rows) scale0 = scale[m];
      if (m + 8 < tile.rows) scale1 = scale[m + 8];
    }
    store_block_bf16<0, 0, kScaleRows>(p, tile, acc, stg, half, wg_tid, p->out1, scale0, scale1);
    store_block_bf16<1, 0, kScaleRows>(p, tile, acc, stg, half, wg_tid, p->out1, scale0, scale1);
    store_block_bf16<2, 0, kScaleRows>(p, tile, acc, stg, half, wg_tid, p->out1, scale0, scale1);
    store_block_bf16<3, 0, kScaleRows>(p, tile, acc, stg, half, wg_tid, p->out1, scale0, scale1);
  }
}

template <int kP, class Params>
__device__ __forceinline__ void store_tile(const Params* p, const Tile& tile, const float (&acc)[128],
                                           float* staging, int half, int wg_tid) {
  using Tr = Traits<kP>;
  static_assert(kP != kDownBwd, "kDownBwd's epilogue runs in consume_tile, with its aux stages");
  if (kP == kGateUp || kP == kDown || kP == kGateUpBwd) {
    store_tile_bf16<kP>(p, tile, acc, reinterpret_cast<char*>(staging), half, wg_tid);
    return;
  }
  store_wgrad_columns<kP, 0>(p, tile, acc, staging, half, wg_tid);
  if (Tr::kDualB) {
    store_wgrad_columns<kP, 1>(p, tile, acc, staging, half, wg_tid);
    store_wgrad_columns<kP, 2>(p, tile, acc, staging, half, wg_tid);
    store_wgrad_columns<kP, 3>(p, tile, acc, staging, half, wg_tid);
  } else {
    store_wgrad_columns<kP, 2>(p, tile, acc, staging, half, wg_tid);
    store_wgrad_columns<kP, 4>(p, tile, acc, staging, half, wg_tid);
    store_wgrad_columns<kP, 6>(p, tile, acc, staging, half, wg_tid);
  }
}

// ---------------------------------------------------------------------------------------------
// The ring and the per-tile roles
// ---------------------------------------------------------------------------------------------
// Stage and phase of the mbarrier ring. The producer and every consumer warpgroup each hold one
// and advance it once per stage in the same tile order, so they agree on every stage.
struct Ring {
  int stage = 0, phase = 0;
  u32 armed = 0, armed_phase = 0;  // a loading warp's lane 0: stages it loaded, each one's last parity
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) { stage = 0; phase ^= 1; }
  }
  // A loading warp's lane 0 (the BF16 producer's thread 0; FP8: that of warps 0 and 1), after its
  // warp issued this stage's loads.
  __device__ __forceinline__ void loaded() {
    armed |= 1u << stage;
    armed_phase = (armed_phase & ~(1u << stage)) | (static_cast<u32>(phase) << stage);
  }
};
static_assert(kStages <= 32, "Ring keeps a bit per stage");

// The producer's thread 0, once, after its last tile and before the kernel's final cluster
// barrier: waits (at most kDrainNs a stage, reporting nothing) until the last loads it issued into
// each stage have landed, its own and the partner's multicast half. Normally the consumers have
// waited for every one already; after an error they stop waiting, and a CTA must not leave while
// a TMA copy is still writing into its shared memory (a launch failure).
template <class Storage>
__device__ __forceinline__ void drain_loads(Storage& ss, const Ring& ring) {
  for (int s = 0; s < kStages; ++s)
    if (ring.armed >> s & 1) mbar_drain(&ss.full[s], ring.armed_phase >> s & 1, kDrainNs);
}

// A loading warp's lane 0 (as Ring::loaded), before its warp loads the current stage again: has the last
// load it issued there landed? Always, in a sound run (the consumers waited for it before they
// freed the stage). After an error the consumers stop waiting and free stages at once, and arming
// a barrier whose phase is still open (its arrival already made) is undefined: seen as a
// launch failure in the fused backward's wind-down. So it waits (at most kDrainNs) and, if the
// load has still not landed, the producer loads nothing more.
template <class Storage>
__device__ __forceinline__ bool previous_load_landed(Storage& ss, const Ring& ring) {
  if (!(ring.armed >> ring.stage & 1)) return true;
  const int parity = ring.armed_phase >> ring.stage & 1;
  if (mbar_try_wait(&ss.full[ring.stage], parity)) return true;
  mbar_drain(&ss.full[ring.stage], parity, kDrainNs);
  return mbar_try_wait(&ss.full[ring.stage], parity);
}

// One arrive per consumer warp on stage s's `empty` barrier in every CTA of the cluster (lane c
// signals CTA c): the partner multicasts its half of B into this stage too. The warp's reads of
// the stage (aux stages: every lane's) are done first.
template <class Storage>
__device__ __forceinline__ void release_stage(Storage& ss, int s, int wg_tid) {
  __syncwarp();
  if ((wg_tid & 31) < kCluster) mbar_arrive_cluster(&ss.empty[s], wg_tid & 31);
}

// Barriers, the pair prefix and the cluster's abort decision; every thread of both CTAs calls it.
// Returns the number of pair tiles (0 if an error was already recorded: an earlier launch's, on a
// shared record; decided once by cta 0 for both CTAs so that neither loads into a partner that
// left).
template <int kP, int kFullArrivals = 1, class Params, class Storage>
__device__ __forceinline__ int gemm_setup(const Params* p, Storage& ss, int cta) {
  using Tr = Traits<kP>;
  const int num_groups = static_cast<int>(p->num_groups);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&ss.full[s], kFullArrivals);  // the producer's arrive(s), one with the TMA byte count
      mbar_init(&ss.empty[s], kCluster * kConsumerWarps);  // every consumer warp of both CTAs
    }
    fence_mbarrier_init_cluster();
    int total = 0;
    for (int g = 0; g < num_groups; ++g) {
      ss.pair_prefix[g] = total;
      if (Tr::kRowProblem) total += ceil_div(ceil_div(ptr<const int>(p->row_counts)[g], kBM), 2);
    }
    ss.pair_prefix[num_groups] = total;
  }
  cluster_sync();  // barriers initialised in both CTAs before any multicast or remote arrive
  if (threadIdx.x == 0 && cta == 0) {
    const u32 abort = has_error(p->error) ? 1u : 0u;
    for (int c = 0; c < kCluster; ++c) st_cluster_u32(&ss.abort, c, abort);
  }
  cluster_sync();
  const int n_tiles = static_cast<int>(p->n) / Tr::kTileN;
  return ss.abort ? 0
         : Tr::kRowProblem ? ss.pair_prefix[num_groups] * n_tiles
                           : num_groups * ceil_div(static_cast<int>(p->m) / kBM, 2) * n_tiles;
}

// Producer warpgroup (or, in the fused kernels, one producer warp), one tile: thread 0 issues
// TMA; all threads wait for each free stage together. After a failed wait (returns false) thread 0
// loads nothing more (no copy may land in a stage still in use, or in a CTA that has left); the
// consumers' waits then fail too and the kernel ends with the error set. Thread 0 also stops
// (silently: an error is recorded already) when a stage's last load has not landed by the time the
// stage is free again (previous_load_landed), which only happens after an error.
// NOTE (known, not fixed): after an error the consumers free stages without waiting, so the
// partner's next multicast B half can land in a stage whose own phase is still open and complete
// it before this CTA's A load lands; previous_load_landed and drain_loads then pass early. It
// needs a tight race on the error path only; the robust fix is a bounded drain of `full` by the
// consumers before they free a stage after an error.
template <int kP>
__device__ __forceinline__ bool produce_tile(const GemmParams* p, SharedStorage& ss, Ring& ring, const Tile& tile,
                                             int cta, int wg_tid, bool ok) {
  using Tr = Traits<kP>;
  const u32 s_base = smem_addr(ss.stages);
  const TmaSource src = tma_source(p);
  const u64 timeout_ns = p->timeout_ns;
  ErrorRecord* const error = p->error;
  for (int kb = 0; kb < tile.k_blocks; ++kb) {
    if (ok) ok = mbar_wait(&ss.empty[ring.stage], ring.phase ^ 1, timeout_ns, error, kOpGemmLoad, kP);
    if (wg_tid == 0 && ok) ok = previous_load_landed(ss, ring);
    if (wg_tid == 0 && ok) {
      const u32 s_a = s_base + ring.stage * kStageBytes;
      load_stage_tma<kP>(src, tile, kb, s_a, s_a + kATileBytes, &ss.full[ring.stage], cta);
      ring.loaded();
    }
    ring.advance();
  }
  for (int c = 0; c < Tr::kAuxStages; ++c) {  // kDownBwd: g and u of this tile, 64 columns a stage
    if (ok) ok = mbar_wait(&ss.empty[ring.stage], ring.phase ^ 1, timeout_ns, error, kOpGemmLoad, kP);
    if (wg_tid == 0 && ok) ok = previous_load_landed(ss, ring);
    if (wg_tid == 0 && ok) {
      const u32 s_a = s_base + ring.stage * kStageBytes;
      mbar_arrive_expect_tx(&ss.full[ring.stage], 2 * kAuxU);
      tma_load_2d(s_a, p->tmap_aux1, tile.n0 + 64 * c, tile.row0 + tile.m0, &ss.full[ring.stage]);
      tma_load_2d(s_a + kAuxU, p->tmap_aux2, tile.n0 + 64 * c, tile.row0 + tile.m0, &ss.full[ring.stage]);
      ring.loaded();
    }
    ring.advance();
  }
  return ok;
}

// The accumulators a tile starts from: zeros, or (a weight gradient with GemmParams::accumulate) its
// stored output; then `k_loop()`, the tile's MMAs over them. True where the tile must stay as it
// is: an accumulating weight gradient with no rows here adds nothing.
// NOTE: each start has its own copy of the k-loop: accumulators defined on two paths that merge
// before the first wgmma make ptxas serialize every wgmma of the kernel (C7515).
template <int kP, class Params, class KLoop>
__device__ __forceinline__ bool run_from_accumulators(const Params* p, const Tile& tile, float (&acc)[128], int half,
                                                      int wg_tid, KLoop&& k_loop) {
  using Tr = Traits<kP>;
  const bool unchanged = !Tr::kRowProblem && p->accumulate && tile.rows == 0;
  if (!Tr::kRowProblem && p->accumulate && tile.store && !unchanged) {
    load_wgrad_accumulators<kP>(p, tile, acc, half, wg_tid);
    k_loop();
  } else {
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    k_loop();
  }
  return unchanged;
}

// kDownBwd's epilogue after a tile's k-blocks: one ring stage of g, u per 64 columns (every tile,
// stored or not, so that the ring stays in step with the producer's aux stages); `keep` as NoKeep's.
template <int kP, class Params, class Storage, class Keep = NoKeep>
__device__ __forceinline__ bool store_down_bwd_tile(const Params* p, Storage& ss, Ring& ring, const Tile& tile,
                                                    const float (&acc)[128], float* staging, int half, int wg_tid,
                                                    bool ok, Keep keep = {}) {
  auto aux_stage = [&]() {
    if (ok) ok = mbar_wait(&ss.full[ring.stage], ring.phase, p->timeout_ns, p->error, kOpGemmAux, kP);
    return ss.stages[ring.stage];
  };
  auto next = [&]() {
    release_stage(ss, ring.stage, wg_tid);
    ring.advance();
  };
  store_down_bwd_columns<0>(p, tile, acc, staging, half, wg_tid, aux_stage(), keep), next();
  store_down_bwd_columns<2>(p, tile, acc, staging, half, wg_tid, aux_stage(), keep), next();
  keep.block(Int<0>{});
  store_down_bwd_columns<4>(p, tile, acc, staging, half, wg_tid, aux_stage(), keep), next();
  store_down_bwd_columns<6>(p, tile, acc, staging, half, wg_tid, aux_stage(), keep), next();
  keep.block(Int<1>{});
  return ok;
}

// A tile's end in the build without epilogue (kEpilogue false): kDownBwd's aux stages waited for
// and handed back; the accumulators' sum stored where no launch reaches (ldo is never negative),
// since ptxas removes the MMAs of accumulators nobody reads.
template <int kP, class Params, class Storage>
__device__ __forceinline__ bool skip_epilogue(const Params* p, Storage& ss, Ring& ring, const float (&acc)[128],
                                              int wg_tid, bool ok) {
  for (int c = 0; c < Traits<kP>::kAuxStages; ++c) {
    if (ok) ok = mbar_wait(&ss.full[ring.stage], ring.phase, p->timeout_ns, p->error, kOpGemmAux, kP);
    release_stage(ss, ring.stage, wg_tid);
    ring.advance();
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 128; ++i) sum += acc[i];
  if (p->ldo < 0) *ptr<float>(p->out1) = sum;
  return ok;
}

// Consumer warpgroup `half` (rows 64 half .. 64 half + 63), one tile: waits for loaded stages,
// issues wgmma into `acc`, hands each stage back to the producers of both CTAs, runs the epilogue
// through this warp's `staging` areas. After a failed wait (timeout, or an error recorded
// elsewhere) this thread stops waiting: the loops run on over garbage (wgmma must stay
// warpgroup-uniform) and the kernel ends with the error set, which the host raises.
template <int kP>
__device__ __forceinline__ bool consume_tile(const GemmParams* p, SharedStorage& ss, Ring& ring, const Tile& tile,
                                             float (&acc)[128], float* staging, int half, int wg_tid, bool ok) {
  using Tr = Traits<kP>;
  const u32 s_base = smem_addr(ss.stages);
  auto k_loop = [&]() {
    int prev = -1;
    const u64 timeout_ns = p->timeout_ns;  // in registers: not reloaded after every barrier
    ErrorRecord* const error = p->error;
    for (int kb = 0; kb < tile.k_blocks; ++kb) {
      if (ok) ok = mbar_wait(&ss.full[ring.stage], ring.phase, timeout_ns, error, kOpGemmMma, kP);
      const u32 s_a = s_base + ring.stage * kStageBytes;
      if (!Tr::kRowProblem && (kb + 1) * kBK > tile.rows) zero_tail_k_rows(s_a, tile.rows - kb * kBK, half, wg_tid);
      wgmma_fence();
      mma_stage<kP>(acc, s_a, s_a + kATileBytes, half);
      wgmma_commit();
      wgmma_wait<1>();  // the previous stage's MMAs are done: hand its buffers back
      fence_accumulators(acc);
      if (prev >= 0) release_stage(ss, prev, wg_tid);
      prev = ring.stage;
      ring.advance();
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    if (prev >= 0) release_stage(ss, prev, wg_tid);
  };
  const bool unchanged = run_from_accumulators<kP>(p, tile, acc, half, wg_tid, k_loop);
  if constexpr (!kEpilogue) {
    ok = skip_epilogue<kP>(p, ss, ring, acc, wg_tid, ok);
  } else if constexpr (Tr::kAuxStages > 0) {
    ok = store_down_bwd_tile<kP>(p, ss, ring, tile, acc, staging, half, wg_tid, ok);
  } else if (tile.store && !unchanged) {
    store_tile<kP>(p, tile, acc, staging, half, wg_tid);
  }
  return ok;
}

// Both roles over the pair tiles `tiles` yields (each role walks its own copy in the same order).
// Every thread of the CTA calls it, after gemm_setup.
template <int kP, class Tiles>
__device__ __forceinline__ void run_tiles(const GemmParams* p, SharedStorage& ss, Tiles tiles, int cta) {
  // NOTE: the role is broadcast from lane 0 so the compiler sees it warp-uniform; wgmma in a path it
  // cannot prove uniform gets serialized (ptxas C7518).
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0), wg_tid = threadIdx.x & 127;
  Ring ring;
  bool ok = true;
  int t;
  if (wg == 0) {
    warpgroup_reg_dealloc<kProducerRegs>();
    // NOTE: threads let run ahead to the final cluster barrier instead (warp 0 diverged around its
    // TMA lane) make the row GEMMs much slower: all 128 producer threads walk every tile.
    while (tiles.next(t)) {
      ok = produce_tile<kP>(p, ss, ring, banded_tile<kP>(p, ss.pair_prefix, t, cta), cta, wg_tid, ok);
    }
    if (wg_tid == 0) drain_loads(ss, ring);
  } else {
    warpgroup_reg_alloc<kConsumerRegs>();
    float acc[128];
    float* staging = ss.staging[threadIdx.x / 32 - 4];
    while (tiles.next(t))
      ok = consume_tile<kP>(p, ss, ring, banded_tile<kP>(p, ss.pair_prefix, t, cta), acc, staging, wg - 1, wg_tid,
                            ok);
  }
}

// The standalone kernel's tile order: cluster c of C takes pair tiles c, c + C, c + 2C, ...
struct StridedTiles {
  int t, step, end;
  __device__ __forceinline__ bool next(int& tile) {
    if (t >= end) return false;
    tile = t;
    t += step;
    return true;
  }
};

// ---------------------------------------------------------------------------------------------
// grouped_gemm<kP>: one persistent grid of 2-CTA clusters over every tile of the problem.
// ---------------------------------------------------------------------------------------------
template <int kP>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kThreads, 1) grouped_gemm(const GemmParams* p) {
  extern __shared__ char smem_raw[];
  SharedStorage& ss = aligned_shared<SharedStorage>(smem_raw);
  const int cta = static_cast<int>(cluster_ctarank());
  const int num_tiles = gemm_setup<kP>(p, ss, cta);
  run_tiles<kP>(p, ss, StridedTiles{static_cast<int>(cluster_id_x()), static_cast<int>(num_clusters_x()), num_tiles},
                cta);
  // No CTA may leave while its partner can still arrive on its barriers or multicast into it.
  cluster_sync();
}

// Compile-time sizes Python reads once from the compiled module (never recomputed by hand):
// out[0] = dynamic shared memory of a grouped_gemm launch.  grid 1, block 1.
__global__ void export_sizes(int* out) { out[0] = kSmemBytes; }

}  // namespace gemm
}  // namespace mok
