"""GPU kernels of a jitted call as they ran: start, duration and name of each
(CUPTI activity records read back through jax.profiler), so that a timing
can leave out what the host adds (dispatch, the final sync) and a kernel's
time can be told from its neighbours'.

    events = kernel_events(fn, *args)     # [] where there is no GPU
"""
from __future__ import annotations

import glob
import os
import shutil
import statistics
import tempfile

import jax
from jax.profiler import ProfileData


def kernel_name(demangled):
    """ScoreKernelMxfp4 of 'dsv4::(anonymous namespace)::ScoreKernelMxfp4(dsv4::...)'."""
    base = demangled[:demangled.rfind("(")] if demangled.endswith(")") else demangled
    return base.split("::")[-1]


def kernel_events(fn, *args, runs=1):
    """[(start_ns, duration_ns, name)] of the GPU activity of `runs` calls of
    fn(*args), sorted by start (fn is called once before, so compiling is not
    traced). Only the streams' lines: the profiler's "XLA Modules" and "XLA
    Ops" lines of the same device repeat the kernels' time spans."""
    jax.block_until_ready(fn(*args))
    d = tempfile.mkdtemp()
    try:
        with jax.profiler.trace(d):
            for _ in range(runs):
                jax.block_until_ready(fn(*args))
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        events = []
        for f in files:
            for plane in ProfileData.from_file(f).planes:
                if not plane.name.startswith("/device:GPU"):
                    continue
                for line in plane.lines:
                    if line.name.startswith("XLA"):
                        continue
                    events += [(e.start_ns, e.duration_ns, e.name) for e in line.events]
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return sorted(events)


def median_period_us(events, first_kernel):
    """Median time from one start of a kernel whose name holds `first_kernel`
    to the next: the period of one call in a loop of calls. None for fewer
    than two starts."""
    starts = [s for s, _, name in events if first_kernel in name]
    if len(starts) < 2:
        return None
    return statistics.median((b - a) / 1e3 for a, b in zip(starts, starts[1:]))
