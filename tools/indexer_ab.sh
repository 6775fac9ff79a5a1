#!/usr/bin/env bash
# A/B of an indexer_topk kernel change on the GPU machine, in one call:
# builds main without and with PATCH once, keeps both CUDA modules, and
# swaps them in before each trace (tools/indexer_trace.py B ctx 8), the two
# alternated REPS times at B = 64, 64k, then once each at B = 64, 8k and
# B = 8, 64k. Alternating one machine's builds shows differences of a few
# tenths of a µs that separate calls, on fresh machines, do not
# (benchmarks/RESULTS-indexer.md, run 22).
#   device tool:  PATCH=path/to.patch [TESTS=1] [REPS=3] bash tools/indexer_ab.sh
# PATCH: a diff against the tree as it is there (git diff > path/to.patch);
# TESTS=1 also runs the indexer GPU tests on the patched build. The tree is
# left patched, with the patched module in place.
set -u
cd "$(dirname "$0")/.."
: "${PATCH:?set PATCH to the change to measure}"
build() {
  python3 -m pip install -q --no-build-isolation --no-deps -e . >/tmp/ab_build.log 2>&1 \
    || { tail -30 /tmp/ab_build.log; exit 1; }
}
module() { python3 -c "import importlib.util as u; print(u.find_spec('dsv4_jax._dsv4_cuda').origin)"; }
trace() {
  echo "[$1] B ctx = $2: $(python3 tools/indexer_trace.py $2 8 2>/dev/null \
    | grep -E 'Score.*median|one call' | tr '\n' ' ')"
}
build && cp "$(module)" /tmp/ab_base.so || exit 1
patch -s -p1 <"$PATCH" || { echo "PATCH does not apply: $PATCH"; exit 1; }
build && cp "$(module)" /tmp/ab_new.so || exit 1
if [ -n "${TESTS:-}" ]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_indexer_topk.py 2>&1 | tail -2
fi
so=$(module)
for _ in $(seq "${REPS:-3}"); do
  for v in base new; do cp "/tmp/ab_$v.so" "$so"; trace $v "64 65536"; done
done
for c in "64 8192" "8 65536"; do
  for v in base new; do cp "/tmp/ab_$v.so" "$so"; trace $v "$c"; done
done
cp /tmp/ab_new.so "$so"
