"""take_rows / put_rows in jnp: the oracle of the copy kernels (rules in
dsv4_jax/ops/copy_rows.py).

Everything moves as the leaves' bits (unsigned integers of their width), so
no float is rounded, widened or canonicalized on the way.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _bits(x):
    return jax.lax.bitcast_convert_type(x, _UINT[np.dtype(x.dtype).itemsize])


def _unbits(b, dtype):
    return jax.lax.bitcast_convert_type(b, dtype)


def _valid(ids, size):
    return (ids >= 0) & (ids < size)


def take_rows(leaves, row_axes, ids, spans, squeeze):
    """[leaf with its row axis replaced by the rows at the ids of its span
    (the axis dropped where `squeeze`)], zero rows for ids outside the axis."""
    out = []
    for x, axis, (start, count), sq in zip(leaves, row_axes, spans, squeeze):
        size, at = x.shape[axis], ids[start:start + count]
        ok = _valid(at, size)
        rows = jnp.take(_bits(x), jnp.clip(at, 0, size - 1), axis=axis)
        mask = ok.reshape((1,) * axis + (-1,) + (1,) * (x.ndim - axis - 1))
        rows = jnp.where(mask, rows, 0)
        out.append(_unbits(jnp.squeeze(rows, axis) if sq else rows, x.dtype))
    return out


def put_rows(leaves, row_axes, ids, rows, spans, squeeze):
    """[leaf with rows[k] written at the ids of its span along its row axis];
    ids outside the axis are skipped. Ids must be distinct (else which row
    lands is not specified)."""
    out = []
    for x, axis, r, (start, count), sq in zip(leaves, row_axes, rows, spans, squeeze):
        size, at = x.shape[axis], ids[start:start + count]
        at = jnp.where(_valid(at, size), at, size)   # size: dropped
        index = (slice(None),) * axis + (at,)
        r = jnp.expand_dims(r, axis) if sq else r
        out.append(_unbits(_bits(x).at[index].set(_bits(r), mode="drop"), x.dtype))
    return out
