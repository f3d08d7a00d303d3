// Grouped BF16 GEMMs of the expert FFNs on Hopper: a producer warp issuing TMA tile loads into a
// 4-stage mbarrier pipeline, two consumer warpgroups issuing wgmma (fp32 accumulators), fused
// epilogues.
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
// rows. In the weight gradients K is the expert's rows: its last partial k-block is loaded with
// zero-filling cp.async instead of TMA, so no expert sums another's rows and ragged sizes
// (0, 1, 129, ...) need no padding. Weight gradients: one CTA owns one output tile and sums K in
// order: deterministic, no atomics.
//
// Per tile (BM x BN x K): loads (BM + BN) * K * 2 bytes, 2 * BM * BN * K FLOPs.
#pragma once
#include "hopper.cuh"

namespace mok {
namespace gemm {

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kThreads = 384;  // warpgroup 0: producer; 1, 2: consumers
constexpr int kATileBytes = kBM * kBK * 2;  // 16 KB
constexpr int kBTileBytes = kBN * kBK * 2;  // 32 KB
constexpr int kStageBytes = kATileBytes + kBTileBytes;
constexpr int kMaxGroups = 1024;
constexpr int kSmemBytes = 1024 + kStages * kStageBytes + 2 * kStages * 8 + (kMaxGroups + 1) * 4;

enum Problem : int { kGateUp = 0, kDown = 1, kDownBwd = 2, kGateUpBwd = 3, kDownWgrad = 4, kGateUpWgrad = 5 };

// Every field is 8 bytes; mirrored by PARAM_FIELDS in mok_proto/kernels/gemm.py.
struct GemmParams {
  i64 num_groups;      // El
  i64 m, n, k;         // row problems: n, k fixed (m = T_e); weight gradients: m, n fixed (k = T_e)
  i64 lda, ldb, ldo;   // leading dimensions (elements)
  i64 b_group_stride;  // elements between experts' weights (row problems)
  i64 o_group_stride;  // elements between experts' outputs (weight gradients)
  i64 k_split;         // kGateUpBwd: k < k_split reads a1/b1, else a2/b2 at k - k_split
  i64 desc_mn_lbo;     // MN-major descriptor strides (bytes), exposed for the layout self-test
  i64 desc_mn_sbo;
  i64 timeout_ns;      // every pipeline wait is bounded
  i64 a1, a2, b1, b2;  // operand addresses (bf16)
  i64 out1, out2, out3;
  i64 aux1, aux2;      // kDownBwd: g, u (bf16 [rows, I])
  i64 row_scale;       // kDown: optional fp32 [rows] (0 = none)
  i64 row_offsets;     // int32 [El]
  i64 row_counts;      // int32 [El]
  i64 error;           // ErrorRecord*
  i64 tmap_a1, tmap_a2, tmap_b1, tmap_b2;  // CUtensorMap addresses (global memory), 128B swizzle
};

template <int kP> struct Traits {
  static constexpr bool kRowProblem = kP <= kGateUpBwd;  // M ragged (else K ragged)
  static constexpr bool kDualB = kP == kGateUp || kP == kGateUpWgrad;  // 128 columns from each of b1, b2
  static constexpr int kAMajorMN = kRowProblem ? 0 : 1;
  static constexpr int kBMajorMN = (kP == kDownBwd || kP == kGateUpBwd) ? 0 : 1;
  static constexpr int kTileN = kDualB ? kBN / 2 : kBN;  // columns per output matrix per tile
};

struct Tile {
  int group, m0, n0, row0, rows, k_blocks;
};

template <typename T>
__device__ __forceinline__ T* ptr(i64 address) { return reinterpret_cast<T*>(address); }

// Tile t of this problem. Row problems: per expert ceil(T_e / BM) row tiles x n tiles, tile_prefix
// holds the running count of row tiles. Weight gradients: (M/BM) x n tiles per expert.
template <int kP>
__device__ __forceinline__ Tile tile_of(const GemmParams* p, const int* tile_prefix, int t) {
  using Tr = Traits<kP>;
  const int n_tiles = static_cast<int>(p->n) / Tr::kTileN;
  Tile tile;
  if (Tr::kRowProblem) {
    const int mt = t / n_tiles;
    int lo = 0, hi = static_cast<int>(p->num_groups);  // last group with prefix <= mt
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (tile_prefix[mid] <= mt) lo = mid; else hi = mid;
    }
    tile.group = lo;
    tile.m0 = (mt - tile_prefix[lo]) * kBM;
    tile.n0 = (t - mt * n_tiles) * Tr::kTileN;
    tile.k_blocks = static_cast<int>(p->k) / kBK;
  } else {
    const int m_tiles = static_cast<int>(p->m) / kBM, per_group = m_tiles * n_tiles;
    tile.group = t / per_group;
    const int r = t - tile.group * per_group;
    tile.m0 = (r / n_tiles) * kBM;
    tile.n0 = (r % n_tiles) * Tr::kTileN;
  }
  tile.row0 = ptr<const int>(p->row_offsets)[tile.group];
  tile.rows = ptr<const int>(p->row_counts)[tile.group];
  if (!Tr::kRowProblem) tile.k_blocks = (tile.rows + kBK - 1) / kBK;
  return tile;
}

// ---------------------------------------------------------------------------------------------
// TMA load of one full stage by one thread: A [BM x BK] and B [BK x BN] as 64-element-wide boxes.
// ---------------------------------------------------------------------------------------------
template <int kP>
__device__ __forceinline__ void load_stage_tma(const GemmParams* p, const Tile& tile, int kb, u32 s_a, u32 s_b, u64* bar) {
  using Tr = Traits<kP>;
  const int k0 = kb * kBK;
  const bool second = kP == kGateUpBwd && k0 >= p->k_split;  // dx: dg/Wg, then du/Wu
  const int k_in = second ? k0 - static_cast<int>(p->k_split) : k0;
  mbar_arrive_expect_tx(bar, kStageBytes);
  if (Tr::kAMajorMN) {  // x^T / h^T: two atoms of 64 m x 64 k rows
    tma_load_2d(s_a, p->tmap_a1, tile.m0, tile.row0 + k0, bar);
    tma_load_2d(s_a + 8192, p->tmap_a1, tile.m0 + 64, tile.row0 + k0, bar);
  } else {  // 128 rows x 64 k
    tma_load_2d(s_a, second ? p->tmap_a2 : p->tmap_a1, k_in, tile.row0 + tile.m0, bar);
  }
  if (Tr::kBMajorMN) {  // four atoms of 64 n x 64 k rows
    const int k_row = Tr::kRowProblem ? tile.group * static_cast<int>(p->k) + k0 : tile.row0 + k0;
#pragma unroll
    for (int atom = 0; atom < 4; ++atom) {
      const bool b2 = Tr::kDualB && atom >= 2;
      const int col = tile.n0 + (Tr::kDualB ? (atom & 1) : atom) * 64;
      tma_load_2d(s_b + atom * 8192, b2 ? p->tmap_b2 : p->tmap_b1, col, k_row, bar);
    }
  } else {  // 256 n rows x 64 k
    tma_load_2d(s_b, second ? p->tmap_b2 : p->tmap_b1, k_in, tile.group * static_cast<int>(p->n) + tile.n0, bar);
  }
}

// ---------------------------------------------------------------------------------------------
// Zero-filling cp.async load of one stage by kLoaders threads (tid < kLoaders): the weight gradients'
// last, partial k-block (rows past T_e read as zeros).
// ---------------------------------------------------------------------------------------------
template <int kP, int kLoaders>
__device__ __forceinline__ void load_stage_cp_async(const GemmParams* p, const Tile& tile, int kb, u32 s_a, u32 s_b, int tid) {
  using Tr = Traits<kP>;
  typedef unsigned short bf16;
  const int k0 = kb * kBK;
  // A: 1024 16-byte chunks.
  for (int c = tid; c < 1024; c += kLoaders) {
    if (Tr::kAMajorMN) {  // A(m, k) = a1[(row0 + k) * lda + m]: atoms of 64 m x 64 k rows
      const int atom = c >> 9, krow = (c >> 3) & 63, ch = c & 7;
      const int kk = k0 + krow;
      const bool valid = kk < tile.rows;
      const bf16* src = ptr<const bf16>(p->a1) + static_cast<i64>(tile.row0 + (valid ? kk : 0)) * p->lda +
                        tile.m0 + atom * 64 + ch * 8;
      cp_async_16(s_a + atom * 8192 + swizzle128(krow, ch), src, valid);
    } else {  // A(m, k) = a[(row0 + m) * lda + k]: 128 rows of 64 k
      const int row = c >> 3, ch = c & 7;
      const int m = tile.m0 + row;
      const bool valid = m < tile.rows;
      const bool second = kP == kGateUpBwd && k0 >= p->k_split;
      const bf16* base = ptr<const bf16>(second ? p->a2 : p->a1);
      const int kk = (second ? k0 - static_cast<int>(p->k_split) : k0) + ch * 8;
      cp_async_16(s_a + swizzle128(row, ch), base + static_cast<i64>(tile.row0 + (valid ? m : 0)) * p->lda + kk, valid);
    }
  }
  // B: 2048 chunks.
  for (int c = tid; c < 2048; c += kLoaders) {
    if (Tr::kBMajorMN) {  // B(k, n) = b[k * ldb + n]: 4 atoms of 64 n x 64 k rows
      const int atom = c >> 9, krow = (c >> 3) & 63, ch = c & 7;
      const bool second = Tr::kDualB && atom >= 2;
      const int col = tile.n0 + (Tr::kDualB ? (atom & 1) : atom) * 64 + ch * 8;
      const bf16* base = ptr<const bf16>(second ? p->b2 : p->b1);
      const int kk = k0 + krow;
      bool valid = true;
      i64 row;
      if (Tr::kRowProblem) {  // weights of expert `group`
        base += static_cast<i64>(tile.group) * p->b_group_stride;
        row = kk;
      } else {  // rows of expert `group`
        valid = kk < tile.rows;
        row = tile.row0 + (valid ? kk : 0);
      }
      cp_async_16(s_b + atom * 8192 + swizzle128(krow, ch), base + row * p->ldb + col, valid);
    } else {  // B(k, n) = b[n * ldb + k]: 256 rows (n) of 64 k
      const int nrow = c >> 3, ch = c & 7;
      const bool second = kP == kGateUpBwd && k0 >= p->k_split;
      const bf16* base = ptr<const bf16>(second ? p->b2 : p->b1) + static_cast<i64>(tile.group) * p->b_group_stride;
      const int kk = (second ? k0 - static_cast<int>(p->k_split) : k0) + ch * 8;
      cp_async_16(s_b + swizzle128(nrow, ch), base + static_cast<i64>(tile.n0 + nrow) * p->ldb + kk, true);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Consumer: one warpgroup, 64 rows x 256 columns, four k16 steps per stage.
// Descriptors (128B swizzle): K-major: rows of 128 bytes, 8-row groups 1024 bytes apart (SBO),
// a k16 step is +32 bytes. MN-major: 64-element atoms of [64 k rows x 128 bytes] (LBO = atom
// stride), 8 k rows = 1024 bytes (SBO), a k16 step is +2048 bytes.
// ---------------------------------------------------------------------------------------------
template <int kP>
__device__ __forceinline__ void mma_stage(const GemmParams* p, float (&acc)[128], u32 s_a, u32 s_b, int half) {
  using Tr = Traits<kP>;
  const u32 mn_lbo = static_cast<u32>(p->desc_mn_lbo), mn_sbo = static_cast<u32>(p->desc_mn_sbo);
#pragma unroll
  for (int ks = 0; ks < kBK / 16; ++ks) {
    const u64 da = Tr::kAMajorMN ? wgmma_desc(s_a + half * 8192 + ks * 2048, mn_lbo, mn_sbo)
                                 : wgmma_desc(s_a + half * 64 * 128 + ks * 32, 16, 1024);
    const u64 db = Tr::kBMajorMN ? wgmma_desc(s_b + ks * 2048, mn_lbo, mn_sbo) : wgmma_desc(s_b + ks * 32, 16, 1024);
    wgmma_m64n256k16<Tr::kAMajorMN, Tr::kBMajorMN>(acc, da, db, 1);
  }
}

// Epilogue. Accumulator layout of m64nNk16: thread (warp w, lane l) holds rows 16w + l/4 (+8) and
// columns 8j + 2(l%4) (+1) in acc[4j + 2*(row half) + (column)]. A 4x4 transpose inside each quad
// of lanes (same row) gives lane q the 8 consecutive columns of j = 4*group + q, so every store
// (and the epilogue loads of g, u) is 16 bytes wide.
__device__ __forceinline__ u32 pick4(const u32 (&x)[4], int i) { return i == 0 ? x[0] : i == 1 ? x[1] : i == 2 ? x[2] : x[3]; }

// In: lane q of a quad holds x[i] = X[q][i]. Out: x[i] = X[i][q]. Every lane of the warp must call it.
__device__ __forceinline__ void quad_transpose(u32 (&x)[4], int q) {
  u32 y[4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int idx = q ^ r;
    const u32 sent = pick4(x, idx);
    const u32 got = r == 0 ? sent : __shfl_xor_sync(0xffffffffu, sent, r);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (i == idx) y[i] = got;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = y[i];
}

// The 8 consecutive fp32 columns 8(4*group + q) .. +7 of row half rh, for this lane.
__device__ __forceinline__ void gather8(const float (&acc)[128], int rh, int group, int q, float (&f)[8]) {
  u32 even[4], odd[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    even[i] = __float_as_uint(acc[4 * (4 * group + i) + 2 * rh]);
    odd[i] = __float_as_uint(acc[4 * (4 * group + i) + 2 * rh + 1]);
  }
  quad_transpose(even, q);
  quad_transpose(odd, q);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(even[i]);
    f[2 * i + 1] = __uint_as_float(odd[i]);
  }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]), pack_bf16x2(f[6], f[7]));
}

__device__ __forceinline__ void unpack8(uint4 v, float (&f)[8]) {
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = bf16_lo(w[i]);
    f[2 * i + 1] = bf16_hi(w[i]);
  }
}

template <int kP>
__device__ __forceinline__ void store_tile(const GemmParams* p, const Tile& tile, const float (&acc)[128], int half,
                                          int wg_tid) {
  using Tr = Traits<kP>;
  const int warp = wg_tid >> 5, lane = wg_tid & 31, q = lane & 3;
  constexpr int kGroups = Tr::kDualB ? 4 : 8;  // groups of 32 columns per output matrix
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int m = tile.m0 + half * 64 + warp * 16 + (lane >> 2) + rh * 8;
    const bool valid = !Tr::kRowProblem || m < tile.rows;  // the same for the 4 lanes of a quad
    const i64 row = Tr::kRowProblem ? tile.row0 + m : m;
    float scale = 1.0f;
    if (kP == kDown && p->row_scale && valid) scale = ptr<const float>(p->row_scale)[row];
    // Element offset of this row's first column in the output (and aux) matrices; a group adds
    // 8 * (4 * group + q). Computed once per row: 64-bit addresses per group cost registers.
    const i64 base = (Tr::kRowProblem ? 0 : tile.group * p->o_group_stride) + row * p->ldo + tile.n0 + 8 * q;
#pragma unroll
    for (int group = 0; group < kGroups; ++group) {
      float f[8], f2[8];
      gather8(acc, rh, group, q, f);
      if (Tr::kDualB) gather8(acc, rh, group + 4, q, f2);  // the second matrix's same columns
      if (!valid) continue;
      const i64 at = base + 32 * group;
      if (kP == kGateUp) {  // f = g, f2 = u
        float h[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) h[i] = f[i] / (1.0f + __expf(-f[i])) * f2[i];
        *ptr<uint4>(p->out1 + 2 * at) = pack8(h);
        if (p->out2) *ptr<uint4>(p->out2 + 2 * at) = pack8(f);
        if (p->out3) *ptr<uint4>(p->out3 + 2 * at) = pack8(f2);
      } else if (kP == kDown || kP == kGateUpBwd) {
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] *= scale;
        *ptr<uint4>(p->out1 + 2 * at) = pack8(f);
      } else if (kP == kDownBwd) {  // f = dh
        float g[8], u[8], dg[8], du[8];
        unpack8(*ptr<const uint4>(p->aux1 + 2 * at), g);
        unpack8(*ptr<const uint4>(p->aux2 + 2 * at), u);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float sig = 1.0f / (1.0f + __expf(-g[i]));
          du[i] = f[i] * g[i] * sig;
          dg[i] = f[i] * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
        }
        *ptr<uint4>(p->out1 + 2 * at) = pack8(dg);
        *ptr<uint4>(p->out2 + 2 * at) = pack8(du);
      } else {  // weight gradients: fp32 [M, N] per expert
        float4* o1 = ptr<float4>(p->out1 + 4 * at);
        o1[0] = make_float4(f[0], f[1], f[2], f[3]);
        o1[1] = make_float4(f[4], f[5], f[6], f[7]);
        if (Tr::kDualB) {
          float4* o2 = ptr<float4>(p->out2 + 4 * at);
          o2[0] = make_float4(f2[0], f2[1], f2[2], f2[3]);
          o2[1] = make_float4(f2[4], f2[5], f2[6], f2[7]);
        }
      }
    }
  }
}

template <int kP>
__global__ void __launch_bounds__(kThreads, 1) grouped_gemm(const GemmParams* p) {
  using Tr = Traits<kP>;
  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>((reinterpret_cast<u64>(smem_raw) + 1023) & ~static_cast<u64>(1023));
  u64* full = reinterpret_cast<u64*>(smem + kStages * kStageBytes);
  u64* empty = full + kStages;
  int* tile_prefix = reinterpret_cast<int*>(empty + kStages);
  ErrorRecord* err = ptr<ErrorRecord>(p->error);
  const int num_groups = static_cast<int>(p->num_groups);

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);    // the producer's arrive (with the TMA byte count, or after cp.async)
      mbar_init(&empty[s], 8);   // one arrive per consumer warp
    }
    int total = 0;
    for (int g = 0; g < num_groups; ++g) {
      tile_prefix[g] = total;
      if (Tr::kRowProblem) total += (ptr<const int>(p->row_counts)[g] + kBM - 1) / kBM;
    }
    tile_prefix[num_groups] = total;
  }
  __syncthreads();
  const int n_tiles = static_cast<int>(p->n) / Tr::kTileN;
  const int num_tiles = Tr::kRowProblem ? tile_prefix[num_groups] * n_tiles
                                        : num_groups * (static_cast<int>(p->m) / kBM) * n_tiles;
  const u32 s_base = smem_addr(smem);
  // NOTE: the role is broadcast from lane 0 so the compiler sees it warp-uniform; wgmma in a path it
  // cannot prove uniform gets serialized (ptxas C7518).
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0), wg_tid = threadIdx.x & 127;

  if (wg == 0) {  // producer warpgroup: thread 0 issues TMA; all 128 load a partial block with cp.async
    int stage = 0, phase = 0;
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const Tile tile = tile_of<kP>(p, tile_prefix, t);
      for (int kb = 0; kb < tile.k_blocks; ++kb) {
        // A failed wait is recorded and the loop runs on (no thread may leave the named barrier
        // below); every later wait then fails at once, so the kernel ends with the error set.
        mbar_wait(&empty[stage], phase ^ 1, p->timeout_ns, err, 100 + kP);
        const u32 s_a = s_base + stage * kStageBytes;
        if (!Tr::kRowProblem && (kb + 1) * kBK > tile.rows) {
          // NOTE: generic-proxy writes, complete and fenced before the barrier tells the consumers.
          load_stage_cp_async<kP, 128>(p, tile, kb, s_a, s_a + kATileBytes, wg_tid);
          cp_async_wait_all();
          fence_proxy_async();
          asm volatile("bar.sync 1, 128;" ::: "memory");  // the producer warpgroup only
          if (wg_tid == 0) mbar_arrive(&full[stage]);
        } else if (wg_tid == 0) {
          load_stage_tma<kP>(p, tile, kb, s_a, s_a + kATileBytes, &full[stage]);
        }
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      }
    }
    return;
  }
  // consumers (no setmaxnreg: at 168 registers neither role spills; a 40-register producer did)
  const int half = wg - 1;
  int stage = 0, phase = 0;
  float acc[128];
  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const Tile tile = tile_of<kP>(p, tile_prefix, t);
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    int prev = -1;
    for (int kb = 0; kb < tile.k_blocks; ++kb) {
      // A failed wait is recorded and the loop runs on (no divergent exit around wgmma); every later
      // wait then fails at once, so the kernel ends quickly with the error set.
      mbar_wait(&full[stage], phase, p->timeout_ns, err, 200 + kP);
      const u32 s_a = s_base + stage * kStageBytes;
      wgmma_fence();
      mma_stage<kP>(p, acc, s_a, s_a + kATileBytes, half);
      wgmma_commit();
      wgmma_wait<1>();  // the previous stage's MMAs are done: hand its buffers back
      fence_accumulators(acc);
      if (prev >= 0 && (threadIdx.x & 31) == 0) mbar_arrive(&empty[prev]);
      prev = stage;
      if (++stage == kStages) { stage = 0; phase ^= 1; }
    }
    wgmma_wait<0>();
    fence_accumulators(acc);
    if (prev >= 0 && (threadIdx.x & 31) == 0) mbar_arrive(&empty[prev]);
    store_tile<kP>(p, tile, acc, half, wg_tid);
  }
}

}  // namespace gemm
}  // namespace mok
