// Shared device helpers: error records, system-scope flags with bounded waits, work shares
// (Workers, grid_threads, ...), peer tables, the weighted sums' slot check (sum_checking_slots),
// row copies. Header-only; compiled at run time by NVRTC (CuPy RawModule) and by nvcc in the CPU
// compile test. No standard headers: NVRTC may not ship them.
//
// Legend: R ranks (EP degree); `rank` is always an EP rank; W ranks driven by one launch.
#pragma once
#include "abi.cuh"

namespace mok {

// ---------------------------------------------------------------------------------------------
// Error record (struct ErrorRecord, enums ErrorCode and Op: cuda/abi.cuh). One per process (or per
// launch site); the first failure wins; the host (mok_proto/kernels/errors.py) turns it into an
// exception naming the operator from the one Op enum.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ bool has_error(const ErrorRecord* err) {
  return *reinterpret_cast<const volatile u64*>(&err->code) != 0;
}

// A timed-out wait poisons the round: later waits in this process give up at once. A capacity
// error does not: the round runs on (placing nothing) so every peer still gets its signals.
__device__ __forceinline__ bool has_timeout(const ErrorRecord* err) {
  return *reinterpret_cast<const volatile u64*>(&err->code) == kErrTimeout;
}

// The first report in the record wins; later ones are dropped. `detail`: see ErrorRecord.
__device__ __forceinline__ void report_error(ErrorRecord* err, int code, int op, int rank, i64 peer,
                                             i64 expected, i64 seen, i64 detail = -1) {
  if (atomicCAS(&err->code, 0ull, static_cast<u64>(code)) == 0ull) {
    err->op = op; err->rank = rank; err->peer = peer; err->expected = expected; err->seen = seen;
    err->block = blockIdx.x; err->thread = threadIdx.x; err->detail = detail;
    __threadfence_system();
  }
}

// A share of some work: the caller is worker `id` of `count` (threads or warps, as the building
// block says); it takes items begin + id, begin + id + count, ... below end.
struct Workers {
  int id, count;
};

// ---------------------------------------------------------------------------------------------
// Flags: u64 epochs that only grow. Release/acquire at system scope (peers may be other processes).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ u64 globaltimer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// One thread waits until *flag >= epoch. False (and an error record) after timeout_ns, or at once
// if another wait in this process already timed out (so a failure never cascades into more waits).
__device__ __forceinline__ bool wait_flag(const u64* flag, u64 epoch, u64 timeout_ns, ErrorRecord* err,
                                          int op, int rank, int peer) {
  const u64 start = globaltimer_ns();
  for (;;) {
    const u64 seen = ld_acquire_sys(flag);
    if (seen >= epoch) return true;
    if (has_timeout(err)) return false;
    if (globaltimer_ns() - start > timeout_ns) {
      report_error(err, kErrTimeout, op, rank, peer, static_cast<i64>(epoch), static_cast<i64>(seen));
      return false;
    }
    __nanosleep(256);
  }
}

// The whole block waits for flags[src] >= epoch for every src < num_ranks (thread src waits for
// src). Returns the same verdict in every thread.
// NOTE: each waiting thread's acquire + the barrier order the peers' data before our reads.
__device__ __forceinline__ bool block_wait_all(const u64* flags, int num_ranks, u64 epoch, u64 timeout_ns,
                                               ErrorRecord* err, int op, int rank) {
  bool ok = true;
  for (int src = threadIdx.x; src < num_ranks; src += blockDim.x)
    ok = ok && wait_flag(flags + src, epoch, timeout_ns, err, op, rank, src);
  return __syncthreads_and(ok) != 0;
}

// True in every thread of exactly one block per launch-rank: the last to finish.
// NOTE: each block fences its own (possibly remote) stores before it counts itself, and the last
// block fences again before it signals, so a peer that sees the signal sees every block's rows.
// The counter resets itself, so the next launch starts from zero (the launch is stream-ordered).
__device__ __forceinline__ bool last_block(unsigned int* counter) {
  __shared__ int is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    const unsigned int prev = atomicAdd(counter, 1u);
    is_last = (prev == gridDim.x - 1);
    if (is_last) {
      atomicExch(counter, 0u);
      __threadfence_system();
    }
  }
  __syncthreads();
  return is_last != 0;
}

// Raise flags[kind][rank] = epoch on every peer (the caller's threads, one peer each: a standalone
// kernel's block_threads(), or one thread of the fused kernel).
__device__ __forceinline__ void signal_all(const u64* flag_table, int kind, int num_ranks, int rank, u64 epoch,
                                           Workers threads) {
  for (int peer = threads.id; peer < num_ranks; peer += threads.count) {
    u64* flags = reinterpret_cast<u64*>(flag_table[peer]);
    __threadfence_system();
    st_release_sys(flags + static_cast<i64>(kind) * num_ranks + rank, epoch);
  }
}

// ---------------------------------------------------------------------------------------------
// Work shares, peer tables and row copies
// ---------------------------------------------------------------------------------------------
// The caller's share in a standalone kernel, whose blocks (per launch rank: blockIdx.x of
// gridDim.x) split all the work between them (grid_*) or whose block does it all (block_*).
// Only kernel bodies (and helpers that serve only them, as sum_checking_slots) call these:
// building blocks take their Workers from the caller, so a persistent kernel can give them any
// split of its blocks.
__device__ __forceinline__ Workers grid_threads() {
  return {static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x), static_cast<int>(gridDim.x * blockDim.x)};
}
__device__ __forceinline__ Workers grid_warps() {
  return {static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) >> 5), static_cast<int>((gridDim.x * blockDim.x) >> 5)};
}
__device__ __forceinline__ Workers block_threads() {
  return {static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)};
}
__device__ __forceinline__ Workers block_warps() {
  return {static_cast<int>(threadIdx.x >> 5), static_cast<int>(blockDim.x >> 5)};
}

// A symmetric buffer is passed as a table of num_ranks addresses (as seen by this process).
template <typename T>
__device__ __forceinline__ T* at(const u64* table, int rank) {
  return reinterpret_cast<T*>(table[rank]);
}

// ---------------------------------------------------------------------------------------------
// Slots without an expert result (the token owner, after the combine). An expert owner whose
// receive buffer overflows places nothing: its schedule reports kErrCapacity in ITS record and
// writes recv_row[s] = -1 on the token owner for every slot s routed to it (comm.cuh
// schedule_place; a slot whose owner fits always gets a row >= 0, so -1 means exactly this). The
// round runs on, so every peer gets its signals, but those slots' rows are never written. With
// virtual ranks the record is shared and already holds the schedule's report; under NVSHMEM the
// token owner has a record of its own, so the weighted sum (the forward's last kernel) checks
// its slots and reports the overflow there too (kOpWeightedSum): every rank that routed a slot
// there raises (one that routed none has no slot to find).
// ---------------------------------------------------------------------------------------------
// Whether slot s has no receive row on its expert owner, for any s of [begin, end) in this
// thread's share. `first`: recv_row[begin + threads.id] loaded earlier (0 if past end), so that
// its latency hides behind the caller's work (the weighted sum issues it before the sum).
__device__ __forceinline__ bool any_slot_unplaced(const int* recv_row, int first, i64 begin, i64 end,
                                                  Workers threads) {
  bool unplaced = first < 0;
  for (i64 s = begin + threads.id + threads.count; s < end; s += threads.count) unplaced = unplaced || recv_row[s] < 0;
  return unplaced;
}

// The whole block, once (every thread must call it: it has barriers): `unplaced` is this thread's
// any_slot_unplaced. If any thread of the block saw such a slot and the record is still clear,
// the block counts every slot of [0, num_slots) without a receive row and reports kErrCapacity /
// kOpWeightedSum: rank = this (token-owning) rank, peer = the lowest expert-owning rank among
// those slots (topk_idx[s] / num_local_experts), expected = num_slots, seen = their count. Every
// block that reports writes the same fields (the first wins). Nothing is skipped: the caller's
// rows are computed as usual. Cost when every slot has a row: one barrier per block.
__device__ __forceinline__ void report_unplaced_slots(const int* recv_row, const int* topk_idx, i64 num_slots,
                                                      int num_local_experts, ErrorRecord* err, int rank,
                                                      bool unplaced) {
  __shared__ int s_count, s_owner;
  if (!__syncthreads_or(unplaced)) return;
  if (__syncthreads_or(threadIdx.x == 0 && has_error(err))) return;  // reported already (this or an earlier kernel)
  if (threadIdx.x == 0) {
    s_count = 0;
    s_owner = 0x7fffffff;
  }
  __syncthreads();
  int count = 0, owner = 0x7fffffff;
  for (i64 s = threadIdx.x; s < num_slots; s += blockDim.x) {
    if (recv_row[s] >= 0) continue;
    ++count;
    owner = min(owner, topk_idx[s] / num_local_experts);
  }
  if (count > 0) {
    atomicAdd(&s_count, count);
    atomicMin(&s_owner, owner);
  }
  __syncthreads();
  if (threadIdx.x == 0 && s_count > 0)
    report_error(err, kErrCapacity, kOpWeightedSum, rank, s_owner, num_slots, s_count);
}

// A weighted sum kernel's body (comm.cuh weighted_sum, token.cuh weighted_sum_bf16): `sum(threads)`
// with threads = grid_threads(), then the check that each of rank's N*K slots got a result
// (any_slot_unplaced over this thread's share of the slots, then report_unplaced_slots), its
// first recv_row load issued before the sum. Params: CommParams or TokenParams (read: recv_row,
// num_tokens, top_k before the sum; topk_idx, num_local_experts, error after it). Every thread of
// every block must call it (the report has barriers).
template <class Params, class Sum>
__device__ __forceinline__ void sum_checking_slots(const Params* p, int rank, Sum sum) {
  const int* recv_row = at<const int>(p->recv_row, rank);
  const i64 num_slots = p->num_tokens * p->top_k;
  const Workers threads = grid_threads();
  const int first = threads.id < num_slots ? recv_row[threads.id] : 0;
  sum(threads);
  report_unplaced_slots(recv_row, at<const int>(p->topk_idx, rank), num_slots, static_cast<int>(p->num_local_experts),
                        p->error, rank, any_slot_unplaced(recv_row, first, 0, num_slots, threads));
}

// One warp copies one row of `bytes` bytes with kVec-byte accesses: kVec = 16 (rows and buffers
// 16-byte aligned: bytes % 16 == 0) or kVec = 2 (any even row size: bf16 rows of odd H). With
// 16-byte accesses each lane has kUnroll loads in flight before it stores them (a warp alone on
// a row is latency-bound: the fused kernel's spare warps take 16, its communicating CTAs 8; the
// copy kernels, whose grids fill the GPU with warps, take 1).
template <int kVec, int kUnroll = 1>
__device__ __forceinline__ void warp_copy_row(void* dst, const void* src, i64 bytes, int lane) {
  static_assert(kVec == 16 || kVec == 2, "rows move in 16-byte or 2-byte accesses");
  static_assert(kVec == 16 || kUnroll == 1, "2-byte copies are not unrolled");
  if constexpr (kVec == 16) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    const i64 n = bytes / 16;
    for (i64 base = 0; base < n; base += 32 * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const i64 i = base + u * 32 + lane;
        v[u] = i < n ? s[i] : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const i64 i = base + u * 32 + lane;
        if (i < n) d[i] = v[u];
      }
    }
  } else {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(src);
    unsigned short* d = reinterpret_cast<unsigned short*>(dst);
    for (i64 i = lane; i < bytes / 2; i += 32) d[i] = s[i];
  }
}

// One warp zeroes one row (kVec as for warp_copy_row).
template <int kVec>
__device__ __forceinline__ void warp_zero_row(void* dst, i64 bytes, int lane) {
  if constexpr (kVec == 16) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (i64 i = lane; i < bytes / 16; i += 32) d[i] = make_uint4(0, 0, 0, 0);
  } else {
    unsigned short* d = reinterpret_cast<unsigned short*>(dst);
    for (i64 i = lane; i < bytes / 2; i += 32) d[i] = 0;
  }
}

// ---------------------------------------------------------------------------------------------
// The emulated link (kernels built with MOK_LINK; mok_proto/link.py is its host side and model).
// Each rank has a clock per direction (CommParams.link_clock: the link busy until, ns). A warp
// that moves rows reserves their bytes on its rank's clock (one budget per rank and direction,
// shared by every warp that moves that rank's rows), copies them, then sleeps until they are
// done: the reservation's end, and for a pull at least a round trip per batch of loads the warp
// has in flight. A push pays its round trip at its flush: the signal after it (link_signal).
// Without MOK_LINK none of this is compiled into any kernel.
// ---------------------------------------------------------------------------------------------
#ifdef MOK_LINK
constexpr bool kLink = true;
#else
constexpr bool kLink = false;
#endif
enum LinkDirection : int { kLinkIn = 0, kLinkOut = 1 };  // into this rank (pulls), out of it (pushes)

struct Link {
  u64* clock;  // [2] this rank's, by LinkDirection
  i64 fs_per_byte, latency_ns;
  int rank;
  bool every_row;
  // Whether a row between this rank and `peer` (-1: no row moves) crosses the link.
  __device__ __forceinline__ bool pays(int peer) const {
    return fs_per_byte > 0 && peer >= 0 && (every_row || peer != rank);
  }
};

__device__ __forceinline__ Link link_of(const CommParams* p, int rank) {
  return {at<u64>(p->link_clock, rank), p->link_fs_per_byte, p->link_latency_ns, rank, p->link_every_row != 0};
}

// Sleep until %globaltimer reaches t_ns, reading no memory (a stalled load costs its warp no more).
__device__ __forceinline__ void sleep_until(u64 t_ns) {
  for (u64 now = globaltimer_ns(); now < t_ns; now = globaltimer_ns()) {
    const u64 left = t_ns - now;
    __nanosleep(left < 1024 ? static_cast<unsigned>(left) : 1024u);
  }
}

// One thread: `bytes` on direction d from max(now, clock), at the link's rate; returns the
// reservation's end (ns). The max and the add are two atomics: the clock only grows.
__device__ __forceinline__ u64 link_reserve(const Link& l, int d, i64 bytes, u64 now) {
  const u64 dur = static_cast<u64>((bytes * l.fs_per_byte + 500000) / 1000000);
  atomicMax(l.clock + d, now);
  return atomicAdd(l.clock + d, dur) + dur;
}

// The whole warp: its items i = begin + warps.id, + warps.count, ... below end, moved by move(i), where
// peer(i) is the other rank of item i's row (-1: no row). With the link, the paying rows (of
// row_bytes each) are reserved before the copy and the warp sleeps after it until they are done
// (a pull: at least one round trip per kBatch bytes of its loads). Every mover calls this: the
// standalone transfer kernels and the fused kernel's movers see the same link.
template <int kBatch, class Peer, class Move>
__device__ __forceinline__ void linked_rows(const CommParams* p, int rank, int d, i64 begin, i64 end, Workers warps,
                                            int lane, Peer peer, Move move) {
  u64 done = 0;
  if constexpr (kLink) {
    const Link l = link_of(p, rank);
    i64 rows = 0;
    for (i64 i = begin + warps.id + lane * warps.count; i < end; i += 32 * warps.count) rows += l.pays(peer(i)) ? 1 : 0;
    for (int o = 16; o > 0; o >>= 1) rows += __shfl_xor_sync(0xffffffffu, rows, o);
    if (lane == 0 && rows > 0) {
      const u64 now = globaltimer_ns();
      done = link_reserve(l, d, rows * p->row_bytes, now);
      const u64 round_trips = static_cast<u64>(rows * ((p->row_bytes + kBatch - 1) / kBatch));
      if (d == kLinkIn && now + round_trips * l.latency_ns > done) done = now + round_trips * l.latency_ns;
    }
    done = __shfl_sync(0xffffffffu, done, 0);
  }
  for (i64 i = begin + warps.id; i < end; i += warps.count) move(i);
  if constexpr (kLink) sleep_until(done);
}

// Before a signal that tells peers rows are complete (a push's flush, a flag): one round trip.
__device__ __forceinline__ void link_signal(const CommParams* p) {
  if constexpr (kLink) {
    if (p->link_fs_per_byte > 0) sleep_until(globaltimer_ns() + static_cast<u64>(p->link_latency_ns));
  }
}

// ---------------------------------------------------------------------------------------------
// bf16 (stored as 16-bit integers; no cuda_bf16.h so NVRTC needs no toolkit headers)
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {  // round to nearest even
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }

// Eight bf16 (16 bytes) <-> eight floats.
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

}  // namespace mok
