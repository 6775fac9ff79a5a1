"""Run-time input errors (docs/design/bad-input.md): counters carried in `state.errors`.

Data-dependent bad input (a slot out of range, a missing block, ...) cannot
raise inside a jitted step. Every op instead drops the offending token or row
and increments the counter of its kind; `check_errors` reads the counters on
the host and raises `CacheInputError` with a readable description.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .error_ops import ErrorOp


class ErrorKind(enum.IntEnum):
    """Index of each counter in `state.errors`. The C++ and CUDA code use the
    same numbers (enum ErrorKind in ffi/include/dsv4/layout.h)."""
    BAD_SLOT = 0          # slot outside [0, R) (-1 padding is not an error)
    BAD_POSITION = 1      # position < 0 or >= max_context (flush: also out of its run)
    MISSING_BLOCK = 2     # block table entry -1 or >= N where a write/read needs it
    BAD_INDEX = 3         # top-k index < -1, or of an entry not emitted yet
    BAD_LENGTH = 4        # a length beyond the request's capacity, or a bad accepted count
    NONFINITE = 5         # NaN or Inf in an input
    BAD_LAYER = 6         # traced layer index out of range or of the wrong kind
    BAD_BLOCK_ASSIGNMENT = 7  # new-block row with logical or physical id out of range
    STALE_WINDOW = 8      # a window row attention needs holds another position


NUM_ERROR_KINDS = len(ErrorKind)

# With error detail each shard's row holds, after the K counters, these
# fields of K words each (docs/design/bad-input.md). FIRST_ROW is what the
# handlers write: the smallest input row each kind dropped in the op now
# running (NO_ROW: none, or a kind not tied to a row); the op's wrapper turns
# it into the record (op, layer, slot, position) of the kind's first count.
FIRST_ROW, OP, LAYER, SLOT, POSITION = range(5)
DETAIL_FIELDS = 5
NO_ROW = np.iinfo(np.int32).max


def errors_row(config) -> int:
    """int32s of one shard's row of `state.errors`."""
    return NUM_ERROR_KINDS * (1 + DETAIL_FIELDS if config.error_detail else 1)


def detail_field(row, field: int):
    """One detail field (FIRST_ROW, OP, ...) of a shard's errors row: its K
    words, by kind (`row` numpy or jnp, its last axis the row)."""
    start = NUM_ERROR_KINDS * (1 + field)
    return row[..., start:start + NUM_ERROR_KINDS]


def add_counts(errors, counts: dict):
    """`errors` (one shard's row) plus per-row counts `{kind: mask}`, each a
    bool array whose first axis is the op's input row (trailing axes: several
    counts a row). With error detail (a row longer than the counters) each
    kind's FIRST_ROW also takes the smallest row counted, as the handlers'
    CountError does; without it only the counters change, as always."""
    K = NUM_ERROR_KINDS
    detail = errors.shape[0] > K
    for kind, mask in counts.items():
        mask = jnp.asarray(mask)
        errors = errors.at[int(kind)].add(jnp.sum(mask, dtype=jnp.int32))
        if detail and mask.ndim:
            hit = jnp.any(mask.reshape(mask.shape[0], -1), axis=1)
            rows = jnp.where(hit, jnp.arange(mask.shape[0], dtype=jnp.int32), NO_ROW)
            at = K * (1 + FIRST_ROW) + int(kind)
            errors = errors.at[at].min(jnp.min(rows, initial=NO_ROW))
    return errors


_DESCRIPTIONS = {
    ErrorKind.BAD_SLOT: "request slot outside [0, max_requests)",
    ErrorKind.BAD_POSITION: ("token rows at a position < 0 or >= max_context (flush: also a "
                             "row out of its request's run of consecutive positions)"),
    ErrorKind.MISSING_BLOCK: "block table entry missing (-1) or >= num_blocks where needed",
    ErrorKind.BAD_INDEX: "top-k index < -1 or of an entry not emitted yet",
    ErrorKind.BAD_LENGTH: ("length beyond the request's capacity, or a speculative step's "
                           "accepted count outside [0, the slot's verified rows]"),
    ErrorKind.NONFINITE: "NaN or Inf in an input",
    ErrorKind.BAD_LAYER: "traced layer index out of range or of the wrong kind",
    ErrorKind.BAD_BLOCK_ASSIGNMENT: "new block with logical or physical id out of range",
    ErrorKind.STALE_WINDOW: ("window rows attention needed that hold another position (a "
                             "chunk appended before its own reads, a gap or a rewind of the "
                             "request's positions): each such row of each query is not read"),
}


class CacheInputError(RuntimeError):
    """Raised by `check_errors` when an op dropped bad input.

    `counts` maps each `ErrorKind` to its count, summed over the shards read;
    `by_shard` (sharded states) maps each shard with a non-zero counter to
    (the process that holds it, its counts), so a multi-process run says which
    process saw what. `first` (for a state made with
    `CacheConfig(error_detail=True)`) maps each kind to a `FirstCount`
    (shard, op, layer, slot, position) of its first count: the op (an
    `ErrorOp`) that counted it first, on the lowest shard that counted it
    (shard None: an unsharded state), its global layer (-1: an op without
    one), and the slot and position of the smallest input row it dropped
    of that kind (as the op got them, shard-local slots when sharded; -1:
    a kind not tied to a row, such as BAD_LAYER, or an op whose rows have no
    position)."""

    def __init__(self, counts: dict[ErrorKind, int],
                 by_shard: dict[int, tuple[int, dict[ErrorKind, int]]] | None = None,
                 first: dict | None = None):
        self.counts = counts
        self.by_shard = by_shard or {}
        self.first = first or {}
        lines = [f"  {kind.name.lower()}: {n} ({_DESCRIPTIONS[kind]})"
                 + _first_text(kind, self.first.get(kind)) for kind, n in counts.items()]
        for shard, (process, kinds) in sorted(self.by_shard.items()):
            lines.append(f"  shard {shard} (process {process}): "
                         + ", ".join(f"{k.name.lower()} {n}" for k, n in kinds.items()))
        super().__init__("the cache dropped bad input (rows dropped, nothing else changed):\n"
                         + "\n".join(lines))


def _nonzero(row) -> dict[ErrorKind, int]:
    return {ErrorKind(i): int(v) for i, v in enumerate(row[:NUM_ERROR_KINDS]) if v}


class FirstCount(NamedTuple):
    """Where a kind was first counted (`CacheInputError.first`)."""
    shard: int | None
    op: ErrorOp
    layer: int
    slot: int
    position: int


def _first_text(kind, record) -> str:
    if record is None:
        return ""
    where = [record.op.name.lower()] + ([] if record.layer < 0 else [f"layer {record.layer}"])
    if record.slot != -1:               # a row (slot -1 is padding, never counted)
        where.append(f"slot {record.slot}")
        if record.position != -1 or kind == ErrorKind.BAD_POSITION:
            where.append(f"position {record.position}")
    return f"; first counted by {', '.join(where)}" + (
        "" if record.shard is None else f" on shard {record.shard}")


def _row_length(state_or_errors) -> int:
    config = getattr(state_or_errors, "config", None)
    if config is None:
        return NUM_ERROR_KINDS
    return errors_row(config)


def _shard_rows(state_or_errors) -> dict[int, tuple[int, np.ndarray]]:
    """Every shard's row of `errors` this process can read: shard ->
    (process holding it, the row as numpy)."""
    errors = getattr(state_or_errors, "errors", state_or_errors)
    row = _row_length(state_or_errors)
    out = {}
    if isinstance(errors, jax.Array) and not errors.is_fully_replicated:
        for piece in errors.addressable_shards:
            shard = (piece.index[0].start or 0) // row
            if shard not in out:    # a shard held by several devices is read once
                out[shard] = (piece.device.process_index, np.asarray(piece.data))
        return dict(sorted(out.items()))
    process = jax.process_index()
    return {k: (process, r) for k, r in enumerate(np.asarray(errors).reshape(-1, row))}


def _first_records(state_or_errors, rows) -> dict:
    """{ErrorKind: FirstCount}: the lowest shard's record of each kind, for
    a state with error detail."""
    config = getattr(state_or_errors, "config", None)
    if config is None or not config.error_detail:
        return {}
    out = {}
    for shard, (_, row) in sorted(rows.items()):
        op, layer, slot, position = (detail_field(row, f) for f in (OP, LAYER, SLOT, POSITION))
        for k in range(NUM_ERROR_KINDS):
            if row[k] and op[k] and ErrorKind(k) not in out:
                out[ErrorKind(k)] = FirstCount(shard if config.sharded else None, ErrorOp(int(op[k])),
                                               int(layer[k]), int(slot[k]), int(position[k]))
    return out


def shard_error_counts(state_or_errors) -> dict[int, tuple[int, dict[ErrorKind, int]]]:
    """Per shard this process can read: shard -> (process holding it, its
    non-zero counters). Unsharded counters are shard 0. In a multi-process run
    (docs/design/sharding.md) a process reads only the shards on its own devices;
    the others' counters are theirs to check. Reads device data: host side
    only."""
    rows = _shard_rows(state_or_errors)
    out = {k: (process, _nonzero(row)) for k, (process, row) in rows.items()}
    return {k: v for k, v in out.items() if v[1]}


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
    on every process). A state made with `CacheConfig(error_detail=True)`
    also says, per kind, the op and layer that counted it first and the
    slot and position of the row it dropped (pass the state, not its errors
    array, for that)."""
    rows = _shard_rows(state_or_errors)
    by_shard = {k: (process, _nonzero(row)) for k, (process, row) in rows.items()}
    by_shard = {k: v for k, v in by_shard.items() if v[1]}
    counts = _summed(by_shard)
    if counts:
        errors = getattr(state_or_errors, "errors", state_or_errors)
        sharded = np.shape(errors)[0] > _row_length(state_or_errors)
        raise CacheInputError(counts, by_shard if sharded else None,
                              _first_records(state_or_errors, rows))


def reset_errors(state):
    """The state with every error counter back at zero, e.g. once
    `check_errors` was handled. Inside or outside jit; on a concrete state
    the new counters keep the old ones' placement (sharded states too)."""
    errors = state.errors
    zeros = jnp.zeros(errors.shape, errors.dtype)
    if not isinstance(errors, jax.core.Tracer):
        zeros = jax.device_put(zeros, errors.sharding)
    return dataclasses.replace(state, errors=zeros)
