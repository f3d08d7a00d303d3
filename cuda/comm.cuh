// Communication of one MoE round: routing all-gather, the MoK pull schedule built on the device,
// dispatch (pull | push), a stand-in expert, combine (push | pull), weighted sum.
//
// Legend: N tokens/rank, H hidden, K top-k, R ranks, E experts, El = E/R local experts,
//         C receive capacity (rows), W ranks driven by one launch (virtual ranks; 1 with NVSHMEM).
// Names: `rank` is an EP rank. A *slot* s = t*K + j is a token's j-th choice (token side); a
//        *receive row* i is a row of an expert owner's receive buffer (expert side); the *slot
//        buffer* `slots` [N*K, H] is where the token owner collects its K result rows.
//
// Two parts:
//  1. Building blocks (device functions). Each takes the EP rank it works for and an explicit
//     share of the work: a range [begin, end) and the caller's workers (`Workers`: its id among
//     `count` threads or warps). Nothing in them reads gridDim, blockIdx or "the last block", so
//     a persistent kernel can call them with any split of its blocks.
//  2. Standalone kernels: thin clients that give every block of the grid an equal share and
//     signal completion with the last-block counter.
//
// Every kernel runs rank = rank_base + blockIdx.y; all symmetric buffers come as peer tables
// (u64 [R] addresses), so one source serves NVSHMEM (one rank per process) and virtual ranks
// (W ranks as slices of one allocation, one launch). Nothing here reads back to the host: counts
// live in device memory, the epoch is a device counter, and every wait is bounded.
//
// Producer/consumer contract of a round (epoch = state[0], raised by begin_round):
//   allgather_routing --kFlagRouting--> schedule (3 launches) --kFlagMap--> wait_peers, dispatch_push
//   dispatch_push --kFlagDispatch--> wait_peers (then the experts)
//   the experts, raise_flag --kFlagReady--> wait_peers, combine_pull
//   combine_push --kFlagCombine--> wait_peers (then the weighted sum, which also checks that
//   every slot got a row: an owner that overflowed placed none, recv_row = -1, see
//   report_unplaced_slots)
// The GPU layer's backward is a second round (epoch + 1) on the forward's schedule, with the same
// copies over its own buffers: reverse-combine pull = raise_flag(kFlagRouting: my dy rows are
// written), wait_peers, dispatch_pull; push = dispatch_push --kFlagDispatch--> wait_peers;
// reverse-dispatch as combine (kFlagCombine, or kFlagReady + pull). Flags only grow, so a kind
// reused at epoch + 1 never satisfies a wait early.
// Every wait is its own wait_peers launch (only the schedule waits inside), naming its Op, so
// the movement kernels are plain copies and the backward reuses them with its own buffers: a
// timed push stage includes its receiver's wait, as a pull stage includes its own loads. A
// kernel only ever waits for flags raised by EARLIER launches (or other processes), so no launch
// needs its own blocks to be co-resident to make progress.
#pragma once
#include "common.cuh"

namespace mok {

// ---------------------------------------------------------------------------------------------
// Views of the round's buffers
// ---------------------------------------------------------------------------------------------
struct SchedView {
  int* offsets;   // [El + 1]  start of each expert's segment; offsets[El] = receive rows used
  int* counts;    // [El]      real rows of each expert (the rest of its segment is padding)
  int* src_rank;  // [C]       token owner of each receive row (-1: padding)
  int* src_slot;  // [C]       slot on that owner
};

__device__ __forceinline__ u64 epoch_of(const CommParams* p, int rank) { return at<u64>(p->state, rank)[0]; }
__device__ __forceinline__ unsigned int* counter_of(const CommParams* p, int rank, int op) {
  return reinterpret_cast<unsigned int*>(at<u64>(p->state, rank) + 1 + op);
}
__device__ __forceinline__ const u64* my_flags(const CommParams* p, int rank, int kind) {
  return at<u64>(p->flags, rank) + static_cast<i64>(kind) * p->num_ranks;
}
__device__ __forceinline__ SchedView sched_of(const CommParams* p, int rank) {
  int* s = at<int>(p->sched, rank);
  const i64 el = p->num_local_experts, cap = p->capacity;
  return {s, s + el + 1, s + 2 * el + 1, s + 2 * el + 1 + cap};
}
// The receive rows [lo, hi) this launch moves and computes on (one turn of the ring; all of them
// without one): rows lo .. hi - 1 live in rows 0 .. hi - lo - 1 of recv and y.
struct TurnRows {
  i64 lo, hi;
};
__device__ __forceinline__ TurnRows turn_rows(const CommParams* p, SchedView sv) {
  const i64 used = sv.offsets[p->num_local_experts];
  if (p->ring_rows == 0) return {0, used};
  return {p->ring_lo, max(p->ring_lo, min(p->ring_lo + p->ring_rows, used))};
}
constexpr int kOutsideTurn = -2;  // a slot whose receive row another turn moves
// Token side: slot s's receive row as this launch sees it: its ring row, kOutsideTurn, or -1 (none).
__device__ __forceinline__ int turn_row(const CommParams* p, int row) {
  if (p->ring_rows == 0 || row < 0) return row;
  return row >= p->ring_lo && row < p->ring_lo + p->ring_rows ? static_cast<int>(row - p->ring_lo) : kOutsideTurn;
}
__device__ __forceinline__ char* row_ptr(const u64* table, int rank, i64 row, i64 row_bytes) {
  return at<char>(table, rank) + row * row_bytes;
}
// Row of token-side source `x` that carries slot s: one row per token (dispatch: x[s / K]) or one
// row per slot (reverse-combine: the scaled output gradient w[t,j] * dout[t] of slot s).
__device__ __forceinline__ i64 source_row(const CommParams* p, i64 s) { return p->slot_rows ? s : s / p->top_k; }
// The whole block waits until every peer raised flag `kind` for this round (see block_wait_all).
__device__ __forceinline__ bool wait_all_peers(const CommParams* p, int rank, int kind, int op) {
  return block_wait_all(my_flags(p, rank, kind), static_cast<int>(p->num_ranks), epoch_of(p, rank), p->timeout_ns,
                        p->error, op, rank);
}

// ---------------------------------------------------------------------------------------------
// Building blocks: routing and schedule
// ---------------------------------------------------------------------------------------------
// Elements [begin, end) of my routing broadcast (element i = (peer, slot) = (i / NK, i % NK) of
// R * N*K): topk_idx[slot] into routing[my rank] of that peer. One element per thread.
__device__ __forceinline__ void allgather_routing_part(const CommParams* p, int rank, i64 begin, i64 end,
                                                       Workers threads) {
  const i64 nk = p->num_tokens * p->top_k;
  const int* src = at<int>(p->topk_idx, rank);
  for (i64 i = begin + threads.id; i < end; i += threads.count) {
    const int peer = static_cast<int>(i / nk);
    const i64 s = i - peer * nk;
    at<int>(p->routing, peer)[rank * nk + s] = src[s];
  }
}

// The schedule runs as three launches over *segments* of kScheduleSegment slots of one source
// rank (segment g = r * Q + q covers slots q * kScheduleSegment ... of source rank r; Q segments
// per rank): count the pairs of each segment per local expert, scan the counts (segment bases,
// M, offsets, capacity), place every segment's pairs. `scratch` (CommParams.sched_scratch, one
// per rank): int32 [R * Q * El] segment counts, then bases | [El * R] M (l * R + r) | [1] fits.
struct ScheduleScratch {
  int* segment;  // [R * Q * El]: counts, then (after the scan) the pairs of (l, r) before segment g
  int* pairs;    // [El * R]:     M[l, r], pairs of source rank r for local expert l
  int* fits;     // [1]:          1 if every segment fits in the capacity
};
__device__ __forceinline__ int segments_per_rank(const CommParams* p) {
  return static_cast<int>((p->num_tokens * p->top_k + kScheduleSegment - 1) / kScheduleSegment);
}
__device__ __forceinline__ ScheduleScratch scratch_of(const CommParams* p, int rank) {
  int* s = at<int>(p->sched_scratch, rank);
  const i64 segment_words = p->num_ranks * segments_per_rank(p) * p->num_local_experts;
  return {s, s + segment_words, s + segment_words + p->num_ranks * p->num_local_experts};
}

// Schedule step 1: counts[l] += pairs for local expert l among routing elements [begin, end) (one
// source rank's slots). `counts` [El] in shared memory, zeroed by the caller.
__device__ __forceinline__ void schedule_count(const CommParams* p, int rank, int* counts, i64 begin, i64 end,
                                               Workers threads) {
  const int el = static_cast<int>(p->num_local_experts);
  const int* routing = at<int>(p->routing, rank);  // [R, N*K]
  const int first_expert = rank * el;
  for (i64 i = begin + threads.id; i < end; i += threads.count) {
    const int l = routing[i] - first_expert;
    if (l >= 0 && l < el) atomicAdd(&counts[l], 1);
  }
}

// Schedule step 2 (one thread): segment offsets padded to `align` from the pairs of each local
// expert (`totals` [El]), and the capacity check. On overflow it reports kErrCapacity and leaves
// every segment empty. Returns whether it fits.
__device__ __forceinline__ bool schedule_offsets(const CommParams* p, int rank, const int* totals, SchedView sv) {
  const int el = static_cast<int>(p->num_local_experts);
  i64 offset = 0;
  for (int l = 0; l < el; ++l) {
    sv.offsets[l] = static_cast<int>(offset);
    sv.counts[l] = totals[l];
    offset += (totals[l] + p->align - 1) / p->align * p->align;
  }
  const bool fits = offset <= p->capacity;
  sv.offsets[el] = fits ? static_cast<int>(offset) : 0;
  if (!fits) {
    for (int l = 0; l < el; ++l) sv.offsets[l] = sv.counts[l] = 0;
    report_error(p->error, kErrCapacity, kOpSchedule, rank, offset, p->capacity, 0);
  }
  return fits;
}

// The local expert of this lane's slot s of a source rank's routing `src` (-1: another rank's
// expert, or s >= s_end), and the lanes of the warp whose slot has the same one (warp-uniform call).
struct SlotExpert {
  int l;
  unsigned int same;
};
__device__ __forceinline__ SlotExpert slot_expert(const int* src, i64 s, i64 s_end, int first_expert, int el) {
  const int l = s < s_end ? src[s] - first_expert : -1;
  const int mine = l >= 0 && l < el ? l : -1;
  return {mine, __match_any_sync(0xffffffffu, mine)};
}
__device__ __forceinline__ int lanes_before(unsigned int lanes, int lane) { return __popc(lanes & ((1u << lane) - 1u)); }

// Schedule step 3: one warp places the pairs among slots [s_begin, s_end) of source rank r:
//   the o-th pair (in slot order) of (l, r) goes to receive row
//   offsets[l] + sum_r' min(M[l,r'], o) + |{r' < r : M[l,r'] > o}|,
// written to src_rank/src_slot here and to recv_row[s] on the source rank (the combine map; -1
// when nothing fits). `cursor` [El]: the pairs of (l, r) before s_begin, advanced as it goes.
// NOTE: the warp walks the slots in order, so o is deterministic: lanes with the same expert
// rank themselves by lane. `pairs` = M (l * R + r) and `offsets` [El + 1] may be shared copies.
__device__ __forceinline__ void schedule_place(const CommParams* p, int rank, const int* pairs, const int* offsets,
                                               int* cursor, SchedView sv, bool fits, int r, i64 s_begin, i64 s_end,
                                               int lane) {
  const int num_ranks = static_cast<int>(p->num_ranks), el = static_cast<int>(p->num_local_experts);
  const int* src = at<int>(p->routing, rank) + r * p->num_tokens * p->top_k;
  int* peer_recv_row = at<int>(p->recv_row, r);
  const int first_expert = rank * el;
  for (i64 chunk = s_begin; chunk < s_end; chunk += 32) {
    const i64 s = chunk + lane;
    const SlotExpert e = slot_expert(src, s, s_end, first_expert, el);
    const int l = e.l, before = lanes_before(e.same, lane);
    const int o = l >= 0 ? cursor[l] + before : 0;
    __syncwarp();
    if (l >= 0 && before == 0) cursor[l] += __popc(e.same);
    __syncwarp();
    if (l < 0) continue;
    int row = -1;
    if (fits) {
      const int* m = pairs + l * num_ranks;
      row = offsets[l];
      for (int q = 0; q < num_ranks; ++q) row += min(m[q], o) + ((q < r && m[q] > o) ? 1 : 0);
      sv.src_rank[row] = r;
      sv.src_slot[row] = static_cast<int>(s);
    }
    peer_recv_row[s] = row;
  }
}

// Schedule step 4: padding rows of every segment hold -1.
__device__ __forceinline__ void schedule_pad(const CommParams* p, SchedView sv, Workers threads) {
  const int el = static_cast<int>(p->num_local_experts);
  for (int l = 0; l < el; ++l)
    for (int i = sv.offsets[l] + sv.counts[l] + threads.id; i < sv.offsets[l + 1]; i += threads.count)
      sv.src_rank[i] = sv.src_slot[i] = -1;
}

// ---------------------------------------------------------------------------------------------
// Building blocks: row movements (one warp per row; kVec: bytes per access, 16 or 2)
// ---------------------------------------------------------------------------------------------
// Dispatch, pull (expert side): receive rows [begin, end): recv[i] <- the source row of slot
// src_slot[i] (source_row) on rank src_rank[i]; padding rows zeroed. The expert owner waits only
// for its own loads. (Reverse-combine, pull: the same with the backward's buffers.) The row
// functions take a `shift`: the fused layer's ring keeps receive row i in row i - shift of recv/y.
// One row of a movement: copy `bytes` from src to dst; src == nullptr: zero dst; dst == nullptr:
// nothing to do. The row functions below say which row i moves where; the movers (a warp per row,
// here and in the fused kernel: warp_move_row) do the copying.
struct RowMove {
  const char* src;
  char* dst;
};

__device__ __forceinline__ RowMove dispatch_pull_row(const CommParams* p, int rank, SchedView sv, i64 i, i64 shift) {
  const int src = sv.src_rank[i];
  return {src < 0 ? nullptr : row_ptr(p->x, src, source_row(p, sv.src_slot[i]), p->row_bytes),
          row_ptr(p->recv, rank, i - shift, p->row_bytes)};
}

__device__ __forceinline__ RowMove combine_push_row(const CommParams* p, int rank, SchedView sv, i64 i, i64 shift) {
  const int dst = sv.src_rank[i];
  return {row_ptr(p->y, rank, i - shift, p->row_bytes),
          dst < 0 ? nullptr : row_ptr(p->slots, dst, sv.src_slot[i], p->row_bytes)};
}

template <int kVec, int kUnroll = 1>
__device__ __forceinline__ void warp_move_row(RowMove m, i64 bytes, int lane) {
  if (m.dst == nullptr) return;
  if (m.src == nullptr)
    warp_zero_row<kVec>(m.dst, bytes, lane);
  else
    warp_copy_row<kVec, kUnroll>(m.dst, m.src, bytes, lane);
}

template <int kVec>
__device__ __forceinline__ void pull_token_rows(const CommParams* p, int rank, SchedView sv, i64 begin, i64 end,
                                                i64 shift, Workers warps, int lane) {
  linked_rows<32 * kVec>(
      p, rank, kLinkIn, begin, end, warps, lane, [&](i64 i) { return sv.src_rank[i]; },
      [&](i64 i) { warp_move_row<kVec>(dispatch_pull_row(p, rank, sv, i, shift), p->row_bytes, lane); });
}

// Token side: f(s, expert owner, receive row there as turn_row sees it) for my slots [begin, end),
// one per worker. With the emulated link, a row pays to or from the slot's expert owner (none where
// it overflowed or another turn moves it); `d` is the direction of the movement (workers: warps).
template <int kBatch, typename F>
__device__ __forceinline__ void for_my_slots(const CommParams* p, int rank, int d, i64 begin, i64 end,
                                             Workers workers, int lane, F f) {
  const int* topk_idx = at<int>(p->topk_idx, rank);
  const int* recv_row = at<int>(p->recv_row, rank);
  const int el = static_cast<int>(p->num_local_experts);
  linked_rows<kBatch>(
      p, rank, d, begin, end, workers, lane,
      [&](i64 s) { return turn_row(p, recv_row[s]) < 0 ? -1 : topk_idx[s] / el; },
      [&](i64 s) { f(s, topk_idx[s] / el, turn_row(p, recv_row[s])); });
}

// Dispatch, push (token side): my slots [begin, end): the source row of s (source_row) into
// recv[recv_row[s]] of the slot's expert owner (nothing where the owner overflowed: reported
// there). (Reverse-combine, push: the same with the backward's buffers.)
template <int kVec>
__device__ __forceinline__ void push_token_rows(const CommParams* p, int rank, i64 begin, i64 end, Workers warps,
                                                int lane) {
  for_my_slots<32 * kVec>(p, rank, kLinkOut, begin, end, warps, lane, [&](i64 s, int owner, int row) {
    if (row < 0) return;
    warp_copy_row<kVec>(row_ptr(p->recv, owner, row, p->row_bytes), row_ptr(p->x, rank, source_row(p, s), p->row_bytes),
                        p->row_bytes, lane);
  });
}

// Combine, push (expert side): receive rows [begin, end): y[i] into slots[src_slot[i]] of token
// owner src_rank[i] (padding rows skipped).
template <int kVec>
__device__ __forceinline__ void push_result_rows(const CommParams* p, int rank, SchedView sv, i64 begin, i64 end,
                                                 i64 shift, Workers warps, int lane) {
  linked_rows<32 * kVec>(
      p, rank, kLinkOut, begin, end, warps, lane, [&](i64 i) { return sv.src_rank[i]; },
      [&](i64 i) { warp_move_row<kVec>(combine_push_row(p, rank, sv, i, shift), p->row_bytes, lane); });
}

// Combine, pull (token side): my slots [begin, end): slots[s] <- y[recv_row[s]] of the slot's
// expert owner (zeros where the owner overflowed).
template <int kVec>
__device__ __forceinline__ void pull_result_rows(const CommParams* p, int rank, i64 begin, i64 end, Workers warps,
                                                 int lane) {
  for_my_slots<32 * kVec>(p, rank, kLinkIn, begin, end, warps, lane, [&](i64 s, int owner, int row) {
    if (row == kOutsideTurn) return;
    char* dst = row_ptr(p->slots, rank, s, p->row_bytes);
    if (row < 0)
      warp_zero_row<kVec>(dst, p->row_bytes, lane);
    else
      warp_copy_row<kVec>(dst, row_ptr(p->y, owner, row, p->row_bytes), p->row_bytes, lane);
  });
}

// Stand-in expert on receive rows [begin, end): y[i] = scale[expert of row i] * recv[i] (fp32
// rows), padding rows 0.
__device__ __forceinline__ void scale_rows(const CommParams* p, int rank, SchedView sv, i64 begin, i64 end,
                                           Workers warps, int lane) {
  const int el = static_cast<int>(p->num_local_experts);
  const float* scale = at<float>(p->scale, rank) + rank * el;
  const i64 hidden = p->hidden;
  for (i64 row = begin + warps.id; row < end; row += warps.count) {
    int l = 0;  // expert of this row: last l with offsets[l] <= row
    while (l + 1 < el && sv.offsets[l + 1] <= row) ++l;
    const bool real = sv.src_rank[row] >= 0;
    const float* in = at<float>(p->recv, rank) + row * hidden;
    float* out = at<float>(p->y, rank) + row * hidden;
    for (i64 h = lane; h < hidden; h += 32) out[h] = real ? __fmul_rn(in[h], scale[l]) : 0.0f;
  }
}

// Weighted sum of elements [begin, end) of [N, H] (fp32 rows):
// out[t] = base[t] + sum_{j=0..K-1} w[t,j] * slots[t*K+j], j in order, each product and sum
// rounded separately (no FMA), exactly as NumPy's reference.weighted_sum.
__device__ __forceinline__ void weighted_sum_part(const CommParams* p, int rank, i64 begin, i64 end,
                                                  Workers threads) {
  const i64 hidden = p->hidden, top_k = p->top_k;
  const float* base = at<float>(p->base, rank);
  const float* w = at<float>(p->topk_w, rank);
  const float* slots = at<float>(p->slots, rank);
  float* out = at<float>(p->out, rank);
  for (i64 i = begin + threads.id; i < end; i += threads.count) {
    const i64 t = i / hidden, h = i - t * hidden;
    float acc = base[i];
    for (i64 j = 0; j < top_k; ++j)
      acc = __fadd_rn(acc, __fmul_rn(w[t * top_k + j], slots[(t * top_k + j) * hidden + h]));
    out[i] = acc;
  }
}

// ---------------------------------------------------------------------------------------------
// Standalone kernels: grid (blocks per rank, W), rank = rank_base + blockIdx.y, every block an
// equal share of [0, total); blocks of kCommThreads (schedule_scan: kScheduleThreads), as the
// wrappers launch them. Completion: the last block signals (see last_block). Their work shares
// (grid_threads, grid_warps, block_threads, block_warps) are in common.cuh.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ int rank_of(const CommParams* p) { return static_cast<int>(p->rank_base) + blockIdx.y; }
__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }
// My last block raises flag `kind` on every peer.
__device__ __forceinline__ void signal_when_last(const CommParams* p, int rank, int op, int kind) {
  if (last_block(counter_of(p, rank, op))) {
    link_signal(p);
    signal_all(p->flags, kind, static_cast<int>(p->num_ranks), rank, epoch_of(p, rank), block_threads());
  }
}

// begin_round: epoch += 1 for each launch-rank.  grid (1, W), block 32.
__global__ void begin_round(const CommParams* p) {
  if (threadIdx.x == 0) at<u64>(p->state, rank_of(p))[0] += 1;
}

// raise_flag: flag `kind` = this round's epoch on every peer, from me: e.g. kFlagReady once my
// expert GEMMs (earlier launches in the stream, complete) wrote the rows pullers read.
// grid (1, W), block >= R or any (threads loop over peers).
__global__ void raise_flag(const CommParams* p, int kind) {
  const int rank = rank_of(p);
  link_signal(p);
  signal_all(p->flags, kind, static_cast<int>(p->num_ranks), rank, epoch_of(p, rank), block_threads());
}

// wait_peers: the receiver side of a push: wait until every peer raised flag `kind` this round.
// grid (1, W), block 128. Later launches in the stream see the peers' rows.
__global__ void wait_peers(const CommParams* p, int kind, int op) {
  wait_all_peers(p, rank_of(p), kind, op);
}

// allgather_routing: my topk_idx [N*K] into routing[my rank] of every peer, then kFlagRouting.
// Moves R * N*K * 4 bytes per rank.  grid (nb, W).
// NOTE: x must be in its symmetric buffer before this launch: the routing flag also publishes x.
__global__ void __launch_bounds__(kCommThreads) allgather_routing(const CommParams* p) {
  const int rank = rank_of(p);
  allgather_routing_part(p, rank, 0, p->num_ranks * p->num_tokens * p->top_k, grid_threads());
  signal_when_last(p, rank, kOpRouting, kFlagRouting);
}

// The MoK placement on this (expert-owning) rank, bit-identical to mok_proto/schedule.py, in
// three launches (see ScheduleScratch), then kFlagMap from the last block of the third. Reads
// R*N*K*4 bytes twice; the row formula costs O(R) per pair. On overflow (rows > C) it reports
// kErrCapacity, places nothing (recv_row = -1) and the round runs on (a capacity error stops no
// wait), so every peer still gets its signals and none hangs; the host raises CapacityError. The
// token owners learn of it from recv_row = -1: their weighted sum reports it in their own record
// (report_unplaced_slots), so under NVSHMEM every rank that routed a slot here raises, naming this
// rank (one that routed none has nothing to report).
//
// schedule_count_segments: grid (R * Q, W), block kCommThreads, dynamic smem El ints. Waits for
// every peer's routing, then counts segment g's pairs per local expert.
__global__ void __launch_bounds__(kCommThreads) schedule_count_segments(const CommParams* p) {
  extern __shared__ int counts[];  // [El]
  const int rank = rank_of(p), el = static_cast<int>(p->num_local_experts);
  if (!wait_all_peers(p, rank, kFlagRouting, kOpSchedule)) return;
  for (int l = threadIdx.x; l < el; l += blockDim.x) counts[l] = 0;
  __syncthreads();
  const i64 nk = p->num_tokens * p->top_k;
  const int q_per_rank = segments_per_rank(p), r = blockIdx.x / q_per_rank, q = blockIdx.x % q_per_rank;
  const i64 begin = r * nk + static_cast<i64>(q) * kScheduleSegment;
  schedule_count(p, rank, counts, begin, min(begin + kScheduleSegment, (r + 1) * nk), block_threads());
  __syncthreads();
  const ScheduleScratch sc = scratch_of(p, rank);
  for (int l = threadIdx.x; l < el; l += blockDim.x) sc.segment[static_cast<i64>(blockIdx.x) * el + l] = counts[l];
}

// schedule_scan: grid (1, W), block kScheduleThreads, dynamic smem (El * R + El) ints. Segment counts
// -> the pairs of (l, r) before each segment (in place) and M; offsets, counts and the capacity
// check; padding rows. NOTE: each thread scans one (r, l) over its Q segments in batches of 8
// independent loads, and the per-expert totals come from M in shared memory, one thread per
// expert: the step is latency bound.
__global__ void __launch_bounds__(kScheduleThreads) schedule_scan(const CommParams* p) {
  extern __shared__ int m[];  // [El * R]  M, then [El] pairs per local expert
  __shared__ int s_fits;
  constexpr int kBatch = 8;
  const int rank = rank_of(p), num_ranks = static_cast<int>(p->num_ranks);
  const int el = static_cast<int>(p->num_local_experts), q_per_rank = segments_per_rank(p);
  const ScheduleScratch sc = scratch_of(p, rank);
  for (int pair = threadIdx.x; pair < el * num_ranks; pair += blockDim.x) {  // pair = r * El + l
    const int r = pair / el, l = pair - r * el;
    int* c = sc.segment + static_cast<i64>(r) * q_per_rank * el + l;  // segment q at c[q * El]
    int running = 0;
    for (int q0 = 0; q0 < q_per_rank; q0 += kBatch) {
      int n[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) n[i] = q0 + i < q_per_rank ? c[(q0 + i) * el] : 0;
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (q0 + i < q_per_rank) c[(q0 + i) * el] = running;
        running += n[i];
      }
    }
    sc.pairs[l * num_ranks + r] = m[l * num_ranks + r] = running;
  }
  __syncthreads();
  int* totals = m + el * num_ranks;
  for (int l = threadIdx.x; l < el; l += blockDim.x) {
    int total = 0;
    for (int r = 0; r < num_ranks; ++r) total += m[l * num_ranks + r];
    totals[l] = total;
  }
  __syncthreads();
  const SchedView sv = sched_of(p, rank);
  if (threadIdx.x == 0) *sc.fits = s_fits = schedule_offsets(p, rank, totals, sv);
  __syncthreads();
  if (s_fits) schedule_pad(p, sv, block_threads());
}

// schedule_place_segments: grid (R * Q, W), block kCommThreads (8 warps: 8 sub-segments of a
// segment), dynamic smem (El * R + El + 1 + kWarps * El) ints. Each warp counts its sub-segment's pairs, the
// block turns the counts into every warp's starting cursor, then each warp places its pairs.
__global__ void __launch_bounds__(kCommThreads) schedule_place_segments(const CommParams* p) {
  extern __shared__ int smem[];
  constexpr int kWarps = kCommThreads / 32, kSub = kScheduleSegment / kWarps;
  const int rank = rank_of(p), num_ranks = static_cast<int>(p->num_ranks), lane = lane_id();
  const int el = static_cast<int>(p->num_local_experts), warp = threadIdx.x >> 5;
  int* pairs = smem;                   // [El * R]  M
  int* offsets = pairs + el * num_ranks;  // [El + 1]
  int* cursor = offsets + el + 1;      // [kWarps][El]
  const ScheduleScratch sc = scratch_of(p, rank);
  const SchedView sv = sched_of(p, rank);
  for (int i = threadIdx.x; i < el * num_ranks; i += blockDim.x) pairs[i] = sc.pairs[i];
  for (int i = threadIdx.x; i <= el; i += blockDim.x) offsets[i] = sv.offsets[i];
  for (int i = threadIdx.x; i < kWarps * el; i += blockDim.x) cursor[i] = 0;
  __syncthreads();
  const i64 nk = p->num_tokens * p->top_k;
  const int q_per_rank = segments_per_rank(p), r = blockIdx.x / q_per_rank, q = blockIdx.x % q_per_rank;
  const i64 s_begin = static_cast<i64>(q) * kScheduleSegment + warp * kSub;
  const i64 s_end = min(s_begin + kSub, nk);
  // 1. This warp's pairs per local expert.
  const int* src = at<int>(p->routing, rank) + r * nk;
  const int first_expert = rank * el;
  for (i64 chunk = s_begin; chunk < s_end; chunk += 32) {
    const SlotExpert e = slot_expert(src, chunk + lane, s_end, first_expert, el);
    if (e.l >= 0 && lanes_before(e.same, lane) == 0) cursor[warp * el + e.l] += __popc(e.same);
    __syncwarp();
  }
  __syncthreads();
  // 2. Every warp's starting cursor: the segment's base plus the warps before it.
  for (int l = threadIdx.x; l < el; l += blockDim.x) {
    int running = sc.segment[static_cast<i64>(blockIdx.x) * el + l];
    for (int w = 0; w < kWarps; ++w) {
      const int n = cursor[w * el + l];
      cursor[w * el + l] = running;
      running += n;
    }
  }
  __syncthreads();
  // 3. Place.
  schedule_place(p, rank, pairs, offsets, cursor + warp * el, sv, *sc.fits != 0, r, s_begin, s_end, lane);
  signal_when_last(p, rank, kOpSchedule, kFlagMap);
}

// turn_segments: each turn's expert segments in the ring (what its GEMMs run on), from the
// schedule: turn t holds receive rows [t M, (t+1) M); expert l's part of them starts at ring row
// offsets[t][l] and has counts[t][l] real rows (0 where the expert has none there).
// grid (1, W), block any.
__global__ void turn_segments(const CommParams* p) {
  const int rank = rank_of(p), el = static_cast<int>(p->num_local_experts);
  const SchedView sv = sched_of(p, rank);
  int* out = at<int>(p->turn_sched, rank);
  for (i64 i = threadIdx.x; i < p->num_turns * el; i += blockDim.x) {
    const i64 t = i / el, l = i - t * el, lo = t * p->ring_rows, hi = lo + p->ring_rows;
    const i64 a = max(lo, static_cast<i64>(sv.offsets[l])), b = min(hi, static_cast<i64>(sv.offsets[l] + sv.counts[l]));
    out[t * 2 * el + l] = static_cast<int>(min(a, hi) - lo);
    out[t * 2 * el + el + l] = static_cast<int>(max(b - a, static_cast<i64>(0)));
  }
}

// The standalone movers' launch bounds. With the emulated link every virtual rank runs its movers
// with the launch of a rank that has the GPU to itself (4 blocks per SM each, kernels/comm.py), so
// two ranks' blocks must fit an SM together (at most 32 registers a thread): a second wave would
// pay every round trip twice. Without the link, the bounds (and the instructions) are unchanged.
#ifdef MOK_LINK
#define MOK_MOVER_BOUNDS __launch_bounds__(kCommThreads, 8)
#else
#define MOK_MOVER_BOUNDS __launch_bounds__(kCommThreads)
#endif

// dispatch_pull: every receive row of the turn (turn_rows) pulled from its token owner. Moves
// rows * H * elem bytes.
template <int kVec>
__global__ void MOK_MOVER_BOUNDS dispatch_pull(const CommParams* p) {
  const int rank = rank_of(p);
  const SchedView sv = sched_of(p, rank);
  const TurnRows t = turn_rows(p, sv);
  pull_token_rows<kVec>(p, rank, sv, t.lo, t.hi, t.lo, grid_warps(), lane_id());
}

// dispatch_push: every slot of mine (of the turn: turn_row) pushed to its expert owner, then
// kFlagDispatch on every peer
// (the consumer waits for all R). Forward: after a wait_peers(kFlagMap) launch (the owners'
// receive rows are placed).
template <int kVec>
__global__ void MOK_MOVER_BOUNDS dispatch_push(const CommParams* p) {
  const int rank = rank_of(p);
  push_token_rows<kVec>(p, rank, 0, p->num_tokens * p->top_k, grid_warps(), lane_id());
  signal_when_last(p, rank, kOpDispatchPush, kFlagDispatch);
}

// expert_scale (stand-in for the expert FFN) on every receive row.
__global__ void __launch_bounds__(kCommThreads) expert_scale(const CommParams* p) {
  const int rank = rank_of(p);
  const SchedView sv = sched_of(p, rank);
  scale_rows(p, rank, sv, 0, sv.offsets[p->num_local_experts], grid_warps(), lane_id());
}

// combine_push: every receive row of the turn pushed to its token owner, then kFlagCombine on every peer.
template <int kVec>
__global__ void MOK_MOVER_BOUNDS combine_push(const CommParams* p) {
  const int rank = rank_of(p);
  const SchedView sv = sched_of(p, rank);
  const TurnRows t = turn_rows(p, sv);
  push_result_rows<kVec>(p, rank, sv, t.lo, t.hi, t.lo, grid_warps(), lane_id());
  signal_when_last(p, rank, kOpCombinePush, kFlagCombine);
}

// combine_pull: the token owner pulls every slot (of the turn), after a wait_peers(kFlagReady) launch (every
// expert owner's result rows are written).
template <int kVec>
__global__ void MOK_MOVER_BOUNDS combine_pull(const CommParams* p) {
  const int rank = rank_of(p);
  pull_result_rows<kVec>(p, rank, 0, p->num_tokens * p->top_k, grid_warps(), lane_id());
}

// weighted_sum over all of [N, H], and the check that every slot of mine got a result (a slot
// whose expert owner overflowed has recv_row < 0: kErrCapacity / kOpWeightedSum in my record, see
// report_unplaced_slots; the sum runs anyway). Body: common.cuh sum_checking_slots, shared with
// token.cuh weighted_sum_bf16.
__global__ void __launch_bounds__(kCommThreads) weighted_sum(const CommParams* p) {
  const int rank = rank_of(p);
  sum_checking_slots(p, rank,
                     [&](Workers threads) { weighted_sum_part(p, rank, 0, p->num_tokens * p->hidden, threads); });
}

}  // namespace mok
