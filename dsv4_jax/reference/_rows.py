"""Shared per-row rules of the reference ops: layer validity, error counting,
the out-of-range index convention for dropped rows, and reading entries.

A dropped row is written at an index one past the end of its axis with
`mode="drop"`; negative indices are never used for that (jnp wraps them).
Reads use clipped indices and mask the result.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import config as C
from ..errors import ErrorKind, add_counts
from . import quant


def layer_ok(idx, n: int):
    """Whether an int32 layer operand (-1 = bad) addresses one of `n` layers."""
    return (idx >= 0) & (idx < n)


def read_index(idx, n: int):
    """`idx` clipped into [0, n) for a read whose result is masked."""
    return jnp.clip(idx, 0, max(n - 1, 0))


def read_entries(pool, layer, block, row, kv_format, ok):
    """Dequantized bf16 entries pool[layer, block, row] (index arrays of one
    shape), zero where not `ok`: a read of the gathers and of attention."""
    N = jax.tree_util.tree_leaves(pool)[0].shape[1]
    b = read_index(block, N)
    entries = jax.tree_util.tree_map(lambda p: p[layer][b, row], pool)
    kv = quant.dequantize_kv(entries, kv_format)
    return jnp.where(ok[..., None], kv, jnp.zeros((), kv.dtype))


def add_errors(errors, ok_layer, counts: dict):
    """errors plus `counts` ({kind: mask}, the mask's first axis the op's
    input row, `errors.add_counts`) when the layer is valid; else only
    BAD_LAYER += 1 (the call is dropped and nothing else is counted)."""
    bad_layer = errors.at[int(ErrorKind.BAD_LAYER)].add(1)
    return jnp.where(ok_layer, add_counts(errors, counts), bad_layer)


def position_ok(token_pos, max_context: int):
    """0 <= pos < max_context for int32 positions; a max_context past the
    int32 range bounds nothing (and must not become an int32 constant)."""
    ok = token_pos >= 0
    if max_context <= np.iinfo(np.int32).max:
        ok = ok & (token_pos < max_context)
    return ok


def token_checks(token_slot, token_pos, R: int, max_context: int):
    """Per token: (valid, bad_slot, bad_pos). Slot -1 is padding (neither
    valid nor an error); a slot outside [0, R) is BAD_SLOT; a position < 0 or
    >= max_context of a good slot is BAD_POSITION."""
    pad = token_slot == -1
    slot_ok = (token_slot >= 0) & (token_slot < R)
    pos_ok = position_ok(token_pos, max_context)
    return slot_ok & pos_ok, ~pad & ~slot_ok, slot_ok & ~pos_ok


def visible_entries(token_pos, limit: int):
    """CSA entries a query at position pos >= 0 sees: min((pos + 1) // 4,
    limit), without the int32 overflow of pos + 1 at pos = 2^31 - 1."""
    n = token_pos // C.CSA_RATIO + (token_pos % C.CSA_RATIO == C.CSA_RATIO - 1)
    return jnp.minimum(n, limit)


def set_pool_rows(pool, index, values):
    """pool.at[index].set(values, mode="drop") that stays in place.

    `index` is a tuple with one entry per leading axis: a slice, a scalar, or
    an int array of n rows (all arrays alike); `values` either per row (rows
    axis first) or broadcast to every row. Rows that address one cell are
    written in row order (the last one stays).

    On XLA's CPU backend a scatter into a pool of 8- or 16-bit floats is not
    done on those types: XLA widens the whole pool to f32, scatters there and
    narrows it back, three pool-sized temporaries per write. Such pools are
    written there by `_select_rows` instead; every other case is a scatter."""
    values = jnp.asarray(values).astype(pool.dtype)
    narrow_float = (jnp.issubdtype(pool.dtype, jnp.floating)
                    and np.dtype(pool.dtype).itemsize in _UINT_OF_WIDTH)
    if narrow_float and _select_applies(pool, index, values):
        return jax.lax.platform_dependent(
            pool, values, cpu=lambda p, v: _select_rows(p, index, v),
            default=lambda p, v: _scatter_rows(p, index, v))
    return _scatter_rows(pool, index, values)


def _scatter_rows(pool, index, values):
    """The write as a scatter. With n = 1 row XLA rewrites the scatter into a
    dynamic-update-slice that its CPU backend fuses with the update's
    computation into a fresh buffer and then copies into the donated pool, a
    copy of the whole pool per decode step; one extra row with an
    out-of-range index (dropped) keeps it a scatter, which updates in place."""
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


# unsigned integer of each float width the select path handles
_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16}


def _select_applies(pool, index, values) -> bool:
    """Whether `_select_rows` covers this write: at least one row array, the
    scalars and arrays on adjacent axes, and the values one scalar or per row
    with nothing but the entry after the addressed axes."""
    picked = [a for a, i in enumerate(index) if not isinstance(i, slice)]
    if not any(jnp.ndim(index[a]) == 1 for a in picked):
        return False
    if picked != list(range(picked[0], picked[-1] + 1)):
        return False
    if values.ndim == 0:
        return True
    return picked[0] == 0 and picked[-1] == len(index) - 1


def _select_rows(pool, index, values):
    """The write as one select over the whole pool, on the pool's bits:
    element e takes values[row(e)] where a row addresses its cell, else keeps
    its bits. A select is an elementwise op, so XLA writes it into the
    donated pool in place, with no temporary beyond an int32 map of rows
    over the row-indexed axes; it reads and writes the pool once, where XLA's
    CPU scatter on these types passes over it three times."""
    k = len(index)
    lead = pool.shape[:k]
    arrays = [a for a, i in enumerate(index) if not isinstance(i, slice) and jnp.ndim(i) == 1]
    scalars = [a for a, i in enumerate(index) if not isinstance(i, slice) and jnp.ndim(i) == 0]
    n = index[arrays[0]].shape[0]
    if n == 0:                       # a step without tokens (or blocks): nothing to write
        return pool
    # the last row that addresses each cell of the row-indexed axes, else -1
    row_map = jnp.full([lead[a] for a in arrays], -1, jnp.int32).at[
        tuple(index[a] for a in arrays)].max(jnp.arange(n, dtype=jnp.int32), mode="drop")
    # scalar indices as jnp reads them: negatives count from the end
    at = jnp.stack([jnp.asarray(index[a], jnp.int32) % lead[a] if lead[a] else jnp.int32(0)
                    for a in scalars] + [jnp.int32(0)])
    in_range = jnp.all(jnp.stack([(jnp.asarray(index[a]) >= -lead[a])
                                  & (jnp.asarray(index[a]) < lead[a]) for a in scalars]
                                 + [jnp.bool_(True)]))
    uint = _UINT_OF_WIDTH[np.dtype(pool.dtype).itemsize]

    def select(pool, new, row_map, at):
        rows = jnp.broadcast_to(
            row_map.reshape([lead[a] if a in arrays else 1 for a in range(k)]), lead)
        for j, axis in enumerate(scalars):
            rows = jnp.where(jax.lax.broadcasted_iota(jnp.int32, lead, axis) == at[j], rows, -1)
        if new.ndim:                                       # per row: row r's entry
            new = jnp.broadcast_to(new, (n,) + pool.shape[k:])[jnp.clip(rows, 0, n - 1)]
        hit = (rows >= 0).reshape(lead + (1,) * (pool.ndim - k))
        bits = jax.lax.bitcast_convert_type(pool, uint)
        return jax.lax.bitcast_convert_type(jnp.where(hit, new, bits), pool.dtype)

    # The branch boundary makes XLA compute the rows' values once, at their
    # own size (fused into the select they are materialized at the pool's
    # size), and skips the pass over the pool when no row lands in it.
    return jax.lax.cond(in_range & jnp.any(row_map >= 0), select,
                        lambda pool, *_: pool,
                        pool, jax.lax.bitcast_convert_type(values, uint), row_map, at)
