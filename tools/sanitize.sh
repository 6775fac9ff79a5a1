#!/usr/bin/env bash
# compute-sanitizer over the GPU kernel tests (issue 8, DESIGN §9): memcheck
# over a subset of the `-m gpu` tests that runs every CUDA kernel (apply_step,
# append, flush CSA and HCA, gather_window / topk / all, indexer_topk, the
# numerics probe), bad rows included, then racecheck over a smaller one.
# Builds nothing: install the CUDA module first (tools/gpu_check.sh with
# SANITIZE=1 does both). Exits non-zero if a tool reports an error, a test
# fails, or a run ends without its summary (a crash or the time limit).
# Logs go to $OUT (or /tmp/gpu_out).
#
# Left out as too slow under the sanitizer: the pools past 2^31 bytes
# (test_gpu_large_pool.py) and the 100-step ds_fp8 replay; the 1000-step
# replay runs for 20 steps (DSV4_REPLAY_STEPS), enough to replay its command
# buffer under memcheck, and the hypothesis suite runs 4 examples a test.
#
# Only this project's kernels (mangled names holding "dsv4") are checked:
# XLA's own kernels, which the tests also launch by the thousand (the jnp
# reference run on the GPU), run unpatched. A first try that checked every
# kernel had not finished its first test after 8 minutes.
#
#   SANITIZE_TOOLS="memcheck racecheck"   tools to run, in order
#   SANITIZE_TIMEOUT=300                  seconds per tool run
#   SANITIZE_KERNELS=dsv4                 kernel-name substring to check; "all": every kernel
#   SANITIZE_ALLOCATOR=platform           XLA_PYTHON_CLIENT_ALLOCATOR
#   SANITIZE_COMMAND_BUFFERS=0            1: leave XLA's command buffers on
#   SANITIZE_OPTS=                        more compute-sanitizer options
#   COMPUTE_SANITIZER=path                the sanitizer binary
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
if [ ! -x "$SAN" ]; then echo "sanitize: compute-sanitizer not found"; exit 1; fi

export PYTHONUNBUFFERED=1
# No preallocation, and one cudaMalloc per buffer: an access past the end of
# a buffer then leaves its allocation, where memcheck sees it (inside a
# preallocated arena it would land in a neighbour, unseen).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_PYTHON_CLIENT_ALLOCATOR=${SANITIZE_ALLOCATOR:-platform}
# XLA's command buffers (CUDA graphs) off unless SANITIZE_COMMAND_BUFFERS=1:
# the kernels then run as plain launches (the 1000-step replay test covers
# the graphs without the sanitizer). conftest's default flags kept.
if [ "${SANITIZE_COMMAND_BUFFERS:-0}" = 0 ]; then
  export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=4} --xla_gpu_enable_command_buffer="
fi
read -r -a SANITIZE_OPTS <<< "${SANITIZE_OPTS:-}"   # more compute-sanitizer options
export DSV4_BAD_INPUT_EXAMPLES=${DSV4_BAD_INPUT_EXAMPLES:-4} DSV4_REPLAY_STEPS=${DSV4_REPLAY_STEPS:-20}

MEMCHECK_ARGS=(tests/test_numerics_gpu.py tests/test_apply_step.py tests/test_cuda_replay.py
               tests/test_bad_input.py tests/test_visibility.py tests/test_isolation.py
               tests/test_ffi_vs_reference.py tests/test_indexer.py
               --deselect "tests/test_cuda_replay.py::test_replay_equals_reference_and_repeats[ds_fp8-100]")
# shared-memory kernels: append, flush (via the ds_fp8 step) and indexer_topk
RACECHECK_ARGS=(tests/test_ffi_vs_reference.py tests/test_indexer.py
                -k "ds_fp8 or handler_scores_bit_exact")

# Which option filters kernels by name (--kernel-name in recent releases, --filter before).
filter=()
if [ "${SANITIZE_KERNELS:-dsv4}" != all ]; then
  for opt in --kernel-name --filter; do
    if timeout 60 "$SAN" "$opt" "kns=${SANITIZE_KERNELS:-dsv4}" true >/dev/null 2>&1; then
      filter=("$opt" "kns=${SANITIZE_KERNELS:-dsv4}"); break
    fi
  done
  [ ${#filter[@]} -gt 0 ] || echo "sanitize: no kernel filter option found: checking every kernel"
fi

reap() {  # every process of one run, found by the marker in its environment
  local d
  for d in /proc/[0-9]*; do
    grep -qsxz "DSV4_SANITIZE_RUN=$1" "$d/environ" && kill -KILL "${d#/proc/}" 2>/dev/null
  done
}

fail=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
  case $tool in
    memcheck) args=("${MEMCHECK_ARGS[@]}") ;;
    *) args=("${RACECHECK_ARGS[@]}") ;;
  esac
  log="$OUT/sanitize_$tool.log"
  echo "== compute-sanitizer --tool $tool ${filter[*]} (allocator $XLA_PYTHON_CLIENT_ALLOCATOR)"
  t0=$(date +%s)
  limit=${SANITIZE_TIMEOUT:-300}
  # Straight to the file: a pipe would wait on a survivor. The sanitizer has
  # been seen to die of a segfault and leave its target running, so every
  # process of the run (marked in its environment) is ended at the limit and
  # after the sanitizer exits.
  run_id="$$-$tool-$t0"
  DSV4_SANITIZE_RUN=$run_id "$SAN" --tool "$tool" "${filter[@]}" "${SANITIZE_OPTS[@]}" \
    --error-exitcode 86 --print-limit 20 \
    "$PY" -m pytest -m gpu -p no:cacheprovider -x -v -rs --durations=8 \
    -o console_output_style=times "${args[@]}" > "$log" 2>&1 &
  pid=$!
  ( sleep "$limit"; echo "sanitize: $tool past its ${limit} s: stopped" >> "$log"; reap "$run_id" ) \
    > /dev/null 2>&1 &
  dog=$!
  disown "$dog"
  wait "$pid"
  rc=$?
  pkill -KILL -P "$dog" 2>/dev/null   # the watchdog's sleep, then the watchdog
  kill -KILL "$dog" 2>/dev/null
  reap "$run_id"
  echo "$tool: rc=$rc in $(( $(date +%s) - t0 )) s"
  grep -E "=+ (ERROR|RACECHECK) SUMMARY|past its" "$log"
  grep -E "[0-9]+ (passed|failed|skipped|deselected)" "$log" | tail -1
  errors=$(grep -Eo "(ERROR SUMMARY: [0-9]+ error|\(([0-9]+) error)" "$log" | grep -Eo "[0-9]+" \
           | awk '{s += $1} END {print s + 0}')
  if ! grep -qE "(ERROR|RACECHECK) SUMMARY" "$log"; then
    echo "$tool: no summary: the run crashed or hit the time limit; last lines:"
    tail -15 "$log"
    fail=1
  elif [ "$rc" -ne 0 ] || [ "$errors" -ne 0 ]; then
    echo "$tool: FAILED ($errors errors reported, rc $rc); first reports:"
    grep -m 12 -E "=+ (Invalid|Error|Race|Program hit|Malloc|Uninitialized|Barrier)|FAILED|Error:" \
      "$log"
    fail=1
  fi
done
[ "$fail" -eq 0 ] && echo "sanitize: clean" || echo "sanitize: FAILED"
exit "$fail"
