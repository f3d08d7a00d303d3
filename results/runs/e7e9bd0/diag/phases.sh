#!/bin/bash
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
rm -rf /tmp/cuda_head; cp -r cuda /tmp/cuda_head
for v in true false; do
  rm -rf cuda; cp -r /tmp/cuda_head cuda
  sed -i "s/constexpr bool kWgradTmaStore = [a-z]*;/constexpr bool kWgradTmaStore = $v;/" cuda/gemm.cuh
  python3 .devrun/phases_patch.py cuda/gemm.cuh
  echo "== tma $v"; timeout 120 python3 .devrun/phases.py ${SHAPES:-deepseek-v4-pro,kimi-k2.7} 2>&1 | tail -6
done
rm -rf cuda; cp -r /tmp/cuda_head cuda
