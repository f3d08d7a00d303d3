#!/bin/bash
# A/B: ring depth kStages 4 vs 3 (would free 48 KB of shared memory for an async epilogue), bench_gemm all problems
set -u
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
rm -rf /tmp/cuda_head; cp -r cuda /tmp/cuda_head
for round in ${ROUNDS:-1}; do
for v in 4 3; do
  rm -rf cuda; cp -r /tmp/cuda_head cuda
  sed -i "s/constexpr int kStages = [0-9];/constexpr int kStages = $v;/" cuda/abi.cuh
  echo "== stages $v round $round" | tee -a $OUT/st3.txt
  timeout 120 python3 scripts/bench_gemm.py --shapes kimi-k2.7,deepseek-v4-pro --routing uniform --iters 20 2>&1 | tee -a $OUT/st3.txt | grep -E "uniform|Error"
done
done
rm -rf cuda; cp -r /tmp/cuda_head cuda
