"""Run-time input errors (docs/design/bad-input.md): counters carried in `state.errors`.

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
    BAD_LENGTH = 4        # a length beyond the request's capacity, or a bad accepted count
    NONFINITE = 5         # NaN or Inf in an input
    BAD_LAYER = 6         # traced layer index out of range or of the wrong kind
    BAD_BLOCK_ASSIGNMENT = 7  # new-block row with logical or physical id out of range


NUM_ERROR_KINDS = len(ErrorKind)

_DESCRIPTIONS = {
    ErrorKind.BAD_SLOT: "request slot outside [0, max_requests)",
    ErrorKind.BAD_POSITION: "negative position or position beyond the request's block table",
    ErrorKind.MISSING_BLOCK: "block table entry missing (-1) or >= num_blocks where needed",
    ErrorKind.BAD_INDEX: "top-k index < -1 or of an entry not emitted yet",
    ErrorKind.BAD_LENGTH: ("length beyond the request's capacity, or a speculative step's "
                           "accepted count outside [0, the slot's verified rows]"),
    ErrorKind.NONFINITE: "NaN or Inf in an input",
    ErrorKind.BAD_LAYER: "traced layer index out of range or of the wrong kind",
    ErrorKind.BAD_BLOCK_ASSIGNMENT: "new block with logical or physical id out of range",
}


class CacheInputError(RuntimeError):
    """Raised by `check_errors` when an op dropped bad input.

    `counts` maps each `ErrorKind` to its count, summed over the shards read;
    `by_shard` (sharded states) maps each shard with a non-zero counter to
    (the process that holds it, its counts), so a multi-process run says which
    process saw what."""

    def __init__(self, counts: dict[ErrorKind, int],
                 by_shard: dict[int, tuple[int, dict[ErrorKind, int]]] | None = None):
        self.counts = counts
        self.by_shard = by_shard or {}
        lines = [f"  {kind.name.lower()}: {n} ({_DESCRIPTIONS[kind]})"
                 for kind, n in counts.items()]
        for shard, (process, kinds) in sorted(self.by_shard.items()):
            lines.append(f"  shard {shard} (process {process}): "
                         + ", ".join(f"{k.name.lower()} {n}" for k, n in kinds.items()))
        super().__init__("the cache dropped bad input (rows dropped, nothing else changed):\n"
                         + "\n".join(lines))


def _nonzero(row) -> dict[ErrorKind, int]:
    return {ErrorKind(i): int(v) for i, v in enumerate(row) if v}


def shard_error_counts(state_or_errors) -> dict[int, tuple[int, dict[ErrorKind, int]]]:
    """Per shard this process can read: shard -> (process holding it, its
    non-zero counters). Unsharded counters are shard 0. In a multi-process run
    (docs/design/sharding.md) a process reads only the shards on its own devices;
    the others' counters are theirs to check. Reads device data: host side
    only."""
    errors = getattr(state_or_errors, "errors", state_or_errors)
    out = {}
    if isinstance(errors, jax.Array) and not errors.is_fully_replicated:
        for piece in errors.addressable_shards:
            shard = (piece.index[0].start or 0) // NUM_ERROR_KINDS
            if shard not in out:    # a shard held by several devices is read once
                out[shard] = (piece.device.process_index, _nonzero(np.asarray(piece.data)))
        return {k: v for k, v in sorted(out.items()) if v[1]}
    process = jax.process_index()
    rows = np.asarray(errors).reshape(-1, NUM_ERROR_KINDS)
    return {k: (process, _nonzero(row)) for k, row in enumerate(rows) if row.any()}


def error_counts(state_or_errors) -> dict[ErrorKind, int]:
    """Non-zero counters as a dict, summed over the shards this process can
    read (reads device data: host side only)."""
    return _summed(shard_error_counts(state_or_errors))


def _summed(by_shard) -> dict[ErrorKind, int]:
    total = np.zeros(NUM_ERROR_KINDS, np.int64)
    for _, kinds in by_shard.values():
        for kind, n in kinds.items():
            total[kind] += n
    return _nonzero(total)


def check_errors(state_or_errors) -> None:
    """Raise `CacheInputError` if any op has counted bad input. Accepts a
    `CacheState` or its `errors` array. A sharded state's counters are summed
    over its shards and also listed per shard with the process that holds
    each; in a multi-process run each process checks its own shards (call it
    on every process)."""
    by_shard = shard_error_counts(state_or_errors)
    counts = _summed(by_shard)
    if counts:
        errors = getattr(state_or_errors, "errors", state_or_errors)
        sharded = np.shape(errors)[0] > NUM_ERROR_KINDS
        raise CacheInputError(counts, by_shard if sharded else None)


def reset_errors(state):
    """The state with every error counter back at zero, e.g. once
    `check_errors` was handled. Inside or outside jit; on a concrete state
    the new counters keep the old ones' placement (sharded states too)."""
    errors = state.errors
    zeros = jnp.zeros(errors.shape, errors.dtype)
    if not isinstance(errors, jax.core.Tracer):
        zeros = jax.device_put(zeros, errors.sharding)
    return dataclasses.replace(state, errors=zeros)
