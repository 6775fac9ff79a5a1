"""One request's cache as values that move (docs/design/state.md, "Request state
that moves"): the per-slot state outside the pages (`RequestSnapshot`: every
layer's window and the compressor accumulators) and the contents of physical
blocks (`RequestBlocks`), read out of a `CacheState` and written back into
another slot and other blocks, bit for bit.

    snap = snapshot(state, slot)                       # device, or memory_kind="pinned_host"
    data = read_blocks(state, manager.blocks_of(rid))  # the pages of the request
    state = write_blocks(state, new_blocks, data)      # in place (the state is donated)
    state = restore(state, new_slot, snap, block_row=new_blocks)

    here = request_ids(state, slot, blocks)            # checked once, kept on the device
    snap, data = read_request(state, here)             # snapshot + read_blocks, one program
    state = write_request(state, there, snap, data)    # write_blocks + restore, one program

Called on concrete arrays each runs one cached `jax.jit` program (the state
donated by the writes: take back the state they return); called inside a
trace it is inlined into the caller's program. Slots and block ids given as
Python ints or numpy are checked and sent to the device with the call; a
`RequestIds` (`request_ids`) is already there, so a move sends nothing. Every
copy moves bits (requests/copies.py: one `take_rows` or `put_rows` call
over every leaf it copies, per shard when sharded), so nothing is rounded, a
-0 stays -0 and a NaN payload is kept.

Sharded (docs/design/sharding.md), `slot` is the global slot
(`ShardedCacheManager.global_slot`), block ids are global
(`ShardedCacheManager.global_blocks`), `block_row` holds the owning shard's
local ids as the block table does, and the calls run under
`with jax.set_mesh(mesh):`; each shard reads or writes only what it owns and
a snapshot or block read is summed over the shards (integers, one non-zero
term) into a copy replicated over the mesh.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..config import CacheConfig
from ..ops.dispatch import auto_means
from ..state import CacheState, check_tree
from .copies import BODIES, READS
from .types import RequestBlocks, RequestIds, RequestSnapshot, blocks_shapes, check_snapshot

__all__ = ["request_ids", "snapshot", "restore", "read_blocks", "write_blocks", "read_request",
           "write_request"]


# ---- placement -----------------------------------------------------------------------------
def _is_traced(state: CacheState) -> bool:
    return isinstance(state.block_table, jax.core.Tracer)


def _replicated(state: CacheState, memory_kind: str | None):
    """Where a copy of one request lives by default: the state's device
    (sharded: replicated over the state's mesh), in `memory_kind`."""
    sharding = state.block_table.sharding
    if state.config.sharded:
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding if memory_kind is None else sharding.with_memory_kind(memory_kind)


def _out_sharding(state, memory_kind, sharding):
    if sharding is None:
        return _replicated(state, memory_kind)
    return sharding if memory_kind is None else sharding.with_memory_kind(memory_kind)


def _program(kind: str, config: CacheConfig, out_sharding):
    """The jitted program of one kind of move (a key of `BODIES`), cached per
    config, placement and what impl "auto" stands for when it is traced
    (`default_impl`). Reads place their copy by `out_sharding`; writes donate
    the state."""
    return _program_for(kind, config, out_sharding, auto_means())


@functools.lru_cache(maxsize=None)
def _program_for(kind: str, config: CacheConfig, out_sharding, auto: str):
    if kind in READS:
        return jax.jit(BODIES[kind], out_shardings=out_sharding)
    return jax.jit(BODIES[kind], donate_argnums=0)


def _to_state_memory(state: CacheState, tree):
    """`tree` moved next to the state (from host memory, another device, or
    numpy), unless it is already there."""
    target = _replicated(state, None)
    leaves = jax.tree_util.tree_leaves(tree)
    if all(isinstance(x, jax.Array) and x.sharding == target for x in leaves):
        return tree
    return jax.device_put(tree, target)


def _run(kind: str, state: CacheState, where: RequestIds, *args, memory_kind=None,
         sharding=None):
    """One move: inlined inside a trace, else its cached program, with the
    ids and any copy going in moved next to the state first."""
    if _is_traced(state):
        return BODIES[kind](state, where, *args)
    where = _to_state_memory(state, where)
    args = [_to_state_memory(state, a) for a in args]
    out = _out_sharding(state, memory_kind, sharding) if kind in READS else None
    return _program(kind, state.config, out)(state, where, *args)


# ---- checks (before anything is donated) ---------------------------------------------------
def _check_slot(state: CacheState, slot) -> np.int32:
    R = state.config.max_requests
    if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool) or not 0 <= slot < R:
        raise ValueError(f"slot: expected an int in [0, {R}) (the cache's request slots"
                         f"{', global over the shards' if state.config.sharded else ''}), "
                         f"got {slot!r}")
    return np.int32(slot)


def _check_blocks(state: CacheState, blocks, what="blocks", distinct=False) -> np.ndarray:
    """Block ids as int32, each in [0, N) (global over the shards) or -1
    (padding); the real ones distinct where `distinct` (a write)."""
    N = state.config.num_blocks
    ids = np.asarray(blocks)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"{what}: expected a 1-D sequence of int block ids, got "
                         f"{ids.dtype}{list(ids.shape)}")
    bad = ids[(ids < -1) | (ids >= N)]
    if bad.size:
        raise ValueError(f"{what}: expected ids in [0, {N}) or -1 (padding), got {int(bad[0])}")
    real = ids[ids >= 0]
    if distinct and np.unique(real).size != real.size:
        raise ValueError(f"{what}: ids must be distinct, got {ids.tolist()}")
    return ids.astype(np.int32)


def _check_row(state: CacheState, block_row) -> np.ndarray:
    """A block-table row: at most MB local block ids, then -1."""
    local = state.config.local()
    MB, N = local.max_blocks_per_request, local.num_blocks
    ids = np.asarray([] if block_row is None else block_row)
    if ids.ndim != 1 or ids.size > MB or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"block_row: expected at most {MB} int block ids, got "
                         f"{ids.dtype}{list(ids.shape)}")
    bad = ids[(ids < -1) | (ids >= N)]
    if bad.size:
        raise ValueError(f"block_row: expected block ids in [0, {N}) or -1, got {int(bad[0])}")
    row = np.full(MB, -1, np.int32)
    row[:ids.size] = ids
    return row


def _bounds(state: CacheState) -> tuple:
    cfg = state.config
    return (cfg.max_requests, cfg.num_blocks, cfg.local().max_blocks_per_request)


def _make_ids(state: CacheState, slot, blocks, block_row, distinct: bool) -> RequestIds:
    has_slot = slot is not None
    head = np.array([_check_slot(state, slot) if has_slot else -1], np.int32)
    ids = np.concatenate([head, _check_blocks(state, blocks, distinct=distinct)])
    row = _check_row(state, block_row)
    if _is_traced(state):
        return RequestIds(jnp.asarray(ids), jnp.asarray(row), has_slot, _bounds(state))
    return jax.device_put(RequestIds(ids, row, has_slot, _bounds(state)),
                          _replicated(state, None))


def _check_ids(state: CacheState, where, need_slot: bool) -> RequestIds:
    """`where`, a RequestIds made for a cache of this state's sizes (with a
    slot where `need_slot`); ValueError otherwise."""
    if not isinstance(where, RequestIds):
        raise ValueError(f"where: expected a RequestIds (request_ids), got "
                         f"{type(where).__name__}")
    if where.bounds != _bounds(state):
        raise ValueError(f"where: made for a cache of (R, N, MB) = {where.bounds}, this one has "
                         f"{_bounds(state)}")
    if need_slot and not where.has_slot:
        raise ValueError("slot: this RequestIds was made without a slot")
    check_tree("where", (where.ids, where.row),
               (jax.ShapeDtypeStruct((where.num_blocks + 1,), jnp.int32),
                jax.ShapeDtypeStruct((_bounds(state)[2],), jnp.int32)))
    return where


def _slot_ids(state: CacheState, slot, block_row=None) -> RequestIds:
    """A move of a slot: `slot` a RequestIds (its own row: no block_row), or
    an int checked here."""
    if isinstance(slot, RequestIds):
        if block_row is not None:
            raise ValueError("block_row: a RequestIds carries its block-table row (give it to "
                             "request_ids)")
        return _check_ids(state, slot, need_slot=True)
    return _make_ids(state, _check_slot(state, slot), (), block_row, distinct=False)


def _block_ids(state: CacheState, blocks, distinct: bool) -> RequestIds:
    if isinstance(blocks, RequestIds):
        return _check_ids(state, blocks, need_slot=False)
    return _make_ids(state, None, blocks, None, distinct)


# ---- public functions --------------------------------------------------------------------------
def request_ids(state: CacheState, slot: int | None = None, blocks: Sequence[int] = (),
                block_row: Sequence[int] | None = None) -> RequestIds:
    """A request's slot, blocks and block-table row in this cache, checked
    now and put on the state's device (replicated over a sharded state's
    mesh): the moves given it (`snapshot`, `restore`, `read_blocks`,
    `write_blocks`, `read_request`, `write_request`) copy no index from the
    host. Make it once per place a request moves to or from.

    slot       an int in [0, R) (global under sharding), or None: blocks only
    blocks     block ids in [0, N) (global), distinct, or -1 (padding)
    block_row  the slot's block-table row for `restore` (shard-local ids, at
               most MB), padded with -1

    ValueError for a value outside those ranges."""
    return _make_ids(state, slot, blocks, block_row, distinct=True)


def snapshot(state: CacheState, slot: int | RequestIds, *, memory_kind: str | None = None,
             sharding=None) -> RequestSnapshot:
    """The per-slot state of request slot `slot`: every layer's window and
    the compressor accumulators (`RequestSnapshot`). Reads only.

    slot         a Python int in [0, R) (global under sharding), or a
                 `RequestIds` with a slot (`request_ids`)
    memory_kind  None: where the state lives; "pinned_host" (or any memory
                 kind the device has) puts the snapshot there, copied by the
                 same program
    sharding     a `jax.sharding.Sharding` for the snapshot's leaves instead
                 of the state's device (sharded: replicated over its mesh)

    ValueError for a bad slot. Inside a trace it is inlined and places
    nothing."""
    where = _slot_ids(state, slot)
    return _run("snapshot", state, where, memory_kind=memory_kind, sharding=sharding)


def restore(state: CacheState, slot: int | RequestIds, snap: RequestSnapshot,
            block_row: Sequence[int] | None = None) -> CacheState:
    """Write a snapshot into request slot `slot`, in place: the slot's window in
    every layer, its accumulators, and its block-table row (`block_row`: the
    physical blocks of its logical blocks 0, 1, ..., then -1; shard-local ids;
    given a `RequestIds`, its row).

    Every per-slot leaf is overwritten, so the slot needs no reset; the pages
    the row points at must hold the request's entries (shared prefix blocks,
    or blocks `write_blocks` filled). The state is donated: use the returned
    one. ValueError, before anything is donated, for a slot outside [0, R), a
    snapshot of another layer pattern or kv_format, or a bad row. A snapshot
    in host memory is moved to the device first."""
    check_snapshot(state.config, snap)
    where = _slot_ids(state, slot, block_row)
    return _run("restore", state, where, snap)


def read_blocks(state: CacheState, blocks: Sequence[int] | RequestIds, *,
                memory_kind: str | None = None, sharding=None) -> RequestBlocks:
    """The contents of physical blocks `blocks` (ids, or a `RequestIds`'
    blocks) in every compressed layer (CSA entries and indexer keys, HCA
    entries), in the order given; a -1 id reads as zero bytes (padding).
    Placement as `snapshot`."""
    where = _block_ids(state, blocks, distinct=False)
    return _run("read_blocks", state, where, memory_kind=memory_kind, sharding=sharding)


def write_blocks(state: CacheState, blocks: Sequence[int] | RequestIds,
                 data: RequestBlocks) -> CacheState:
    """Write `data` (from `read_blocks`, any placement) into physical blocks
    `blocks` (ids, or a `RequestIds`' blocks), in place, every row of every
    compressed layer; -1 ids are skipped. Ids must be distinct. The state is
    donated: use the returned one."""
    where = _block_ids(state, blocks, distinct=True)
    _check_data(state, data, where.num_blocks)
    return _run("write_blocks", state, where, data)


def _check_data(state, data, nb):
    if not isinstance(data, RequestBlocks):
        raise ValueError(f"data: expected RequestBlocks, got {type(data).__name__}")
    check_tree("data", data, blocks_shapes(state.config, nb))


def read_request(state: CacheState, where: RequestIds, *, memory_kind: str | None = None,
                 sharding=None) -> tuple[RequestSnapshot, RequestBlocks]:
    """`snapshot` of `where`'s slot and `read_blocks` of its blocks in one
    program (unsharded with the FFI handlers: one copy). Placement as
    `snapshot`."""
    where = _check_ids(state, where, need_slot=True)
    return _run("read_request", state, where, memory_kind=memory_kind, sharding=sharding)


def write_request(state: CacheState, where: RequestIds, snap: RequestSnapshot,
                  data: RequestBlocks) -> CacheState:
    """`write_blocks` of `data` into `where`'s blocks and `restore` of `snap`
    with its block-table row into its slot, in one program (unsharded with
    the FFI handlers: one copy), in place. The state is donated: use the
    returned one."""
    where = _check_ids(state, where, need_slot=True)
    check_snapshot(state.config, snap)
    _check_data(state, data, where.num_blocks)
    return _run("write_request", state, where, snap, data)
