#!/usr/bin/env bash
# The decode step's cache kernels (append, write_layer, indexer_topk) on a GPU
# machine: their GPU tests, then device times against the targets and the
# original append kernel in one short table (tools/step_kernels_check.py).
# Builds nothing: build first with the testing modules, as tools/gpu_check.sh
# does:
#   pip install --no-build-isolation --no-deps -e . \
#       --config-settings=cmake.define.DSV4_BUILD_TESTING=ON
# The original append kernel is timed from a copy of its sources in $PEERS
# (default .peers/, ignored by git); without it, or without torch, its column
# says why. Logs and JSON go to $OUT (or /tmp/step_kernels_out).
# SKIP_TESTS=1 skips the tests; QUICK=1 times fewer sizes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/step_kernels_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git log -1 --format="commit %h %s" 2>/dev/null | cut -c1-100
test_rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== GPU tests of the changed kernels"
  $PY -m pytest -q -n 0 -m gpu -p no:cacheprovider \
      tests/ops/test_decode_step_kernels_gpu.py tests/ops/test_flush_windows_gpu.py \
      tests/ops/test_write_layer.py tests/ops/test_flush.py \
      2>&1 | tee "$OUT/pytest.log" | tail -15
  test_rc=${PIPESTATUS[0]}
fi
echo "== device times ($(( $(date +%s) - T0 )) s so far)"
$PY tools/step_kernels_check.py --json "$OUT/step_kernels.json" --peers "${PEERS:-.peers}" ${QUICK:+--quick} \
    2>&1 | tee "$OUT/times.log" | grep -v '^{' | tail -30
bench_rc=${PIPESTATUS[0]}
echo "== write_layer then indexer_topk with XLA's command buffers off"
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" $PY tools/step_kernels_check.py \
    --pair-only 2>&1 | tee "$OUT/pair_no_command_buffers.log" | grep '^| write' | tail -4
echo "== done in $(( $(date +%s) - T0 )) s: tests rc=$test_rc times rc=$bench_rc"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
