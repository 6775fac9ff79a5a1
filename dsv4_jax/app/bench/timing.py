"""How the benchmarks time: the sampling loop, and one run's record of rows
with the two references every op row is compared with (a device copy of the
same byte count, and the cheapest call there is).

Method: every timed function is jitted, the state donated where the op
updates it. One timed call runs `inner` back-to-back op calls on different
layers inside one jit (so small ops measure the device, not Python
dispatch), and each batch of `batch` calls rotates over separate input sets;
a sample is the wall time of a batch over the op calls it made, closed by
jax.block_until_ready; the result is the median of `reps` samples after
warm-up. The copy reference is a jitted uint8 XOR over a buffer of half an
op's byte count (read + write = the same bytes), timed the same way in the
same run.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ... import _ffi
from ...errors import error_counts
from .inputs import inner_layers


def time_it(call, n_sets, batch, reps, warm=2):
    """Median seconds per call of call(i) (i rotates over input sets)."""
    out = None
    for i in range(warm * n_sets):
        out = call(i)
    jax.block_until_ready(out)
    samples = []
    k = 0
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(batch):
            out = call(k)
            k += 1
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / batch)
    return statistics.median(samples)


@dataclasses.dataclass(frozen=True)
class Settings:
    reps: int              # samples a case, the median is reported
    batch: int             # calls a sample
    with_reference: bool   # also time the jnp reference of each op
    inner: int | None = None   # op calls a timed jit call; None: by size (inner_layers)


class BenchRun:
    """One benchmark run: its settings, the rows it recorded (each also
    handed to `emit` as a line as it comes), the error counts of the states
    it timed, and the references op rows are compared with."""

    def __init__(self, settings: Settings, emit=print):
        self.settings = settings
        self.emit = emit
        self.platform = jax.default_backend()
        self.impl = "cuda" if self.platform == "gpu" else "cpu"
        self.rows: list[dict] = []
        self.errors: dict[str, int] = {}
        self.empty_us = float("nan")
        self._copy_cache: dict[tuple[int, int], float] = {}
        self.rng = np.random.default_rng(0)

    def layers(self, rows: int, most: int | None = None) -> int:
        """Op calls (on as many layers) a timed jit call makes for an op of
        `rows` rows: the settings' `inner`, else many for small ops and few
        for large ones (inputs.inner_layers), at most `most`."""
        n = self.settings.inner or inner_layers(rows)
        return n if most is None else min(n, most)

    @property
    def impls(self) -> tuple[str, ...]:
        """The impls an op is timed with."""
        return (self.impl, "reference") if self.settings.with_reference else (self.impl,)

    def time(self, call, n_sets, reps=None, batch=None, warm=2):
        """time_it with this run's reps and batch unless given."""
        return time_it(call, n_sets, batch or self.settings.batch, reps or self.settings.reps,
                       warm)

    def record(self, **row):
        self.rows.append(row)
        self.emit(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()))

    def count_errors(self, state):
        """Adds the bad input the ops counted in `state`: a timed call that
        dropped its rows did less than the bytes it is credited with."""
        for kind, n in error_counts(state).items():
            self.errors[kind.name.lower()] = self.errors.get(kind.name.lower(), 0) + n

    def copy_seconds(self, nbytes, inner=1):
        """Seconds of the copy reference over `nbytes` (read + write), with
        `inner` separate buffers a jit call, as the op is timed."""
        n = max(int(nbytes // 2), 16)
        if (n, inner) in self._copy_cache:
            return self._copy_cache[(n, inner)]
        sets = 2
        bufs = [[jnp.asarray(self.rng.integers(0, 256, n, dtype=np.uint8)) for _ in range(inner)]
                for _ in range(sets)]
        f = jax.jit(lambda xs: [x ^ jnp.uint8(0x5A) for x in xs], donate_argnums=0)

        def call(i):
            bufs[i % sets] = f(bufs[i % sets])
            return bufs[i % sets]
        s = self.time(call, sets) / inner
        self._copy_cache[(n, inner)] = s
        return s

    @property
    def copy_gbps(self) -> float:
        """The fastest copy of the run in GB/s (bytes read + written): the
        ceiling the plot draws."""
        return max((2 * n / s / 1e9 for (n, _), s in self._copy_cache.items()), default=0.0)

    def empty_call(self):
        """The floor: an FFI call that does nothing (dsv4_noop, in the
        testing modules), else the smallest XLA op."""
        inner = 64
        x = [jnp.zeros((4,), jnp.int32) for _ in range(2)]
        if _ffi.has_target(self.impl, "dsv4_noop"):
            noop = jax.ffi.ffi_call("dsv4_noop", jax.ShapeDtypeStruct((4,), jnp.int32),
                                    input_output_aliases={0: 0})
            what = "empty FFI call"
        else:
            noop = lambda v: v + 1  # noqa: E731
            what = "smallest XLA op"

        def body(v):
            for _ in range(inner):
                v = noop(v)
            return v
        f = jax.jit(body, donate_argnums=0)

        def call(i):
            x[i % 2] = f(x[i % 2])
            return x[i % 2]
        self.empty_us = self.time(call, 2) / inner * 1e6
        self.record(op="empty", what=what, us=self.empty_us)

    def op_row(self, op, rows, seconds, nbytes, inner=1, **extra):
        """A row of an op that moves `nbytes` in `seconds`, against the copy
        of as many bytes and the empty call."""
        copy = self.copy_seconds(nbytes, inner)
        self.record(op=op, rows=rows, us=seconds * 1e6, bytes=int(nbytes),
                    GBps=nbytes / seconds / 1e9, copy_pct=100.0 * copy / seconds,
                    vs_empty=seconds * 1e6 / self.empty_us, **extra)
