#!/usr/bin/env bash
# compute-sanitizer over the GPU kernel tests (docs/design/bad-input.md): memcheck
# over a subset of the `-m gpu` tests that runs every CUDA kernel (apply_step,
# append, flush CSA and HCA, gather_window / topk / all, indexer_topk, the
# numerics probe) in every kv format, bad rows included, then racecheck over
# the kernels that use shared memory (append, flush, indexer_topk).
# Builds nothing: install the CUDA module first (tools/gpu_check.sh with
# SANITIZE=1 does both). Exits non-zero if a tool reports an error, a test
# fails, or a run ends without its summary (a crash or the time limit).
# Logs go to $OUT (or /tmp/gpu_out).
#
# Left out as too slow under the sanitizer: the pools past 2^31 bytes
# (properties/test_large_pool_gpu.py), the 100-step ds_fp8 replay, and
# properties/test_ffi_vs_reference.py (its jnp reference runs on the GPU: 41 s
# a format under memcheck; the replay tests cover the same kernels in every
# format).
# The 1000-step replay runs 20 steps (DSV4_REPLAY_STEPS) and the hypothesis
# suite 4 examples a test (DSV4_BAD_INPUT_EXAMPLES).
#
# Seen with compute-sanitizer 2025.3.1 and JAX 0.11.2: with
# XLA_PYTHON_CLIENT_ALLOCATOR=platform and the default --target-processes all,
# the sanitizer itself died of a segfault early in the tests that run
# XLA-compiled code (three times, command buffers on or off), leaving its
# target running. With XLA's BFC allocator (not preallocated) and
# --target-processes application-only it ran clean; which of the two
# matters was not established. The BFC allocator packs buffers into shared
# regions, so memcheck sees an access past a buffer only where it leaves the
# region; the bad-input tests' sentinel bytes (0xA5) catch stray writes
# inside. SANITIZE_ALLOCATOR=cuda_async (one stream-ordered allocation a
# buffer) might be sharper; it has not been tried here.
#
#   SANITIZE_TOOLS="memcheck racecheck"   tools to run, in order
#   SANITIZE_TIMEOUT=                     seconds a tool run may take (unset: no limit;
#                                         its processes are ended when it exits)
#   SANITIZE_ALLOCATOR=bfc                XLA_PYTHON_CLIENT_ALLOCATOR
#   SANITIZE_COMMAND_BUFFERS=0            1: leave XLA's command buffers on
#   SANITIZE_KERNELS=all                  a mangled-name substring ("dsv4": only this
#                                         project's kernels, XLA's run unchecked and
#                                         faster; not tried on the device yet)
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
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_PYTHON_CLIENT_ALLOCATOR=${SANITIZE_ALLOCATOR:-bfc}
# XLA's command buffers (CUDA graphs) off unless SANITIZE_COMMAND_BUFFERS=1:
# the kernels then run as plain launches (the 1000-step replay test covers
# the graphs without the sanitizer). conftest's default flags kept.
if [ "${SANITIZE_COMMAND_BUFFERS:-0}" = 0 ]; then
  export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=4} --xla_gpu_enable_command_buffer="
fi
read -r -a SANITIZE_OPTS <<< "${SANITIZE_OPTS:-}"   # more compute-sanitizer options
export DSV4_BAD_INPUT_EXAMPLES=${DSV4_BAD_INPUT_EXAMPLES:-4} DSV4_REPLAY_STEPS=${DSV4_REPLAY_STEPS:-20}

MEMCHECK_ARGS=(tests/numerics/test_numerics_gpu.py tests/ops/test_apply_step.py
               tests/properties/test_cuda_replay.py tests/properties/test_bad_input.py
               tests/ops/test_append.py tests/ops/test_gather_window.py
               tests/ops/test_gather_topk.py tests/ops/test_gather_all.py
               tests/properties/test_row_and_layer_rules.py
               tests/properties/test_isolation.py tests/ops/test_indexer_topk.py
               tests/ops/test_indexer_topk_scores.py tests/ops/test_indexer_topk_select.py
               --deselect "tests/properties/test_cuda_replay.py::test_replay_equals_reference_and_repeats[ds_fp8-100]")
# shared-memory kernels: append and flush (CSA and HCA, bad rows among good
# ones), indexer_topk (its mxfp4 score kernel in pairs of warps on the small
# grids, one warp a tile column on the full grid of
# handler_scores_bit_exact_on_a_full_grid, and several tiles a warp at 65536
# entries, 6 on an H100, so every warp wraps its ring of 2 cp.async stages;
# its select in clusters of 4 CTAs there, handing keys over through
# distributed shared memory)
RACECHECK_ARGS=(tests/properties/test_cuda_replay.py tests/ops/test_indexer_topk_scores.py
                tests/ops/test_indexer_topk_select.py
                -k "bad_rows_dropped_and_counted or handler_scores_bit_exact or long_context_many_ties or (select_spread_over_a_cluster and 262144)")

# Which option filters kernels by name (--kernel-name in recent releases, --filter before).
filter=()
if [ "${SANITIZE_KERNELS:-all}" != all ]; then
  for opt in --kernel-name --filter; do
    if "$SAN" --help 2>/dev/null | grep -q -- "^ *$opt "; then
      filter=("$opt" "kns=$SANITIZE_KERNELS"); break
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
  limit=${SANITIZE_TIMEOUT:-}
  # Straight to the file: a pipe would wait on a survivor. The sanitizer has
  # been seen to die of a segfault and leave its target running, so every
  # process of the run (marked in its environment) is ended at the limit and
  # after the sanitizer exits.
  run_id="$$-$tool-$t0"
  DSV4_SANITIZE_RUN=$run_id "$SAN" --tool "$tool" --target-processes application-only \
    "${filter[@]}" "${SANITIZE_OPTS[@]}" --error-exitcode 86 --print-limit 20 \
    "$PY" -m pytest -n 0 -m gpu -p no:cacheprovider -x -v -rs --durations=8 \
    -o console_output_style=times "${args[@]}" > "$log" 2>&1 &
  pid=$!
  dog=
  if [ -n "$limit" ]; then
    ( sleep "$limit"; echo "sanitize: $tool past its ${limit} s: stopped" >> "$log"; reap "$run_id" ) \
      > /dev/null 2>&1 &
    dog=$!
    disown "$dog"
  fi
  wait "$pid"
  rc=$?
  if [ -n "$dog" ]; then
    sleeper=$(pgrep -P "$dog")         # the watchdog, then its sleep
    kill -KILL "$dog" $sleeper 2>/dev/null
  fi
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
