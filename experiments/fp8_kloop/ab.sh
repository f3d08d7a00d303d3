#!/usr/bin/env bash
# On one GPU, in a checkout of branch wip/fp8-kloop: the GPU suite on it, then the fused FP8 passes
# (bench_layer --precision fp8 --fused 0:2048) with main's four changed headers and with the branch's.
# Before: for f in fused gemm gemm_fp8 hopper; do git show main:cuda/$f.cuh > experiments/fp8_kloop/main/$f.cuh; done
# (mkdir -p experiments/fp8_kloop/main first), and nvshmem4py's wheel in .whl/ (shared/DEVICE.md).
# Env: SHAPES (kimi-k2.7,deepseek-v4-pro), T (suite seconds, 320), TB (seconds per bench, 110).
set -u
here=experiments/fp8_kloop
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD MOK_GIT_SHA=wip-fp8-kloop
nvidia-smi -L > "$OUT/gpu.txt"
timeout 60 python3 -m pytest -m gpu_alone -q -rs > "$OUT/gpu_alone_tests.txt" 2>&1
echo "rc=$?" >> "$OUT/gpu_alone_tests.txt"; tail -2 "$OUT/gpu_alone_tests.txt"
timeout "${T:-320}" python3 -m pytest -m gpu -v -rs -n 6 tests/test_gpu_fp8_layer.py tests/test_fused_layer.py \
  tests/test_link_gpu.py tests/test_gpu_layer.py tests > "$OUT/gpu_tests.txt" 2>&1
echo "rc=$?" >> "$OUT/gpu_tests.txt"; tail -3 "$OUT/gpu_tests.txt"
mkdir -p /tmp/branch_cuda && cp cuda/*.cuh /tmp/branch_cuda/
for v in main branch; do
  if [ "$v" = main ]; then cp "$here"/main/*.cuh cuda/; else cp /tmp/branch_cuda/*.cuh cuda/; fi
  timeout "${TB:-110}" python3 scripts/bench_layer.py --precision fp8 --shapes "${SHAPES:-kimi-k2.7,deepseek-v4-pro}" \
    --iters 10 --fused 0:2048 > "$OUT/bench_$v.txt" 2>&1
  echo "rc=$?" >> "$OUT/bench_$v.txt"
  echo "== $v"; grep -E "fused|sequential" "$OUT/bench_$v.txt" | tail -12
done
