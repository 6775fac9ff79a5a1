#!/usr/bin/env bash
# One call on the GPU machine: build the CUDA module, run the GPU tests and the
# benchmarks, print a short table last. Logs and JSON go to $OUT (or /tmp/gpu_out).
#   device tool:  bash tools/gpu_check.sh
# SKIP_BENCH=1 skips the benchmarks (ops, indexer_topk, tensor_issue.cu),
# SKIP_OPS_BENCH=1 only benchmarks/run.py;
# BENCH_ARGS / INDEXER_BENCH_ARGS / PYTEST_ARGS pass options through.
# SANITIZE=1 also runs tools/sanitize.sh (compute-sanitizer memcheck and
# racecheck over the kernel tests, a few minutes) after the tests;
# SANITIZE=only builds and runs only that.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}

echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "== build (no package index there: no build isolation, no deps)"
t0=$(date +%s)
if ! $PY -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
echo "built in $(( $(date +%s) - t0 )) s"
(cd /tmp && $PY -m dsv4_jax info)

SANITIZE=${SANITIZE:-}
if [ "$SANITIZE" = only ]; then
  echo "== compute-sanitizer only"
  OUT="$OUT" PYTHON="$PY" bash tools/sanitize.sh
  exit $?
fi

echo "== GPU tests"
$PY -m pytest -q -m gpu -p no:cacheprovider --durations=10 tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
test_rc=${PIPESTATUS[0]}
# the mxfp4 score kernel's two shapes (PairWarps in cuda/indexer_topk.cu)
# whatever the grid: the runs above take the one each grid gets
for pairs in 0 1; do
  echo "== indexer tests, DSV4_INDEXER_PAIRS=$pairs"
  DSV4_INDEXER_PAIRS=$pairs $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer.py \
    2>&1 | tee "$OUT/pytest_indexer_pairs$pairs.log" | tail -2
  [ "${PIPESTATUS[0]}" -eq 0 ] || test_rc=1
done
# the select's sort, where its ranking by bins (RankSelect) would run
echo "== indexer tests, DSV4_SELECT_RANK=0"
DSV4_SELECT_RANK=0 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer.py \
  2>&1 | tee "$OUT/pytest_indexer_sort.log" | tail -2
[ "${PIPESTATUS[0]}" -eq 0 ] || test_rc=1

sanitize_rc=0
if [ -n "$SANITIZE" ] && [ "$SANITIZE" != 0 ]; then
  echo "== compute-sanitizer"
  OUT="$OUT" PYTHON="$PY" bash tools/sanitize.sh
  sanitize_rc=$?
fi

bench_rc=0
if [ -z "${SKIP_BENCH:-}" ]; then
  echo "== benchmarks"
  if [ -z "${SKIP_OPS_BENCH:-}" ]; then
    $PY benchmarks/run.py --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
    bench_rc=${PIPESTATUS[0]}
  fi
  echo "== indexer_topk benchmark"
  $PY benchmarks/indexer.py --json "$OUT/indexer.json" ${INDEXER_BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/indexer.log" | tail -22
  [ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
  echo "== tensor-core issue microbenchmark (benchmarks/tensor_issue.cu)"
  if nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 benchmarks/tensor_issue.cu \
      -o /tmp/tensor_issue >"$OUT/tensor_issue_build.log" 2>&1; then
    /tmp/tensor_issue 2>&1 | tee "$OUT/tensor_issue.md" | tail -16
    [ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
  else
    tail -20 "$OUT/tensor_issue_build.log"; bench_rc=1
  fi
fi

echo "== summary"
grep -E "passed|failed|error" "$OUT/pytest_gpu.log" | tail -1
echo "tests rc=$test_rc sanitize rc=$sanitize_rc bench rc=$bench_rc"
[ "$test_rc" -eq 0 ] && [ "$sanitize_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
