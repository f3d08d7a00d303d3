// The BF16 GEMM tiles of gemm.cuh (its header says what they compute): the sizes, the register
// split, SharedStorage, each problem's operand layout (Traits), the tile naming (group_tile,
// tile_of; banded_tile, the standalone kernel's order), a stage's TMA loads, the weight gradients'
// tail zeroing, and one stage's MMAs. gemm_fp8.cuh and fused.cuh use them through gemm.cuh.
#pragma once
#include "hopper.cuh"

namespace mok {
namespace gemm {

// Tile sizes, the cluster, thread roles, kMaxGroups, the Problem enum and GemmParams: cuda/abi.cuh.
constexpr int kATileBytes = kBM * kBK * 2;  // 16 KB
constexpr int kBTileBytes = kBN * kBK * 2;  // 32 KB
constexpr int kStageBytes = kATileBytes + kBTileBytes;
static_assert(kCluster == 2, "tile pairing and the B halves below assume clusters of two");
static_assert(kStagingFloats * 4 >= 16 * 128, "a staging area holds one stmatrix block: 16 rows x 128 bytes");
static_assert(kThreads == 128 * (1 + kConsumerWarps / 4), "one producer warpgroup, then the consumers");

// Registers per thread after the warpgroups rebalance them (setmaxnreg): a launch of kThreads
// threads, one CTA per SM, starts at 65536 / kThreads rounded down to 8 (168) each; the producer
// warpgroup gives some back and the two consumer warpgroups (128 fp32 accumulators each, plus the
// epilogue) take them. ptxas -v: no spills in any grouped_gemm<kP> (168 for all: two spilled).
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
constexpr int kProducerRegs = 88;
constexpr int kConsumerRegs = 208;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kThreads * kLaunchRegs, "over the CTA's registers");

// Tickets in flight between a cluster's claimer and its readers (fused.cuh: the claimed tile pairs).
constexpr int kTickets = 4;

// Shared memory of one CTA. The kernel aligns the dynamic base up to 1024 bytes (128B-swizzled
// TMA and wgmma atoms), so a launch asks for sizeof + 1024.
struct SharedStorage {
  char stages[kStages][kStageBytes];              // the ring: A tile, then B tile (or aux g, u)
  float staging[kConsumerWarps][kStagingFloats];  // epilogue staging, two areas per warp
  u64 full[kStages];                              // producer -> consumers: stage loaded
  u64 empty[kStages];                             // consumers (both CTAs) -> producers: stage free
  int abort;                                      // set in both CTAs by cta 0: skip every tile
  int go;                                         // fused.cuh: the movers of a chunk task proceed
  int ticket[kTickets];                           // fused.cuh: claimed tile pairs, cta 0 -> both CTAs
  u64 ticket_full[kTickets];                      // fused.cuh: a ticket written (cta 0's arrive)
  u64 ticket_empty[kTickets];                     // fused.cuh (cta 0's only): every reader took it
  int pair_prefix[kMaxGroups + 1];                // row problems: pair rows before expert g
};
constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage)) + 1024;
static_assert(kSmemBytes <= 232448, "over the 227 KB of shared memory a block may have on sm_90");

template <int kP> struct Traits {
  static constexpr bool kRowProblem = kP <= kGateUpBwd;  // M ragged (else K ragged)
  static constexpr bool kDualB = kP == kGateUp || kP == kGateUpWgrad;  // 128 columns from each of b1, b2
  static constexpr int kAMajorMN = kRowProblem ? 0 : 1;
  static constexpr int kBMajorMN = (kP == kDownBwd || kP == kGateUpBwd) ? 0 : 1;
  static constexpr int kTileN = kDualB ? kBN / 2 : kBN;  // columns per output matrix per tile
  // kDownBwd: after a tile's k-blocks the producer loads the tile's g and u through the same ring,
  // 64 columns (2 x 16 KB) per stage, so the epilogue reads them from shared memory.
  static constexpr int kAuxStages = kP == kDownBwd ? kBN / 64 : 0;
};

// A problem as a type (a generic lambda's argument: tag.kProblem is a constant expression).
template <int kP> struct Tag {
  static constexpr int kProblem = kP;
};

struct Tile {
  int group, m0, n0, row0, rows, k_blocks;
  bool store;      // false: a duplicate of the partner CTA's tile (odd M tile count), not written
  bool multicast;  // false: the partner's tile is another expert's (fused.cuh): this CTA loads all of B
};

template <typename T>
__device__ __forceinline__ T* ptr(i64 address) { return reinterpret_cast<T*>(address); }

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Output tile m_tile (rows 128 m_tile ..) x n_tile of group (expert) `group`: row problems have M
// = the group's rows (ragged) and a fixed K; weight gradients a fixed M and K = the group's rows.
// An m_tile past the last (a pair's second tile where the M tile count is odd) recomputes the one
// before it and stores nothing. Every scheduler (StridedTiles here, a fused plan's tasks) names
// its tiles through this.
template <int kP, int kDepth = kBK, class Params>
__device__ __forceinline__ Tile group_tile(const Params* p, int group, int m_tile, int n_tile) {
  using Tr = Traits<kP>;
  Tile tile;
  tile.group = group;
  tile.n0 = n_tile * Tr::kTileN;
  tile.row0 = ptr<const int>(p->row_offsets)[group];
  tile.rows = ptr<const int>(p->row_counts)[group];
  const int m_tiles = Tr::kRowProblem ? ceil_div(tile.rows, kBM) : static_cast<int>(p->m) / kBM;
  tile.k_blocks = Tr::kRowProblem ? static_cast<int>(p->k) / kDepth : ceil_div(tile.rows, kDepth);
  tile.store = m_tile < m_tiles;
  tile.m0 = (tile.store ? m_tile : m_tile - 1) * kBM;
  tile.multicast = true;
  return tile;
}

// The last of `groups` ascending entries (receive-row offsets, or a pair prefix) at or below
// `value`: the group it falls in (empty groups share their successor's entry; the later is taken).
__device__ __forceinline__ int group_at(const int* entries, int groups, int value) {
  int lo = 0, hi = groups;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (entries[mid] <= value) lo = mid; else hi = mid;
  }
  return lo;
}

// Pair tile t of this problem, as run by cluster CTA `cta`. Row problems: per expert
// ceil(ceil(T_e / BM) / 2) pair rows x n tiles; pair_prefix holds the running count of pair rows.
// Weight gradients: ceil((M / BM) / 2) pair rows x n tiles per expert.
template <int kP, int kDepth = kBK, class Params>
__device__ __forceinline__ Tile tile_of(const Params* p, const int* pair_prefix, int t, int cta) {
  const int n_tiles = static_cast<int>(p->n) / Traits<kP>::kTileN;
  if (Traits<kP>::kRowProblem) {
    const int mp = t / n_tiles, lo = group_at(pair_prefix, static_cast<int>(p->num_groups), mp);
    return group_tile<kP, kDepth>(p, lo, 2 * (mp - pair_prefix[lo]) + cta, t - mp * n_tiles);
  }
  const int per_group = ceil_div(static_cast<int>(p->m) / kBM, 2) * n_tiles;
  const int group = t / per_group, r = t - group * per_group;
  return group_tile<kP, kDepth>(p, group, 2 * (r / n_tiles) + cta, r % n_tiles);
}

// The standalone kernel's pair tile t, in bands. An expert's tiles keep tile_of's range of t, but
// its P pair rows are cut into ceil(P / kBandPairs) bands of near-equal height, and within a band the pair row moves
// fastest: the tiles of one wave (consecutive t) form a block about kBandPairs pair rows tall
// instead of a strip along N, so they read fewer distinct A and B slices (one per pair row and
// per n tile; sqrt(66 clusters) ~ 8 minimises their sum).
constexpr int kBandPairs = 8;

template <int kP, int kDepth = kBK, class Params>
__device__ __forceinline__ Tile banded_tile(const Params* p, const int* pair_prefix, int t, int cta) {
  const int n_tiles = static_cast<int>(p->n) / Traits<kP>::kTileN;
  int group, first, pairs;  // the expert, its first pair row (in t / n_tiles units), its pair rows
  if (Traits<kP>::kRowProblem) {
    group = group_at(pair_prefix, static_cast<int>(p->num_groups), t / n_tiles);
    first = pair_prefix[group], pairs = pair_prefix[group + 1] - first;
  } else {
    pairs = ceil_div(static_cast<int>(p->m) / kBM, 2);
    group = t / (pairs * n_tiles), first = group * pairs;
  }
  const int r = t - first * n_tiles;  // the tile within its expert
  const int bands = ceil_div(pairs, kBandPairs), q = pairs / bands, tall = pairs - q * bands;  // tall: q + 1 high
  const int row = r / n_tiles;  // band b holds rows s_b .. s_b + h_b - 1 of the row-major order
  const int b = row < tall * (q + 1) ? row / (q + 1) : tall + (row - tall * (q + 1)) / q;
  const int s = b * q + min(b, tall), h = q + (b < tall ? 1 : 0), i = r - s * n_tiles;
  return group_tile<kP, kDepth>(p, group, 2 * (s + i % h) + cta, i / h);
}

// ---------------------------------------------------------------------------------------------
// TMA load of one full stage by one thread: A [BM x BK] (this CTA's own) and half of B [BK x BN]
// (multicast to both CTAs of the cluster; the partner loads the other half), as 64-element-wide
// boxes (MN-major) or 128-row boxes (K-major). The stage's barrier counts all of its bytes.
// ---------------------------------------------------------------------------------------------
// What load_stage_tma reads of the launch, held in the producer's registers: the launch
// parameters live in global memory and every barrier's memory clobber would reload them per stage
// (dependent loads before each copy, on the producer's critical path).
struct TmaSource {
  i64 a1, a2, b1, b2;  // the tensor maps' addresses
  int k_split, k, n;
};
template <class Params>
__device__ __forceinline__ TmaSource tma_source(const Params* p) {
  return {p->tmap_a1, p->tmap_a2, p->tmap_b1, p->tmap_b2, static_cast<int>(p->k_split), static_cast<int>(p->k),
          static_cast<int>(p->n)};
}

template <int kP>
__device__ __forceinline__ void load_stage_tma(const TmaSource& p, const Tile& tile, int kb, u32 s_a, u32 s_b, u64* bar,
                                               int cta) {
  using Tr = Traits<kP>;
  const int k0 = kb * kBK;
  const bool second = kP == kGateUpBwd && k0 >= p.k_split;  // dx: dg/Wg, then du/Wu
  const int k_in = second ? k0 - p.k_split : k0;
  mbar_arrive_expect_tx(bar, kStageBytes);
  if (Tr::kAMajorMN) {  // x^T / h^T: two atoms of 64 m x 64 k rows
    tma_load_2d(s_a, p.a1, tile.m0, tile.row0 + k0, bar);
    tma_load_2d(s_a + 8192, p.a1, tile.m0 + 64, tile.row0 + k0, bar);
  } else {  // 128 rows x 64 k
    tma_load_2d(s_a, second ? p.a2 : p.a1, k_in, tile.row0 + tile.m0, bar);
  }
  constexpr unsigned short kBoth = (1u << kCluster) - 1;
  if (Tr::kBMajorMN) {  // four atoms of 64 n x 64 k rows; this CTA loads atoms 2 cta, 2 cta + 1
    const int k_row = Tr::kRowProblem ? tile.group * p.k + k0 : tile.row0 + k0;
    if (tile.multicast) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int atom = 2 * cta + i;
        const bool b2 = Tr::kDualB && atom >= 2;
        const int col = tile.n0 + (Tr::kDualB ? (atom & 1) : atom) * 64;
        tma_load_2d_multicast(s_b + atom * 8192, b2 ? p.b2 : p.b1, col, k_row, bar, kBoth);
      }
    } else {  // every atom, into this CTA only
#pragma unroll
      for (int atom = 0; atom < 4; ++atom) {
        const bool b2 = Tr::kDualB && atom >= 2;
        const int col = tile.n0 + (Tr::kDualB ? (atom & 1) : atom) * 64;
        tma_load_2d(s_b + atom * 8192, b2 ? p.b2 : p.b1, col, k_row, bar);
      }
    }
  } else {  // 256 n rows x 64 k; this CTA loads rows 128 cta .. 128 cta + 127
    const i64 b_map = second ? p.b2 : p.b1;
    const int n_row = tile.group * p.n + tile.n0;
    if (tile.multicast) {
      tma_load_2d_multicast(s_b + cta * 16384, b_map, k_in, n_row + 128 * cta, bar, kBoth);
    } else {  // both halves, into this CTA only
      tma_load_2d(s_b, b_map, k_in, n_row, bar);
      tma_load_2d(s_b + 16384, b_map, k_in, n_row + 128, bar);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The weight gradients' last, partial k-block of an expert (K = the expert's rows, ragged): TMA
// loads all kBK k rows of the stage like any other (rows past the expert's end are the next
// expert's, or zeros past the tensor), and the consumers zero k rows valid .. kBK - 1 of both
// operands before their MMAs, so they sum exactly the expert's rows. Both operands are MN-major
// there, atoms of [64 k rows x 128 bytes]: a k row is one 128-byte line of an atom whatever the
// swizzle. Warpgroup `half` zeroes its own A atom and B atoms 2 half, 2 half + 1; then both
// consumer warpgroups meet (named barrier kConsumersBarrier), so each sees all of B zeroed.
// ---------------------------------------------------------------------------------------------
constexpr int kConsumersBarrier = 2;  // bar.sync id of the two consumer warpgroups (256 threads)

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync %0, 256;" ::"n"(kConsumersBarrier) : "memory");
}

__device__ __forceinline__ void zero_tail_k_rows(u32 s_a, int valid, int half, int wg_tid) {
  const int chunks = (kBK - valid) * 8;  // 16-byte chunks per atom to zero
  for (int c = wg_tid; c < 3 * chunks; c += 128) {
    const int atom = c / chunks, rest = c - atom * chunks;
    const u32 base = atom == 0 ? s_a + half * 8192 : s_a + kATileBytes + (2 * half + atom - 1) * 8192;
    st_shared_zero16(base + (valid + rest / 8) * 128 + (rest & 7) * 16);
  }
  fence_proxy_async();  // generic writes, read next by wgmma (the async proxy)
  consumers_sync();
}

// ---------------------------------------------------------------------------------------------
// Consumer: one warpgroup, 64 rows x 256 columns, four k16 steps per stage.
// Descriptors (128B swizzle): K-major: rows of 128 bytes, 8-row groups 1024 bytes apart (SBO),
// a k16 step is +32 bytes. MN-major: 64-element atoms of [64 k rows x 128 bytes] (LBO = atom
// stride), 8 k rows = 1024 bytes (SBO), a k16 step is +2048 bytes.
// ---------------------------------------------------------------------------------------------
template <int kP>
__device__ __forceinline__ void mma_stage(float (&acc)[128], u32 s_a, u32 s_b, int half) {
  using Tr = Traits<kP>;
  constexpr u32 mn_lbo = kBK * 128, mn_sbo = 1024;  // (compile-time: nothing is loaded per k-block)
#pragma unroll
  for (int ks = 0; ks < kBK / 16; ++ks) {
    const u64 da = Tr::kAMajorMN ? wgmma_desc(s_a + half * 8192 + ks * 2048, mn_lbo, mn_sbo)
                                 : wgmma_desc(s_a + half * 64 * 128 + ks * 32, 16, 1024);
    const u64 db = Tr::kBMajorMN ? wgmma_desc(s_b + ks * 2048, mn_lbo, mn_sbo) : wgmma_desc(s_b + ks * 32, 16, 1024);
    wgmma_m64n256k16<Tr::kAMajorMN, Tr::kBMajorMN>(acc, da, db, 1);
  }
}

}  // namespace gemm
}  // namespace mok
