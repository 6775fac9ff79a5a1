"""The copies of a request's moves as traced code (requests/transfer.py
runs them as jitted programs or inlines them into a caller's trace), one
body per kind of move, each taking the state and a `RequestIds`.

Unsharded, where the FFI handlers of `dsv4_jax.ops.copy_rows` are built for
the state's platform (impl "auto"), a move is one `take_rows` or `put_rows`
call over every leaf it copies (one kernel on the GPU), the ids read on the
device. With `default_impl("reference")`, and sharded, jnp slices and
scatters of each leaf's bits, each shard reading or writing only what it
owns (a read summed over the shards: integers, one non-zero term).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import copy_rows
from ..ops.dispatch import resolve_impl
from ..sharded_state import run_sharded
from ..state import CacheState
from .types import RequestBlocks, RequestIds, RequestSnapshot, blocks_shapes, snapshot_shapes


# ---- bits -----------------------------------------------------------------------------
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _bits(x):
    """`x` bitcast to the unsigned integer of its width (a free reinterpretation)."""
    return jax.lax.bitcast_convert_type(x, _UINT[np.dtype(x.dtype).itemsize])


def _unbits(b, dtype):
    return jax.lax.bitcast_convert_type(b, dtype)


def _write_rows(pool, at, rows):
    """`pool[:, at] = rows` (at: i32[n], an index past the axis dropped; rows:
    [pool.shape[0], n, ...] of the pool's dtype), in place on the donated
    pool. A scatter with "set" moves the rows' bits as they are; how it stays
    in place differs by backend (`_write_rows_cpu` for XLA's CPU backend)."""
    return jax.lax.platform_dependent(pool, at, rows, cpu=_write_rows_cpu,
                                      default=_scatter_rows)


def _scatter_rows(pool, at, rows):
    """One scatter kernel on the GPU, in place on the donated pool, in the
    pool's own dtype: converting the pool to its bits and back would add two
    passes over the whole pool, and a single row needs no padding there."""
    return pool.at[:, at].set(rows, mode="drop")


def _write_rows_cpu(pool, at, rows):
    """XLA's CPU backend: a scatter on the pool's bits (it runs a scatter into
    8- or 16-bit floats by widening the whole pool to f32) of at least two
    rows (one row becomes a dynamic-update-slice, which the CPU backend
    builds in a fresh buffer and copies back; the extra row is dropped)."""
    rows = _bits(rows)
    if at.shape[0] == 1:
        at = jnp.concatenate([at, jnp.full((1,), pool.shape[1], at.dtype)])
        rows = jnp.concatenate([rows, rows], axis=1)
    return _unbits(_bits(pool).at[:, at].set(rows, mode="drop"), pool.dtype)


# ---- per-shard bodies (a whole state is one shard) -------------------------------------------
def _slot_parts(st: CacheState):
    """The per-slot leaves of a state, each with the slot on axis 1 (the
    block table, on axis 0, is handled apart)."""
    return (st.swa, st.csa.comp, st.csa.icomp, st.hca.comp)


def _block_parts(st: CacheState) -> RequestBlocks:
    return RequestBlocks(st.csa.kv, st.csa.index, st.hca.kv)


def _with_slot_parts(st: CacheState, parts, table) -> CacheState:
    """`st` with new per-slot leaves (`_slot_parts`' order) and block table."""
    window, comp, icomp, hcomp = parts
    return dataclasses.replace(st, block_table=table, swa=window,
                               csa=dataclasses.replace(st.csa, comp=comp, icomp=icomp),
                               hca=dataclasses.replace(st.hca, comp=hcomp))


def _with_block_parts(st: CacheState, b: RequestBlocks) -> CacheState:
    """`st` with new pool leaves (`_block_parts`' order)."""
    return dataclasses.replace(st, csa=dataclasses.replace(st.csa, kv=b.csa_kv, index=b.csa_index),
                               hca=dataclasses.replace(st.hca, kv=b.hca_kv))


def _snapshot_of(state: CacheState, parts) -> RequestSnapshot:
    """A snapshot from the slot's leaves in `_slot_parts`' order."""
    cfg = state.config
    return RequestSnapshot(*parts, cfg.compress_ratios, cfg.kv_format)


def _parts_of(snap: RequestSnapshot):
    """A snapshot's leaves in `_slot_parts`' order (`_snapshot_of` undone)."""
    return (snap.window, snap.csa_comp, snap.csa_icomp, snap.hca_comp)


def _local_index(index, first, size):
    """(index - first, whether it falls in [0, size)): a global slot or block
    id seen from the shard that owns [first, first + size)."""
    local = index - first
    return local, (local >= 0) & (local < size)


def _take_slot(st: CacheState, slot, first):
    """The bits of the slot's leaves where this shard owns `slot`, else zeros."""
    R = st.config.max_requests
    local, ok = _local_index(slot, first, R)
    at = jnp.clip(local, 0, R - 1)
    take = lambda x: jnp.where(ok, _bits(jax.lax.dynamic_index_in_dim(x, at, 1, False)), 0)
    return jax.tree_util.tree_map(take, _slot_parts(st))


def _put_slot(st: CacheState, slot, first, snap_parts, row) -> CacheState:
    """The state with the snapshot's leaves and block-table row written into
    `slot` where this shard owns it (else unchanged)."""
    R = st.config.max_requests
    local, ok = _local_index(slot, first, R)
    at = jnp.where(ok, local, R)[None]         # R: dropped by mode="drop"
    parts = jax.tree_util.tree_map(
        lambda x, b: _write_rows(x, at, b[:, None]), _slot_parts(st), snap_parts)
    return _with_slot_parts(st, parts, st.block_table.at[at[0]].set(row, mode="drop"))


def _take_blocks(st: CacheState, blocks, first):
    N = st.config.num_blocks
    local, ok = _local_index(blocks, first, N)
    at = jnp.clip(local, 0, N - 1)

    def take(x):
        rows = _bits(x[:, at])
        return jnp.where(ok.reshape((1, -1) + (1,) * (rows.ndim - 2)), rows, 0)
    return jax.tree_util.tree_map(take, _block_parts(st))


def _put_blocks(st: CacheState, blocks, first, data) -> CacheState:
    N = st.config.num_blocks
    local, ok = _local_index(blocks, first, N)
    at = jnp.where(ok, local, N)
    return _with_block_parts(
        st, jax.tree_util.tree_map(lambda x, b: _write_rows(x, at, b), _block_parts(st), data))


# ---- whole-state bodies -------------------------------------------------------------------
def _over_shards(state: CacheState, body, operands, out):
    """`body(local_state, first_slot, first_block, *operands)` on every shard
    (on the whole state when unsharded). `out` "state": it returns the
    shard's state; "sum": it returns bits, summed over the shards."""
    cfg = state.config
    if not cfg.sharded:
        return body(state, 0, 0, *operands)
    local = cfg.local()

    def per_shard(st, *ops):
        k = jax.lax.axis_index(cfg.shard_axis)
        res = body(st, k * local.max_requests, k * local.num_blocks, *ops)
        return res if out == "state" else jax.tree_util.tree_map(lambda x: x[None], res)
    # "rows" as the spec of the whole output: each shard's bits on a new
    # leading axis, shard after shard
    res = run_sharded(per_shard, state, [], list(operands), "state" if out == "state" else "rows")
    if out == "state":
        return res
    return jax.tree_util.tree_map(lambda x: jnp.sum(x, axis=0, dtype=x.dtype), res)


def _snapshot_slices(state: CacheState, slot) -> RequestSnapshot:
    window, comp, icomp, hcomp = _over_shards(
        state, lambda st, fs, fb, s: _take_slot(st, s, fs), [slot], "sum")
    shapes = snapshot_shapes(state.config)
    window = jax.tree_util.tree_map(lambda b, s: _unbits(b, s.dtype), window, shapes.window)
    return _snapshot_of(state, (window, _unbits(comp, jnp.float32), _unbits(icomp, jnp.float32),
                                _unbits(hcomp, jnp.float32)))


def _read_blocks_slices(state: CacheState, blocks) -> RequestBlocks:
    bits = _over_shards(state, lambda st, fs, fb, b: _take_blocks(st, b, fb), [blocks], "sum")
    shapes = blocks_shapes(state.config, blocks.shape[0])
    return jax.tree_util.tree_map(lambda b, s: _unbits(b, s.dtype), bits, shapes)


def _restore_slices(state: CacheState, slot, snap: RequestSnapshot, row) -> CacheState:
    parts = _parts_of(snap)
    return _over_shards(state, lambda st, fs, fb, s, p, r: _put_slot(st, s, fs, p, r),
                        [slot, parts, row], "state")


def _write_blocks_slices(state: CacheState, blocks, data: RequestBlocks) -> CacheState:
    return _over_shards(state, lambda st, fs, fb, b, d: _put_blocks(st, b, fb, d),
                        [blocks, data], "state")


# Unsharded, where copy_rows' FFI handlers are built for the state's platform,
# a move is one take_rows or put_rows call over every leaf it copies: the
# slot's leaves at ids[0] (held without the slot axis, as the snapshot holds
# them), the block-table row at ids[0], the pools' blocks at ids[1:].
def _fused(state: CacheState) -> bool:
    """Whether the moves of this state go through copy_rows' FFI handlers:
    decided when a move is traced."""
    return not state.config.sharded and \
        resolve_impl("auto", "dsv4_take_rows", [state.block_table]) != "reference"


def _copy_layout(state: CacheState, nb: int, *, slot=False, table=False, blocks=False):
    """(leaves, row axes, spans, squeeze) of the parts a fused move copies."""
    parts = []
    if slot:
        parts += [(x, 1, (0, 1), True) for x in jax.tree_util.tree_leaves(_slot_parts(state))]
    if table:
        parts.append((state.block_table, 0, (0, 1), True))
    if blocks:
        parts += [(x, 1, (1, nb), False) for x in jax.tree_util.tree_leaves(_block_parts(state))]
    return [list(p) for p in zip(*parts)]


def _take(state: CacheState, where: RequestIds, *, slot: bool, blocks: bool):
    """(snapshot or None, RequestBlocks or None): one take_rows call."""
    leaves, axes, spans, squeeze = _copy_layout(state, where.num_blocks, slot=slot, blocks=blocks)
    rows = copy_rows.take_rows(leaves, axes, where.ids, spans=spans, squeeze=squeeze)
    snap = data = None
    if slot:
        tree = jax.tree_util.tree_structure(_slot_parts(state))
        n = tree.num_leaves
        snap = _snapshot_of(state, jax.tree_util.tree_unflatten(tree, rows[:n]))
        rows = rows[n:]
    if blocks:
        data = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(_block_parts(state)),
                                            rows)
    return snap, data


def _put(state: CacheState, where: RequestIds, snap: RequestSnapshot | None,
         data: RequestBlocks | None) -> CacheState:
    """The state with the snapshot (and the block-table row) and / or the
    blocks written: one put_rows call, in place."""
    nb, slot, blocks = where.num_blocks, snap is not None, data is not None
    leaves, axes, spans, squeeze = _copy_layout(state, nb, slot=slot, table=slot, blocks=blocks)
    rows = []
    if slot:
        rows += jax.tree_util.tree_leaves(_parts_of(snap)) + [where.row]
    if blocks:
        rows += jax.tree_util.tree_leaves(data)
    new = copy_rows.put_rows(leaves, axes, where.ids, rows, spans=spans, squeeze=squeeze)
    st = state
    if slot:
        tree = jax.tree_util.tree_structure(_slot_parts(state))
        n = tree.num_leaves
        st = _with_slot_parts(st, jax.tree_util.tree_unflatten(tree, new[:n]), new[n])
        new = new[n + 1:]
    if blocks:
        st = _with_block_parts(st, jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(_block_parts(state)), new))
    return st


def _snapshot_body(state: CacheState, where: RequestIds) -> RequestSnapshot:
    if _fused(state):
        return _take(state, where, slot=True, blocks=False)[0]
    return _snapshot_slices(state, where.ids[0])


def _read_blocks_body(state: CacheState, where: RequestIds) -> RequestBlocks:
    if _fused(state):
        return _take(state, where, slot=False, blocks=True)[1]
    return _read_blocks_slices(state, where.ids[1:])


def _read_request_body(state: CacheState, where: RequestIds):
    if _fused(state):
        return _take(state, where, slot=True, blocks=True)
    return _snapshot_slices(state, where.ids[0]), _read_blocks_slices(state, where.ids[1:])


def _restore_body(state: CacheState, where: RequestIds, snap: RequestSnapshot) -> CacheState:
    if _fused(state):
        return _put(state, where, snap, None)
    return _restore_slices(state, where.ids[0], snap, where.row)


def _write_blocks_body(state: CacheState, where: RequestIds, data: RequestBlocks) -> CacheState:
    if _fused(state):
        return _put(state, where, None, data)
    return _write_blocks_slices(state, where.ids[1:], data)


def _write_request_body(state: CacheState, where: RequestIds, snap: RequestSnapshot,
                        data: RequestBlocks) -> CacheState:
    if _fused(state):
        return _put(state, where, snap, data)
    state = _write_blocks_slices(state, where.ids[1:], data)
    return _restore_slices(state, where.ids[0], snap, where.row)


BODIES = {"snapshot": _snapshot_body, "read_blocks": _read_blocks_body,
           "read_request": _read_request_body, "restore": _restore_body,
           "write_blocks": _write_blocks_body, "write_request": _write_request_body}
READS = ("snapshot", "read_blocks", "read_request")
