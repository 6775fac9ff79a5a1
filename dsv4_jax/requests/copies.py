"""The copies of a request's moves as traced code (requests/transfer.py
runs them as jitted programs or inlines them into a caller's trace), one
body per kind of move, each taking the state and a `RequestIds`.

Every move is one `take_rows` or `put_rows` call (dsv4_jax.ops.copy_rows)
over every leaf it copies: the slot's leaves at ids[0] (held without the
slot axis, as the snapshot holds them), the block-table row at ids[0], the
pools' blocks at ids[1:]; the ids are read on the device. The
implementation is picked as every op's is (impl "auto": the FFI handlers of
the state's platform where built, else the jnp reference). Sharded, the
call runs on every shard with the ids made shard-local: a shard skips the
ids it does not own (writes) or reads zero bytes there (reads), and a read
is summed over the shards as bits (integers, one non-zero term).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import copy_rows
from ..sharded_state import run_sharded
from ..state import CacheState
from .types import RequestBlocks, RequestIds, RequestSnapshot

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _bits(x):
    """`x` bitcast to the unsigned integer of its width (a free reinterpretation)."""
    return jax.lax.bitcast_convert_type(x, _UINT[np.dtype(x.dtype).itemsize])


# ---- the parts of a state a move copies ------------------------------------------------------
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


# ---- one copy call, on every shard ---------------------------------------------------------
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


def _local_ids(ids, first_slot, first_block):
    """The ids `[slot, blocks...]` as the shard owning slots from
    `first_slot` and blocks from `first_block` sees them: another shard's id
    falls outside its axes (a -1 stays negative), so the copy skips it."""
    if isinstance(first_slot, int) and first_slot == first_block == 0:
        return ids
    first = jnp.full(ids.shape, first_block, ids.dtype).at[0].set(first_slot)
    return ids - first


def _copy_layout(state: CacheState, nb: int, *, slot=False, table=False, blocks=False):
    """(leaves, row axes, spans, squeeze) of the parts a move copies."""
    parts = []
    if slot:
        parts += [(x, 1, (0, 1), True) for x in jax.tree_util.tree_leaves(_slot_parts(state))]
    if table:
        parts.append((state.block_table, 0, (0, 1), True))
    if blocks:
        parts += [(x, 1, (1, nb), False) for x in jax.tree_util.tree_leaves(_block_parts(state))]
    return [list(p) for p in zip(*parts)]


def _take(state: CacheState, where: RequestIds, *, slot: bool, blocks: bool):
    """(snapshot or None, RequestBlocks or None): one take_rows call a shard."""
    nb = where.num_blocks

    def body(st, first_slot, first_block, ids):
        leaves, axes, spans, squeeze = _copy_layout(st, nb, slot=slot, blocks=blocks)
        rows = copy_rows.take_rows(leaves, axes, _local_ids(ids, first_slot, first_block),
                                   spans=spans, squeeze=squeeze)
        return [_bits(r) for r in rows]
    bits = _over_shards(state, body, [where.ids], "sum")
    leaves = _copy_layout(state, nb, slot=slot, blocks=blocks)[0]
    rows = [jax.lax.bitcast_convert_type(b, x.dtype) for b, x in zip(bits, leaves)]
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
    blocks written: one put_rows call a shard, in place."""
    nb, slot, blocks = where.num_blocks, snap is not None, data is not None
    rows = []
    if slot:
        rows += jax.tree_util.tree_leaves(_parts_of(snap)) + [where.row]
    if blocks:
        rows += jax.tree_util.tree_leaves(data)

    def body(st, first_slot, first_block, ids, rows):
        leaves, axes, spans, squeeze = _copy_layout(st, nb, slot=slot, table=slot, blocks=blocks)
        new = copy_rows.put_rows(leaves, axes, _local_ids(ids, first_slot, first_block), rows,
                                 spans=spans, squeeze=squeeze)
        if slot:
            tree = jax.tree_util.tree_structure(_slot_parts(st))
            n = tree.num_leaves
            st = _with_slot_parts(st, jax.tree_util.tree_unflatten(tree, new[:n]), new[n])
            new = new[n + 1:]
        if blocks:
            st = _with_block_parts(st, jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(_block_parts(st)), new))
        return st
    return _over_shards(state, body, [where.ids, rows], "state")


def _snapshot_body(state: CacheState, where: RequestIds) -> RequestSnapshot:
    return _take(state, where, slot=True, blocks=False)[0]


def _read_blocks_body(state: CacheState, where: RequestIds) -> RequestBlocks:
    return _take(state, where, slot=False, blocks=True)[1]


def _read_request_body(state: CacheState, where: RequestIds):
    return _take(state, where, slot=True, blocks=True)


def _restore_body(state: CacheState, where: RequestIds, snap: RequestSnapshot) -> CacheState:
    return _put(state, where, snap, None)


def _write_blocks_body(state: CacheState, where: RequestIds, data: RequestBlocks) -> CacheState:
    return _put(state, where, None, data)


def _write_request_body(state: CacheState, where: RequestIds, snap: RequestSnapshot,
                        data: RequestBlocks) -> CacheState:
    return _put(state, where, snap, data)


BODIES = {"snapshot": _snapshot_body, "read_blocks": _read_blocks_body,
          "read_request": _read_request_body, "restore": _restore_body,
          "write_blocks": _write_blocks_body, "write_request": _write_request_body}
READS = ("snapshot", "read_blocks", "read_request")
