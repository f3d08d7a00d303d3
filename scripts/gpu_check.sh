#!/usr/bin/env bash
# One command for a GPU session: the GPU test suite, then the layer benchmark, logs in one folder.
#
#   bash scripts/gpu_check.sh [--no-bench] [-- bench_layer.py options]
#
# Run from the repo root on the GPU machine (no ./run there: it would try to download packages).
# Installs the carried wheels (nvshmem4py, pytest-xdist) from .whl/ (or $MOK_WHEELS) if there are
# any (../shared/DEVICE.md), runs `pytest -m gpu` (6 workers with pytest-xdist when installed; then
# the `gpu_alone` tests, which need the GPU to themselves, in one), then
# scripts/bench_layer.py over the four paper shapes. Logs go to $OUT (the device
# tool's folder) or results/gpu_check/, and every results/ file this run wrote goes into one
# archive there, results_new.tgz (the device tool brings back a few files, not a folder's worth).
# Exit status: the tests' or, if they passed, the benchmark's; 1, with one line saying why, when
# `nvidia-smi -L` lists no GPU (nothing runs) or no GPU (or gpu_alone) test passed (every one skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
bench=1
if [ "${1:-}" = "--no-bench" ]; then bench=0; shift; fi
if [ "${1:-}" = "--" ]; then shift; fi
if ! nvidia-smi -L 2>/dev/null | grep -q "^GPU "; then
  echo "[gpu_check] no GPU here: nvidia-smi -L lists none (or is not installed); nothing was run" >&2
  exit 1
fi
out=${OUT:-results/gpu_check}
mkdir -p "$out"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1  # NOTE: never NVLink multicast
wheels=${MOK_WHEELS:-.whl}  # the folder of carried wheels
if ls "$wheels"/*.whl >/dev/null 2>&1; then  # a carried wheel that does not install is an error, not a skip
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$wheels"/*.whl || { echo "[gpu_check] the carried wheels in $wheels/ did not install" >&2; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
# pytest's status ($1), or 1 (with one line saying why) when it passed with nothing run: every test of
# its log ($2) skipped, e.g. CuPy missing
passed_something() {
  local summary
  summary=$(tail -1 "$2")
  if [ "$1" = 0 ] && ! [[ "$summary" =~ [1-9][0-9]*\ passed ]]; then
    echo "[gpu_check] no $3 passed (pytest: ${summary//=/}): see the skip reasons in $2" >&2
    echo 1
  else
    echo "$1"
  fi
}
# NOTE: the commit stamped on results is mok_proto.bench.git_sha()'s: set MOK_GIT_SHA to the source
# checkout's `git describe --always --dirty` when this tree is a copy (its .git may be stale).
stamp=$(mktemp) && touch "$stamp"
workers=""
# (MOK_TEST_WORKERS: how many; on an H100, 6 finish sooner than 4: docs/LOG.md)
if python3 -c "import xdist" 2>/dev/null; then workers="-n ${MOK_TEST_WORKERS:-6}"; fi
echo "[gpu_check] pytest -m gpu $workers -> $out/gpu_tests.txt" >&2
# the longest GPU tests' files named first: the workers start them at once rather than end on them
# shellcheck disable=SC2086  # $workers: zero or two words
python3 -m pytest -m gpu -q -rs $workers --durations=20 tests/test_gpu_fp8_layer.py tests/test_fused_layer.py \
  tests/test_link_gpu.py tests > "$out/gpu_tests.txt" 2>&1
status=$(passed_something $? "$out/gpu_tests.txt" "GPU test")
tail -3 "$out/gpu_tests.txt" >&2
if [ "$status" = 0 ] && [ -n "$workers" ]; then  # the tests timed against the clock skipped there: the GPU alone
  echo "[gpu_check] pytest -m gpu_alone -> $out/gpu_alone_tests.txt" >&2
  python3 -m pytest -m gpu_alone -q -rs > "$out/gpu_alone_tests.txt" 2>&1
  status=$(passed_something $? "$out/gpu_alone_tests.txt" "gpu_alone test")
  tail -1 "$out/gpu_alone_tests.txt" >&2
fi
if [ "$bench" = 1 ] && [ "$status" = 0 ]; then
  echo "[gpu_check] scripts/bench_layer.py $* -> $out/bench_layer.txt" >&2
  python3 scripts/bench_layer.py "$@" > "$out/bench_layer.txt" 2>&1
  status=$?
  tail -12 "$out/bench_layer.txt" >&2
fi
if [ -n "$(find results -newer "$stamp" -type f ! -path "results/gpu_check/*" | head -1)" ]; then
  find results -newer "$stamp" -type f ! -path "results/gpu_check/*" -print0 | tar czf "$out/results_new.tgz" --null -T -
fi
rm -f "$stamp"
echo "[gpu_check] exit $status; logs in $out" >&2
exit "$status"
