"""Copies of whole rows of several state leaves in one call: the moves of a
request's cache (dsv4_jax/requests/transfer.py) read a slot's and its blocks'
rows out of the state and write them back in place.

A leaf of any shape and dtype has a row axis (`row_axes[k]`); its rows are
what lies at one index along that axis, copied as bytes. `ids` i32[M] is a
device array: nothing is read back to the host. Leaf k uses the ids
`ids[start : start + count]` of its span (`spans[k] = (start, count)`;
default the whole array), so one call can move a request's slot (one id)
and its blocks (the next ids) together. Its rows ("flat leaf") have the
leaf's shape with the row axis of size `count`, or, where `squeeze[k]`
(count 1), without the row axis: a snapshot leaf passes as it is, with no
reshape around the call (XLA may copy a reshaped operand to lay it out).

FFI targets (operands in this order):
"dsv4_take_rows"
  attrs  row_axes i64[K], id_starts i64[K]
  args   ids i32[M], leaves (K, any dtypes)
  rets   results (K flat leaves: row j of flat leaf k holds row ids[start_k + j]
         of leaf k, zero bytes where that id is outside the row axis)
"dsv4_put_rows"
  attrs  row_axes i64[K], id_starts i64[K]
  args   ids i32[M], leaves (2K: the K leaves, then K flat leaves shaped as
         take's results)
  rets   results (the K leaves, aliased to the leaf arguments, in place: row
         ids[start_k + j] of leaf k set to row j of flat leaf k; ids outside
         the axis are skipped: a padding -1, or a bad id, nothing outside the
         leaf is ever written)
Ids of one span must be distinct for put_rows (else which row lands is not
specified). At most 24 leaves a call. The handlers check every shape and
span; the CUDA kernel is one launch for all leaves.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..reference import copy_rows as ref
from .dispatch import check_array, ffi_call, resolve_impl

MAX_LEAVES = 24


def _layout(leaves, row_axes, ids, spans, squeeze):
    """(row axes, spans, squeeze) checked and filled in with their defaults."""
    check_array("ids", ids, (None,), jnp.int32)
    K, M = len(leaves), ids.shape[0]
    if len(row_axes) != K or not 0 < K <= MAX_LEAVES:
        raise ValueError(f"leaves: expected 1 to {MAX_LEAVES} leaves, one row axis each, got "
                         f"{K} leaves and {len(row_axes)} axes")
    row_axes = [int(a) for a in row_axes]
    spans = [(0, M)] * K if spans is None else [(int(s), int(c)) for s, c in spans]
    squeeze = [False] * K if squeeze is None else [bool(q) for q in squeeze]
    if len(spans) != K or len(squeeze) != K:
        raise ValueError(f"spans, squeeze: expected one per leaf ({K}), got {len(spans)} and "
                         f"{len(squeeze)}")
    for k, (x, axis, (start, count), sq) in enumerate(zip(leaves, row_axes, spans, squeeze)):
        if not 0 <= axis < x.ndim:
            raise ValueError(f"row_axes[{k}]: expected an axis of a {x.ndim}-d leaf, got {axis}")
        if start < 0 or count < 0 or start + count > M:
            raise ValueError(f"spans[{k}]: expected ids [start, start + count) within the {M} "
                             f"ids, got ({start}, {count})")
        if sq and count != 1:
            raise ValueError(f"squeeze[{k}]: only a span of one id drops the row axis, got "
                             f"{count} ids")
    return row_axes, spans, squeeze


def flat_shape(x, axis: int, count: int, squeeze: bool = False) -> jax.ShapeDtypeStruct:
    """The shape of `count` rows of leaf `x` along `axis` (without the axis
    where `squeeze`)."""
    mid = () if squeeze else (count,)
    return jax.ShapeDtypeStruct(x.shape[:axis] + mid + x.shape[axis + 1:], x.dtype)


def take_rows(leaves: Sequence, row_axes: Sequence[int], ids: jax.Array, *,
              spans: Sequence[tuple[int, int]] | None = None,
              squeeze: Sequence[bool] | None = None, impl: str = "auto") -> list:
    """The rows of every leaf at the ids of its span (zero bytes where an id
    is outside the row axis), as flat leaves. Reads only."""
    leaves = list(leaves)
    row_axes, spans, squeeze = _layout(leaves, row_axes, ids, spans, squeeze)
    impl = resolve_impl(impl, "dsv4_take_rows", leaves)
    if impl == "reference":
        return ref.take_rows(leaves, row_axes, ids, spans, squeeze)
    return ffi_call("dsv4_take_rows", [ids, *leaves],
                    [flat_shape(x, a, c, q) for x, a, (_, c), q in
                     zip(leaves, row_axes, spans, squeeze)], {},
                    row_axes=np.asarray(row_axes, np.int64),
                    id_starts=np.asarray([s for s, _ in spans], np.int64))


def put_rows(leaves: Sequence, row_axes: Sequence[int], ids: jax.Array, rows: Sequence, *,
             spans: Sequence[tuple[int, int]] | None = None,
             squeeze: Sequence[bool] | None = None, impl: str = "auto") -> list:
    """The leaves with `rows[k]` (flat leaves, shaped as `take_rows` returns
    them) written at the ids of leaf k's span along its row axis, in place on
    donated leaves; ids outside an axis are skipped."""
    leaves, rows = list(leaves), list(rows)
    row_axes, spans, squeeze = _layout(leaves, row_axes, ids, spans, squeeze)
    if len(rows) != len(leaves):
        raise ValueError(f"rows: expected {len(leaves)} arrays, got {len(rows)}")
    for k, (x, a, (_, c), q, r) in enumerate(zip(leaves, row_axes, spans, squeeze, rows)):
        want = flat_shape(x, a, c, q)
        check_array(f"rows[{k}]", r, want.shape, want.dtype)
    impl = resolve_impl(impl, "dsv4_put_rows", leaves)
    if impl == "reference":
        return ref.put_rows(leaves, row_axes, ids, rows, spans, squeeze)
    K = len(leaves)
    return ffi_call("dsv4_put_rows", [ids, *leaves, *rows],
                    [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
                    {1 + k: k for k in range(K)}, row_axes=np.asarray(row_axes, np.int64),
                    id_starts=np.asarray([s for s, _ in spans], np.int64))
