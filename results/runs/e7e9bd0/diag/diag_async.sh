#!/bin/bash
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
rm -rf /tmp/cuda_head; cp -r cuda /tmp/cuda_head
for v in "false 0" "true 0" "true 1" "true 2"; do
  set -- $v
  rm -rf cuda; cp -r /tmp/cuda_head cuda
  sed -i "s/constexpr bool kAsyncWgradStore = [a-z]*;/constexpr bool kAsyncWgradStore = $1;/; s/constexpr int kAsyncDiag = [0-9];/constexpr int kAsyncDiag = $2;/" cuda/gemm.cuh
  echo "== async $1 diag $2" | tee -a $OUT/diag.txt
  timeout 120 python3 scripts/bench_gemm.py --shapes deepseek-v4-pro --routing uniform --problems down_wgrad,gate_up_wgrad --iters 20 2>&1 | tee -a $OUT/diag.txt | grep -E "wgrad|Error"
done
rm -rf cuda; cp -r /tmp/cuda_head cuda
