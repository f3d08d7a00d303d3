#!/bin/bash
# async wgrad store: GEMM tests, digest equality and A/B bench_gemm (kAsyncWgradStore true/false)
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv > $OUT/smi.txt
timeout 90 python3 -m pytest -m gpu -q -x tests/test_gemm.py > $OUT/gemm_tests.txt 2>&1; rc=$?; tail -2 $OUT/gemm_tests.txt
[ $rc -ne 0 ] && { grep -E "Error|error|assert" $OUT/gemm_tests.txt | head -20; }
rm -rf /tmp/cuda_head; cp -r cuda /tmp/cuda_head
for round in ${ROUNDS:-1 2}; do
for v in true false; do
  rm -rf cuda; cp -r /tmp/cuda_head cuda
  sed -i "s/constexpr bool kAsyncWgradStore = [a-z]*;/constexpr bool kAsyncWgradStore = $v;/" cuda/gemm.cuh
  echo "== async $v round $round" | tee -a $OUT/ab.txt
  [ $round = 1 ] && timeout 60 python3 .devrun/wg_hash.py 2>&1 | tee -a $OUT/ab.txt | tail -3
  timeout 150 python3 scripts/bench_gemm.py --shapes ${AB_SHAPES:-kimi-k2.7,deepseek-v4-pro} --routing uniform,skewed --problems down_wgrad,gate_up_wgrad --iters 20 2>&1 | tee -a $OUT/ab.txt | grep -E "wgrad|Error|FAIL|rc"
done
done
rm -rf cuda; cp -r /tmp/cuda_head cuda
python3 - <<'PY'
import os, re
rows = {}; v = None; hashes = {}
for line in open(os.environ["OUT"] + "/ab.txt"):
    m = re.match(r"== async (\w+)", line)
    if m: v = m.group(1); continue
    if line.startswith("WGHASH"): hashes.setdefault(v, []).append(line.split()[4]); continue
    f = line.split()
    if len(f) > 4 and f[2].endswith("wgrad") and f[-1] == "yes": rows.setdefault(v, {}).setdefault(tuple(f[:3]), []).append(float(f[3]))
print("digests equal:", hashes.get("true") == hashes.get("false") and bool(hashes.get("true")), hashes)
t, b = rows.get("true", {}), rows.get("false", {})
for k in b:
    if k in t: print(" ".join(k), "async/sync TFLOP/s", t[k], b[k], f"{max(t[k]) / max(b[k]):.3f}")
PY
