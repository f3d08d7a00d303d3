// FP8 (e4m3) block quantization: the rule of mok_proto/fp8.py, matched bit for bit (codes and
// scales; that module's docstring is the spec and gives the layouts).
//   quantize_rows<In, false>  x [rows, cols] -> codes [rows, cols], scales [rows, cols / B]
//                             (1 x B blocks along a row: activations as the row GEMMs read them)
//   quantize_rows<In, true>   x [rows, cols] -> codes [cols, rows], scales [cols, rows / B]
//                             (the rule on x^T: B x 1 blocks, K-major for the weight gradients)
//   quantize_blocks<In>       x [batch, rows, cols] -> codes [batch, rows, cols], scales
//                             [batch, rows / B, cols / B] (B x B blocks: weights), optionally also
//                             the transposed codes [batch, cols, rows] and scales
//   quantize_segment_rows<In>, quantize_segment_columns<In>: the two row quantizers on the rows
//                             of expert segments only (the GPU layer's receive rows: offsets and
//                             counts on the device); the columns' last block of a segment reads
//                             the rows past its count as zero. In may also be unsigned char for
//                             the columns: e4m3 codes with their 1 x B scales, dequantized first.
//   dequantize_segment_rows   codes, scales (1 x B) -> bf16(fl32(decode(code) * scale)) [rows, cols]
//                             on the segments' rows (fp8.dequantize_rows rounded to bf16)
// In: float (fp32) or unsigned short (bf16 bits). Each reads rows * cols * sizeof(In) bytes and
// writes rows * cols (twice with the transposed codes) + 4 rows * cols / B; no FLOPs to speak of.
// Shapes are the wrapper's business (mok_proto/kernels/fp8.py): rows, cols multiples of B (the
// transposed row kernel: rows only), 16-byte aligned rows; segments start at multiples of B.
//
// Legend: B = kQuantBlock (128). Every operation on a value is IEEE with subnormals kept (keep_div,
// keep_mul, keep_fma, keep_rcp, keep_max, keep_abs, keep_neg: PTX without .ftz; C++'s `-x` would
// be neg.ftz): CuPy compiles every module with -ftz=true after our options, which would flush the
// subnormals the rule quantizes. amax reductions may run in any order (max is exact); keep_max
// skips NaN as the rule does. The rule's division x / scale is Divisor's (exact, with the block's
// reciprocal: docs/design.md).
#pragma once
#include "hopper.cuh"

namespace mok::fp8 {

constexpr int kWarps = kQuantThreads / 32;

__device__ __forceinline__ float keep_div(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float keep_mul(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float keep_fma(float a, float b, float c) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
  return r;
}
__device__ __forceinline__ float keep_rcp(float a) {
  float r;
  asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
// The larger of a and b; the other where one is NaN (as fmaxf).
__device__ __forceinline__ float keep_max(float a, float b) {
  float r;
  asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// The sign bit cleared / flipped (a NaN stays some NaN: keep_max skips it, e4m3x4 codes it 0x7F).
// As PTX, not bit operations, so that ptxas folds them into the user's |x| and -x modifiers.
__device__ __forceinline__ float keep_abs(float a) {
  float r;
  asm("abs.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
__device__ __forceinline__ float keep_neg(float a) {
  float r;
  asm("neg.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}

// Four e4m3 codes, a in the lowest byte. cvt.rn.satfinite (PTX ISA, cvt): round to nearest even,
// |value| beyond 448 (infinities included) gives sign-preserved 448, subnormal inputs and results
// supported, zero keeps its sign, a NaN gives "NaN in the destination format" with its sign left
// open: every NaN byte is made 0x7F here (the rule's NaN code).
__device__ __forceinline__ u32 e4m3x4(float a, float b, float c, float d) {
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));  // first operand: upper byte
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  const u32 v = static_cast<u32>(lo) | (static_cast<u32>(hi) << 16);
  // A byte is a NaN code iff its low 7 bits are all ones: then ~v & 0x7F is 0 and adding 0x7F
  // leaves bit 7 clear (no carry crosses a byte: 0x7F + 0x7F < 0x100). Clear those bytes' sign.
  const u32 not_nan = ((~v & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) & 0x80808080u;
  return v & (not_nan | 0x7F7F7F7Fu);
}

// 2^e, e the smallest integer with amax <= 448 * 2^e, at least -149; 1 for amax 0; an infinite
// amax is returned as is. From the bits: amax = 1.f * 2^E gives e = E - 8 + (1.f > 1.75).
__device__ __forceinline__ float pow2_scale(float amax) {
  const u32 bits = __float_as_uint(amax);
  if (bits == 0u) return 1.0f;
  if (bits >= 0x7F800000u) return amax;
  int exp;
  u32 mant;
  if (bits < 0x00800000u) {  // subnormal: normalise the mantissa
    const int s = __clz(bits) - 8;
    exp = -126 - s;
    mant = (bits << s) & 0x7FFFFFu;
  } else {
    exp = static_cast<int>(bits >> 23) - 127;
    mant = bits & 0x7FFFFFu;
  }
  const int e = max(exp - 8 + (mant > 0x600000u ? 1 : 0), -149);
  return e >= -126 ? __uint_as_float(static_cast<u32>(e + 127) << 23) : __uint_as_float(1u << (e + 149));
}

// The block's scale from its amax (>= 0): amax / 448 rounded to nearest (1 where that is 0), or
// the power of two above.
__device__ __forceinline__ float block_scale(float amax, bool pow2) {
  if (pow2) return pow2_scale(amax);
  const float s = keep_div(amax, static_cast<float>(kE4m3Max));
  return __float_as_uint(s) == 0u ? 1.0f : s;  // (by its bits: a flushing compare calls a subnormal 0)
}

// fl32(x / scale) for the values x of one block (|x| <= its amax, or NaN), equal bit for bit to
// the IEEE division where it decides a code, in four operations a value: the reciprocal once a
// block, then Markstein's correction, q = q0 - (b q0 - x) y with q0 = x y, y = fl32(1 / b). That
// is exact while b, y, x and the remainder stay normal (below that, |x / scale| is far under
// e4m3's smallest code and only its sign counts), so a scale under 2^-90 is first moved up by
// k = 2^100 (x k, b k: exact); an infinite scale divides as b = y = 0, which gives q0 = x * 0 as
// IEEE x / inf does. tests/test_fp8_divisor.py mirrors it in NumPy and checks it against the division.
struct Divisor {
  float b, y, k;
};
__device__ __forceinline__ Divisor divisor(float scale) {
  const u32 biased = __float_as_uint(scale) >> 23;  // scale > 0: its biased exponent (0: subnormal)
  if (biased == 0xFFu) return {0.0f, 0.0f, 1.0f};
  const float k = biased < 127u - 90u ? 0x1p100f : 1.0f;
  const float b = keep_mul(scale, k);
  return {b, keep_rcp(b), k};
}
__device__ __forceinline__ float quotient(float x, const Divisor& d) {
  const float xk = keep_mul(x, d.k);
  const float q0 = keep_mul(xk, d.y);
  return keep_fma(keep_neg(keep_fma(d.b, q0, keep_neg(xk))), d.y, q0);
}

__device__ __forceinline__ u32 quantize4(const float (&v)[4], const Divisor& d) {
  return e4m3x4(quotient(v[0], d), quotient(v[1], d), quotient(v[2], d), quotient(v[3], d));
}

__device__ __forceinline__ float amax4(float m, const float (&v)[4]) {
  return keep_max(keep_max(m, keep_max(keep_abs(v[0]), keep_abs(v[1]))), keep_max(keep_abs(v[2]), keep_abs(v[3])));
}

// The max of m over the lanes that differ from this one in lane bits kFirst .. 1 only (16: the warp).
template <int kFirst = 16>
__device__ __forceinline__ float warp_max(float m) {
#pragma unroll
  for (int off = kFirst; off > 0; off >>= 1) m = keep_max(m, __shfl_xor_sync(0xffffffffu, m, off));
  return m;
}

// Four consecutive elements (16 bytes of fp32, 8 of bf16) as floats; one element.
__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
  const float4 f = *reinterpret_cast<const float4*>(p);
  v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
}
__device__ __forceinline__ void load4(const unsigned short* p, float (&v)[4]) {
  const uint2 w = *reinterpret_cast<const uint2*>(p);
  v[0] = bf16_lo(w.x); v[1] = bf16_hi(w.x); v[2] = bf16_lo(w.y); v[3] = bf16_hi(w.y);
}
__device__ __forceinline__ float load1(const float* p) { return *p; }
__device__ __forceinline__ float load1(const unsigned short* p) { return bf16_lo(*p); }

// Where the whole-array column quantizer reads x [rows, cols] (fp32 or bf16 values). load4: the 4
// values from (row, col), col a multiple of 4; `vector` (cols a multiple of 4, so every row is
// aligned for one 4-value load: 16 bytes fp32, 8 bf16) loads them at once, else one by one;
// columns from cols on read as zero.
template <typename In>
struct Source {
  const In* x;
  i64 cols;
  bool vector;
  __device__ __forceinline__ void load4(i64 row, i64 col, float (&v)[4]) const {
    const In* at = x + row * cols + col;
    if (vector && col + 4 <= cols) {
      fp8::load4(at, v);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = col + j < cols ? load1(at + j) : 0.0f;
    }
  }
};
template <typename In>
__device__ __forceinline__ Source<In> source_of(const QuantParams* p) {
  return {reinterpret_cast<const In*>(p->x), p->cols, p->cols % 4 == 0};
}

// One 1 x B block by one warp, from its 4 values a lane (lane l: elements 4l .. 4l + 3): the lane's
// 4 codes into codes[l], the block's scale (lane 0) into *scale.
__device__ __forceinline__ void quantize_block(const float (&v)[4], bool pow2, u32* codes, float* scale, int lane) {
  const float s = block_scale(warp_max(amax4(0.0f, v)), pow2);
  codes[lane] = quantize4(v, divisor(s));
  if (lane == 0) *scale = s;
}

// One warp copies bf16 row `row` of x [rows, cols] (QuantParams x, codes, scales, cols, pow2; cols
// a multiple of B) from `src` and quantizes the values it holds (quantize_block's bits): the fused
// kernel's movers on a row they pull. The warp takes the row 4 blocks (1 KB) at a time: a block is 8
// lanes', each holding 16 of its values, so the block's amax takes three shuffles and its scale and
// reciprocal are computed once per 16 values. Lane l of a group of 64 16-byte chunks holds chunks
// c and c + 8, c = 16 (l / 8) + l % 8 (each load instruction reads whole sectors). kUnroll
// (even) chunks a lane in flight.
template <int kUnroll>
__device__ __forceinline__ void copy_quantize_row_bf16(const QuantParams* p, i64 row, const void* src, int lane) {
  static_assert(kQuantBlock == 8 * 16, "a block is 8 lanes' 16 values");
  static_assert(kUnroll % 2 == 0, "a lane moves two chunks of a block");
  constexpr int kGroups = kUnroll / 2;  // groups of 4 blocks in flight
  const int n = static_cast<int>(p->cols / 8);  // the row's 16-byte chunks, a multiple of 16
  const uint4* s = static_cast<const uint4*>(src);
  uint4* x = reinterpret_cast<uint4*>(reinterpret_cast<unsigned short*>(p->x) + row * p->cols);
  uint2* codes = reinterpret_cast<uint2*>(p->codes + row * p->cols);
  float* scales = reinterpret_cast<float*>(p->scales) + row * (p->cols / kQuantBlock);
  const int first = 16 * (lane >> 3) + (lane & 7);
  for (int base = 0; base < n; base += 64 * kGroups) {
    uint4 v[kGroups][2];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int i = base + 64 * g + first;  // a block is all in or all out (i < n iff i + 8 < n)
      v[g][0] = i < n ? s[i] : make_uint4(0, 0, 0, 0);
      v[g][1] = i < n ? s[i + 8] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int i = base + 64 * g + first;
      if (i < n) {
        x[i] = v[g][0];
        x[i + 8] = v[g][1];
      }
    }
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      if (base + 64 * g >= n) break;  // warp-uniform: the shuffles see every lane
      const int i = base + 64 * g + first;
      float f[4][4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 w = v[g][h];
        f[2 * h][0] = bf16_lo(w.x), f[2 * h][1] = bf16_hi(w.x), f[2 * h][2] = bf16_lo(w.y), f[2 * h][3] = bf16_hi(w.y);
        f[2 * h + 1][0] = bf16_lo(w.z), f[2 * h + 1][1] = bf16_hi(w.z);
        f[2 * h + 1][2] = bf16_lo(w.w), f[2 * h + 1][3] = bf16_hi(w.w);
      }
      const float m = warp_max<4>(amax4(amax4(amax4(amax4(0.0f, f[0]), f[1]), f[2]), f[3]));
      const float scale = block_scale(m, p->pow2 != 0);
      if (i < n) {
        const Divisor d = divisor(scale);
        codes[i] = make_uint2(quantize4(f[0], d), quantize4(f[1], d));
        codes[i + 8] = make_uint2(quantize4(f[2], d), quantize4(f[3], d));
        if ((lane & 7) == 0) scales[i / 16] = scale;
      }
    }
  }
}

// 1 x B blocks along rows: block i (of rows * cols / B, row-major) is x[i*B : (i+1)*B] of the flat
// array, and its scale is scales[i]. Blocks [begin, end); one warp per block, 4 elements per lane,
// one 128-byte store; a warp loads kInFlight blocks before it reduces the first (the segment kernel:
// one block a warp at a time leaves its loads latency-bound).
template <typename In, int kInFlight>
__device__ __forceinline__ void quantize_row_blocks(const QuantParams* p, i64 begin, i64 end, Workers warps,
                                                    int lane) {
  const In* x = reinterpret_cast<const In*>(p->x);
  u32* codes = reinterpret_cast<u32*>(p->codes);
  float* scales = reinterpret_cast<float*>(p->scales);
  for (i64 first = begin + warps.id; first < end; first += kInFlight * warps.count) {
    float v[kInFlight][4];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const i64 blk = first + u * warps.count;
      if (blk < end) load4(x + blk * kQuantBlock + 4 * lane, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const i64 blk = first + u * warps.count;  // warp-uniform: the shuffles see every lane
      if (blk >= end) break;
      quantize_block(v[u], p->pow2 != 0, codes + blk * (kQuantBlock / 4), scales + blk, lane);
    }
  }
}

// B x 1 blocks: the CTA takes rows [row0, row0 + B) (row0 a multiple of B) of C = kQuantColumns
// columns from col0 and writes those columns as C rows of codes [cols, rows] (128 bytes each) and
// their scales [cols, rows / B]. Rows from row0 + live_rows on read as zero (a segment's last
// block, zero-padded as the reference pads it). Thread t reads 4 columns 4 (t % 16) .. of rows
// t / 16 + 16 i (a warp: two rows of C columns, coalesced), keeps their running amax and stages
// the values column-major; then warp w quantizes columns w, w + 8, .. (lane l: rows 4l .. 4l + 3,
// one 128-byte store a column). A caller that runs it again syncs the CTA first (shared memory).
constexpr int kColumnGroups = kQuantColumns / 4;                   // threads across a row of C columns
constexpr int kColumnRowsAPass = kQuantThreads / kColumnGroups;    // rows one load of every thread covers
static_assert(kQuantColumns % 4 == 0 && kQuantThreads % kColumnGroups == 0 && kQuantBlock % kColumnRowsAPass == 0 &&
              kColumnRowsAPass == 2 * kWarps, "a warp: two rows of kQuantColumns columns");
template <typename In>
__device__ __forceinline__ void quantize_column_blocks(const QuantParams* p, const Source<In>& src, i64 row0,
                                                       i64 live_rows, i64 col0, int warp, int lane) {
  constexpr int kC = kQuantColumns;
  __shared__ float tile[kC][kQuantBlock + 1];  // [column][row]; + 1: conflict-free column writes
  __shared__ float partial[kWarps][kC];
  __shared__ float col_scale[kC];
  const i64 rows = p->rows, cols = p->cols;
  const int tid = warp * 32 + lane, group = tid % kColumnGroups, r0 = tid / kColumnGroups;
  const i64 col = col0 + 4 * group;
  float m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
  for (int r = r0; r < kQuantBlock; r += kColumnRowsAPass) {
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (r < live_rows && col < cols) src.load4(row0 + r, col, v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      tile[4 * group + j][r] = v[j];
      m[j] = keep_max(m[j], keep_abs(v[j]));
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // the warp's other row of these columns: lane ^ 16
    m[j] = keep_max(m[j], __shfl_xor_sync(0xffffffffu, m[j], 16));
    if (lane < 16) partial[warp][4 * group + j] = m[j];
  }
  __syncthreads();
  if (tid < kC) {
    float mc = partial[0][tid];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) mc = keep_max(mc, partial[w][tid]);
    const float scale = block_scale(mc, p->pow2 != 0);
    col_scale[tid] = scale;
    if (col0 + tid < cols)
      reinterpret_cast<float*>(p->scales)[(col0 + tid) * (rows / kQuantBlock) + row0 / kQuantBlock] = scale;
  }
  __syncthreads();
  for (int c = warp; c < kC && col0 + c < cols; c += kWarps) {
    const float q[4] = {tile[c][4 * lane], tile[c][4 * lane + 1], tile[c][4 * lane + 2], tile[c][4 * lane + 3]};
    reinterpret_cast<u32*>(p->codes + (col0 + c) * rows + row0)[lane] = quantize4(q, divisor(col_scale[c]));
  }
}

// x [rows, cols] quantized in 1 x B blocks (kTransposed: B x 1 blocks, written transposed).
// grid: any x (a grid-stride loop over blocks); kTransposed: (ceil(cols / kQuantColumns), rows / B).
template <typename In, bool kTransposed>
__global__ void __launch_bounds__(kQuantThreads) quantize_rows(const QuantParams* p) {
  if constexpr (kTransposed) {
    const i64 row0 = static_cast<i64>(blockIdx.y) * kQuantBlock, col0 = static_cast<i64>(blockIdx.x) * kQuantColumns;
    quantize_column_blocks<In>(p, source_of<In>(p), row0, kQuantBlock, col0, threadIdx.x >> 5, threadIdx.x & 31);
  } else {
    quantize_row_blocks<In, 1>(p, 0, p->rows * (p->cols / kQuantBlock), grid_warps(), threadIdx.x & 31);
  }
}

// Segment e of the segment quantizers: rows [row_offsets[e], row_offsets[e] + row_counts[e]).
struct Segment {
  i64 first, count;
};
__device__ __forceinline__ Segment segment_of(const QuantParams* p, int e) {
  return {reinterpret_cast<const int*>(p->row_offsets)[e], reinterpret_cast<const int*>(p->row_counts)[e]};
}

// quantize_rows<In, false> on the rows of every segment only; rows outside them are neither read
// nor written. grid (any, num_groups): the CTAs of blockIdx.y share segment blockIdx.y's blocks;
// each warp keeps kSegmentRowBlocksInFlight blocks in flight (so fewer of the grid's CTAs fit an
// SM at once than kQuantCtasPerSm: the rest start as those finish).
constexpr int kSegmentRowBlocksInFlight = 8;
template <typename In>
__global__ void __launch_bounds__(kQuantThreads) quantize_segment_rows(const QuantParams* p) {
  const Segment seg = segment_of(p, blockIdx.y);
  const i64 per_row = p->cols / kQuantBlock;
  quantize_row_blocks<In, kSegmentRowBlocksInFlight>(p, seg.first * per_row, (seg.first + seg.count) * per_row,
                                                     grid_warps(), threadIdx.x & 31);
}

// quantize_rows<In, true> on every segment's rows, in blocks of B rows from its first row (a
// multiple of B), the rows past its count read as zero; blocks past a segment's last are not
// written. The work items (segment by segment, B-row block by block, then slices of
// kColumnItemBytes bytes of each row: 128 / sizeof(In) columns) are spread over a flat grid: CTA b
// takes items b, b + gridDim.x, ..., so uneven segments cost no tail. One lane stages an item into
// shared memory by one TMA box (x_map; e4m3 input: warp 0's lanes copy each row's scale by
// cp.async) one item ahead of the math, so no thread waits for global memory while it computes;
// then every warp takes one 16-byte chunk of the item's columns (lane l: rows 4l .. 4l + 3, read
// in the rotated order of rotated_row), reduces each column's amax across the warp and stores 4
// codes a lane and column (128 bytes a warp).
constexpr int kColumnItemBytes = kQuantColumnItemBytes;
static_assert(kColumnItemBytes == 128, "one item row is one 128-byte swizzle row: 8 warps of 16-byte chunks");
template <typename In>
constexpr int kItemCols = kColumnItemBytes / static_cast<int>(sizeof(In));
constexpr int kStagedItemBytes = kQuantBlock * kColumnItemBytes;  // one TMA box: B rows x 128 bytes
// Where 16-byte chunk c of row r of a staged item lies (TMA's 128-byte swizzle).
__device__ __forceinline__ u32 staged_chunk(int r, int c) { return r * kColumnItemBytes + 16 * (c ^ (r & 7)); }
// The row a lane's k-th read takes: 4 lane + (k + lane / 2) % 4, so that the 8 lanes of a
// quarter-warp read 8 different swizzled chunk positions (with k for all, 2: a 4-way conflict);
// its 4 codes of a column come out in this order and are rotated back before the store.
__device__ __forceinline__ int rotated_row(int k, int lane) { return 4 * lane + ((k + (lane >> 1)) & 3); }
constexpr int kColumnArrivals = 1 + 32;  // warp 0's lane 0 with the byte count, then each of its lanes
static_assert(kQuantColumnStages == 2, "the item loop keeps one item staged ahead of the one it quantizes");
struct ColumnStorage {  // 1024-byte aligned (the swizzle's period)
  unsigned char rows[kQuantColumnStages][kStagedItemBytes];
  alignas(16) float row_scales[kQuantColumnStages][kQuantBlock];  // e4m3 input: each staged row's 1 x B scale
  float4 divisors[kWarps][8];                                       // a warp's pass's columns' Divisor (b, y, k)
  u64 full[kQuantColumnStages];
};

struct ColumnItem {
  i64 row0;
  int live_rows, col0;  // live_rows: at most B
};
// The items in increasing order (each call asks for a later item than the one before).
struct ColumnItems {
  int e = 0;     // the segment of the items from `base` on
  i64 base = 0;
  __device__ __forceinline__ bool find(const QuantParams* p, i64 item, int item_cols, ColumnItem& it) {
    const i64 slices = (p->cols + item_cols - 1) / item_cols;
    for (; e < p->num_groups; ++e) {
      const Segment seg = segment_of(p, e);
      const i64 n = (seg.count + kQuantBlock - 1) / kQuantBlock * slices;
      if (item < base + n) {
        const i64 k = item - base, r = k / slices * kQuantBlock;
        it = {seg.first + r, static_cast<int>(min(seg.count - r, static_cast<i64>(kQuantBlock))),
              static_cast<int>(k % slices * item_cols)};
        return true;
      }
      base += n;
    }
    return false;
  }
};

// Warp 0: item `it` into stage s (B rows x 128 bytes from (it.row0, it.col0): rows past x's end
// and columns past its last read as zero), and with e4m3 input its live rows' scales.
template <typename In>
__device__ __forceinline__ void stage_column_item(const QuantParams* p, ColumnStorage& ss, int s, const ColumnItem& it,
                                                  int lane) {
  if (lane == 0) {
    mbar_arrive_expect_tx(&ss.full[s], kStagedItemBytes);
    tma_load_2d(smem_addr(ss.rows[s]), p->x_map, it.col0, static_cast<int>(it.row0), &ss.full[s]);
  }
  if constexpr (sizeof(In) == 1) {
    const i64 per_row = p->cols / kQuantBlock;
    const float* scales = reinterpret_cast<const float*>(p->x_scales) + it.row0 * per_row + it.col0 / kQuantBlock;
    for (int r = lane; r < it.live_rows; r += 32) cp_async_4(smem_addr(&ss.row_scales[s][r]), scales + r * per_row, 4);
    cp_async_arrive_noinc(&ss.full[s]);
  } else {
    mbar_arrive(&ss.full[s]);
  }
}

// Two e4m3 codes (the low 16 bits of `pair`, the first in the low byte) as floats, exact (every
// e4m3 value is an f16 value; both NaN codes give NaN, as mok_proto.fp8.decode_e4m3).
__device__ __forceinline__ float2 decode_e4m3x2(u32 pair) {
  float2 f;
  asm("{\n.reg .b16 c, lo, hi;\n.reg .b32 h;\ncvt.u16.u32 c, %2;\ncvt.rn.f16x2.e4m3x2 h, c;\n"
      "mov.b32 {lo, hi}, h;\ncvt.f32.f16 %0, lo;\ncvt.f32.f16 %1, hi;\n}"
      : "=f"(f.x), "=f"(f.y)
      : "r"(pair));
  return f;
}
// A warp's 16-byte chunk of an item's columns is quantized in kPasses passes of kN columns (e4m3
// input: two passes, so that a pass's values fit the registers).
template <typename In>
struct ChunkPasses {
  static constexpr int kN = sizeof(In) == 4 ? 4 : 8, kPasses = 16 / static_cast<int>(sizeof(In)) / kN;
  static_assert(kN <= 8 && kPasses * kN * static_cast<int>(sizeof(In)) == 16, "a pass's divisors: 8 a warp at most");
};
// Pass kPass's values of one staged row's chunk w: fp32, bf16, or e4m3 codes times the row's scale.
template <typename In, int kPass, int kN>
__device__ __forceinline__ void pass_values(const u32 (&w)[4], float scale, float (&v)[kN]) {
  if constexpr (sizeof(In) == 4) {
#pragma unroll
    for (int i = 0; i < kN; ++i) v[i] = __uint_as_float(w[i]);
  } else if constexpr (sizeof(In) == 2) {
    unpack8(make_uint4(w[0], w[1], w[2], w[3]), v);
  } else {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) {
      const float2 f = decode_e4m3x2(w[2 * kPass + i / 2] >> (16 * (i % 2)));
      v[2 * i] = keep_mul(f.x, scale), v[2 * i + 1] = keep_mul(f.y, scale);
    }
  }
}

// The amax of column lane / (32 / kN) of a warp's kN columns (m[j]: this lane's part of column j):
// halving exchanges (the lanes with `bit` set keep the upper half of the columns left), then a
// butterfly over the lanes that share a column.
template <int kN>
__device__ __forceinline__ float column_amax(float (&m)[kN], int lane) {
#pragma unroll
  for (int half = kN / 2, bit = 16; half >= 1; half >>= 1, bit >>= 1) {
    const bool upper = (lane & bit) != 0;
#pragma unroll
    for (int j = 0; j < half; ++j) {
      const float give = upper ? m[j] : m[j + half];
      m[j] = keep_max(upper ? m[j + half] : m[j], __shfl_xor_sync(0xffffffffu, give, bit));
    }
  }
  return warp_max<16 / kN>(m[0]);
}

// Pass kPass over one warp's chunk of a staged item (raw[k]: row rotated_row(k, lane); rs: their
// e4m3 row scales): each of its columns' scale, and the column's codes of this lane's 4 rows.
template <typename In, int kPass>
__device__ __forceinline__ void quantize_column_pass(const QuantParams* p, ColumnStorage& ss, const ColumnItem& it,
                                                     const u32 (&raw)[4][4], const float (&rs)[4], int warp, int lane) {
  constexpr int kN = ChunkPasses<In>::kN;
  const i64 rows = p->rows, cols = p->cols;
  const i64 col = it.col0 + (warp * ChunkPasses<In>::kPasses + kPass) * kN;  // the pass's first column
  float v[4][kN], m[kN];
#pragma unroll
  for (int j = 0; j < kN; ++j) m[j] = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    pass_values<In, kPass>(raw[k], rs[k], v[k]);
    const bool live = rotated_row(k, lane) < it.live_rows;  // stale bytes past the live rows and columns read as 0
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      v[k][j] = live && col + j < cols ? v[k][j] : 0.0f;
      m[j] = keep_max(m[j], keep_abs(v[k][j]));
    }
  }
  const int c = lane / (32 / kN);
  const float scale = block_scale(column_amax<kN>(m, lane), p->pow2 != 0);
  const Divisor d = divisor(scale);
  if (lane % (32 / kN) == 0) {
    ss.divisors[warp][c] = make_float4(d.b, d.y, d.k, 0.0f);
    if (col + c < cols)
      reinterpret_cast<float*>(p->scales)[(col + c) * (rows / kQuantBlock) + it.row0 / kQuantBlock] = scale;
  }
  __syncwarp();
  u32* out = reinterpret_cast<u32*>(p->codes + col * rows + it.row0) + lane;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    const float4 f = ss.divisors[warp][j];
    const Divisor dj{f.x, f.y, f.z};
    if (col + j < cols) {  // byte k: rotated_row(k, lane)'s code; rotated so that byte i is row 4 lane + i
      const u32 w = e4m3x4(quotient(v[0][j], dj), quotient(v[1][j], dj), quotient(v[2][j], dj), quotient(v[3][j], dj));
      out[j * rows / 4] = __funnelshift_l(w, w, 8 * ((lane >> 1) & 3));
    }
  }
  __syncwarp();  // every lane has read the divisors before the next pass writes its own
}

// A flat grid over the items; warp 0 stages the next two by TMA. Each wait for a staged item is
// bounded (p->timeout_ns, reported into p->error); a launch given a record that holds an error
// quantizes nothing.
template <typename In>
__global__ void __launch_bounds__(kQuantThreads, kQuantColumnCtasPerSm) quantize_segment_columns(const QuantParams* p) {
  __shared__ char raw_smem[sizeof(ColumnStorage) + 1024];
  ColumnStorage& ss = aligned_shared<ColumnStorage>(raw_smem);
  constexpr int kCols = kItemCols<In>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  ErrorRecord* err = reinterpret_cast<ErrorRecord*>(p->error);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kQuantColumnStages; ++s) mbar_init(&ss.full[s], kColumnArrivals);
    fence_mbarrier_init_cluster();
  }
  if (__syncthreads_or(threadIdx.x == 0 && has_error(err))) return;  // reported already: quantize nothing
  ColumnItems items;
  ColumnItem cur, next, later;  // cur in stage s, next in stage s ^ 1
  bool have_cur = items.find(p, blockIdx.x, kCols, cur);
  bool have_next = have_cur && items.find(p, blockIdx.x + gridDim.x, kCols, next);
  if (warp == 0) {
    if (have_cur) stage_column_item<In>(p, ss, 0, cur, lane);
    if (have_next) stage_column_item<In>(p, ss, 1, next, lane);
  }
  u32 phases = 0;  // bit s: the parity stage s's next fill completes
  for (i64 item = blockIdx.x + 2 * static_cast<i64>(gridDim.x), s = 0; have_cur; item += gridDim.x, s ^= 1) {
    // (the box's bytes: the host's x_map and kStagedItemBytes agree by kQuantColumnItemBytes,
    // tests/test_fp8_segment_wrappers.py)
    const u32 parity = (phases >> s) & 1u;
    const bool landed = mbar_wait(&ss.full[s], static_cast<int>(parity), p->timeout_ns, err, kOpQuantColumns, -1);
    const u32 at = smem_addr(ss.rows[s]);
    u32 raw[4][4];
    float rs[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int r = rotated_row(k, lane);
      const uint4 q = ld_shared_u32x4(at + staged_chunk(r, warp));
      raw[k][0] = q.x, raw[k][1] = q.y, raw[k][2] = q.z, raw[k][3] = q.w;
      rs[k] = sizeof(In) == 1 ? ss.row_scales[s][r] : 0.0f;
    }
    if (!__syncthreads_and(landed)) {  // a wait gave up (reported): stop once the copies in flight have landed
      if (threadIdx.x == 0) {
        mbar_drain(&ss.full[s], static_cast<int>(parity), kDrainNs);
        if (have_next) mbar_drain(&ss.full[s ^ 1], static_cast<int>((phases >> (s ^ 1)) & 1u), kDrainNs);
      }
      return;
    }
    phases ^= 1u << s;  // every warp holds its values: the stage may be refilled
    const bool have_later = have_next && items.find(p, item, kCols, later);
    if (warp == 0 && have_later) {
      fence_proxy_async();
      stage_column_item<In>(p, ss, static_cast<int>(s), later, lane);
    }
    quantize_column_pass<In, 0>(p, ss, cur, raw, rs, warp, lane);
    if constexpr (ChunkPasses<In>::kPasses == 2) quantize_column_pass<In, 1>(p, ss, cur, raw, rs, warp, lane);
    cur = next, have_cur = have_next, next = later, have_next = have_later;
  }
}

// x [batch, rows, cols] quantized in B x B blocks; grid (cols / B, rows / B, batch), one CTA per
// block. Warp w holds rows w, w + 8, ... of the block, lane l its columns 4l .. 4l + 3 (64 values
// in registers). With codes_t the codes are staged in shared memory and written transposed too.
template <typename In>
__global__ void __launch_bounds__(kQuantThreads) quantize_blocks(const QuantParams* p) {
  constexpr int kRowsPerWarp = kQuantBlock / kWarps;
  __shared__ float partial[kWarps];
  __shared__ __align__(16) unsigned char staged[kQuantBlock][kQuantBlock + 4];  // [column][row]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const i64 rows = p->rows, cols = p->cols;
  const i64 row0 = static_cast<i64>(blockIdx.y) * kQuantBlock, col0 = static_cast<i64>(blockIdx.x) * kQuantBlock;
  const i64 matrix = static_cast<i64>(blockIdx.z) * rows * cols;
  const In* x = reinterpret_cast<const In*>(p->x) + matrix + row0 * cols + col0 + 4 * lane;
  float v[kRowsPerWarp][4];
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    load4(x + (warp + kWarps * j) * cols, v[j]);
    m = amax4(m, v[j]);
  }
  m = warp_max(m);
  if (lane == 0) partial[warp] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) m = keep_max(m, partial[w]);
  const float scale = block_scale(m, p->pow2 != 0);
  const Divisor d = divisor(scale);
  const i64 row_blocks = rows / kQuantBlock, col_blocks = cols / kQuantBlock;
  if (threadIdx.x == 0) {
    reinterpret_cast<float*>(p->scales)[(blockIdx.z * row_blocks + blockIdx.y) * col_blocks + blockIdx.x] = scale;
    if (p->scales_t) {
      reinterpret_cast<float*>(p->scales_t)[(blockIdx.z * col_blocks + blockIdx.x) * row_blocks + blockIdx.y] = scale;
    }
  }
  unsigned char* codes = reinterpret_cast<unsigned char*>(p->codes) + matrix + row0 * cols + col0 + 4 * lane;
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = warp + kWarps * j;
    const u32 q = quantize4(v[j], d);
    *reinterpret_cast<u32*>(codes + r * cols) = q;
    if (p->codes_t) {
#pragma unroll
      for (int i = 0; i < 4; ++i) staged[4 * lane + i][r] = static_cast<unsigned char>(q >> (8 * i));
    }
  }
  if (p->codes_t) {  // uniform: every thread of the CTA takes this branch or none does
    __syncthreads();
    unsigned char* codes_t = reinterpret_cast<unsigned char*>(p->codes_t) + matrix + col0 * rows + row0 + 4 * lane;
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const int c = warp + kWarps * j;
      *reinterpret_cast<u32*>(codes_t + c * rows) = *reinterpret_cast<const u32*>(&staged[c][4 * lane]);
    }
  }
}

// fp8.dequantize_rows of the segments' rows rounded to bf16 into p->out (both roundings to nearest
// even, subnormals kept; NaN codes give NaN); rows outside every segment are neither read nor
// written. grid (any, num_groups) as quantize_segment_rows: the threads of blockIdx.y's CTAs take
// its 16-code chunks in turn (16 divides B: one scale a chunk), kDequantChunksInFlight each in flight.
constexpr int kDequantChunksInFlight = 4;
__global__ void __launch_bounds__(kQuantThreads) dequantize_segment_rows(const QuantParams* p) {
  const Segment seg = segment_of(p, blockIdx.y);
  const i64 per_row = p->cols / 16, end = (seg.first + seg.count) * per_row;
  const uint4* codes = reinterpret_cast<const uint4*>(p->codes);
  const float* scales = reinterpret_cast<const float*>(p->scales);
  uint4* out = reinterpret_cast<uint4*>(p->out);
  const Workers threads = grid_threads();
  for (i64 first = seg.first * per_row + threads.id; first < end; first += kDequantChunksInFlight * threads.count) {
    uint4 c[kDequantChunksInFlight];
    float s[kDequantChunksInFlight];
#pragma unroll
    for (int u = 0; u < kDequantChunksInFlight; ++u) {
      const i64 i = first + u * threads.count;
      if (i < end) c[u] = codes[i], s[u] = scales[i / (kQuantBlock / 16)];
    }
#pragma unroll
    for (int u = 0; u < kDequantChunksInFlight; ++u) {
      const i64 i = first + u * threads.count;
      if (i >= end) break;
      const u32 w[4] = {c[u].x, c[u].y, c[u].z, c[u].w};
      float f[2][8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 d = decode_e4m3x2(w[j / 2] >> (16 * (j % 2)));
        f[j / 4][2 * (j % 4)] = keep_mul(d.x, s[u]), f[j / 4][2 * (j % 4) + 1] = keep_mul(d.y, s[u]);
      }
      out[2 * i] = pack8(f[0]);
      out[2 * i + 1] = pack8(f[1]);
    }
  }
}

}  // namespace mok::fp8
