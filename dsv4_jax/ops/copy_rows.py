"""Copies of whole rows of several state leaves in one call: the moves of a
request's cache (dsv4_jax/request_state.py) read a slot's or blocks' rows out
of the state and write them back in place.

A leaf of any shape and dtype has a row axis (`row_axes[k]`); its rows are
what lies at one index along that axis, copied as bytes. `ids` i32[n] are
device arrays: nothing is read back to the host.

FFI targets (operands in this order):
"dsv4_take_rows"
  attrs  row_axes i64[K]
  args   ids i32[n], leaves (K, any dtypes)
  rets   K flat leaves: leaf k with its row axis of size n; row j holds the
         leaf's row ids[j], zero bytes where ids[j] is outside the axis
"dsv4_put_rows"
  attrs  row_axes i64[K]
  args   ids i32[n], leaves (K), flat leaves (K, shaped as take's results)
  rets   the K leaves, aliased to the leaf arguments (in place): row ids[j]
         of leaf k set to row j of flat leaf k; ids outside the axis are
         skipped. Ids must be distinct (else which row lands is not
         specified).
At most 16 leaves a call. The CUDA kernel is one launch for all leaves.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..reference import copy_rows as ref
from ._dispatch import check_array, ffi_call, resolve_impl

MAX_LEAVES = 16


def _check(leaves, row_axes, ids):
    check_array("ids", ids, (None,), jnp.int32)
    if len(leaves) != len(row_axes) or not 0 < len(leaves) <= MAX_LEAVES:
        raise ValueError(f"leaves: expected 1 to {MAX_LEAVES} leaves, one row axis each, got "
                         f"{len(leaves)} leaves and {len(row_axes)} axes")
    for k, (x, axis) in enumerate(zip(leaves, row_axes)):
        if not 0 <= axis < x.ndim:
            raise ValueError(f"row_axes[{k}]: expected an axis of a {x.ndim}-d leaf, got {axis}")


def flat_shape(x, axis: int, n: int) -> jax.ShapeDtypeStruct:
    """The shape of `n` rows of leaf `x` along `axis`."""
    return jax.ShapeDtypeStruct(x.shape[:axis] + (n,) + x.shape[axis + 1:], x.dtype)


def take_rows(leaves: Sequence, row_axes: Sequence[int], ids: jax.Array, *,
              impl: str = "auto") -> list:
    """The rows `ids` of every leaf, as leaves with the row axis of size n
    (zero bytes where an id is outside the axis). Reads only."""
    leaves, row_axes = list(leaves), [int(a) for a in row_axes]
    _check(leaves, row_axes, ids)
    impl = resolve_impl(impl, "dsv4_take_rows", leaves)
    if impl == "reference":
        return ref.take_rows(leaves, row_axes, ids)
    n = ids.shape[0]
    return ffi_call("dsv4_take_rows", [ids, *leaves],
                    [flat_shape(x, a, n) for x, a in zip(leaves, row_axes)], {},
                    row_axes=np.asarray(row_axes, np.int64))


def put_rows(leaves: Sequence, row_axes: Sequence[int], ids: jax.Array, rows: Sequence, *,
             impl: str = "auto") -> list:
    """The leaves with `rows[k]` (shaped as `take_rows` returns them) written
    at `ids` along each row axis, in place on donated leaves; ids outside an
    axis are skipped."""
    leaves, row_axes, rows = list(leaves), [int(a) for a in row_axes], list(rows)
    _check(leaves, row_axes, ids)
    n = ids.shape[0]
    if len(rows) != len(leaves):
        raise ValueError(f"rows: expected {len(leaves)} arrays, got {len(rows)}")
    for k, (x, a, r) in enumerate(zip(leaves, row_axes, rows)):
        want = flat_shape(x, a, n)
        check_array(f"rows[{k}]", r, want.shape, want.dtype)
    impl = resolve_impl(impl, "dsv4_put_rows", leaves)
    if impl == "reference":
        return ref.put_rows(leaves, row_axes, ids, rows)
    K = len(leaves)
    return ffi_call("dsv4_put_rows", [ids, *leaves, *rows],
                    [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
                    {1 + k: k for k in range(K)}, row_axes=np.asarray(row_axes, np.int64))
