#!/usr/bin/env bash
# Variants of the FP8 weight gradients' k-loop (cuda/gemm_fp8.cuh), timed against the tree as it is.
#
#   bash experiments/fp8_wgrad_variants/run.sh [--rounds N] [--tests] [--only V,V..] [-- bench_gemm.py options]
#
# On the GPU machine, from the repo root (PYTHONPATH holding nvshmem4py's install, as
# scripts/gpu_check.sh sets it). Each variant is this tree with a patch applied, in a scratch copy:
#   base           the tree as it is
#   strict-turns   the consumer warpgroups alternate at the tensor cores, each waiting for the other's
#                  MMAs to be done (named barriers 4 and 5)
#   column-split   each consumer warpgroup takes an n128 half of the tile over all 128 rows (four
#                  m64n64 MMA groups a k-block), its 32 column scales read once a k-block before the
#                  MMAs (docs/design.md 5.8; ptxas spills 8 bytes outside the k-loop)
#   tiles-128x128  a kernel of its own (cuda/gemm_fp8_wgrad.cuh): 128 x 128 tiles, 64 accumulators
#                  and two temporaries a warpgroup, k-blocks in pairs (the second's MMAs under the
#                  first's promotion), B shared by the cluster's CTAs in turns; tiles='128x256' the
#                  tree's kernel (its GPU tests run both and compare their bits)
# Rounds run the variants in turn (bench_gemm.py --precision fp8, the weight gradients of kimi-k2.7
# and deepseek-v4-pro by default) and print each one's rows; --tests also runs
# tests/test_gemm_fp8.py's GPU tests in every variant (4 pytest-xdist workers where xdist is
# installed); --only: these variants (base always runs, first). Exit status: 1 if any run or test
# failed (or every test skipped), 2 on a bad option.
set -uo pipefail
cd "$(dirname "$0")/../.."
here=experiments/fp8_wgrad_variants
rounds=2 tests=0 only=
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds)
      if ! [[ "${2:-}" =~ ^[1-9][0-9]*$ ]]; then echo "run.sh: --rounds needs a positive integer" >&2; exit 2; fi
      rounds=$2; shift 2 ;;
    --tests) tests=1; shift ;;
    --only)
      if [ $# -lt 2 ] || [ -z "$2" ]; then echo "run.sh: --only needs a list of variants" >&2; exit 2; fi
      only=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
bench=(scripts/bench_gemm.py --precision fp8 --shapes kimi-k2.7,deepseek-v4-pro --problems down_wgrad,gate_up_wgrad
       --routing uniform --iters 20 "$@")
declare -A patches=([base]="" [strict-turns]="strict-turns" [column-split]="column-split"
                   [tiles-128x128]="tiles-128x128")
variants=(base strict-turns column-split tiles-128x128)
if [ -n "$only" ]; then
  chosen=(base)
  for v in ${only//,/ }; do
    if [ -z "${patches[$v]+x}" ]; then echo "run.sh: no variant $v (${variants[*]})" >&2; exit 2; fi
    [ "$v" = base ] || chosen+=("$v")
  done
  variants=("${chosen[@]}")
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
root=$PWD
status=0
for v in "${variants[@]}"; do
  mkdir -p "$scratch/$v"
  cp -r cuda mok_proto scripts tests pyproject.toml "$scratch/$v/"
  for p in ${patches[$v]}; do
    if command -v patch > /dev/null; then apply=(patch --forward --batch -s -p1 -i); else apply=(git apply); fi
    (cd "$scratch/$v" && "${apply[@]}" "$root/$here/$p.patch") || { echo "[$v] $p.patch does not apply" >&2; exit 1; }
  done
  # each variant's own copy first on the path: its mok_proto, so its cuda/
  (cd "$scratch/$v" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
    "import sys; from mok_proto.kernels import build; sys.exit(build.CUDA_DIR.resolve() != __import__('pathlib').Path('cuda').resolve())") ||
    { echo "[$v] its copy does not build from its own cuda/ (PYTHONPATH?)" >&2; exit 1; }
done
for r in $(seq 1 "$rounds"); do
  for v in "${variants[@]}"; do
    echo "== $v, round $r"
    (cd "$scratch/$v" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 "${bench[@]}" > bench.txt 2>&1) || status=1
    grep -E "wgrad|error|Error" "$scratch/$v/bench.txt"
  done
done
if [ "$tests" = 1 ]; then
  workers=()
  python3 -c "import xdist" 2> /dev/null && workers=(-n 4)  # pytest-xdist, where it is installed
  for v in "${variants[@]}"; do
    echo "== $v: tests/test_gemm_fp8.py -m gpu"
    (cd "$scratch/$v" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -m gpu -q ${workers[@]+"${workers[@]}"} tests/test_gemm_fp8.py > tests.txt 2>&1) ||
      status=1
    tail -1 "$scratch/$v/tests.txt"
    grep -qE "[1-9][0-9]* passed" <(tail -1 "$scratch/$v/tests.txt") || status=1  # every test skipped: not a pass
  done
fi
exit "$status"
