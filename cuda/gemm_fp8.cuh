// Grouped FP8 GEMMs of the expert FFNs on Hopper, block-scaled as DeepSeek-V3 trains: e4m3 codes,
// one fp32 scale per 1 x 128 activation block along K and per 128 x 128 weight block (the weight
// gradients: both operands 1 x 128 along K = the expert's rows), the scales applied to fp32
// accumulators in registers once per 128-deep k-block. The shape of gemm.cuh (read it first): a
// producer warpgroup, a 4-stage TMA ring, two consumer warpgroups, clusters of two that share B by
// multicast; its tile naming, ring helpers, gemm_setup and epilogues are reused as they are.
// Layouts of codes and scales: mok_proto/fp8.py (quantize_rows, quantize_blocks).
//
// Legend: as gemm.cuh. Hopper's FP8 wgmma takes only K-major operands: every A is [M, K] and every B is
// [N, K], K contiguous (the weights' codes as each problem needs, the weight gradients' operands transposed).
//
//   problem       C per tile        A [M,K] (1x128 scales)   B [N,K] (scales)                     K     epilogue
//   kGateUp       [T_e, I] g|u      xq [rows,H]              Wg^T|Wu^T [E,I,H] (128x128)          H     h, g, u bf16; hq, hs
//   kDown         [T_e, H]          hq [rows,I]              Wd^T [E,H,I] (128x128)               I     y = s_row acc, bf16
//   kDownBwd      [T_e, I]          dyq [rows,H]             Wd [E,I,H] (128x128)                 H     dg, du bf16; dgq, duq
//   kGateUpBwd    [T_e, H]          dgq|duq [rows,I]         Wg|Wu [E,H,I] (128x128)              2I    dx bf16
//   kDownWgrad    [I, H]            h^T [I,rows]             dy^T [H,rows] (1x128)                T_e   dWd fp32
//   kGateUpWgrad  [H, I] x 2        x^T [H,rows]             dg^T|du^T [I,rows] (1x128)           T_e   dWg, dWu fp32
//
// The arithmetic, per output element (m, n), k-blocks kb = 0, 1, ... in increasing order
// (mok_proto/reference_fp8.py scaled_matmul is its NumPy mirror):
//     block = sum over the kb's 128 k of A[m, k] B[n, k]    4 wgmma k32 into a temporary (scale-d 0 first)
//     acc   = __fmaf_rn(block, __fmul_rn(sa[m, kb], sb[n, kb]), acc)
// with sb the 128 x 128 block's scale in the row problems. The tensor cores sum a k-block's FP8
// products with less than fp32's precision; promoting every 128 k into fp32 registers bounds that.
//
// Tile: BM = 128 rows (64 per consumer warpgroup) x BN = 256 columns (dual problems: 128 of each
// matrix) x 128 k a stage (one scale block; 128 bytes of e4m3 = one 128B-swizzle row). A
// consumer warpgroup holds the 128 result accumulators of gemm.cuh's m64n256 layout and a 64-register
// temporary: per k-block it runs the 4 m64n128k32 MMAs of one n128 half, waits, promotes, then the
// other half. Both warpgroups work on the same stage, so they tend to wait and promote at the same
// time, the tensor cores idle (docs/design.md: why neither turns nor a pipeline of quarters).
// Scales: the scale arrays' layouts allow no TMA box (a tile's scales are strided), so the lanes of
// the producer's warp 1 copy the stage's scales with cp.async (sa of the tile's 128 rows; sb: the
// two n128 halves' block scales, or the weight gradients' 256 column scales) into shared memory
// beside the ring, while warp 0 issues the TMA copies of the codes; the stage's `full` barrier
// counts warp 0's lane 0 arrive with the TMA byte count and one arrival per lane of warp 1 once
// its copies have landed (cp.async.mbarrier.arrive.noinc). Rows past an
// expert's end get scale 0 in the row problems (their codes may be NaN: those rows are never stored).
// Weight gradients: K = the expert's rows; expert segments start at multiples of 128 rows (the
// caller's layout), so k-block kb of expert e is scale block row0 / 128 + kb of [*, rows / 128]
// and no scale block straddles two experts. The consumers zero the k bytes of the last, partial
// k-block that lie past the expert's end in both operands (zero_tail_k), whatever codes the gap
// holds (NaN codes included). One CTA owns an output tile and sums K in order: deterministic.
// kGateUp's h: h = silu(g) * u as gemm.cuh computes it, rounded to bf16 and stored; hq, hs are the
// 1 x 128 quantization of that bf16 h (this tile's 128 columns of a row are one block), equal bit
// for bit to fp8.quantize_rows of the stored h (cuda/fp8.cuh's block_scale and quantize4).
//
// Building blocks (as gemm.cuh): SharedStorage, load_stage_tma / load_stage_scales, produce_tile, consume_tile,
// run_tiles<kP, Tiles>; tile naming gemm::tile_of<kP, kKBlock>, ring gemm::Ring; SharedCountTiles, the
// standalone kernel's scheduler. The kernel: grouped_gemm<kP>, kP a gemm::Problem (the bf16 module's).
//
// Per tile (BM x BN x K): 2 BM BN K FLOPs; each CTA loads (BM + BN / 2) K code bytes and 4 (BM + BN)
// (row problems: 4 BM + 8) scale bytes per 128 k, and receives BN / 2 K from its partner.
#pragma once
#include "fp8.cuh"
#include "gemm.cuh"

namespace mok {
namespace gemm_fp8 {

using gemm::kBM;
using gemm::kBN;
using gemm::kCluster;
using gemm::kConsumerWarps;
using gemm::kDown;
using gemm::kDownBwd;
using gemm::kDownWgrad;
using gemm::kGateUp;
using gemm::kGateUpBwd;
using gemm::kGateUpWgrad;
using gemm::kMaxGroups;
using gemm::kStages;
using gemm::kStagingFloats;
using gemm::kThreads;
using gemm::ptr;
using gemm::Ring;
using gemm::Tile;
using gemm::Traits;

constexpr int kKBlock = fp8::kQuantBlock;       // k depth of a stage: one scale block, 128 bytes of codes
constexpr int kATileBytes = kBM * kKBlock;      // 16 KB
constexpr int kHalfBytes = 128 * kKBlock;       // one n128 half of the B tile: 16 KB
constexpr int kBTileBytes = 2 * kHalfBytes;     // 32 KB
constexpr int kStageBytes = kATileBytes + kBTileBytes;
constexpr int kFullArrivals = 33;  // producer warp 0's lane 0 with the TMA bytes, then one per lane of warp 1
static_assert(kBN == 256 && kBM == 128, "the tile is two n128 halves of B over two 64-row consumer halves");
static_assert(kKBlock == 128, "a k-block is one 128-byte swizzle row of e4m3 codes");
static_assert(kStagingFloats * 4 >= 16 * kKBlock, "a staging area holds a warp's 16 rows of 128 codes");

// Registers per thread after setmaxnreg (gemm.cuh): a consumer holds 128 accumulators and a
// 64-register temporary. Chosen so that nothing spills (tests/test_kernels_build.py checks it);
// ptxas is not monotonic in these numbers, so recheck after any change.
constexpr int kProducerRegs = 64;
constexpr int kConsumerRegs = 216;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kThreads * gemm::kLaunchRegs, "over the CTA's registers");
// The weight gradients' consumers also hold column scales loaded ahead (column_scales).
constexpr int kWgradProducerRegs = 56;
constexpr int kWgradConsumerRegs = 224;
static_assert(128 * kWgradProducerRegs + 256 * kWgradConsumerRegs <= kThreads * gemm::kLaunchRegs,
              "over the CTA's registers");

// Shared memory of one CTA (the kernel aligns the base up to 1024 bytes: a launch asks sizeof + 1024).
struct SharedStorage {
  char stages[kStages][kStageBytes];              // the ring: A codes, then B codes (or aux g, u)
  float staging[kConsumerWarps][kStagingFloats];  // epilogue staging, 2 KB per warp
  float scale_a[kStages][kBM];                    // each stage's A scales, one per tile row
  alignas(16) float scale_b[kStages][kBN];        // B's: [0], [1] per n128 half (row problems); per column
                                                  // (column_slot; column_scales reads 16 bytes at a time)
  u64 full[kStages];                              // producer warps 0, 1 -> consumers: stage loaded
  u64 empty[kStages];                             // consumers (both CTAs) -> producers: stage free
  int abort;                                      // set in both CTAs by cta 0: skip every tile
  int num_tiles;                                  // the standalone kernel's pair tiles (SharedCountTiles)
  int pair_prefix[kMaxGroups + 1];                // row problems: pair rows before expert g
};
constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage)) + 1024;
static_assert(kSmemBytes <= 232448, "over the 227 KB of shared memory a block may have on sm_90");

// ---------------------------------------------------------------------------------------------
// Producer: one stage's codes (lane 0 of warp 0, TMA) and scales (every lane of warp 1)
// ---------------------------------------------------------------------------------------------
// A [128 rows x 128 k] into this CTA; B half `cta` [128 rows x 128 k] into both CTAs of the
// cluster (the partner loads the other half); a row problem's tile that does not multicast (the
// fused kernel's pair of two experts) loads both halves itself. Row problems: B is expert `group`'s [N, K] matrix
// (rows group * N + n), dual (kGateUp): half h is matrix h at the tile's 128 columns. Weight
// gradients: A = X^T [M, rows], B = Y^T [N, rows] at k = the expert's rows row0 + k0 ..
template <int kP>
__device__ __forceinline__ void load_stage_tma(const gemm::TmaSource& p, const Tile& tile, int kb, u32 s_a, u64* bar,
                                               int cta) {
  using Tr = Traits<kP>;
  constexpr unsigned short kBoth = (1u << kCluster) - 1;
  const int k0 = kb * kKBlock;
  const u32 s_b = s_a + kATileBytes + cta * kHalfBytes;
  mbar_arrive_expect_tx(bar, kStageBytes);
  if (Tr::kRowProblem) {
    const bool second = kP == kGateUpBwd && k0 >= p.k_split;  // dx: dg/Wg, then du/Wu
    const int k_in = second ? k0 - p.k_split : k0;
    tma_load_2d(s_a, second ? p.a2 : p.a1, k_in, tile.row0 + tile.m0, bar);
    if (tile.multicast) {
      const i64 b_map = (Tr::kDualB ? cta : second) ? p.b2 : p.b1;
      const int n_row = tile.group * p.n + tile.n0 + (Tr::kDualB ? 0 : 128 * cta);
      tma_load_2d_multicast(s_b, b_map, k_in, n_row, bar, kBoth);
    } else {  // (fused.cuh: the partner's tile is another expert's) both halves, into this CTA only
#pragma unroll
      for (int h = 0; h < kCluster; ++h) {
        const i64 b_map = (Tr::kDualB ? h : second) ? p.b2 : p.b1;
        const int n_row = tile.group * p.n + tile.n0 + (Tr::kDualB ? 0 : 128 * h);
        tma_load_2d(s_a + kATileBytes + h * kHalfBytes, b_map, k_in, n_row, bar);
      }
    }
  } else {
    const int k_row = tile.row0 + k0;
    tma_load_2d(s_a, p.a1, k_row, tile.m0, bar);
    const i64 b_map = Tr::kDualB && cta ? p.b2 : p.b1;
    tma_load_2d_multicast(s_b, b_map, k_row, tile.n0 + (Tr::kDualB ? 0 : 128 * cta), bar, kBoth);
  }
}

// Where lane `lane` of the producer's warp 1 copies a tile's scales from: element offsets into
// the scale arrays, computed once a tile; k-block kb adds its block index (load_stage_scales).
// Row i of the lane's four (tile row lane + 32 i) is at a0 + i * a_step (row problems: 0 past the
// expert's end, a_in's bit i clear); B: row problems, lanes 0, 1: the 128 x 128 block row of n128
// half `lane` at b0; weight gradients: column lane + 32 j at b0 + (j % 4) * b_step (dual: j >= 4
// in the second matrix), else b0 + j * b_step.
// NOTE: 32-bit offsets: a scale array of 2^32 floats would belong to 0.5 TiB of codes.
struct ScaleSrc {
  u32 a0, a_step, b0, b_step, a_in;
  __device__ __forceinline__ u32 a(int i) const { return (a_in >> i & 1) ? a0 + i * a_step : 0u; }
};
template <int kP>
__device__ __forceinline__ ScaleSrc scale_src(const Fp8GemmParams* p, const Tile& tile, int lane) {
  using Tr = Traits<kP>;
  const u32 a_stride = static_cast<u32>(p->a_scale_stride), b_stride = static_cast<u32>(p->b_scale_stride);
  ScaleSrc src{0u, 32 * a_stride, 0u, 32 * b_stride, 0xFu};
  const int m = tile.m0 + lane;
  if (Tr::kRowProblem) {
    src.a0 = static_cast<u32>(tile.row0 + m) * a_stride;
    src.a_in = 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i) src.a_in |= static_cast<u32>(m + 32 * i < tile.rows) << i;
    const int n_block = (tile.n0 + (Tr::kDualB ? 0 : 128 * (lane & 1))) / 128;
    src.b0 = static_cast<u32>(tile.group) * static_cast<u32>(p->b_scale_group_stride) + n_block * b_stride;
  } else {
    src.a0 = static_cast<u32>(m) * a_stride;
    src.b0 = static_cast<u32>(tile.n0 + lane) * b_stride;
  }
  return src;
}

// The scale arrays (read once a launch by the producer).
struct ScaleBases {
  const float *a1, *a2, *b1, *b2;
  int split_blocks;  // kGateUpBwd: k-blocks of the first operand pair
};
__device__ __forceinline__ ScaleBases scale_bases(const Fp8GemmParams* p) {
  return {ptr<const float>(p->scale_a1), ptr<const float>(p->scale_a2), ptr<const float>(p->scale_b1),
          ptr<const float>(p->scale_b2), static_cast<int>(p->k_split / kKBlock)};
}

// Where the weight gradients' column scale of tile column 32 j + l lies in a stage's scale_b: 32 j +
// column_slot(l), so that a consumer thread's 16 columns of a quarter (64 kQ + 8 j' + 2 t + c, t =
// lane % 4) are four 16-byte chunks, 64 kQ + 16 (j' / 2) + 4 t + 2 (j' % 2) + c (column_scales).
__host__ __device__ constexpr int column_slot(int l) {
  return 16 * (l >> 4) + 4 * ((l >> 1) & 3) + 2 * ((l >> 3) & 1) + (l & 1);
}
__host__ __device__ constexpr u32 column_slots_taken(int l = 0) {  // bit s: some column l.. 31 has slot s
  return l == 32 ? 0u : (1u << column_slot(l)) | column_slots_taken(l + 1);
}
static_assert(column_slots_taken() == 0xFFFFFFFFu, "column_slot must give each of 32 columns its own slot");

// Lane `lane` of the producer's warp 1: its share of k-block kb's scales, copied (cp.async) into
// the stage's arrays s_a [kBM], s_b [kBN] (shared addresses).
template <int kP>
__device__ __forceinline__ void load_stage_scales(const ScaleBases& base, const ScaleSrc& src, const Tile& tile,
                                                  int kb, u32 s_a, u32 s_b, int lane) {
  using Tr = Traits<kP>;
  if (Tr::kRowProblem) {
    const bool second = kP == kGateUpBwd && kb >= base.split_blocks;  // dx: dg/Wg, then du/Wu
    const int kb_in = second ? kb - base.split_blocks : kb;
    const float* sa = (second ? base.a2 : base.a1) + kb_in;
#pragma unroll
    for (int i = 0; i < 4; ++i)  // rows past the expert's end: 0 (never stored)
      cp_async_4(s_a + 4 * (lane + 32 * i), sa + src.a(i), (src.a_in >> i & 1) ? 4 : 0);
    if (lane < 2) {
      const float* sb = ((Tr::kDualB ? lane : second) ? base.b2 : base.b1) + kb_in;
      cp_async_4(s_b + 4 * lane, sb + src.b0, 4);
    }
  } else {
    const int kb_rows = tile.row0 / kKBlock + kb;  // segments start at multiples of 128 rows
#pragma unroll
    for (int i = 0; i < 4; ++i) cp_async_4(s_a + 4 * (lane + 32 * i), base.a1 + kb_rows + src.a(i), 4);
    const int at = column_slot(lane);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const bool b2 = Tr::kDualB && j >= 4;
      cp_async_4(s_b + 4 * (at + 32 * j), (b2 ? base.b2 : base.b1) + kb_rows + src.b0 + (b2 ? j - 4 : j) * src.b_step, 4);
    }
  }
}

// One stage of the ring, by one producer warp: it waits for the stage to be free (as in
// gemm.cuh), then `load(bar, s_stage)` in every lane, unless its lane 0 finds the stage's last load
// not landed (gemm::previous_load_landed: only after an error; the warp then loads nothing more).
template <class Storage, class Load>
__device__ __forceinline__ bool produce_stage(const Fp8GemmParams* p, Storage& ss, Ring& ring, int problem,
                                              int lane, bool ok, Load load) {
  if (ok) ok = mbar_wait(&ss.empty[ring.stage], ring.phase ^ 1, p->timeout_ns, p->error, kOpGemmLoad, problem);
  if (lane == 0 && ok) ok = gemm::previous_load_landed(ss, ring);
  ok = __shfl_sync(0xffffffffu, ok, 0);
  if (ok) {
    load(&ss.full[ring.stage], smem_addr(ss.stages[ring.stage]));
    if (lane == 0) ring.loaded();
  }
  ring.advance();
  return ok;
}

// kDownBwd's aux stage c: g and u of the tile's columns 64 c .. 64 c + 63 (one lane).
__device__ __forceinline__ void load_aux_stage(const Fp8GemmParams* p, const Tile& tile, int c, u32 s_stage, u64* bar) {
  mbar_arrive_expect_tx(bar, 2 * gemm::kAuxU);
  tma_load_2d(s_stage, p->tmap_aux1, tile.n0 + 64 * c, tile.row0 + tile.m0, bar);
  tma_load_2d(s_stage + gemm::kAuxU, p->tmap_aux2, tile.n0 + 64 * c, tile.row0 + tile.m0, bar);
}

// The producer warpgroup, one tile: its k-blocks (kDownBwd: then g and u of the tile, 64 columns a
// stage, for the epilogue). Two warps split each stage's work, so that neither paces the ring:
// warp 0's lane 0 arms `full` with the TMA byte count and issues the copies of the codes; warp
// 1's 32 lanes copy the scales and arrive once they have landed (aux stages: arrive). After a
// failed wait a warp loads nothing more and the consumers' waits fail too.
template <int kP, class Storage>
__device__ __forceinline__ bool produce_tile(const Fp8GemmParams* p, Storage& ss, Ring& ring, const Tile& tile,
                                             int cta, int warp, int lane, const ScaleBases& base, bool ok) {
  if (warp == 0) {
    const gemm::TmaSource src = gemm::tma_source(p);
    for (int kb = 0; kb < tile.k_blocks; ++kb)
      ok = produce_stage(p, ss, ring, kP, lane, ok, [&](u64* bar, u32 s_stage) {
        if (lane == 0) load_stage_tma<kP>(src, tile, kb, s_stage, bar, cta);
      });
    for (int c = 0; c < Traits<kP>::kAuxStages; ++c)
      ok = produce_stage(p, ss, ring, kP, lane, ok, [&](u64* bar, u32 s_stage) {
        if (lane == 0) load_aux_stage(p, tile, c, s_stage, bar);
      });
  } else {
    const ScaleSrc src = scale_src<kP>(p, tile, lane);
    for (int kb = 0; kb < tile.k_blocks; ++kb)
      ok = produce_stage(p, ss, ring, kP, lane, ok, [&](u64* bar, u32) {
        load_stage_scales<kP>(base, src, tile, kb, smem_addr(ss.scale_a[ring.stage]), smem_addr(ss.scale_b[ring.stage]),
                              lane);
        cp_async_arrive_noinc(bar);
      });
    for (int c = 0; c < Traits<kP>::kAuxStages; ++c)
      ok = produce_stage(p, ss, ring, kP, lane, ok, [&](u64* bar, u32) { mbar_arrive(bar); });
  }
  return ok;
}

// The fused kernel's FP8 tiles (cuda/fused.cuh), by one producer warp (the others of its warpgroup
// move rows): per k-block every lane copies its share of the scales and raises the stage's pending
// count (cp_async_arrive: lowered again once its copies landed), then lane 0 arms `full` with the
// TMA byte count and issues the copies of the codes. So `full` keeps the expected count of one
// that the BF16 tiles of the same kernel (the shared expert's) arrive with.
template <int kP, class Storage>
__device__ __forceinline__ bool produce_tile_warp(const Fp8GemmParams* p, Storage& ss, Ring& ring, const Tile& tile,
                                                  int cta, int lane, bool ok) {
  const gemm::TmaSource tma = gemm::tma_source(p);
  const ScaleBases base = scale_bases(p);
  const ScaleSrc src = scale_src<kP>(p, tile, lane);
  for (int kb = 0; kb < tile.k_blocks; ++kb)
    ok = produce_stage(p, ss, ring, kP, lane, ok, [&](u64* bar, u32 s_stage) {
      load_stage_scales<kP>(base, src, tile, kb, smem_addr(ss.scale_a[ring.stage]), smem_addr(ss.scale_b[ring.stage]),
                            lane);
      cp_async_arrive(bar);
      __syncwarp();  // every lane's raise before the arrival that could complete the phase
      if (lane == 0) load_stage_tma<kP>(tma, tile, kb, s_stage, bar, cta);
    });
  for (int c = 0; c < Traits<kP>::kAuxStages; ++c)
    ok = produce_stage(p, ss, ring, kP, lane, ok, [&](u64* bar, u32 s_stage) {
      if (lane == 0) load_aux_stage(p, tile, c, s_stage, bar);
    });
  return ok;
}

// The fused kernel's shared memory where it runs FP8 tiles: gemm.cuh's (the BF16 tiles, the
// tickets, the movers' flag) and each stage's scales.
struct FusedStorage : gemm::SharedStorage {
  float scale_a[kStages][kBM];
  alignas(16) float scale_b[kStages][kBN];
};
constexpr int kFusedSmemBytes = static_cast<int>(sizeof(FusedStorage)) + 1024;
static_assert(kFusedSmemBytes <= 232448, "over the 227 KB of shared memory a block may have on sm_90");

// ---------------------------------------------------------------------------------------------
// Consumer
// ---------------------------------------------------------------------------------------------
// The weight gradients' last, partial k-block (K = the expert's rows): TMA loaded all 128 k of
// the stage (past the expert's end: the next expert's rows, gap rows with any codes, or zeros past
// the tensor). Both operands are K-major, so k is the byte within a 128-byte row, and the 128B
// swizzle moves whole 16-byte chunks (logical chunk c of stage row r sits at chunk c ^ (r % 8)).
// Warpgroup `half` clears bytes valid .. 127 of its 64 A rows and of B rows 128 half .. +127
// (stage rows 128 + ..); then both consumer warpgroups meet, so each sees all of B cleared.
__device__ __forceinline__ void zero_tail_k(char* stage, int valid, int half, int wg_tid) {
  const int first = valid >> 4, keep = valid & 15;  // the first chunk to clear; its bytes 0 .. keep - 1 stay
  u32 mask[4];  // of that chunk's words (little-endian: byte b of the chunk is byte b % 4 of word b / 4)
#pragma unroll
  for (int j = 0, n = keep; j < 4; ++j, n -= 4) mask[j] = n >= 4 ? 0xFFFFFFFFu : n <= 0 ? 0u : (1u << (8 * n)) - 1u;
#pragma unroll
  for (int k = 0; k < 2; ++k) {  // this thread's rows wg_tid, wg_tid + 128 of the warpgroup's 192
    const int r = wg_tid + 128 * k;
    if (r >= 192) break;  // (warp-uniform)
    const int row = r < 64 ? half * 64 + r : 128 + half * 128 + (r - 64);  // stage row (B's start at 128)
    char* line = stage + row * 128;
#pragma unroll
    for (int c = 0; c < 8; ++c) {  // logical chunk c of the row
      if (c < first) continue;  // (uniform)
      uint4* chunk = reinterpret_cast<uint4*>(line + ((c ^ (row & 7)) << 4));
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (c == first && keep) {
        v = *chunk;
        v.x &= mask[0], v.y &= mask[1], v.z &= mask[2], v.w &= mask[3];
      }
      *chunk = v;
    }
  }
  fence_proxy_async();  // generic writes, read next by wgmma (the async proxy)
  gemm::consumers_sync();
}

// desc + add in the 14-bit address field (a 32-bit add: the field cannot carry, shared addresses
// stay below 2^18).
__device__ __forceinline__ u64 desc_plus(u64 desc, u32 add) {
  return (desc & 0xFFFFFFFF00000000ull) | static_cast<u32>(static_cast<u32>(desc) + add);
}

// acc's quarter kQ += t * (sa * sb): t[4j + 2rh + c] is row 16 w + l/4 + 8 rh of the warpgroup's
// 64, column 64 kQ + 8j + 2 (l%4) + c of the tile (gemm.cuh's accumulator layout), and
// acc[32 kQ + 4j + 2rh + c] the same element. s0, s1: the row problems' sa * sb of rows rh = 0, 1;
// sa0, sa1, b: the weight gradients' row scales and this thread's column scales of the quarter
// (column_scales).
template <int kP, int kQ>
__device__ __forceinline__ void promote_quarter(float (&acc)[128], const float (&t)[32], float s0, float s1,
                                                float sa0, float sa1, const float2 (&b)[8]) {
  if constexpr (Traits<kP>::kRowProblem) {
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[32 * kQ + i] = __fmaf_rn(t[i], (i & 2) ? s1 : s0, acc[32 * kQ + i]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float s[4] = {__fmul_rn(sa0, b[j].x), __fmul_rn(sa0, b[j].y), __fmul_rn(sa1, b[j].x),
                          __fmul_rn(sa1, b[j].y)};
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[32 * kQ + 4 * j + c] = __fmaf_rn(t[4 * j + c], s[c], acc[32 * kQ + 4 * j + c]);
    }
  }
}

// The weight gradients' column scales of quarter kQ this thread promotes (columns 64 kQ + 8j +
// 2 (l%4), + 1; j in [kFirst, kLast)), from the stage's array at s_b: loaded ahead of the math
// that uses them (the promotion otherwise waits on each load).
template <int kP, int kQ, int kFirst = 0, int kLast = 8>
__device__ __forceinline__ void column_scales(u32 s_b, int lane, float2 (&b)[8]) {
  static_assert(kFirst % 2 == 0 && kLast % 2 == 0, "one wide load holds two j");
  if constexpr (!Traits<kP>::kRowProblem) {
#pragma unroll
    for (int j = kFirst; j < kLast; j += 2) {  // (column_slot's layout)
      const uint4 w = ld_shared_u32x4(s_b + 4 * (64 * kQ + 8 * j + 4 * (lane & 3)));
      b[j] = make_float2(__uint_as_float(w.x), __uint_as_float(w.y));
      b[j + 1] = make_float2(__uint_as_float(w.z), __uint_as_float(w.w));
    }
  }
}

// A loaded stage's start (`row`: this thread's first row of the tile; `tail`: the stage's valid k,
// kKBlock but in a weight gradient's last k-block, whose bytes tail .. 127 are zeroed): the
// descriptors' offset (add to the stage-0 ones with desc_plus), the row scales sa0, sa1 (rows row,
// row + 8), the B scales' address and, row problems, sa * sb of (n128 half, row rh): s00 .. s11.
struct KBlockIn {
  u32 desc_add, s_b;
  float sa0, sa1, s00, s01, s10, s11;
};
template <int kP, class Storage>
__device__ __forceinline__ KBlockIn kblock_in(Storage& ss, int stage, int tail, int row, int half, int wg_tid) {
  if (!Traits<kP>::kRowProblem && tail < kKBlock) zero_tail_k(ss.stages[stage], tail, half, wg_tid);
  const u32 s_scale_a = smem_addr(ss.scale_a[stage]) + 4 * row;
  KBlockIn in{static_cast<u32>(stage * kStageBytes) >> 4, smem_addr(ss.scale_b[stage]), ld_shared_f32(s_scale_a),
              ld_shared_f32(s_scale_a + 32), 0.0f, 0.0f, 0.0f, 0.0f};
  if constexpr (Traits<kP>::kRowProblem) {
    const float sb0 = ld_shared_f32(in.s_b), sb1 = ld_shared_f32(in.s_b + 4);
    in.s00 = __fmul_rn(in.sa0, sb0), in.s01 = __fmul_rn(in.sa1, sb0);
    in.s10 = __fmul_rn(in.sa0, sb1), in.s11 = __fmul_rn(in.sa1, sb1);
  }
  return in;
}

// The k-blocks of one tile: per k-block, the two n128 halves into one 64-register temporary (4 x
// m64n128k32, waited for), each promoted into acc; descriptors by a 32-bit add, every row scale
// read before the MMAs, half of the weight gradients' column scales of each n128 half's first
// quarter while that half's MMAs run (all of them: spills); the row problems' stage released as
// soon as its last MMA is done (the weight gradients' once promoted: their column scales are read
// until then). Per element the k-blocks are promoted in increasing order.
template <int kP, class Storage>
__device__ __forceinline__ bool consume_kblocks(const Fp8GemmParams* p, Storage& ss, Ring& ring, const Tile& tile,
                                                float (&acc)[128], int half, int wg_tid, bool ok) {
  using Tr = Traits<kP>;
  const u32 s_base = smem_addr(ss.stages);
  const int lane = wg_tid & 31, row = half * 64 + (wg_tid >> 5) * 16 + (lane >> 2);
  const u64 da0 = wgmma_desc(s_base + half * 64 * kKBlock, 16, 1024), db0 = wgmma_desc(s_base + kATileBytes, 16, 1024);
  float blk[64];
  float2 b0[8], b1[8];  // the weight gradients' column scales of a half's two quarters (column_scales)
  auto mma = [&](u64 da, u64 db, auto&& meanwhile) {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kKBlock / 32; ++ks)
      wgmma_m64n128k32_e4m3(blk, desc_plus(da, 2 * ks), desc_plus(db, 2 * ks), ks);
    wgmma_commit();
    meanwhile();  // loads the MMAs do not need, their latency under the MMAs'
    wgmma_wait<0>();
    fence_accumulators(blk);
  };
  // Counted down; last_rows: the valid k of a weight gradient's last k-block (its expert's rows).
  const int last_rows = Tr::kRowProblem ? kKBlock : tile.rows - (tile.k_blocks - 1) * kKBlock;
  for (int left = tile.k_blocks; left > 0; --left) {
    if (ok) ok = mbar_wait(&ss.full[ring.stage], ring.phase, p->timeout_ns, p->error, kOpGemmMma, kP);
    const KBlockIn in = kblock_in<kP>(ss, ring.stage, left == 1 ? last_rows : kKBlock, row, half, wg_tid);
    const u64 da = desc_plus(da0, in.desc_add), db = desc_plus(db0, in.desc_add);
    const u32 s_b = in.s_b;
    const float sa0 = in.sa0, sa1 = in.sa1, s00 = in.s00, s01 = in.s01, s10 = in.s10, s11 = in.s11;
    mma(da, db, [&] { column_scales<kP, 0, 0, 4>(s_b, lane, b0); });
    column_scales<kP, 0, 4, 8>(s_b, lane, b0);
    promote_quarter<kP, 0>(acc, reinterpret_cast<const float(&)[32]>(blk[0]), s00, s01, sa0, sa1, b0);
    column_scales<kP, 1>(s_b, lane, b1);
    promote_quarter<kP, 1>(acc, reinterpret_cast<const float(&)[32]>(blk[32]), s00, s01, sa0, sa1, b1);
    mma(da, desc_plus(db, kHalfBytes >> 4), [&] { column_scales<kP, 2, 0, 4>(s_b, lane, b0); });
    column_scales<kP, 2, 4, 8>(s_b, lane, b0);
    if constexpr (Tr::kRowProblem) gemm::release_stage(ss, ring.stage, wg_tid);
    promote_quarter<kP, 2>(acc, reinterpret_cast<const float(&)[32]>(blk[0]), s10, s11, sa0, sa1, b0);
    column_scales<kP, 3>(s_b, lane, b1);
    promote_quarter<kP, 3>(acc, reinterpret_cast<const float(&)[32]>(blk[32]), s10, s11, sa0, sa1, b1);
    if constexpr (!Tr::kRowProblem) gemm::release_stage(ss, ring.stage, wg_tid);
    ring.advance();
  }
  return ok;
}

__device__ __forceinline__ float round_bf16(float x) { return bf16_lo(pack_bf16x2(x, 0.0f)); }

// kGateUp: this warp's 16 rows of h (acc[4J + 2 rh + c], J < 16, already bf16 values) quantized
// 1 x 128: the row's amax over the quad that holds it, the scale, the codes staged in the warp's
// 2 KB area (16-byte chunk c of row r at c ^ (r % 8)), then 16-byte stores of whole rows.
__device__ __forceinline__ void store_h_codes(const Fp8GemmParams* p, const Tile& tile, const float (&acc)[128],
                                              char* stg, int half, int wg_tid) {
  const int warp = wg_tid >> 5, lane = wg_tid & 31;
  const int m_warp = tile.m0 + half * 64 + warp * 16;  // the warp's first row in the expert
  __syncwarp();  // the previous use of the staging area is done
  // One pass per row half, not unrolled (the code stays in the instruction cache); its 32 values
  // are chosen by value (an index into acc chosen at run time would put acc in local memory).
#pragma unroll 1
  for (int rh = 0; rh < 2; ++rh) {
    float h[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {  // h[2J + c] = acc[4J + 2 rh + c]
      const int k = 4 * (i >> 1) + (i & 1);
      h[i] = rh ? acc[k + 2] : acc[k];
    }
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; ++i) amax = fp8::keep_max(amax, fp8::keep_abs(h[i]));
    amax = fp8::keep_max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fp8::keep_max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const float scale = fp8::block_scale(amax, p->pow2 != 0);
    const fp8::Divisor d = fp8::divisor(scale);
    const int r = (lane >> 2) + 8 * rh;
#pragma unroll
    for (int j = 0; j < 16; j += 2) {  // columns 8j + 2(l%4), +1 and 8(j+1) + 2(l%4), +1: chunk j/2 of row r
      const float v[4] = {h[2 * j], h[2 * j + 1], h[2 * j + 2], h[2 * j + 3]};
      const u32 q = fp8::quantize4(v, d);
      char* chunk = stg + r * 128 + (((j >> 1) ^ (r & 7)) << 4) + 2 * (lane & 3);
      *reinterpret_cast<unsigned short*>(chunk) = static_cast<unsigned short>(q);
      *reinterpret_cast<unsigned short*>(chunk + 8) = static_cast<unsigned short>(q >> 16);
    }
    if ((lane & 3) == 0 && m_warp + r < tile.rows)
      ptr<float>(p->out_scales)[static_cast<i64>(tile.row0 + m_warp + r) * (p->n / kKBlock) + tile.n0 / kKBlock] = scale;
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = (lane >> 3) + 4 * i, c = lane & 7;
    const uint4 v = *reinterpret_cast<const uint4*>(stg + r * 128 + ((c ^ (r & 7)) << 4));
    if (m_warp + r < tile.rows)
      *ptr<uint4>(p->out_codes + static_cast<i64>(tile.row0 + m_warp + r) * p->ldo + tile.n0 + 16 * c) = v;
  }
}

// kDownBwd with out_codes (dgq, dgs) and out_codes2 (duq, dus): dg and du quantized 1 x 128 for
// gate_up_bwd from the bf16 values the epilogue stored, which gemm::store_down_bwd_tile hands on
// (kept in registers: the groups of 8 columns 32 j + 8 (l%4) of the lane's row, j < 4 per block).
// Per block and row half, the block's amax over the quad that holds the row, then the row
// quantizer's scale and codes: equal bit for bit to fp8.quantize_rows of the stored dg, du.
struct DgDuCodes {
  const Fp8GemmParams* p;
  const Tile* tile;
  int half, wg_tid;
  gemm::DgDu8 kept[2][4] = {};  // [row half][group within the block]

  template <class RowHalf, class Group>
  __device__ __forceinline__ void operator()(RowHalf, Group, const gemm::DgDu8& v) {
    kept[RowHalf::kValue][Group::kValue % 4] = v;
  }

  template <class Block>
  __device__ __forceinline__ void block(Block) const {
    constexpr int b = Block::kValue;
    if (!p->out_codes || !tile->store) return;  // (uniform over the CTA: the shuffles below need the warp)
    const int lane = wg_tid & 31;
    const bool pow2 = p->pow2 != 0;
    // One pass per (row half, matrix), not unrolled: the epilogue's code stays in the instruction
    // cache (four unrolled copies stalled the warps on instruction fetch).
#pragma unroll 1
    for (int pass = 0; pass < 4; ++pass) {
      const int rh = pass >> 1;
      const bool du = pass & 1;
      const gemm::RowOut r = gemm::row_out(p, *tile, rh, half, wg_tid);
      const i64 row = tile->row0 + tile->m0 + r.row;  // == (r.base - tile->n0 - 8 (l%4)) / ldo
      float v[4][8];
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        // (selected by value, word by word: a reference chosen at run time would put `kept` in local memory)
        const uint4 w0 = du ? kept[0][j].du : kept[0][j].dg, w1 = du ? kept[1][j].du : kept[1][j].dg;
        unpack8(make_uint4(rh ? w1.x : w0.x, rh ? w1.y : w0.y, rh ? w1.z : w0.z, rh ? w1.w : w0.w), v[j]);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fp8::keep_max(amax, fp8::keep_abs(v[j][i]));
      }
      amax = fp8::keep_max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // the quad: one row's block
      amax = fp8::keep_max(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      const float scale = fp8::block_scale(amax, pow2);
      if (!r.valid) continue;  // (a quad's lanes share their row: an invalid one's values reach no valid lane)
      const fp8::Divisor d = fp8::divisor(scale);
      unsigned char* codes = ptr<unsigned char>(du ? p->out_codes2 : p->out_codes);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float lo[4] = {v[j][0], v[j][1], v[j][2], v[j][3]}, hi[4] = {v[j][4], v[j][5], v[j][6], v[j][7]};
        *reinterpret_cast<uint2*>(codes + r.base + kKBlock * b + 32 * j) =
            make_uint2(fp8::quantize4(lo, d), fp8::quantize4(hi, d));
      }
      float* scales = ptr<float>(du ? p->out_scales2 : p->out_scales);
      if ((lane & 3) == 0) scales[row * (p->n / kKBlock) + tile->n0 / kKBlock + b] = scale;
    }
  }
};
static_assert(kBN == 2 * kKBlock, "a down_bwd tile row is two 1 x 128 blocks (store_down_bwd_tile's block calls)");

// kGateUp's epilogue: g, u where asked (bf16), then h = silu(g) * u (as gemm.cuh computes it) into
// g's registers, rounded to bf16: stored as h, and quantized into hq, hs.
__device__ __forceinline__ void store_gate_up(const Fp8GemmParams* p, const Tile& tile, float (&acc)[128], char* stg,
                                              int half, int wg_tid) {
  using gemm::kCopy;
  if (p->out2) {
    gemm::store_block_bf16<0, 0, kCopy>(p, tile, acc, stg, half, wg_tid, p->out2, 1.0f, 1.0f);
    gemm::store_block_bf16<1, 0, kCopy>(p, tile, acc, stg, half, wg_tid, p->out2, 1.0f, 1.0f);
  }
  if (p->out3) {
    gemm::store_block_bf16<0, 16, kCopy>(p, tile, acc, stg, half, wg_tid, p->out3, 1.0f, 1.0f);
    gemm::store_block_bf16<1, 16, kCopy>(p, tile, acc, stg, half, wg_tid, p->out3, 1.0f, 1.0f);
  }
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = round_bf16(acc[i] * gemm::sigmoid(acc[i]) * acc[64 + i]);
  gemm::store_block_bf16<0, 0, kCopy>(p, tile, acc, stg, half, wg_tid, p->out1, 1.0f, 1.0f);
  gemm::store_block_bf16<1, 0, kCopy>(p, tile, acc, stg, half, wg_tid, p->out1, 1.0f, 1.0f);
  store_h_codes(p, tile, acc, stg, half, wg_tid);
}

// Consumer warpgroup `half` (rows 64 half .. +63), one tile: per k-block, waits for the stage,
// reads its scales, runs and promotes the two n128 halves, hands the stage back to the producers
// of both CTAs; then the epilogue. After a failed wait the loops run on over garbage (wgmma must
// stay warpgroup-uniform) and the kernel ends with the error set.
template <int kP, class Storage>
__device__ __forceinline__ bool consume_tile(const Fp8GemmParams* p, Storage& ss, Ring& ring, const Tile& tile,
                                             float (&acc)[128], float* staging, int half, int wg_tid, bool ok) {
  using Tr = Traits<kP>;
  // (acc is no wgmma accumulator here: the promotion adds into it, so one k-loop serves both starts)
  const bool unchanged = gemm::run_from_accumulators<kP>(p, tile, acc, half, wg_tid, [] {});
  ok = consume_kblocks<kP>(p, ss, ring, tile, acc, half, wg_tid, ok);
  if constexpr (!gemm::kEpilogue) {
    ok = gemm::skip_epilogue<kP>(p, ss, ring, acc, wg_tid, ok);
  } else if constexpr (Tr::kAuxStages > 0) {
    ok = gemm::store_down_bwd_tile<kP>(p, ss, ring, tile, acc, staging, half, wg_tid, ok,
                                       DgDuCodes{p, &tile, half, wg_tid});
  } else if (tile.store && !unchanged) {
    if constexpr (kP == kGateUp) {
      store_gate_up(p, tile, acc, reinterpret_cast<char*>(staging), half, wg_tid);
    } else {
      gemm::store_tile<kP>(p, tile, acc, staging, half, wg_tid);
    }
  }
  return ok;
}

// Both roles over the pair tiles `tiles` yields (each role walks its own copy in the same order).
template <int kP, class Tiles>
__device__ __forceinline__ void run_tiles(const Fp8GemmParams* p, SharedStorage& ss, Tiles tiles, int cta) {
  // NOTE: the role is broadcast from lane 0 so the compiler sees it warp-uniform (gemm.cuh run_tiles).
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0), wg_tid = threadIdx.x & 127;
  Ring ring;
  bool ok = true;
  int t;
  if (wg == 0) {
    warpgroup_reg_dealloc<Traits<kP>::kRowProblem ? kProducerRegs : kWgradProducerRegs>();
    const int warp = __shfl_sync(0xffffffffu, wg_tid >> 5, 0), lane = wg_tid & 31;
    const ScaleBases base = scale_bases(p);
    while (tiles.next(t))  // warps 2, 3 have nothing to load
      if (warp < 2)
        ok = produce_tile<kP>(p, ss, ring, gemm::tile_of<kP, kKBlock>(p, ss.pair_prefix, t, cta), cta, warp, lane,
                              base, ok);
    if (warp == 1) cp_async_wait_all();  // the scale copies
    if (wg_tid == 0) gemm::drain_loads(ss, ring);
  } else {
    warpgroup_reg_alloc<Traits<kP>::kRowProblem ? kConsumerRegs : kWgradConsumerRegs>();
    float acc[128];
    float* staging = ss.staging[threadIdx.x / 32 - 4];
    while (tiles.next(t))
      ok = consume_tile<kP>(p, ss, ring, gemm::tile_of<kP, kKBlock>(p, ss.pair_prefix, t, cta), acc, staging, wg - 1,
                            wg_tid, ok);
  }
}

// The standalone kernel's tile order, gemm::StridedTiles' (cluster c takes pair tiles c, c + C, ..),
// its start and count read at the first and every call: nothing but a pointer is held in registers
// across the warpgroups' register reallocation (setmaxnreg), where ptxas would spill.
struct SharedCountTiles {
  const int* count;  // shared memory
  int t = -1;
  __device__ __forceinline__ bool next(int& tile) {
    t = t < 0 ? static_cast<int>(cluster_id_x()) : t + static_cast<int>(num_clusters_x());
    tile = t;
    return t < *count;
  }
};

// ---------------------------------------------------------------------------------------------
// grouped_gemm<kP>: one persistent grid of 2-CTA clusters over every tile of the problem.
// ---------------------------------------------------------------------------------------------
template <int kP>
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kThreads, 1) grouped_gemm(const Fp8GemmParams* p) {
  extern __shared__ char smem_raw[];
  SharedStorage& ss = aligned_shared<SharedStorage>(smem_raw);
  const int cta = static_cast<int>(cluster_ctarank());
  const int num_tiles = gemm::gemm_setup<kP, kFullArrivals>(p, ss, cta);
  if (threadIdx.x == 0) ss.num_tiles = num_tiles;
  __syncthreads();
  run_tiles<kP>(p, ss, SharedCountTiles{&ss.num_tiles}, cta);
  // No CTA may leave while its partner can still arrive on its barriers or multicast into it.
  cluster_sync();
}

// Compile-time sizes Python reads once from the compiled module: out[0] = dynamic shared memory of
// a grouped_gemm launch.  grid 1, block 1.
__global__ void export_sizes(int* out) { out[0] = kSmemBytes; }

}  // namespace gemm_fp8
}  // namespace mok
