// Communication kernels of one MoE round: routing all-gather, the MoK pull schedule built on the
// device, dispatch (pull | push), a stand-in expert, combine (push | pull), weighted sum.
//
// Legend: N tokens/rank, H hidden, K top-k, R ranks, E experts, El = E/R local experts,
//         C receive capacity (rows), W ranks driven by one launch (virtual ranks; 1 with NVSHMEM).
// Every kernel runs rank = rank_base + blockIdx.y; all symmetric buffers come as peer tables
// (u64 [R] addresses), so one source serves NVSHMEM (one rank per process) and virtual ranks
// (W ranks as slices of one allocation, one launch). Nothing here reads back to the host: counts
// live in device memory, the epoch is a device counter, and every wait is bounded.
//
// Producer/consumer contract of a round (epoch = state[0], raised by begin_round):
//   allgather_routing --kFlagRouting--> build_schedule --kFlagMap--> dispatch_push, (combine_pull)
//   dispatch_push --kFlagDispatch--> wait_peers (then expert_scale) --kFlagReady--> combine_pull
//   combine_push --kFlagCombine--> wait_peers (then weighted_sum)
// A push's receiver waits in its own wait_peers launch, so a timed push stage includes its
// completion wait, as a pull does. A kernel only ever waits for flags raised by EARLIER launches
// (or other processes), so no launch needs its own blocks to be co-resident to make progress.
#pragma once
#include "common.cuh"

namespace mok {

enum FlagKind : int { kFlagRouting = 0, kFlagMap = 1, kFlagDispatch = 2, kFlagReady = 3, kFlagCombine = 4,
                      kNumFlagKinds = 5 };
enum Op : int { kOpRouting = 0, kOpSchedule = 1, kOpDispatchPull = 2, kOpDispatchPush = 3, kOpExpert = 4,
                kOpCombinePush = 5, kOpCombinePull = 6, kOpWeightedSum = 7, kNumOps = 8 };

// Every field is 8 bytes; the order is mirrored by PARAM_FIELDS in mok_proto/kernels/comm.py
// (a CPU test compares the two lists).
struct CommParams {
  i64 num_ranks;          // R
  i64 rank_base;          // rank of blockIdx.y == 0
  i64 num_tokens;         // N
  i64 top_k;              // K
  i64 num_experts;        // E
  i64 num_local_experts;  // El
  i64 row_words;          // row size in 4-byte words (H * sizeof(elem) / 4)
  i64 hidden;             // H (elements)
  i64 capacity;           // C
  i64 align;              // expert segments start at multiples of align
  i64 timeout_ns;         // every wait gives up after this
  const u64* topk_idx;    // int32 [N, K]           (local input)
  const u64* topk_w;      // float [N, K]           (local input)
  const u64* routing;     // int32 [R, N*K]         (all-gather target)
  const u64* x;           // rows  [N, H]           (dispatch source)
  const u64* recv;        // rows  [C, H]           (expert side in)
  const u64* y;           // rows  [C, H]           (expert side out)
  const u64* slots;       // rows  [N*K, H]         (token side in)
  const u64* base;        // float [N, H]           (shared-expert output; zeros without one)
  const u64* out;         // float [N, H]
  const u64* dst_slot;    // int32 [N*K]            (written by the expert owners: the combine map)
  const u64* sched;       // int32 [El+1 | El | C | C] offsets, counts, src_rank, src_slot
  const u64* flags;       // u64   [kNumFlagKinds, R]
  const u64* state;       // u64   [1 + kNumOps]    epoch, then last-block counters
  const u64* scale;       // float [E]              stand-in expert: y = scale[e] * x
  ErrorRecord* error;     // this process's error record
};

struct SchedView {
  int* offsets;   // [El + 1]
  int* counts;    // [El]
  int* src_rank;  // [C]
  int* src_slot;  // [C]
};

__device__ __forceinline__ int rank_of(const CommParams* p) { return static_cast<int>(p->rank_base) + blockIdx.y; }
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
__device__ __forceinline__ int global_warp() { return (blockIdx.x * blockDim.x + threadIdx.x) >> 5; }
__device__ __forceinline__ int num_warps() { return (gridDim.x * blockDim.x) >> 5; }
__device__ __forceinline__ char* row_ptr(const u64* table, int rank, i64 row, i64 row_words) {
  return at<char>(table, rank) + row * row_words * 4;
}
// Token side, one warp per source slot s of mine: f(s, expert owner, receive slot there or -1).
template <typename F>
__device__ __forceinline__ void for_my_slots(const CommParams* p, int rank, F f) {
  const int* topk_idx = at<int>(p->topk_idx, rank);
  const int* dst_slot = at<int>(p->dst_slot, rank);
  const int el = static_cast<int>(p->num_local_experts);
  for (i64 s = global_warp(); s < p->num_tokens * p->top_k; s += num_warps()) f(s, topk_idx[s] / el, dst_slot[s]);
}
// The whole block waits until every peer raised flag `kind` for this round (see block_wait_all).
__device__ __forceinline__ bool wait_all_peers(const CommParams* p, int rank, int kind, int op) {
  return block_wait_all(my_flags(p, rank, kind), static_cast<int>(p->num_ranks), epoch_of(p, rank), p->timeout_ns,
                        p->error, op, rank);
}

// ---------------------------------------------------------------------------------------------
// begin_round: epoch += 1 for each launch-rank.  grid (1, W), block 32.
// ---------------------------------------------------------------------------------------------
__global__ void begin_round(const CommParams* p) {
  if (threadIdx.x == 0) at<u64>(p->state, rank_of(p))[0] += 1;
}

// ---------------------------------------------------------------------------------------------
// wait_peers: the receiver side of a push: wait until every peer raised flag `kind` this round.
// grid (1, W), block 128. Later launches in the stream see the peers' rows.
// ---------------------------------------------------------------------------------------------
__global__ void wait_peers(const CommParams* p, int kind, int op) {
  wait_all_peers(p, rank_of(p), kind, op);
}

// ---------------------------------------------------------------------------------------------
// allgather_routing: my topk_idx [N*K] into routing[my rank] of every peer, then kFlagRouting.
// Moves R * N*K * 4 bytes per rank.  grid (nb, W).
// NOTE: x must be in its symmetric buffer before this launch: the routing flag also publishes x.
// ---------------------------------------------------------------------------------------------
__global__ void allgather_routing(const CommParams* p) {
  const int rank = rank_of(p);
  const i64 nk = p->num_tokens * p->top_k, total = p->num_ranks * nk;
  const int* src = at<int>(p->topk_idx, rank);
  for (i64 i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int peer = static_cast<int>(i / nk);
    const i64 s = i - peer * nk;
    at<int>(p->routing, peer)[rank * nk + s] = src[s];
  }
  if (last_block(counter_of(p, rank, kOpRouting)))
    signal_all(p->flags, kFlagRouting, static_cast<int>(p->num_ranks), rank, epoch_of(p, rank));
}

// ---------------------------------------------------------------------------------------------
// build_schedule: the MoK placement on this (expert-owning) rank, bit-identical to
// mok_proto/schedule.py:
//   M[l,r] pairs of source rank r for local expert l; segment l starts at offsets[l] (multiple of
//   align); the o-th pair (in source-slot order) of (l, r) goes to
//   offsets[l] + sum_r' min(M[l,r'], o) + |{r' < r : M[l,r'] > o}|.
// Also writes dst_slot[s] on every source rank (the combine/push map), then kFlagMap.
// grid (1, W), block 1024, dynamic smem 2 * El * R ints. Reads R*N*K*4 bytes twice; the slot
// formula costs O(R) per pair (fine for R <= 72; a multi-block version is future work).
// On overflow (rows > C) it reports kErrCapacity, places nothing (dst_slot = -1) and the round
// runs on (a capacity error stops no wait), so every peer still gets its signals and none hangs;
// the host raises CapacityError.
// ---------------------------------------------------------------------------------------------
__global__ void build_schedule(const CommParams* p) {
  extern __shared__ int smem[];
  __shared__ int s_fits;
  const int rank = rank_of(p);
  const int num_ranks = static_cast<int>(p->num_ranks), el = static_cast<int>(p->num_local_experts);
  const i64 nk = p->num_tokens * p->top_k;
  const u64 epoch = epoch_of(p, rank);
  int* counts = smem;             // [El * R]  M[l, r] at l * R + r
  int* cursor = smem + el * num_ranks;  // [El * R]  pairs of (l, r) placed so far
  if (!wait_all_peers(p, rank, kFlagRouting, kOpSchedule))
    return;
  for (int i = threadIdx.x; i < el * num_ranks; i += blockDim.x) counts[i] = cursor[i] = 0;
  __syncthreads();

  // 1. Count pairs per (local expert, source rank).
  const int* routing = at<int>(p->routing, rank);  // [R, N*K]
  const int first_expert = rank * el;
  for (i64 i = threadIdx.x; i < num_ranks * nk; i += blockDim.x) {
    const int l = routing[i] - first_expert;
    if (l >= 0 && l < el) atomicAdd(&counts[l * num_ranks + static_cast<int>(i / nk)], 1);
  }
  __syncthreads();

  // 2. Segment offsets (padded to align) and the capacity check.
  const SchedView sv = sched_of(p, rank);
  if (threadIdx.x == 0) {
    i64 offset = 0;
    for (int l = 0; l < el; ++l) {
      int total = 0;
      for (int r = 0; r < num_ranks; ++r) total += counts[l * num_ranks + r];
      sv.offsets[l] = static_cast<int>(offset);
      sv.counts[l] = total;
      offset += (total + p->align - 1) / p->align * p->align;
    }
    s_fits = offset <= p->capacity;
    sv.offsets[el] = s_fits ? static_cast<int>(offset) : 0;
    if (!s_fits) {
      for (int l = 0; l < el; ++l) sv.offsets[l] = sv.counts[l] = 0;
      report_error(p->error, kErrCapacity, kOpSchedule, rank, offset, p->capacity, 0);
    }
  }
  __syncthreads();
  const bool fits = s_fits != 0;

  // 3. Place every pair. One warp walks one source rank's slots in order, so o (the pair's index
  //    within its (l, r)) is deterministic: lanes with the same expert rank themselves by lane.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int r = warp; r < num_ranks; r += warps) {
    const int* src = routing + r * nk;
    int* peer_dst_slot = at<int>(p->dst_slot, r);
    for (i64 chunk = 0; chunk < nk; chunk += 32) {
      const i64 s = chunk + lane;
      const int l = s < nk ? src[s] - first_expert : -1;
      const bool mine = l >= 0 && l < el;
      const unsigned int same = __match_any_sync(0xffffffffu, mine ? l : -1);
      const int before = __popc(same & ((1u << lane) - 1u));
      const int o = mine ? cursor[l * num_ranks + r] + before : 0;
      __syncwarp();
      if (mine && before == 0) cursor[l * num_ranks + r] += __popc(same);
      __syncwarp();
      if (!mine) continue;
      int slot = -1;
      if (fits) {
        const int* m = counts + l * num_ranks;
        slot = sv.offsets[l];
        for (int q = 0; q < num_ranks; ++q) slot += min(m[q], o) + ((q < r && m[q] > o) ? 1 : 0);
        sv.src_rank[slot] = r;
        sv.src_slot[slot] = static_cast<int>(s);
      }
      peer_dst_slot[s] = slot;
    }
  }
  // 4. Padding rows hold -1.
  if (fits) {
    for (int l = 0; l < el; ++l)
      for (int i = sv.offsets[l] + sv.counts[l] + threadIdx.x; i < sv.offsets[l + 1]; i += blockDim.x)
        sv.src_rank[i] = sv.src_slot[i] = -1;
  }
  __syncthreads();
  signal_all(p->flags, kFlagMap, num_ranks, rank, epoch);
}

// ---------------------------------------------------------------------------------------------
// dispatch_pull: recv[i] <- x[src_slot[i] / K] on rank src_rank[i] (padding rows zeroed).
// The expert owner waits only for its own loads.  Moves num_slots * H * elem bytes.  grid (nb, W).
// ---------------------------------------------------------------------------------------------
template <int kVec>
__global__ void dispatch_pull(const CommParams* p) {
  const int rank = rank_of(p), lane = threadIdx.x & 31;
  const SchedView sv = sched_of(p, rank);
  const int num_slots = sv.offsets[p->num_local_experts];
  for (int i = global_warp(); i < num_slots; i += num_warps()) {
    const int src = sv.src_rank[i];
    char* dst = row_ptr(p->recv, rank, i, p->row_words);
    if (src < 0)
      warp_zero_row(dst, static_cast<int>(p->row_words), lane);
    else
      warp_copy_row<kVec>(dst, row_ptr(p->x, src, sv.src_slot[i] / p->top_k, p->row_words),
                          static_cast<int>(p->row_words), lane);
  }
}

// ---------------------------------------------------------------------------------------------
// dispatch_push: every token owner stores x[s / K] into recv[dst_slot[s]] of the expert owner,
// then raises kFlagDispatch on every peer (the consumer waits for all R).  grid (nb, W).
// ---------------------------------------------------------------------------------------------
template <int kVec>
__global__ void dispatch_push(const CommParams* p) {
  const int rank = rank_of(p), lane = threadIdx.x & 31;
  if (!wait_all_peers(p, rank, kFlagMap, kOpDispatchPush)) return;
  for_my_slots(p, rank, [&](i64 s, int owner, int slot) {
    if (slot < 0) return;  // owner overflowed: reported there
    warp_copy_row<kVec>(row_ptr(p->recv, owner, slot, p->row_words), row_ptr(p->x, rank, s / p->top_k, p->row_words),
                        static_cast<int>(p->row_words), lane);
  });
  if (last_block(counter_of(p, rank, kOpDispatchPush)))
    signal_all(p->flags, kFlagDispatch, static_cast<int>(p->num_ranks), rank, epoch_of(p, rank));
}

// ---------------------------------------------------------------------------------------------
// expert_scale (stand-in for the expert FFN): y[i] = scale[expert of row i] * recv[i], padding 0.
// One warp per row. signal_ready: raise kFlagReady on every peer when done (pull combine).
// grid (nb, W).
// ---------------------------------------------------------------------------------------------
__global__ void expert_scale(const CommParams* p, int signal_ready) {
  const int rank = rank_of(p), lane = threadIdx.x & 31, el = static_cast<int>(p->num_local_experts);
  const SchedView sv = sched_of(p, rank);
  const int num_slots = sv.offsets[el];
  const float* scale = at<float>(p->scale, rank) + rank * el;
  const i64 hidden = p->hidden;
  for (int row = global_warp(); row < num_slots; row += num_warps()) {
    int l = 0;  // expert of this row: last l with offsets[l] <= row
    while (l + 1 < el && sv.offsets[l + 1] <= row) ++l;
    const bool real = sv.src_rank[row] >= 0;
    const float* in = at<float>(p->recv, rank) + row * hidden;
    float* out = at<float>(p->y, rank) + row * hidden;
    for (i64 h = lane; h < hidden; h += 32) out[h] = real ? __fmul_rn(in[h], scale[l]) : 0.0f;
  }
  if (signal_ready && last_block(counter_of(p, rank, kOpExpert)))
    signal_all(p->flags, kFlagReady, static_cast<int>(p->num_ranks), rank, epoch_of(p, rank));
}

// ---------------------------------------------------------------------------------------------
// combine_push: the expert owner stores y[i] into slots[src_slot[i]] of token owner src_rank[i],
// then raises kFlagCombine on every peer.  grid (nb, W).
// ---------------------------------------------------------------------------------------------
template <int kVec>
__global__ void combine_push(const CommParams* p) {
  const int rank = rank_of(p), lane = threadIdx.x & 31, num_ranks = static_cast<int>(p->num_ranks);
  const SchedView sv = sched_of(p, rank);
  const int num_slots = sv.offsets[p->num_local_experts];
  for (int i = global_warp(); i < num_slots; i += num_warps()) {
    const int dst = sv.src_rank[i];
    if (dst < 0) continue;
    warp_copy_row<kVec>(row_ptr(p->slots, dst, sv.src_slot[i], p->row_words), row_ptr(p->y, rank, i, p->row_words),
                        static_cast<int>(p->row_words), lane);
  }
  if (last_block(counter_of(p, rank, kOpCombinePush)))
    signal_all(p->flags, kFlagCombine, num_ranks, rank, epoch_of(p, rank));
}

// ---------------------------------------------------------------------------------------------
// combine_pull: the token owner waits for kFlagReady from all R, then loads
// slots[s] <- y[dst_slot[s]] of the expert owner.  grid (nb, W).
// ---------------------------------------------------------------------------------------------
template <int kVec>
__global__ void combine_pull(const CommParams* p) {
  const int rank = rank_of(p), lane = threadIdx.x & 31;
  if (!wait_all_peers(p, rank, kFlagReady, kOpCombinePull)) return;
  for_my_slots(p, rank, [&](i64 s, int owner, int slot) {
    char* dst = row_ptr(p->slots, rank, s, p->row_words);
    if (slot < 0)
      warp_zero_row(dst, static_cast<int>(p->row_words), lane);
    else
      warp_copy_row<kVec>(dst, row_ptr(p->y, owner, slot, p->row_words), static_cast<int>(p->row_words), lane);
  });
}

// ---------------------------------------------------------------------------------------------
// weighted_sum: out[t] = base[t] + sum_{j=0..K-1} w[t,j] * slots[t*K+j], j in order, each
// product and sum rounded separately (no FMA), exactly as NumPy's reference.weighted_sum.
// grid (nb, W).
// ---------------------------------------------------------------------------------------------
__global__ void weighted_sum(const CommParams* p) {
  const int rank = rank_of(p);
  const i64 hidden = p->hidden, top_k = p->top_k;
  const float* base = at<float>(p->base, rank);
  const float* w = at<float>(p->topk_w, rank);
  const float* slots = at<float>(p->slots, rank);
  float* out = at<float>(p->out, rank);
  for (i64 i = blockIdx.x * blockDim.x + threadIdx.x; i < p->num_tokens * hidden; i += gridDim.x * blockDim.x) {
    const i64 t = i / hidden, h = i - t * hidden;
    float acc = base[i];
    for (i64 j = 0; j < top_k; ++j)
      acc = __fadd_rn(acc, __fmul_rn(w[t * top_k + j], slots[(t * top_k + j) * hidden + h]));
    out[i] = acc;
  }
}

}  // namespace mok
