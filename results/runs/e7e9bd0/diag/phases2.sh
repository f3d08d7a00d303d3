#!/bin/bash
set -u
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
rm -rf /tmp/cuda_head; cp -r cuda /tmp/cuda_head
python3 .devrun/phases_patch.py cuda/gemm.cuh
timeout 100 python3 .devrun/phases2.py clusters 2>&1 | tail -8
timeout 200 python3 .devrun/phases2.py layer ${SHAPES:-deepseek-v4-pro} 2>&1 | tail -8
rm -rf cuda; cp -r /tmp/cuda_head cuda
