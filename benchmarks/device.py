"""What the default device offers the benchmarks: the memory a case may
fill, and the copy rate its times are compared with."""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp

from dsv4_jax.app.bench.device_timeline import kernel_events


def memory_limit_bytes():
    """What the default device can hold: the allocator's limit less what is
    in use on a GPU, physical memory on a CPU."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def copy_bandwidth(nbytes=1 << 30, reps=5):
    """Device copy bandwidth in B/s (bytes read + bytes written): the fastest
    of `reps` runs of one kernel (x + 1) on the GPU's timeline, or host-timed
    where there is no GPU."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    events = kernel_events(f, x, runs=reps)
    if events:   # one kernel a run; the reps longest events, should others appear
        return 2 * nbytes / (min(sorted(d for _, d, _ in events)[-reps:]) * 1e-9)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return 2 * nbytes / min(ts)
