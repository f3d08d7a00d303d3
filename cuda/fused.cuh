// The fused passes of the MoE layer: one persistent launch that runs a plan's task tables
// (mok_proto/plan/, `fused_forward` / `fused_backward`; kernels fused_forward, fused_backward:
// one task loop, run_fused<kPass>, over the pass's GEMM problems; fused_forward_fp8 and
// fused_backward_fp8: FP8 routed experts, gemm_fp8.cuh's tiles, docs/design.md 5.10). Forward: the dispatched rows
// are pulled and the combined rows pushed minibatch by minibatch while the shared and routed
// expert GEMM tiles run as soon as their rows are in; before it (separate launches, as MoK does)
// the routing all-gather and the schedule, after it the flag that publishes the combine, the
// wait and the fixed-order weighted sum. Backward: the same with the reverse-combine (pull, into
// recv_dy), down_bwd / gate_up_bwd tiles, the reverse-dispatch (push) and the deferred weight-
// gradient tiles, and (plan.scale, plan.token_grads: the defaults with those transfers inside) the
// token owner's work: dy_slots = w * dout first (published to the pullers by a flag raised inside)
// and, once every peer's reverse-dispatch into this rank's slots is complete (their flags), the
// slot sum and d topk_weights beside the weight-gradient tiles. A transfer in the other direction
// (push in, pull out) runs as its sequential launch before (resp. after) the kernel: the plan has
// chunk tasks only for the transfers that run inside.
//
// Legend: R ranks, El local experts, MB minibatch rows, W launch ranks (grid.y), B = kBM rows.
//
// Roles: CTA b of a launch rank runs tasks[task_begin[b] .. task_begin[b + 1]) in order, then (a
// cluster's GEMM roles, when the plan has a pool) the pool's tile pairs it claims (see claim_pair
// in fused_sync.cuh). CTAs below comm_ctas only communicate (every warp moves rows through
// registers); the spare warps of a compute CTA move the chunks in its table (every chunk with
// comm_ctas = 0; with comm_ctas > 0 those of a transfer the plan spreads over every CTA) while the
// CTA's GEMMs run. These *movers*
// also run the token-side tasks (scale, slot sum) of their table: kMoverKinds. The others run
// GEMM tiles with the building blocks of gemm.cuh (its producer warpgroup and two consumer
// warpgroups), in 2-CTA clusters: the plan gives both CTAs of a cluster the same tile at the same
// position of their tables, CTA `cta` taking 128-row tile 2p + cta of row pair p, so the pair
// shares B by multicast as the standalone grouped GEMM does (where both tiles are one expert's),
// and computes the same bits: every output row is the same dot products in the same k order.
//
// Rows: expert segments are padded to B = 128 rows (the schedule's align), so a row tile is one
// expert's; a row pair may straddle two experts (its CTAs then load their own B, no multicast).
// Each tile's expert is found from the schedule's offsets on the device, so the plan is
// independent of the routing. Tasks for pairs past the real rows do nothing but
// signal. Receive row r lives in row r % ring_rows of the row buffers (the ring; ring_rows >=
// every receive row: no reuse); the plan makes a dispatch into a ring slot wait for the release
// of its previous occupant (its combine, which comes after its down tiles).
//
// Ready counters (u32, this launch rank's, zeroed before the launch): a task waits (one thread,
// acquire, bounded: kOpFusedWait names the counter and the task) until each of its counters
// reaches its target, and adds one to each of its signal counters (release) when its rows are
// stored. A remote counter (every rank's tasks raise it) is kept as peer flags: see remote_flag
// (fused_sync.cuh, with the waits, signals and the pool's tickets).
// Rows stored by plain stores and read by TMA cross proxies: the writer fences
// (fence.proxy.async.global) before its release, the TMA-issuing reader after its acquire.
//
// Timeline (FusedParams.record_trace): TraceRecord of every task: start (consumer or comm start), ready
// (waits met: the producer's, for a GEMM tile), end (signal; a GEMM task that signals nothing: the
// first consumer warpgroup's epilogue issued), task index, SM, and the CTA that ran it (a claimed
// pair's is known only there).
#pragma once
#include "fused_sync.cuh"
#include "token.cuh"

namespace mok {
namespace fused {

using gemm::Ring;
using gemm::Tile;
using gemm::Traits;

// A compute CTA's register split (gemm.cuh's kProducerRegs / kConsumerRegs for the standalone
// kernel): here the producer warpgroup also runs the spare warps' row copies (kSideUnroll 16-byte
// values in flight per lane) and every problem of the pass is one kernel. Both fused kernels spill
// a little at this split (ptxas -v), far less than with the same count for every thread.
constexpr int kFusedProducerRegs = 120;
constexpr int kFusedConsumerRegs = 192;
// The FP8 kernels: their FP8 consumers hold a 64-register temporary beside the accumulators
// (gemm_fp8.cuh's 216), so its movers keep fewer values in flight (kSideUnrollFp8).
constexpr int kFusedFp8ProducerRegs = 72;
constexpr int kFusedFp8ConsumerRegs = 216;
static_assert(128 * kFusedFp8ProducerRegs + 256 * kFusedFp8ConsumerRegs <= gemm::kThreads * gemm::kLaunchRegs,
              "over the CTA's registers");
static_assert(128 * kFusedProducerRegs + 256 * kFusedConsumerRegs <= gemm::kThreads * gemm::kLaunchRegs,
              "over the CTA's registers");

// ---------------------------------------------------------------------------------------------
// GEMM tasks
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ int slot_of(int kind) {
  switch (kind) {
    case plan::kTaskSharedGateUp: case plan::kTaskSharedDownBwd: return kSlotSharedFirst;
    case plan::kTaskSharedDown: case plan::kTaskSharedGateUpBwd: return kSlotSharedSecond;
    case plan::kTaskGateUp: case plan::kTaskDownBwd: return kSlotFirst;
    case plan::kTaskDown: case plan::kTaskGateUpBwd: return kSlotSecond;
    case plan::kTaskSharedDownWgrad: return kSlotSharedDownWgrad;
    case plan::kTaskSharedGateUpWgrad: return kSlotSharedGateUpWgrad;
    case plan::kTaskDownWgrad: return kSlotDownWgrad;
    default: return kSlotGateUpWgrad;  // kTaskGateUpWgrad
  }
}

// A row problem over the receive rows (the routed experts'), not the tokens (the shared expert's).
__device__ __forceinline__ bool routed_rows(int kind) {
  return kind == plan::kTaskGateUp || kind == plan::kTaskDown || kind == plan::kTaskDownBwd ||
         kind == plan::kTaskGateUpBwd;
}

__device__ __forceinline__ i64 ring_rows_of(const Ctx& c, int kind) { return routed_rows(kind) ? c.fp->ring_rows : 0; }

// The tile of GEMM task t for cluster CTA `cta` (gemm::group_tile, as the standalone kernel
// names it). Row problems: row pair p = row_tile / 2 starts at row 2 B p of the segment layout
// (routed: receive rows, shared: tokens; one group from 0); CTA cta's tile is the pair's 128 rows
// 2 B p + B cta, its expert the last whose offset is at or before them (segments are padded to B
// rows, so a tile is one expert's; the pair's two may differ: then neither multicasts B). A tile
// past the last real row repeats its partner's (store false); false: the whole pair lies past it
// (nothing to do). The tile's rows are then shifted to the ring (row r in row r % ring_rows).
// Weight gradients: expert t.expert (the shared expert: group 0), weight row tile 2 (row_tile / 2)
// + cta, K = the expert's rows (gemm::zero_tail_k_rows clears its last k-block past the end): one
// CTA sums the tile's whole K in order (deterministic, no atomics).
template <int kP, int kDepth, class Params>
__device__ __forceinline__ bool tile_for(const Ctx& c, const Params* p, const Task& t, int cta, Tile& tile) {
  if (!Traits<kP>::kRowProblem) {
    tile = gemm::group_tile<kP, kDepth>(p, t.expert < 0 ? 0 : t.expert, (t.row_tile & ~1) + cta, t.col_tile);
    return true;
  }
  const int* offsets = gemm::ptr<const int>(p->row_offsets);
  const int* counts = gemm::ptr<const int>(p->row_counts);
  const int groups = static_cast<int>(p->num_groups);
  const int pair_row = (t.row_tile & ~1) * gemm::kBM, end = offsets[groups - 1] + counts[groups - 1];
  if (pair_row >= end) return false;
  const int row = pair_row + cta * gemm::kBM, other = pair_row + (1 - cta) * gemm::kBM;
  const int group = gemm::group_at(offsets, groups, row < end ? row : pair_row);
  tile = gemm::group_tile<kP, kDepth>(p, group, (row - offsets[group]) / gemm::kBM, t.col_tile);
  tile.multicast = other >= end || row >= end || gemm::group_at(offsets, groups, other) == group;
  const i64 ring_rows = ring_rows_of(c, t.kind);
  if (ring_rows > 0) tile.row0 -= static_cast<int>(pair_row - pair_row % ring_rows);
  return true;
}

// The producer warp's lane 0 waits for task t's counters (then fences, as the TMA reader of rows
// stored by generic stores); every lane gets the outcome.
__device__ __forceinline__ bool task_ready(const Ctx& c, const Task& t, int index, int wg_tid, bool ok) {
  bool ready = false;
  if (wg_tid == 0) {
    ready = ok && wait_task(c, t, index);
    if (ready) fence_proxy_async_global();
    if (c.trace) c.trace[index].ready_ns = static_cast<i64>(globaltimer_ns());
  }
  return __shfl_sync(0xffffffffu, ready, 0) != 0;
}

// An FP8 tile of the FP8 kernels (a routed row problem's): gemm_fp8's one-warp producer.
template <int kP, class Storage>
__device__ __forceinline__ bool produce_fp8_task(const Ctx& c, Storage& ss, Ring& ring, const Task& t, int index,
                                                 int cta, int wg_tid, bool ok) {
  const gemm_fp8::Fp8GemmParams* p = c.fp8 + slot_of(t.kind);
  Tile tile;
  if (!tile_for<kP, gemm_fp8::kKBlock>(c, p, t, cta, tile)) return ok;
  ok = task_ready(c, t, index, wg_tid, ok);
  __syncwarp();  // lane 0's acquire, before every lane's copies of the scales the task waited for
  return gemm_fp8::produce_tile_warp<kP>(p, ss, ring, tile, cta, wg_tid, ok);
}

// Producer warp (warp 0 of warpgroup 0), one task: lane 0 waits for the task's counters (then
// fences, as the TMA reader of rows stored by generic stores), the warp loads the tile into the
// ring (lane 0 issues the TMA; an FP8 tile's lanes copy its scales too: gemm_fp8's
// produce_tile_warp). kFp8: the routed experts' row tiles are FP8 (fused_forward_fp8, fused_backward_fp8).
template <int kP, bool kFp8, class Storage>
__device__ __forceinline__ bool produce_task(const Ctx& c, Storage& ss, Ring& ring, const Task& t, int index,
                                             int cta, int wg_tid, bool ok) {
  if constexpr (kFp8 && Traits<kP>::kRowProblem) {  // (an FP8 plan's routed weight-gradient tiles are BF16's)
    if (routed_rows(t.kind)) return produce_fp8_task<kP>(c, ss, ring, t, index, cta, wg_tid, ok);
  }
  const GemmParams* p = c.gemm + slot_of(t.kind);
  Tile tile;
  if (!tile_for<kP, gemm::kBK>(c, p, t, cta, tile)) return ok;
  ok = task_ready(c, t, index, wg_tid, ok);
  return gemm::produce_tile<kP>(p, ss, ring, tile, cta, wg_tid, ok);
}

// Whose outputs a later task of the same launch reads through TMA (so the writers fence them for
// the async proxy): gate_up's h (down's A), down_bwd's dg, du (gate_up_bwd's A, gate_up_wgrad's B;
// FP8: its dgq, duq, gate_up_bwd's A).
// down's y and gate_up_bwd's dx are read by the movers' plain loads (or after the kernel), the
// weight gradients after the kernel.
template <int kP>
constexpr bool kTmaReadsOutput = kP == gemm::kGateUp || kP == gemm::kDownBwd;

// Consumer warpgroups, one task: the tile's MMAs and epilogue; then, for a task that signals, once
// both warpgroups stored their rows (and fenced them for TMA readers), the first consumer thread
// signals. A task that signals nothing goes straight on to its next tile: no fence, no barrier, no
// release, none of which anyone needs.
template <int kP, bool kFp8, class Storage>
__device__ __forceinline__ bool consume_task(const Ctx& c, Storage& ss, Ring& ring, const Task& t, int index,
                                             int cta, float (&acc)[128], float* staging, int half, int wg_tid,
                                             bool ok) {
  const bool lead = threadIdx.x == 128;
  const i64 start = c.trace && lead ? static_cast<i64>(globaltimer_ns()) : 0;
  Tile tile;
  bool fp8_tile = false;
  if constexpr (kFp8 && Traits<kP>::kRowProblem) {
    if (routed_rows(t.kind)) {
      fp8_tile = true;
      const gemm_fp8::Fp8GemmParams* p = c.fp8 + slot_of(t.kind);
      if (tile_for<kP, gemm_fp8::kKBlock>(c, p, t, cta, tile))
        ok = gemm_fp8::consume_tile<kP>(p, ss, ring, tile, acc, staging, half, wg_tid, ok);
    }
  }
  if (!fp8_tile) {
    const GemmParams* p = c.gemm + slot_of(t.kind);
    if (tile_for<kP, gemm::kBK>(c, p, t, cta, tile))
      ok = gemm::consume_tile<kP>(p, ss, ring, tile, acc, staging, half, wg_tid, ok);
  }
  if (t.signal_counter[0] >= 0 || t.signal_counter[1] >= 0) {
    if constexpr (kTmaReadsOutput<kP>) fence_proxy_async_global();
    gemm::consumers_sync();
    if (lead) signal_task(c, t);
  }
  if (lead) trace_times(c, index, start, static_cast<i64>(globaltimer_ns()));
  return ok;
}

// ---------------------------------------------------------------------------------------------
// Communication tasks: chunk c = row_tile of the C = col_tile chunks of minibatch m's transfer
// moves its receive rows m MB + c, + C, ... (C: the communicating CTAs, or every CTA for a
// transfer the plan spreads over all of them: plan/build.py, spread_from). A warp moves a row through registers
// (warp_move_row, as the standalone comm kernels do), kUnroll 16-byte values per lane in flight.
// Two kinds of movers run the same function: a communicating CTA (every warp; kCommUnroll) and
// the spare warps of a compute CTA beside its GEMM tiles (kSideWarps; kSideUnroll). A CTA moves
// bytes at a fixed rate whatever the row size (1-D bulk copies driven by one thread cost a fixed
// time per row: docs/LOG.md).
// ---------------------------------------------------------------------------------------------
// The rows of chunk task t: receive rows first, first + stride, ... (count of them) of its
// minibatch, each moved by `move(k)` (the RowMove of the k-th); none unless `ok`.
struct ChunkRows {
  const CommParams* cp;
  SchedView sv;
  int rank;
  i64 first, stride, count, shift;
  bool dispatch;  // incoming (dispatch, reverse-combine: pulled into receive rows), else outgoing (pushed)
  __device__ __forceinline__ RowMove move(i64 k) const {
    const i64 i = first + k * stride;
    return dispatch ? dispatch_pull_row(cp, rank, sv, i, shift) : combine_push_row(cp, rank, sv, i, shift);
  }
  // The other rank of the k-th row (its token owner; -1: padding), for the emulated link.
  __device__ __forceinline__ int peer(i64 k) const { return sv.src_rank[first + k * stride]; }
};

__device__ __forceinline__ ChunkRows chunk_rows(const Ctx& c, const Task& t, bool ok) {
  ChunkRows r;
  r.cp = c.cp;
  r.sv = sched_of(c.cp, c.rank);
  r.rank = c.rank;
  // With the layer's ring of several turns (CommParams ring_rows), the plan's rows are the turn's:
  // receive rows ring_lo + ..., stored from ring row 0 (turn_rows, comm.cuh).
  const TurnRows turn = turn_rows(c.cp, r.sv);
  const i64 row = t.minibatch * c.fp->minibatch_rows;
  const i64 begin = turn.lo + row;
  const i64 end = begin + c.fp->minibatch_rows < turn.hi ? begin + c.fp->minibatch_rows : turn.hi;
  r.shift = turn.lo + row - row % c.fp->ring_rows;
  r.stride = t.col_tile;  // the minibatch's transfer is split into col_tile chunks
  r.first = begin + t.row_tile;
  r.count = ok && r.first < end ? (end - r.first + r.stride - 1) / r.stride : 0;
  r.dispatch = t.kind == plan::kTaskDispatch || t.kind == plan::kTaskRevCombine;  // into the receive rows
  return r;
}

constexpr int kCommWarps = gemm::kThreads / 32;  // a communicating CTA: every warp moves rows
constexpr int kCommUnroll = 8;                   // (8: faster than 16 when every warp of the CTA copies)
constexpr int kSideWarps = 3;                    // a compute CTA: warps 1 .. 3 of the producer warpgroup
constexpr int kSideUnroll = 16;
// FP8: fewer 16-byte values in flight per mover lane than kSideUnroll (the producer warpgroup has
// kFusedFp8ProducerRegs), per pass (docs/design.md: why 4 in the backward and 8 in the forward)
constexpr int kSideUnrollFp8[2] = {8, 4};  // [kPass]
constexpr int kMoverBarrier = 3;  // bar.sync id of a task's movers (0: __syncthreads; gemm.cuh: kConsumersBarrier)
static_assert(kMoverBarrier != gemm::kConsumersBarrier, "one named barrier per group of threads");

// The kWarps movers of one mover task (warp `warp` of them; warp 0's lane 0 leads): the leader
// waits for the task's counters, every warp does its share, then the leader signals. `go`: a
// shared flag of the movers. A chunk task moves its rows (fenced for their readers: the GEMMs'
// TMA loads, or the peers). The token-side tasks of tokens kEpilogueRows row_tile .. run the
// standalone token kernels' device functions (token.cuh): kTaskScale writes their dy_slots rows
// (scale_part; fenced for the peers that pull them), kTaskSlotSum their dx and d topk_weights
// (token_grads; read after the kernel). Both are backward tasks: the forward (kPass 0) compiles
// them out, as with_problem trusts the plan (Plan.check) for the pass's kinds.
template <int kPass, int kWarps, int kUnroll, bool kQuantize = false>
__device__ __forceinline__ bool mover_task(const Ctx& c, volatile int* go, const Task& t, int index, int warp,
                                           int lane, bool ok) {
  const bool lead = warp == 0 && lane == 0;
  const i64 start = lead ? static_cast<i64>(globaltimer_ns()) : 0;
  if (lead) {
    *go = ok && wait_task(c, t, index);
    if (c.trace) c.trace[index].ready_ns = static_cast<i64>(globaltimer_ns());
  }
  asm volatile("bar.sync %0, %1;" ::"n"(kMoverBarrier), "n"(kWarps * 32) : "memory");
  ok = *go != 0;
  if (kPass == 1 && (t.kind == plan::kTaskSlotSum || t.kind == plan::kTaskScale)) {
    const i64 t0 = static_cast<i64>(t.row_tile) * plan::kEpilogueRows, n = c.tp->num_tokens;
    const i64 t1 = t0 + plan::kEpilogueRows < n ? t0 + plan::kEpilogueRows : n, h8 = c.tp->hidden / 8;
    const Workers threads{warp * 32 + lane, kWarps * 32};
    if (ok && t0 < n && t.kind == plan::kTaskScale) scale_part(c.tp, c.rank, t0 * h8, t1 * h8, threads);
    if (ok && t0 < n && t.kind == plan::kTaskSlotSum)
      token_grads(c.tp, c.rank, t0, t1, threads, Workers{warp, kWarps}, lane);
    if (t.kind == plan::kTaskScale) __threadfence_system();  // the peers' pulls, after the flag
  } else {
    const ChunkRows rows = chunk_rows(c, t, ok);
    // fp8 dispatch: a row is its codes and its scales, moved as the sequential pulls move them (the
    // emulated link charges the codes' bytes)
    const bool fp8_rows = kQuantize && c.codes != nullptr && t.kind == plan::kTaskDispatch;
    linked_rows<32 * 16 * kUnroll>(
        fp8_rows ? c.codes : c.cp, c.rank, rows.dispatch ? kLinkIn : kLinkOut, 0, rows.count, Workers{warp, kWarps},
        lane, [&](i64 k) { return rows.peer(k); },
        [&](i64 k) {
          // kQuantize (the FP8 kernels): a pulled row (dispatch: x, reverse-combine: dy) is stored
          // and quantized from the same registers, as q(recv), q(recv_dy) give it (padding rows,
          // which no segment holds, are only moved)
          if constexpr (kQuantize) {
            if (fp8_rows) {
              const i64 i = rows.first + k * rows.stride;
              warp_move_row<16, kUnroll>(dispatch_pull_row(c.codes, c.rank, rows.sv, i, rows.shift), c.codes->row_bytes,
                                         lane);
              const RowMove s = dispatch_pull_row(c.scales, c.rank, rows.sv, i, rows.shift);
              if (c.scales->row_bytes % 16 == 0)
                warp_move_row<16>(s, c.scales->row_bytes, lane);
              else
                warp_move_row<2>(s, c.scales->row_bytes, lane);
              return;
            }
            if (c.quant != nullptr && rows.dispatch && rows.peer(k) >= 0) {
              fp8::copy_quantize_row_bf16<kUnroll>(c.quant, rows.first + k * rows.stride - rows.shift, rows.move(k).src,
                                                   lane);
              return;
            }
          }
          warp_move_row<16, kUnroll>(rows.move(k), c.cp->row_bytes, lane);
        });
    if (rows.dispatch)
      fence_proxy_async_global();  // the rows are read by the GEMMs' TMA loads
    else
      __threadfence_system();  // the peers' slot rows, before the flag that says they are complete
  }
  asm volatile("bar.sync %0, %1;" ::"n"(kMoverBarrier), "n"(kWarps * 32) : "memory");  // every row is stored
  if (lead) {
    signal_task(c, t);
    trace_times(c, index, start, static_cast<i64>(globaltimer_ns()));
  }
  return ok;
}

// The tasks the movers run (abi.cuh kMoverKinds: the transfers' chunks, the scale, the token gradients).
__device__ __forceinline__ bool is_mover(int kind) { return (plan::kMoverKinds >> kind) & 1; }
static_assert(plan::kMoverKinds == ((1 << plan::kTaskDispatch) | (1 << plan::kTaskCombine) |
                                    (1 << plan::kTaskRevCombine) | (1 << plan::kTaskRevDispatch) |
                                    (1 << plan::kTaskScale) | (1 << plan::kTaskSlotSum)),
              "mover_task runs the transfers' chunks, kTaskScale and kTaskSlotSum: teach it the new mover kind");

// The grouped-GEMM problem of a task of pass kPass (0: forward, 1: backward), for the roles'
// dispatch: f.template operator()<Problem>() runs the task.
template <int kPass, typename F>
__device__ __forceinline__ bool with_problem(int kind, F f) {
  if constexpr (kPass == 0) {
    if (kind == plan::kTaskSharedGateUp || kind == plan::kTaskGateUp) return f(gemm::Tag<gemm::kGateUp>());
    return f(gemm::Tag<gemm::kDown>());
  } else {
    if (kind == plan::kTaskSharedDownBwd || kind == plan::kTaskDownBwd) return f(gemm::Tag<gemm::kDownBwd>());
    if (kind == plan::kTaskSharedGateUpBwd || kind == plan::kTaskGateUpBwd) return f(gemm::Tag<gemm::kGateUpBwd>());
    if (kind == plan::kTaskSharedDownWgrad || kind == plan::kTaskDownWgrad) return f(gemm::Tag<gemm::kDownWgrad>());
    return f(gemm::Tag<gemm::kGateUpWgrad>());
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel: grid (the plan's num_sms, W) in 2-CTA clusters, kThreads threads, gemm::kSmemBytes of
// dynamic shared memory; every CTA of every launch rank resident at once (the host sizes the grid
// from the driver's occupancy answer).
// ---------------------------------------------------------------------------------------------
template <bool kFp8>
struct StorageOf {
  using Type = SharedStorage;
};
template <>
struct StorageOf<true> {
  using Type = gemm_fp8::FusedStorage;  // gemm.cuh's and the FP8 stages' scales
};

// kFp8 (fused_forward_fp8, fused_backward_fp8): the routed experts' row tiles are FP8 (gemm_fp8.cuh),
// the shared expert's BF16; the movers of the incoming transfer (dispatch, reverse-combine) quantize
// the rows they receive (Ctx::quant).
template <int kPass, bool kFp8 = false>
__device__ __forceinline__ void run_fused(const FusedParams* fp) {
  using Storage = typename StorageOf<kFp8>::Type;
  extern __shared__ char smem_raw[];
  Storage& ss = aligned_shared<Storage>(smem_raw);
  const int cta = static_cast<int>(cluster_ctarank());
  const CommParams* cp = reinterpret_cast<const CommParams*>(fp->comm);
  const int w = blockIdx.y;
  Ctx c;
  c.fp = fp;
  c.cp = cp;
  c.tp = reinterpret_cast<const TokenParams*>(fp->token);
  c.info = reinterpret_cast<const Counter*>(fp->counter_info);
  c.first_remote = static_cast<int>(fp->first_remote);
  c.pass = kPass;
  c.gemm = reinterpret_cast<const GemmParams*>(fp->gemm) + w * kFusedGemms;
  c.fp8 = kFp8 ? reinterpret_cast<const gemm_fp8::Fp8GemmParams*>(fp->fp8_gemm) + w * kFusedGemms : nullptr;
  c.quant = kFp8 && fp->quant ? reinterpret_cast<const fp8::QuantParams*>(fp->quant) + w : nullptr;
  c.codes = kFp8 ? reinterpret_cast<const CommParams*>(fp->dispatch_codes) : nullptr;
  c.scales = kFp8 ? reinterpret_cast<const CommParams*>(fp->dispatch_scales) : nullptr;
  c.tasks = reinterpret_cast<const Task*>(fp->tasks);
  c.counters = reinterpret_cast<u32*>(fp->counters) + w * fp->num_counters;
  c.trace = fp->record_trace ? reinterpret_cast<TraceRecord*>(fp->trace) + w * fp->num_tasks : nullptr;
  c.rank = static_cast<int>(cp->rank_base) + w;
  // Barriers and the cluster's abort decision (an error recorded before this launch: run nothing).
  if (threadIdx.x == 0) init_tickets(ss);
  gemm::gemm_setup<gemm::kGateUp>(c.gemm + kSlotFirst, ss, cta);
  const int* task_begin = reinterpret_cast<const int*>(fp->task_begin);
  const int first = task_begin[blockIdx.x], last = task_begin[blockIdx.x + 1];
  bool ok = true;
  if (!ss.abort) {
    if (blockIdx.x < fp->comm_ctas) {
      for (int i = first; i < last; ++i)
        ok = mover_task<kPass, kCommWarps, kCommUnroll, kFp8>(c, &ss.go, c.tasks[i], i, threadIdx.x >> 5,
                                                              threadIdx.x & 31, ok);
    } else {
      // NOTE: the role is broadcast from lane 0 so the compiler sees it warp-uniform (wgmma).
      const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0), wg_tid = threadIdx.x & 127;
      Ring ring;
      if (wg == 0) {
        warpgroup_reg_dealloc<kFp8 ? kFusedFp8ProducerRegs : kFusedProducerRegs>();
        if (wg_tid < 32) {  // the producer warp: GEMM tasks
          // its table's GEMM tasks, then the pool's pairs as claimed (one call site of produce_task:
          // a second one made ptxas spill more in the consumers)
          for (int n = first;; ++n) {
            int i = n;
            if (n >= last) {  // claim j = n - last (live registers: n and last only)
              const int j = n - last;
              if (fp->claim_counter < 0) break;  // no pool
              int k = -1;
              if (wg_tid == 0 && cta == 0) k = claim_pair(c, ss, j, ok);
              if (wg_tid == 0 && cta != 0) {
                k = read_ticket(c, ss, j, ok);
                if (k >= 0) return_ticket(ss, j);  // (-1: the last ticket, or an error)
              }
              k = __shfl_sync(0xffffffffu, k, 0);
              if (k < 0) break;
              i = Pool(c).first + 2 * k + cta;
            }
            const Task t = c.tasks[i];
            if (is_mover(t.kind)) continue;
            ok = with_problem<kPass>(t.kind, [&](auto tag) {
              return produce_task<decltype(tag)::kProblem, kFp8>(c, ss, ring, t, i, cta, wg_tid, ok);
            });
          }
          if constexpr (kFp8) cp_async_wait_all();  // the FP8 tiles' scale copies
          if (wg_tid == 0) gemm::drain_loads(ss, ring);
        } else {  // the spare warps: communication tasks
          const int side = wg_tid / 32 - 1;
          for (int i = first; i < last; ++i) {
            const Task t = c.tasks[i];
            if (is_mover(t.kind))
              ok = mover_task<kPass, kSideWarps, kFp8 ? kSideUnrollFp8[kPass] : kSideUnroll, kFp8>(
                  c, &ss.go, t, i, side, wg_tid & 31, ok);
          }
        }
      } else {
        warpgroup_reg_alloc<kFp8 ? kFusedFp8ConsumerRegs : kFusedConsumerRegs>();
        float acc[128];
        float* staging = ss.staging[threadIdx.x / 32 - 4];
        for (int n = first;; ++n) {  // as the producer: the table, then the pool's claimed pairs
          int i = n;
          if (n >= last) {
            const int j = n - last;
            if (fp->claim_counter < 0) break;
            const int k = read_ticket(c, ss, j, ok);
            const bool stop = consumers_any(k < 0);  // after it every consumer has read ticket j
            if (!stop && threadIdx.x == 128) return_ticket(ss, j);
            if (stop) break;
            i = Pool(c).first + 2 * k + cta;
          }
          const Task t = c.tasks[i];
          if (is_mover(t.kind)) continue;
          ok = with_problem<kPass>(t.kind, [&](auto tag) {
            return consume_task<decltype(tag)::kProblem, kFp8>(c, ss, ring, t, i, cta, acc, staging, wg - 1, wg_tid,
                                                                ok);
          });
        }
      }
    }
  }
  // No CTA may leave while its partner can still arrive on its barriers or multicast into it.
  cluster_sync();
}

__global__ void __cluster_dims__(gemm::kCluster, 1, 1) __launch_bounds__(gemm::kThreads, 1)
    fused_forward(const FusedParams* fp) {
  run_fused<0>(fp);
}

__global__ void __cluster_dims__(gemm::kCluster, 1, 1) __launch_bounds__(gemm::kThreads, 1)
    fused_backward(const FusedParams* fp) {
  run_fused<1>(fp);
}

// The forward with FP8 routed experts (RunConfig precision "fp8").
__global__ void __cluster_dims__(gemm::kCluster, 1, 1) __launch_bounds__(gemm::kThreads, 1)
    fused_forward_fp8(const FusedParams* fp) {
  run_fused<0, true>(fp);
}

// The backward with FP8 routed experts: FP8 data-gradient tiles; FP8 weight gradients run after the
// kernel (with their operands' transposed quantizations), BF16 ones (wgrad_precision bf16) may run inside.
__global__ void __cluster_dims__(gemm::kCluster, 1, 1) __launch_bounds__(gemm::kThreads, 1)
    fused_backward_fp8(const FusedParams* fp) {
  run_fused<1, true>(fp);
}

// Compile-time sizes Python reads once from the compiled module: out[0] = dynamic shared memory of
// the FP8 kernels (the BF16 kernels take gemm.cuh's).  grid 1, block 1.
__global__ void export_sizes(int* out) { out[0] = gemm_fp8::kFusedSmemBytes; }

}  // namespace fused
}  // namespace mok
