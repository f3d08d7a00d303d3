// The fused kernels' synchronization (included by fused.cuh, read that first): the roles'
// context (Ctx), the ready counters' waits and signals (local counters and the remote ones kept
// as peer flags), the timeline's records, and the pool's claims and tickets.
#pragma once
#include "comm.cuh"
#include "gemm_fp8.cuh"

namespace mok {
namespace fused {

using gemm::GemmParams;
using gemm::SharedStorage;
using plan::Counter;
using plan::Task;

__device__ __forceinline__ u32 ld_acquire_gpu(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ u32 ld_relaxed_gpu(const u32* p) {
  u32 v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// With a relaxed load that saw the releasing write before it: an acquire (PTX memory model, the
// acquire pattern "strong read, then fence.acq_rel").
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ void red_release_add(u32* p) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(p) : "memory");
}

// This thread's generic-proxy global writes, ordered before later async-proxy (TMA) accesses.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

__device__ __forceinline__ int sm_id() {
  int r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return r;
}

// What every role of a CTA needs: the launch, its rank's counters, GEMMs and trace.
struct Ctx {
  const FusedParams* fp;
  const CommParams* cp;
  const TokenParams* tp;   // the token-side tasks' buffers (scale, slot sum; nullptr: the plan has none)
  const GemmParams* gemm;  // this launch rank's kFusedGemms
  const gemm_fp8::Fp8GemmParams* fp8;  // fused_forward_fp8: ... and its routed slots' FP8 GEMMs (else nullptr)
  const fp8::QuantParams* quant;  // fused_forward_fp8 with the dispatch inside: recv -> xq, xq_s (else nullptr)
  const CommParams* codes;        // ... with fp8 dispatch inside: the codes' and the scales' rows (else nullptr)
  const CommParams* scales;
  const Task* tasks;
  const Counter* info;  // the plan's counters (kind, target, remote): read for remote counters only
  int first_remote;     // counters first_remote .. are the remote ones (plan/core.py numbers them last)
  u32* counters;
  TraceRecord* trace;  // nullptr: no timeline
  int rank;            // EP rank
  int pass;            // 0: forward, 1: backward
};

// A *remote* counter (mok_proto/plan/: raised by the tasks of every rank; its target counts R signals per
// signalling task) is kept as the round's peer flags: each rank counts its own signals in its
// counter, and the signal that completes its share (target / R) raises the counter's flag on
// every peer (flags[kind][rank] = the round's epoch, as raise_flag does after a standalone launch);
// a wait on it waits for every peer's flag. The kernel knows two remote counters (the host refuses
// a plan with another: kernels/fused.py), each as the flag its standalone launches raise:
//   SLOTS_ARRIVED: every peer's outgoing push into my slots is complete  -> kFlagCombine
//   PUBLISHED:     every peer's rows that I pull are written             -> kFlagRouting
// and a wait that times out names the operator that waited (SymmTimeoutError).
static_assert(kRemoteCounterKinds == ((1 << plan::kCounterSlotsArrived) | (1 << plan::kCounterPublished)),
              "remote_flag and remote_op know SLOTS_ARRIVED and PUBLISHED: teach them the new remote counter");
__device__ __forceinline__ int remote_flag(int counter_kind) {
  return counter_kind == plan::kCounterSlotsArrived ? kFlagCombine : kFlagRouting;
}
__device__ __forceinline__ int remote_op(int counter_kind, int pass) {
  if (counter_kind == plan::kCounterSlotsArrived) return pass == 0 ? kOpCombinePush : kOpRevDispatchPush;
  return pass == 0 ? kOpDispatchPull : kOpRevCombinePull;
}

// One thread: wait until each counter of task `index` reaches its target (wait_task: wait_local,
// and for a remote counter wait_peers_flag). False (and an error record naming the counter, its
// target and the task, or the peer) after the timeout, or at once once any error is recorded (the
// kernel then winds down: later tasks move and load nothing).
// The spin reads relaxed, backing off from kSpinMinNs to kSpinMaxNs between reads, and acquires
// once (fence) when the target is seen: an acquire on every read, by the spare warps of every
// compute CTA waiting for most of the kernel, slows the GEMM tiles beside them (docs/LOG.md).
constexpr unsigned kSpinMinNs = 64, kSpinMaxNs = 1024;

// One thread spins until seen() >= target (relaxed reads, backing off): true, or false once an
// error is recorded or after timeout_ns (then `seen_last` is the last value read).
template <typename Seen>
__device__ __forceinline__ bool spin_until(const Ctx& c, Seen seen, u64 target, u64 timeout_ns, u64& seen_last) {
  const u64 start = globaltimer_ns();
  for (unsigned sleep_ns = kSpinMinNs;; sleep_ns = min(2 * sleep_ns, kSpinMaxNs)) {
    seen_last = seen();
    if (seen_last >= target) return true;
    if (has_error(c.fp->error) || globaltimer_ns() - start > timeout_ns) return false;
    __nanosleep(sleep_ns);
  }
}

__device__ __forceinline__ u64 ld_relaxed_sys(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// One thread: this rank's counter `id` reaches `target` (then an acquire). Not in time:
// kErrTimeout naming kOpFusedWait, the counter, its target, the value seen and task `index` (a
// wait on this kernel's own work: KernelTimeoutError). It gives up after kFusedLocalTimeoutFactor
// (abi.cuh) x the timeout of a wait on a peer's flag: when a peer is missing, the tasks that wait
// here for its rows started waiting about when the task that waits for its flag did, and the
// peer's timeout (SymmTimeoutError, naming it) must be the error reported; they then see it and
// stop.
__device__ __forceinline__ bool wait_local(const Ctx& c, int id, u32 target, int index) {
  const u32* counter = c.counters + id;
  if (ld_acquire_gpu(counter) >= target) return true;
  u64 seen = 0;
  const u64 timeout_ns = kFusedLocalTimeoutFactor * static_cast<u64>(c.fp->timeout_ns);
  if (!spin_until(c, [&] { return static_cast<u64>(ld_relaxed_gpu(counter)); }, target, timeout_ns, seen)) {
    if (!has_error(c.fp->error)) report_error(c.fp->error, kErrTimeout, kOpFusedWait, c.rank, id, target, seen, index);
    return false;
  }
  fence_acq_rel_gpu();
  return true;
}

// One thread, remote counter `id` after this rank's own share of it (wait_task): every peer's
// flag this round (then an acquire at system scope: the peers' rows are visible). A peer that
// never raises it: kErrTimeout naming remote_op, the peer, the epoch and the flag seen (as the
// standalone wait_peers reports it: SymmTimeoutError).
// NOTE: not common.cuh's wait_flag (an ld.acquire.sys spin with 256 ns sleeps): spins that acquire
// on every read slow the GEMM tiles beside them (see kSpinMinNs), so this one reads relaxed with
// the backoff of spin_until and acquires once.
__device__ __forceinline__ bool wait_peers_flag(const Ctx& c, int id) {
  const u64 epoch = epoch_of(c.cp, c.rank);
  const u64* flags = my_flags(c.cp, c.rank, remote_flag(c.info[id].kind));
  for (int src = 0; src < static_cast<int>(c.cp->num_ranks); ++src) {
    u64 seen = 0;
    const u64 timeout_ns = static_cast<u64>(c.fp->timeout_ns);
    if (!spin_until(c, [&] { return ld_relaxed_sys(flags + src); }, epoch, timeout_ns, seen)) {
      if (!has_error(c.fp->error))
        report_error(c.fp->error, kErrTimeout, remote_op(c.info[id].kind, c.pass), c.rank, src,
                     static_cast<i64>(epoch), static_cast<i64>(seen));
      return false;
    }
  }
  asm volatile("fence.acq_rel.sys;" ::: "memory");
  return true;
}

__device__ __forceinline__ bool wait_task(const Ctx& c, const Task& t, int index) {
  for (int i = 0; i < 2; ++i) {
    const int id = t.wait_counter[i];
    if (id < 0) continue;
    // a remote counter: first this rank's own share of its signals (target / R: what fails there is
    // this kernel's own work), then the peers' flags. Told by its id: a load of c.info[id] in
    // every wait and signal slows the fused forward.
    const bool remote = id >= c.first_remote;
    u32 target = static_cast<u32>(t.wait_target[i]);
    // (an int division: c.cp->num_ranks' 64-bit one makes the movers spill)
    if (remote) target = static_cast<u32>(c.info[id].target / static_cast<int>(c.cp->num_ranks));
    if (!wait_local(c, id, target, index) || (remote && !wait_peers_flag(c, id))) return false;
  }
  return true;
}

// One thread, after the task's rows are stored (and, by the caller's barrier, everyone's): the
// release add orders every write before the barrier (its own and, cumulatively, the other
// threads') before the count (PTX memory model; the pattern of CUTLASS's semaphores), so no
// __threadfence() precedes it (one costs every pass time).
// A remote counter (see remote_flag): an acquire-release add, and the add that completes this
// rank's share raises the flag on every peer (signal_all: a system-scope fence, then a release
// store; the add's acquire ordered every earlier signaller's rows before it).
__device__ __forceinline__ void signal_task(const Ctx& c, const Task& t) {
  for (int i = 0; i < 2; ++i) {
    const int id = t.signal_counter[i];
    if (id < 0) continue;
    if (id < c.first_remote) {
      red_release_add(c.counters + id);
      continue;
    }
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(c.counters + id) : "memory");
    const int num_ranks = static_cast<int>(c.cp->num_ranks);
    if (static_cast<int>(old) + 1 == c.info[id].target / num_ranks) {
      link_signal(c.cp);
      signal_all(c.cp->flags, remote_flag(c.info[id].kind), num_ranks, c.rank, epoch_of(c.cp, c.rank), Workers{0, 1});
    }
  }
}

__device__ __forceinline__ void trace_times(const Ctx& c, int index, i64 start, i64 end) {
  if (!c.trace) return;
  TraceRecord& r = c.trace[index];
  r.start_ns = start;
  r.end_ns = end;
  r.task = index;
  r.sm = sm_id();
  r.block = static_cast<int>(blockIdx.x);
}

// ---------------------------------------------------------------------------------------------
// The pool (plan/core.py: Plan.pool_table, `claim`): the tile pairs no CTA's table holds, claimed at run
// time in order, each by a cluster whose producer issued its own table's GEMM loads (MoK's ticket scheduler,
// over the tail of the global order): the cluster that finishes first takes the next pair. Cluster
// CTA 0's producer lane 0 claims (an add on the plan's CLAIMED counter, this launch rank's) and
// hands each claim to the readers of both CTAs through kTickets shared-memory tickets: it writes
// ticket j % kTickets into both CTAs, then arrives on both CTAs' ticket_full (release, cluster
// scope); the readers (CTA 1's producer lane 0; each CTA's consumers, after agreeing on it) wait
// for it (acquire, cluster scope) and arrive on CTA 0's ticket_empty once they have read it. A
// ticket of -1: no pair left (every reader stops); after an error no ticket is written and the readers
// leave their waits on the recorded error. Each claimed pair then runs as a
// table's does (produce_task, consume_task, same waits and signals), as task Pool::first + 2k + cta.
// ---------------------------------------------------------------------------------------------
constexpr int kTicketReaders = (gemm::kCluster - 1) + gemm::kCluster;  // partner producer lanes 0, CTAs' consumers

// Before gemm_setup (whose fence and cluster barrier publish the inits to the partner).
__device__ __forceinline__ void init_tickets(SharedStorage& ss) {
  for (int q = 0; q < gemm::kTickets; ++q) {
    mbar_init(&ss.ticket_full[q], 1);
    mbar_init(&ss.ticket_empty[q], kTicketReaders);
  }
}

// The pool's tasks: pair k is tasks first + 2k (cta 0) and + 1 (cta 1). (Read when a CTA reaches
// it, not kept in Ctx: two more live registers made ptxas spill more in the consumers.)
struct Pool {
  int first, pairs;
  __device__ __forceinline__ explicit Pool(const Ctx& c)
      : first(reinterpret_cast<const int*>(c.fp->task_begin)[gridDim.x]),
        pairs((static_cast<int>(c.fp->num_tasks) - first) / 2) {}
};

// Claim j of this cluster (CTA 0's producer lane 0): pair k of the pool, or -1 when none is left,
// written to both CTAs' ticket j once every reader returned ticket j - kTickets. After an error
// (ok false, or that wait failed) it writes nothing: a slot may still be unread, and the readers
// leave their waits on the recorded error.
__device__ __forceinline__ int claim_pair(const Ctx& c, SharedStorage& ss, int j, bool ok) {
  const int q = j % gemm::kTickets, parity = (j / gemm::kTickets) & 1;
  const GemmParams* g = c.gemm + kSlotFirst;
  if (!ok || !mbar_wait<true>(&ss.ticket_empty[q], parity ^ 1, g->timeout_ns, c.fp->error, kOpFusedClaim, j))
    return -1;
  int k = static_cast<int>(atomicAdd(c.counters + c.fp->claim_counter, 1u));
  if (k >= Pool(c).pairs) k = -1;
  for (u32 cta = 0; cta < gemm::kCluster; ++cta) {
    st_cluster_u32(&ss.ticket[q], cta, static_cast<u32>(k));
    mbar_arrive_cluster<true>(&ss.ticket_full[q], cta);
  }
  return k;
}

// A reader thread's ticket j: the pair, or -1 (none left, or the wait failed: an error).
__device__ __forceinline__ int read_ticket(const Ctx& c, SharedStorage& ss, int j, bool ok) {
  const int q = j % gemm::kTickets, parity = (j / gemm::kTickets) & 1;
  const GemmParams* g = c.gemm + kSlotFirst;
  if (ok) ok = mbar_wait<true>(&ss.ticket_full[q], parity, g->timeout_ns, c.fp->error, kOpFusedClaim, j);
  return ok ? *reinterpret_cast<volatile int*>(&ss.ticket[q]) : -1;
}

// One arrive per reader on CTA 0's ticket_empty j, after it read ticket j (only after a wait that
// succeeded: an early arrive could free the slot of a ticket another reader has not read).
__device__ __forceinline__ void return_ticket(SharedStorage& ss, int j) {
  mbar_arrive_cluster<true>(&ss.ticket_empty[j % gemm::kTickets], 0);
}

// Every consumer thread of the CTA (both warpgroups): true if `pred` holds for any of them (a
// barrier reduction: wgmma needs the warpgroups to agree on every pair they run).
__device__ __forceinline__ bool consumers_any(bool pred) {
  u32 any;
  asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, %2, 256, p;\nselp.u32 %0, 1, 0, q;\n}\n"
               : "=r"(any)
               : "r"(static_cast<u32>(pred)), "n"(gemm::kConsumersBarrier)
               : "memory");
  return any != 0;
}

}  // namespace fused
}  // namespace mok
