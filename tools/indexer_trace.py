"""In-situ GPU timeline of indexer_topk: kernel durations and gaps as they
run inside a jitted loop (CUPTI events through jax.profiler), not one kernel
at a time as a kernel profiler replays them.

    python3 tools/indexer_trace.py B ctx [calls]

benchmarks/indexer.py's loop of `calls` calls (state carried) runs three
times under the profiler; the last run's events are printed, then the median
duration of each kernel and the median time from one score kernel's start to
the next (the period of one call).
"""
import collections
import glob
import os
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import ProfileData

sys.path.insert(0, "benchmarks")
from indexer import decode_loop, make_state  # noqa: E402

B, ctx = int(sys.argv[1]), int(sys.argv[2])
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 6
st = make_state(B, ctx)
rng = np.random.default_rng(1)
slot = jnp.arange(B, dtype=jnp.int32)
pos = jnp.full((B,), ctx - 1, jnp.int32)
q = jnp.asarray(rng.standard_normal((B, 64, 128)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((B, 64)), jnp.float32)


def kernel_name(demangled):
    """ScoreKernelMxfp4 of 'dsv4::(anonymous namespace)::ScoreKernelMxfp4(dsv4::...)'."""
    base = demangled[:demangled.rfind("(")] if demangled.endswith(")") else demangled
    return base.split("::")[-1]


loop = decode_loop(slot, pos, 512, calls, impl="auto", q_format="mxfp4")
loop(st, q, w).block_until_ready()
d = tempfile.mkdtemp()
with jax.profiler.trace(d):
    for _ in range(3):
        loop(st, q, w).block_until_ready()
files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
if not files:
    sys.exit("no profile written")
events = []
for plane in ProfileData.from_file(files[0]).planes:
    if plane.name.startswith("/device:GPU"):
        for line in plane.lines:
            events += [(e.start_ns, e.duration_ns, e.name) for e in line.events]
if not events:
    sys.exit("no GPU events (not on a GPU?)")
events.sort()
kernels = [e for e in events if "Kernel" in e[2]]
last = kernels[-2 * calls:]
t0 = last[0][0]
prev_end = None
for s, dur, name in last:
    gap = "" if prev_end is None else f"{(s - prev_end) / 1e3:7.2f}"
    short = kernel_name(name)
    print(f"{(s - t0) / 1e3:9.2f} us  {dur / 1e3:7.2f} us  gap {gap:>7s}  {short}")
    prev_end = s + dur
by_name = collections.defaultdict(list)
for s, dur, name in last:
    by_name[kernel_name(name)].append(dur / 1e3)
for name, ds in by_name.items():
    print(f"{name}: median {statistics.median(ds):.2f} us")
starts = [s for s, _, name in last if "Score" in name]
if len(starts) > 1:
    periods = [(b - a) / 1e3 for a, b in zip(starts, starts[1:])]
    print(f"one call (score start to score start): median {statistics.median(periods):.2f} us")
