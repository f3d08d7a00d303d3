"""Diagnostic only: per-tile phase stamps (clock64) in consume_tile for the weight gradients. Edits a copy of
e7e9bd0's cuda/gemm.cuh (python phases_patch.py cuda/gemm.cuh), with or without tma_store_epilogue.patch."""
import re, sys
p = sys.argv[1]
s = open(p).read()
glob = '''
extern "C" __device__ unsigned long long mok_phase[132 * 2 * 128 * 4];
extern "C" __device__ int mok_phase_n[132 * 2];
namespace mok {'''
s = s.replace("\nnamespace mok {", glob, 1)
old = '''  using Tr = Traits<kP>;
  const u32 s_base = smem_addr(ss.stages);
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  int prev = -1;'''
new = '''  using Tr = Traits<kP>;
  const u32 s_base = smem_addr(ss.stages);
  const bool rec = !Tr::kRowProblem && wg_tid == 0;
  unsigned long long* ph = nullptr;
  if (rec) {
    const int n = mok_phase_n[blockIdx.x * 2 + half]++;
    if (n < 128) ph = mok_phase + ((blockIdx.x * 2 + half) * 128 + n) * 4;
  }
  if (ph) ph[0] = clock64();
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
  int prev = -1;'''
assert old in s; s = s.replace(old, new)
old = '''    if (ok) ok = mbar_wait(&ss.full[ring.stage], ring.phase, p->timeout_ns, p->error, kOpGemmMma, kP);
    const u32 s_a = s_base + ring.stage * kStageBytes;'''
new = '''    if (ok) ok = mbar_wait(&ss.full[ring.stage], ring.phase, p->timeout_ns, p->error, kOpGemmMma, kP);
    if (ph && kb == 0) ph[1] = clock64();
    const u32 s_a = s_base + ring.stage * kStageBytes;'''
assert old in s; s = s.replace(old, new)
old = '''  wgmma_wait<0>();
  fence_accumulators(acc);
  if (prev >= 0) release_stage(ss, prev, wg_tid);'''
new = '''  wgmma_wait<0>();
  fence_accumulators(acc);
  if (ph) ph[2] = clock64();
  if (prev >= 0) release_stage(ss, prev, wg_tid);'''
assert old in s; s = s.replace(old, new)
# the epilogue's end: e7e9bd0's store_tile call, or the one of tma_store_epilogue.patch (ring.area)
for call in ("store_tile<kP>(p, tile, acc, staging, half, wg_tid);",
             "store_tile<kP>(p, tile, acc, staging, ring.area, half, wg_tid);"):
    old = "    " + call + "\n  }\n  return ok;"
    if old in s:
        s = s.replace(old, "    " + call + "\n  }\n  if (ph) ph[3] = clock64();\n  return ok;")
        break
else:
    raise SystemExit("phases_patch.py: consume_tile's epilogue call not found")
open(p, "w").write(s)
