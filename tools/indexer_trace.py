"""In-situ GPU timeline of indexer_topk: kernel durations and gaps as they
run inside a jitted loop (CUPTI events through jax.profiler), not one kernel
at a time as a kernel profiler replays them.

    python3 tools/indexer_trace.py B ctx [calls]

benchmarks/indexer.py's loop of `calls` calls (state carried) runs three
times under the profiler; the last run's kernels are printed, then the
median duration of each kernel and the median time from one score kernel's
start to the next (the period of one call, which the benchmark reports).
"""
import collections
import os
import statistics
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from device_timeline import kernel_events, kernel_name, median_period_us  # noqa: E402
from indexer import decode_loop, make_state  # noqa: E402

B, ctx = int(sys.argv[1]), int(sys.argv[2])
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 6
st = make_state(B, ctx)
rng = np.random.default_rng(1)
slot = jnp.arange(B, dtype=jnp.int32)
pos = jnp.full((B,), ctx - 1, jnp.int32)
q = jnp.asarray(rng.standard_normal((B, 64, 128)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((B, 64)), jnp.float32)

loop = decode_loop(slot, pos, 512, calls, impl="auto", q_format="mxfp4")
events = [e for e in kernel_events(loop, st, q, w, runs=3) if "Kernel" in e[2]]
if not events:
    sys.exit("no GPU kernels traced (not on a GPU?)")
last = events[-2 * calls:]
t0 = last[0][0]
prev_end = None
for s, dur, name in last:
    gap = "" if prev_end is None else f"{(s - prev_end) / 1e3:7.2f}"
    print(f"{(s - t0) / 1e3:9.2f} us  {dur / 1e3:7.2f} us  gap {gap:>7s}  {kernel_name(name)}")
    prev_end = s + dur
by_name = collections.defaultdict(list)
for s, dur, name in last:
    by_name[kernel_name(name)].append(dur / 1e3)
for name, ds in by_name.items():
    print(f"{name}: median {statistics.median(ds):.2f} us")
period = median_period_us(last, "Score")
if period is not None:
    print(f"one call (score start to score start): median {period:.2f} us")
