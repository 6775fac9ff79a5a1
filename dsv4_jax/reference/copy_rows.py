"""take_rows / put_rows in jnp: the oracle of the copy kernels (rules in
dsv4_jax/ops/copy_rows.py).

Rows move as bits (unsigned integers of the leaf's width), so no float is
rounded, widened or canonicalized on the way: `take_rows` gathers from the
leaf's bits (the bitcast fuses into the gather), `put_rows` scatters into
the leaf in place, on its bits where XLA's CPU backend would otherwise widen
a narrow float, in the leaf's own dtype elsewhere (a scatter "set" copies
each element as it is), and writes only the rows it is given.
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


def _index(axis, at):
    return (slice(None),) * axis + (at,)


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
        r = jnp.expand_dims(r, axis) if sq else r
        out.append(jax.lax.platform_dependent(
            x, at, r, cpu=lambda x, at, r, a=axis: _write_rows_cpu(x, a, at, r),
            default=lambda x, at, r, a=axis: _write_rows(x, a, at, r)))
    return out


def _write_rows(x, axis, at, rows):
    """`x[..., at, ...] = rows` along `axis` as one scatter, in place on a
    donated `x`, in its own dtype: bitcasting the leaf to its bits and back
    would cost the GPU two passes over the whole leaf."""
    return x.at[_index(axis, at)].set(rows, mode="drop")


def _write_rows_cpu(x, axis, at, rows):
    """XLA's CPU backend: the scatter on the leaf's bits (it runs a scatter
    into 8- or 16-bit floats by widening the whole leaf to f32; the bitcast
    itself is free there) and of at least two rows (one row becomes a
    dynamic-update-slice, which it builds in a fresh buffer and copies back;
    the extra row, at an index past the axis, is dropped)."""
    rows = _bits(rows)
    if at.shape[0] == 1:
        at = jnp.concatenate([at, jnp.full((1,), x.shape[axis], at.dtype)])
        rows = jnp.concatenate([rows, rows], axis=axis)
    return _unbits(_bits(x).at[_index(axis, at)].set(rows, mode="drop"), x.dtype)
