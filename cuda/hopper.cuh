// Hopper (sm_90a) primitives for the GEMM tiles: shared-memory addresses, mbarriers with bounded
// waits, TMA and bulk copies, wgmma descriptors (128-byte swizzle), the m64n256k16 bf16 and
// m64n128k32 e4m3 MMAs, bf16 packing. Header-only, no standard headers (NVRTC).
#pragma once
#include "common.cuh"

namespace mok {

__device__ __forceinline__ u32 smem_addr(const void* p) { return static_cast<u32>(__cvta_generic_to_shared(p)); }

// A kernel's shared storage: the shared memory `raw` (dynamic, or a static array 1024 bytes larger
// than Storage) rounded up to 1024 bytes (TMA's 128B swizzle), by pointer arithmetic on `raw` (not
// through an integer), so that the compiler still knows every access through it is to shared
// memory: 32-bit addresses, none kept in 64 bits.
template <class Storage>
__device__ __forceinline__ Storage& aligned_shared(char* raw) {
  return *reinterpret_cast<Storage*>(raw + ((1024u - (smem_addr(raw) & 1023u)) & 1023u));
}

// ---------------------------------------------------------------------------------------------
// mbarrier
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(u64* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// kCluster: acquire at cluster scope (the phase was completed by a partner CTA's release.cluster
// arrive, whose shared-memory stores the waiter reads next: fused.cuh's claim hand-off); else the
// default, acquire at CTA scope.
template <bool kCluster = false>
__device__ __forceinline__ bool mbar_try_wait(u64* bar, int parity) {
  u32 done;
  if constexpr (kCluster)
    asm volatile(
        "{\n.reg .pred P;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 P, [%1], %2;\n"
        "selp.u32 %0, 1, 0, P;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  else
    asm volatile(
        "{\n.reg .pred P;\nmbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2;\nselp.u32 %0, 1, 0, P;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  return done != 0;
}

// Wait for the phase of `parity` to complete; false (and an error record) after timeout_ns, or
// once another thread has recorded an error. NOTE: the error record and the clock are looked at
// only every kPollNs: reading the record is a slow system-scope load, and a wait that sat behind
// one on every spin notices a completed phase late (the GEMM mainloop slows markedly).
// The report names `op` (an Op) and `detail` (see ErrorRecord), the parity waited for, and the
// reporting block and thread; it has no EP rank or peer (-1).
template <bool kCluster = false>
__device__ __forceinline__ bool mbar_wait(u64* bar, int parity, u64 timeout_ns, ErrorRecord* err, int op,
                                          int detail) {
  constexpr u64 kPollNs = 20000;
  if (mbar_try_wait<kCluster>(bar, parity)) return true;
  const u64 start = globaltimer_ns();
  u64 polled = start;
  while (!mbar_try_wait<kCluster>(bar, parity)) {
    const u64 now = globaltimer_ns();
    if (now - polled < kPollNs) continue;
    polled = now;
    if (has_error(err)) return false;
    if (now - start > timeout_ns) {
      report_error(err, kErrTimeout, op, -1, -1, parity, 0, detail);
      return false;
    }
  }
  return true;
}

// After an error: wait at most `ns` for a phase, reporting nothing (a copy issued before the error
// must land before its CTA leaves; see gemm::drain_loads). kDrainNs: the bound the kernels use (a
// copy in flight lands within microseconds; one that never will must not hold the kernel).
constexpr u64 kDrainNs = 1000000;
__device__ __forceinline__ void mbar_drain(u64* bar, int parity, u64 ns) {
  const u64 start = globaltimer_ns();
  while (!mbar_try_wait(bar, parity) && globaltimer_ns() - start < ns) {
  }
}

// ---------------------------------------------------------------------------------------------
// Thread-block clusters (CTAs of one cluster run on one GPC and can reach each other's shared memory)
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ u32 cluster_ctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ u32 cluster_id_x() {
  u32 r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}
__device__ __forceinline__ u32 num_clusters_x() {
  u32 r;
  asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster; orders shared-memory writes before it (release) with
// reads after it (acquire), cluster-wide.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
// Register budget of the calling warpgroup (every warp of it executes this): the producer
// warpgroup gives registers back, the consumer warpgroups take them (accumulators, epilogue).
template <int kRegs> __device__ __forceinline__ void warpgroup_reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs> __device__ __forceinline__ void warpgroup_reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
// Makes mbarrier.init visible to the cluster's other CTAs (before they arrive or multicast).
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Arrive on the mbarrier at the same shared-memory offset as `bar`, in cluster CTA `cta`.
// NOTE: default (release, CTA scope) semantics, as for a local arrive: `.release.cluster` makes
// the whole GEMM much slower. kRelease: release at cluster scope, so that this thread's earlier
// shared-memory stores into that CTA (st_cluster_u32) are seen by a thread whose mbar_wait<true>
// sees the phase complete (fused.cuh's claim hand-off only, once per claimed tile pair).
template <bool kRelease = false>
__device__ __forceinline__ void mbar_arrive_cluster(u64* bar, u32 cta) {
  if constexpr (kRelease)
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_addr(bar)),
        "r"(cta)
        : "memory");
  else
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_addr(bar)),
        "r"(cta)
        : "memory");
}

// Store to the u32 at the same shared-memory offset as `p`, in cluster CTA `cta` (after a cluster
// barrier: every CTA of the cluster must have started).
__device__ __forceinline__ void st_cluster_u32(const void* p, u32 cta, u32 value) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\nst.shared::cluster.u32 [remote], %2;\n}\n" ::"r"(
          smem_addr(p)),
      "r"(cta), "r"(value)
      : "memory");
}

// Loads from a shared-memory address (32-bit: a generic pointer into shared memory costs a 64-bit
// register pair and a generic load). Volatile: never moved above the barrier wait before them.
__device__ __forceinline__ float ld_shared_f32(u32 addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float2 ld_shared_f32x2(u32 addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ uint4 ld_shared_u32x4(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}

// 16 zero bytes at a shared-memory address (16-byte aligned).
__device__ __forceinline__ void st_shared_zero16(u32 addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(addr), "r"(0) : "memory");
}

// ---------------------------------------------------------------------------------------------
// TMA: 2-D tiles from a tensor map (in global memory, 64-byte aligned), completion counted in bytes
// on an mbarrier.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// One arrival on a local mbarrier (release at CTA scope: this thread's earlier shared-memory
// stores are seen by a thread whose wait sees the phase complete).
__device__ __forceinline__ void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void tma_load_2d(u32 dst, i64 tensor_map, int c0, int c1, u64* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(tensor_map), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

// The same box into the same shared-memory offset of every CTA in cta_mask; each CTA's mbarrier at
// `bar`'s offset counts the bytes that land in that CTA.
__device__ __forceinline__ void tma_load_2d_multicast(u32 dst, i64 tensor_map, int c0, int c1, u64* bar,
                                                      unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(tensor_map), "r"(c0), "r"(c1), "r"(smem_addr(bar)), "h"(cta_mask)
      : "memory");
}

// cp.async: 4 bytes global -> shared without holding them in registers. src_bytes 0 reads nothing
// and writes 4 zero bytes (src must still be a global address).
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, u32 src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// One arrival of this thread on `bar`'s current phase once every cp.async it issued before has
// landed (noinc: the barrier's expected count includes this arrival). A waiter that sees the
// phase complete sees those copies.
__device__ __forceinline__ void cp_async_arrive_noinc(u64* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// The same without noinc: the pending count of `bar`'s phase is raised by one now and lowered by
// the arrival once the copies landed, so the barrier's expected count need not include it; the
// raise must come before the arrival that would otherwise complete the phase.
__device__ __forceinline__ void cp_async_arrive(u64* bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Every cp.async this thread issued has landed (before its CTA may leave).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// NOTE: plain shared-memory stores go through the generic proxy, wgmma and bulk copies read through
// the async proxy (TMA writes through it too): a thread that wrote shared memory that an async-proxy
// operation reads next fences first (gemm::zero_tail_k_rows).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---------------------------------------------------------------------------------------------
// wgmma
// ---------------------------------------------------------------------------------------------
// Shared-memory matrix descriptor, 128B swizzle. lbo/sbo in bytes (see the GEMM header for which
// stride is which for K-major and MN-major operands).
__device__ __forceinline__ u64 wgmma_desc(u32 addr, u32 lbo, u32 sbo) {
  return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(lbo >> 4) << 16) |
         (static_cast<u64>(sbo >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// D[64x256] (+)= A[64x16] * B[16x256], bf16 in, fp32 accumulate; kTA/kTB: 0 K-major, 1 MN-major.
template <int kTA, int kTB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], u64 desc_a, u64 desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %131, %132;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTA), "n"(kTB));
}

// D[64x128] (+)= A[64x32] * B[32x128], e4m3 in, fp32 accumulate; scale_d 0: D = A * B. FP8 wgmma
// has no transpose operands: both A and B are K-major in shared memory (a k32 step is 32 bytes of
// a 128-byte row). (The tensor cores' accumulation of FP8 products is not IEEE fp32: gemm_fp8.cuh
// adds each k-block's result into fp32 registers.)
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], u64 desc_a, u64 desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// Four 8x8 bf16 matrices to shared memory: lane l gives the address of row l % 8 of matrix l / 8;
// v[i] is this lane's element pair of matrix i in the mma fragment layout (row l / 4, columns
// 2 (l % 4), +1), which is the layout of a wgmma accumulator's 8-column block.
__device__ __forceinline__ void stmatrix_x4(u32 addr, const u32 (&v)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v[0]), "r"(v[1]),
               "r"(v[2]), "r"(v[3])
               : "memory");
}

// Keep the accumulators in registers across the asynchronous MMA (no spill, no reordering).
template <int kN>
__device__ __forceinline__ void fence_accumulators(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

}  // namespace mok
