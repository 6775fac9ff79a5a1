"""Run-time input errors (docs/design.md §9): counters carried in `state.errors`.

Data-dependent bad input (a slot out of range, a missing block, ...) cannot
raise inside a jitted step. Every op instead drops the offending token or row
and increments the counter of its kind; `check_errors` reads the counters on
the host and raises `CacheInputError` with a readable description.
"""
from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np


class ErrorKind(enum.IntEnum):
    """Index of each counter in `state.errors`. The C++ and CUDA code use the
    same numbers (enum ErrorKind in ffi/include/dsv4/layout.h)."""
    BAD_SLOT = 0          # slot outside [0, R) (-1 padding is not an error)
    BAD_POSITION = 1      # negative position, or beyond the request's block table
    MISSING_BLOCK = 2     # block table entry -1 or >= N where a write/read needs it
    BAD_INDEX = 3         # top-k index < -1, or of an entry not emitted yet
    BAD_LENGTH = 4        # a length beyond the request's capacity
    NONFINITE = 5         # NaN or Inf in an input
    BAD_LAYER = 6         # traced layer index out of range or of the wrong kind
    BAD_BLOCK_ASSIGNMENT = 7  # new-block row with logical or physical id out of range


NUM_ERROR_KINDS = len(ErrorKind)

_DESCRIPTIONS = {
    ErrorKind.BAD_SLOT: "request slot outside [0, max_requests)",
    ErrorKind.BAD_POSITION: "negative position or position beyond the request's block table",
    ErrorKind.MISSING_BLOCK: "block table entry missing (-1) or >= num_blocks where needed",
    ErrorKind.BAD_INDEX: "top-k index < -1 or of an entry not emitted yet",
    ErrorKind.BAD_LENGTH: "length beyond the request's capacity",
    ErrorKind.NONFINITE: "NaN or Inf in an input",
    ErrorKind.BAD_LAYER: "traced layer index out of range or of the wrong kind",
    ErrorKind.BAD_BLOCK_ASSIGNMENT: "new block with logical or physical id out of range",
}


class CacheInputError(RuntimeError):
    """Raised by `check_errors` when an op dropped bad input."""

    def __init__(self, counts: dict[ErrorKind, int]):
        self.counts = counts
        lines = [f"  {kind.name.lower()}: {n} ({_DESCRIPTIONS[kind]})"
                 for kind, n in counts.items()]
        super().__init__("the cache dropped bad input (rows dropped, nothing else changed):\n"
                         + "\n".join(lines))


def error_counts(state_or_errors) -> dict[ErrorKind, int]:
    """Non-zero counters as a dict (reads device data: host side only)."""
    errors = getattr(state_or_errors, "errors", state_or_errors)
    values = np.asarray(errors).reshape(-1, NUM_ERROR_KINDS).sum(axis=0)
    return {ErrorKind(i): int(v) for i, v in enumerate(values) if v}


def check_errors(state_or_errors) -> None:
    """Raise `CacheInputError` if any op has counted bad input. Accepts a
    `CacheState` or its `errors` array (sharded states sum over shards)."""
    counts = error_counts(state_or_errors)
    if counts:
        raise CacheInputError(counts)


def reset_errors(state):
    """The state with every error counter back at zero, e.g. once
    `check_errors` was handled. Inside or outside jit; on a concrete state
    the new counters keep the old ones' placement (sharded states too)."""
    errors = state.errors
    zeros = jnp.zeros(errors.shape, errors.dtype)
    if not isinstance(errors, jax.core.Tracer):
        zeros = jax.device_put(zeros, errors.sharding)
    return dataclasses.replace(state, errors=zeros)
