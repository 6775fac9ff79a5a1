"""Shared per-row rules of the reference ops: layer validity, error counting,
and the out-of-range index convention for dropped rows.

A dropped row is written at an index one past the end of its axis with
`mode="drop"`; negative indices are never used for that (jnp wraps them).
Reads use clipped indices and mask the result.
"""
from __future__ import annotations

import jax.numpy as jnp

from ..errors import NUM_ERROR_KINDS, ErrorKind


def layer_ok(idx, n: int):
    """Whether an int32 layer operand (-1 = bad) addresses one of `n` layers."""
    return (idx >= 0) & (idx < n)


def read_index(idx, n: int):
    """`idx` clipped into [0, n) for a read whose result is masked."""
    return jnp.clip(idx, 0, max(n - 1, 0))


def add_errors(errors, ok_layer, counts: dict):
    """errors + counts when the layer is valid; else only BAD_LAYER += 1 (the
    call is dropped and nothing else is counted)."""
    vec = jnp.zeros((NUM_ERROR_KINDS,), jnp.int32)
    for kind, n in counts.items():
        vec = vec.at[int(kind)].add(jnp.asarray(n, jnp.int32))
    bad = jnp.zeros((NUM_ERROR_KINDS,), jnp.int32).at[int(ErrorKind.BAD_LAYER)].set(1)
    return errors + jnp.where(ok_layer, vec, bad)


def count(mask):
    return jnp.sum(mask, dtype=jnp.int32)


def token_checks(token_slot, token_pos, R: int, max_context: int):
    """Per token: (valid, bad_slot, bad_pos). Slot -1 is padding (neither
    valid nor an error); a slot outside [0, R) is BAD_SLOT; a position < 0 or
    >= max_context of a good slot is BAD_POSITION."""
    pad = token_slot == -1
    slot_ok = (token_slot >= 0) & (token_slot < R)
    pos_ok = (token_pos >= 0) & (token_pos < max_context)
    return slot_ok & pos_ok, ~pad & ~slot_ok, slot_ok & ~pos_ok



def set_pool_rows(pool, index, values):
    """pool.at[index].set(values, mode="drop") that stays in place.

    `index` is a tuple with one entry per leading axis: a slice, a scalar, or
    an int array of n rows (all arrays alike); `values` either per row (rows
    axis first) or broadcast to every row. With n = 1 XLA rewrites the
    scatter into a dynamic-update-slice that its CPU backend fuses with the
    update's computation into a fresh buffer and then copies into the donated
    pool, a copy of the whole pool per decode step; one extra row with an
    out-of-range index (dropped) keeps it a scatter, which updates in place."""
    values = jnp.asarray(values).astype(pool.dtype)
    rows = [i for i in index if not isinstance(i, slice) and jnp.ndim(i) == 1]
    if rows and rows[0].shape[0] == 1:
        index = tuple(i if isinstance(i, slice) or jnp.ndim(i) == 0 else
                      jnp.concatenate([i, jnp.full((1,), pool.shape[axis], jnp.asarray(i).dtype)])
                      for axis, i in enumerate(index))
        # Values given per row (rows axis first, no slice before the arrays)
        # get a copy for the dropped row; others broadcast as they are.
        if values.ndim and not isinstance(index[0], slice) and values.shape[0] == 1:
            values = jnp.concatenate([values, values], axis=0)
    return pool.at[index].set(values, mode="drop")
