"""Where the first bad input of each kind was counted (docs/design/bad-input.md):
the op, the layer, and the slot and position of the row it dropped, kept in
`state.errors` beside the counters when the config asks for it
(`CacheConfig(error_detail=True)`), shown by `check_errors`.

Per shard the row of `errors` is

    counters   i32[K]   as without detail (K = NUM_ERROR_KINDS)
    first_row  i32[K]   written by the op: the smallest input row it dropped
                        of each kind (NO_ROW: none, or a kind not tied to a row)
    op         i32[K]   the ErrorOp that first counted the kind, 0 none
    layer      i32[K]   its global layer (-1: an op without one)
    slot       i32[K]   the slot of the row it dropped first (-1: none)
    position   i32[K]   that row's position (-1: an op whose rows have none)

so `errors` is i32[S * 6K]. Every implementation of an op (the reference,
the CPU and the CUDA handlers) counts into the first 2K words: the counter,
and the smallest offending row (an atomic min on the GPU, so the same row
on every implementation and every run). Around each public op
`records_detail` sets first_row to NO_ROW, runs the op, and for each kind
whose counter the op took from zero writes the op, the layer and the slot
and position of that row, read from the op's own inputs. Cheap: a few dozen
integers an op, and no pass over rows when detail is off.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
from typing import Callable

import jax
import jax.numpy as jnp

from .error_ops import ErrorOp
from .errors import (DETAIL_FIELDS, FIRST_ROW, LAYER, NO_ROW, NUM_ERROR_KINDS, OP, POSITION,
                     SLOT, errors_row)

__all__ = ["ErrorOp", "records_detail", "errors_row", "DETAIL_FIELDS"]

# Set while a public op records: the ops it calls (per shard, or
# write_layer's append) count into the same first_row and record nothing.
_recording = contextvars.ContextVar("dsv4_error_detail_recording", default=False)


@contextlib.contextmanager
def _inside_record():
    token = _recording.set(True)
    try:
        yield
    finally:
        _recording.reset(token)


def records_detail(op: ErrorOp, rows: Callable, *, layer_arg: bool = True, state_at=None):
    """Decorate a public op so that, on a state with error detail, it records
    itself, its `layer` (the argument after the state) and the slot and
    position of the row it dropped first, for every kind it counts first.

    `rows(args)`: the op's input rows, from its arguments by name, as
    (slot i32[S * n], position i32[S * n] or None): row r of shard s is
    entry s * n + r, the row its handler counts as r. `state_at`: where the
    state is in the op's result (None: the result is the state; an int: an
    index of the result tuple, when it is a tuple that long)."""
    def wrap(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(state, *args, **kwargs):
            config = getattr(state, "config", None)
            if not getattr(config, "error_detail", False) or _recording.get():
                return fn(state, *args, **kwargs)
            S, K = config.num_shards, NUM_ERROR_KINDS
            before = state.errors.reshape(S, errors_row(config))
            start = K * (1 + FIRST_ROW)
            cleared = before.at[:, start:start + K].set(NO_ROW).reshape(-1)
            with _inside_record():
                out = fn(dataclasses.replace(state, errors=cleared), *args, **kwargs)
            if state_at is None:
                new = out
            elif isinstance(out, tuple) and len(out) > state_at \
                    and hasattr(out[state_at], "errors"):
                new = out[state_at]
            else:                                 # return_state=False: nothing kept
                return out
            after = new.errors.reshape(S, errors_row(config))
            bound = signature.bind(state, *args, **kwargs)
            bound.apply_defaults()
            layer = bound.arguments.get("layer", -1) if layer_arg else -1
            slot, position = _row_records(after[:, start:start + K], *rows(bound.arguments), S)
            here = {OP: jnp.full((S, K), int(op), jnp.int32),
                    LAYER: jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (S, K)),
                    SLOT: slot, POSITION: position}
            first = (before[:, :K] == 0) & (after[:, :K] > 0)
            for field, value in here.items():
                at = K * (1 + field)
                after = after.at[:, at:at + K].set(
                    jnp.where(first, value, after[:, at:at + K]))
            new = dataclasses.replace(new, errors=after.reshape(-1))
            if state_at is None:
                return new
            return out[:state_at] + (new,) + out[state_at + 1:]
        return run
    return wrap


def _row_records(first_row, slot, position, S: int):
    """(slot, position) i32[S, K] of each shard's first_row i32[S, K]: the
    row's entries of `slot` and `position` (i32[S * n]; position None: -1),
    -1 for NO_ROW."""
    slot = jnp.asarray(slot, jnp.int32).reshape(S, -1)
    n = slot.shape[1]
    has = (first_row >= 0) & (first_row < n)
    at = jnp.clip(first_row, 0, max(n - 1, 0))
    pick = lambda values: jnp.where(has, jnp.take_along_axis(values, at, axis=1), -1) \
        if n else jnp.full(first_row.shape, -1, jnp.int32)
    out_slot = pick(slot)
    if position is None:
        return out_slot, jnp.full(first_row.shape, -1, jnp.int32)
    return out_slot, pick(jnp.asarray(position, jnp.int32).reshape(S, -1))


def meta_rows(args):
    """The error rows of an op on the step's tokens (append, flush,
    write_layer): the rows of its StepMeta."""
    return args["meta"].token_slot, args["meta"].token_pos


def query_rows(args):
    """The error rows of a read by query (indexer_topk, attention,
    gather_topk): its token_slot and token_pos."""
    return args["token_slot"], args["token_pos"]


def slot_rows(args):
    """The error rows of a gather by slot (gather_window, gather_all): its
    slots, no position."""
    return args["slots"], None
