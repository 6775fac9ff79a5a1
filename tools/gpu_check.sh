#!/usr/bin/env bash
# On any machine with an NVIDIA GPU and nvcc, from the checkout: build the CUDA
# module in place, run the GPU tests and the benchmarks, print a short table
# last. Logs and JSON go to $OUT (or /tmp/gpu_out).
# The GPU tests are one `pytest -m gpu` process, which covers every kernel path:
# a kernel variant is chosen by shape, device or an attribute only tests pass,
# never by the environment, so no stage reruns tests under switches.
#   bash tools/gpu_check.sh
# SKIP_BENCH=1 skips the benchmarks (ops, indexer_topk in mxfp4 and bf16),
# SKIP_OPS_BENCH=1 only benchmarks/run.py; SKIP_TESTS=1 skips the tests (a
# call for the benchmarks the budget left out of a full one);
# BENCH_ARGS / INDEXER_BENCH_ARGS / PYTEST_ARGS pass options through.
# SANITIZE=1 also runs tools/sanitize.sh (compute-sanitizer memcheck and
# racecheck over the kernel tests, a few minutes) after the tests;
# SANITIZE=only builds and runs only that.
# BUDGET_S, where a run must end within a wall time (a batch job's limit), is
# the seconds the script plans for: each benchmark stage after the tests starts
# only if the time it usually takes is left, else it is named as skipped in the
# summary. Unset, every stage runs.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
T_START=$(date +%s)
BUDGET_S=${BUDGET_S:-}
SKIPPED=()
left() { echo $(( BUDGET_S - ($(date +%s) - T_START) )); }
# fits NAME SECONDS: whether about SECONDS are left for stage NAME (else noted)
fits() {
  if [ -z "$BUDGET_S" ] || [ "$(left)" -ge "$2" ]; then return 0; fi
  echo "== $1: skipped ($(left) s of the budget left, it takes about $2)"
  SKIPPED+=("$1")
  return 1
}

echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "== build (with the testing modules)"
t0=$(date +%s)
# The build tools and dependencies already installed are used (no build
# isolation, no deps), so no package index is needed; --config-settings, not
# -C: pip before 23.1 lacks the short form.
if ! $PY -m pip install -q --no-build-isolation --no-deps -e . \
    --config-settings=cmake.define.DSV4_BUILD_TESTING=ON >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
# the numerics probes and dsv4_noop: without them GPU tests would skip
(cd /tmp && $PY -c "import dsv4_jax._dsv4_testing_cuda") \
  || { echo "BUILD FAILED: no _dsv4_testing_cuda"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"
(cd /tmp && $PY -m dsv4_jax info)

SANITIZE=${SANITIZE:-}
if [ "$SANITIZE" = only ]; then
  echo "== compute-sanitizer only"
  OUT="$OUT" PYTHON="$PY" bash tools/sanitize.sh
  exit $?
fi

test_rc=0
if [ -n "${SKIP_TESTS:-}" ]; then
  echo "== tests skipped (SKIP_TESTS)"; : >"$OUT/pytest_gpu.log"
else
  echo "== GPU tests"
  $PY -m pytest -q -n 0 -m gpu -p no:cacheprovider --durations=10 tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
  test_rc=${PIPESTATUS[0]}
  # The example and the README's step are not marked gpu (CI runs them on the
  # CPU); here impl="auto" takes every op's CUDA kernel end to end.
  echo "== examples/decode_loop.py and the README's step on the GPU"
  $PY -m pytest -q -n 0 -p no:cacheprovider tests/test_example.py tests/test_readme.py 2>&1 \
    | tee "$OUT/pytest_example.log" | tail -1
  [ "${PIPESTATUS[0]}" -eq 0 ] || test_rc=1
fi

sanitize_rc=0
if [ -n "$SANITIZE" ] && [ "$SANITIZE" != 0 ]; then
  echo "== compute-sanitizer"
  OUT="$OUT" PYTHON="$PY" bash tools/sanitize.sh
  sanitize_rc=$?
fi

# Benchmarks, most wanted first: the indexer's mxfp4 grid (its default query
# format), the ops, then the indexer's bf16 rows.
bench_rc=0
if [ -z "${SKIP_BENCH:-}" ]; then
  if fits "indexer_topk benchmark, mxfp4" 100; then
    echo "== indexer_topk benchmark, mxfp4"
    $PY benchmarks/bench_indexer.py --json "$OUT/indexer.json" --q-formats mxfp4 ${INDEXER_BENCH_ARGS:-} \
      2>&1 | tee "$OUT/indexer.log" | tail -14
    [ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
  fi
  if [ -z "${SKIP_OPS_BENCH:-}" ] && fits "ops benchmark (benchmarks/run.py)" 150; then
    echo "== ops benchmark"
    $PY benchmarks/run.py --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
    [ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
  fi
  if fits "indexer_topk benchmark, bf16" 120; then
    echo "== indexer_topk benchmark, bf16"
    $PY benchmarks/bench_indexer.py --json "$OUT/indexer_bf16.json" --q-formats bf16 ${INDEXER_BENCH_ARGS:-} \
      2>&1 | tee "$OUT/indexer_bf16.log" | tail -14
    [ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
  fi
fi

echo "== summary ($(( $(date +%s) - T_START )) s)"
grep -E "passed|failed|error" "$OUT/pytest_gpu.log" | tail -1
[ -f "$OUT/indexer.log" ] && grep -E "^ *(B|64) +(context|65536) " "$OUT/indexer.log" | tail -2
[ "${#SKIPPED[@]}" -eq 0 ] || echo "skipped for time: ${SKIPPED[*]}"
echo "tests rc=$test_rc sanitize rc=$sanitize_rc bench rc=$bench_rc"
[ "$test_rc" -eq 0 ] && [ "$sanitize_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
