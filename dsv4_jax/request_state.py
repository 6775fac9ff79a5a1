"""One request's cache as values that move (docs/design.md §5, "Request state
that moves"): the per-slot state outside the pages (`RequestSnapshot`: every
layer's window, the compressor accumulators, the length) and the contents of
physical blocks (`RequestBlocks`), read out of a `CacheState` and written back
into another slot and other blocks, bit for bit.

    snap = snapshot(state, slot)                       # device, or memory_kind="pinned_host"
    data = read_blocks(state, manager.blocks_of(rid))  # the pages of the request
    state = write_blocks(state, new_blocks, data)      # in place (the state is donated)
    state = restore(state, new_slot, snap, block_row=new_blocks)

Called on concrete arrays each runs one cached `jax.jit` program (the state
donated by the writes: take back the state they return); called inside a
trace it is inlined into the caller's program. Every copy moves bits (reads
bitcast the leaves to unsigned integers, writes are scatters that set rows,
on the CPU of the bits too), so nothing is rounded, a -0 stays -0 and a NaN
payload is kept.

Unsharded, where the FFI handlers of `dsv4_jax.ops.copy_rows` are built for
the state's platform (impl "auto"), each move's copy is one `take_rows` or
`put_rows` call over all its leaves (one kernel on the GPU); with
`default_impl("reference")`, and sharded, the jnp slices and scatters below.

Sharded (docs/design.md §10), `slot` is the global slot
(`ShardedCacheManager.global_slot`), block ids are global
(`ShardedCacheManager.global_blocks`), `block_row` holds the owning shard's
local ids as the block table does, and the calls run under
`with jax.set_mesh(mesh):`; each shard reads or writes only what it owns and
a snapshot or block read is summed over the shards (integers, one non-zero
term) into a copy replicated over the mesh.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import config as C
from .config import CacheConfig
from .ops import copy_rows
from .ops._dispatch import auto_means, resolve_impl
from .state import (CacheState, IndexerKeys, KVEntries, WindowState, _dataclass,
                    index_key_shapes, kv_entry_shapes, state_shapes)


@_dataclass(static=("compress_ratios", "kv_format"))
class RequestSnapshot:
    """The state of one request outside the paged pools.

    window     WindowState: kv KVEntries[L, 128, ...], pos i32[L, 128]
    csa_comp   f32[Lc, 2, 3, 512]   CSA compressor accumulators (current, next)
    csa_icomp  f32[Lc, 2, 3, 128]   CSA indexer compressor accumulators
    hca_comp   f32[Lh, 1, 3, 512]   HCA compressor accumulator
    length     i32[]                1 + the largest position the windows hold
                                    (0 for an empty slot): the request's length
                                    when its last token reached every window

    Static: the layer pattern and kv_format it was taken under; `restore`
    refuses a snapshot of another layout. R, N and the shard count do not
    matter: a snapshot restores into any cache of the same model and format.
    """
    window: WindowState
    csa_comp: jax.Array
    csa_icomp: jax.Array
    hca_comp: jax.Array
    length: jax.Array
    compress_ratios: tuple
    kv_format: str


@_dataclass
class RequestBlocks:
    """The contents of `nb` physical blocks in every compressed layer.

    csa_kv     KVEntries [Lc, nb, 32, ...]
    csa_index  IndexerKeys [Lc, nb, 32, ...]
    hca_kv     KVEntries [Lh, nb, 1, ...]
    """
    csa_kv: KVEntries
    csa_index: IndexerKeys
    hca_kv: KVEntries


def snapshot_shapes(config: CacheConfig) -> RequestSnapshot:
    """`RequestSnapshot` of `config` as `jax.ShapeDtypeStruct`s."""
    full = state_shapes(config.local())
    drop_slot = lambda s: jax.ShapeDtypeStruct(s.shape[:1] + s.shape[2:], s.dtype)
    window = jax.tree_util.tree_map(drop_slot, full.swa)
    return RequestSnapshot(window, drop_slot(full.csa.comp), drop_slot(full.csa.icomp),
                           drop_slot(full.hca.comp), jax.ShapeDtypeStruct((), jnp.int32),
                           config.compress_ratios, config.kv_format)


def blocks_shapes(config: CacheConfig, num_blocks: int) -> RequestBlocks:
    """`RequestBlocks` of `num_blocks` blocks as `jax.ShapeDtypeStruct`s."""
    csa = (config.num_csa, num_blocks, CacheConfig.entries_per_block(C.CSA))
    hca = (config.num_hca, num_blocks, CacheConfig.entries_per_block(C.HCA))
    return RequestBlocks(kv_entry_shapes(config.kv_format, csa), index_key_shapes(csa),
                         kv_entry_shapes(config.kv_format, hca))


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
    window, comp, icomp, hcomp = jax.tree_util.tree_map(take, _slot_parts(st))
    last = jnp.max(jax.lax.dynamic_index_in_dim(st.swa.pos, at, 1, False))
    length = jnp.where(ok, last + 1, 0).astype(jnp.uint32)
    return window, comp, icomp, hcomp, length


def _put_slot(st: CacheState, slot, first, snap_parts, row) -> CacheState:
    """The state with the snapshot's leaves and block-table row written into
    `slot` where this shard owns it (else unchanged)."""
    R = st.config.max_requests
    local, ok = _local_index(slot, first, R)
    at = jnp.where(ok, local, R)[None]         # R: dropped by mode="drop"
    window, comp, icomp, hcomp = jax.tree_util.tree_map(
        lambda x, b: _write_rows(x, at, b[:, None]), _slot_parts(st), snap_parts)
    table = st.block_table.at[at[0]].set(row, mode="drop")
    return dataclasses.replace(
        st, block_table=table, swa=window,
        csa=dataclasses.replace(st.csa, comp=comp, icomp=icomp),
        hca=dataclasses.replace(st.hca, comp=hcomp))


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
    new = jax.tree_util.tree_map(lambda x, b: _write_rows(x, at, b), _block_parts(st), data)
    return dataclasses.replace(
        st, csa=dataclasses.replace(st.csa, kv=new.csa_kv, index=new.csa_index),
        hca=dataclasses.replace(st.hca, kv=new.hca_kv))


# ---- whole-state programs -------------------------------------------------------------------
def _over_shards(state: CacheState, body, operands, out):
    """`body(local_state, first_slot, first_block, *operands)` on every shard
    (on the whole state when unsharded). `out` "state": it returns the
    shard's state; "sum": it returns bits, summed over the shards."""
    cfg = state.config
    if not cfg.sharded:
        return body(state, 0, 0, *operands)
    from .sharding import run_sharded
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


def _fused(state: CacheState) -> bool:
    """Whether the moves of this (unsharded) state go through copy_rows' FFI
    handlers: decided when a move is traced."""
    return not state.config.sharded and \
        resolve_impl("auto", "dsv4_take_rows", [state.block_table]) != "reference"


def _snapshot_body(state: CacheState, slot) -> RequestSnapshot:
    cfg = state.config
    if _fused(state):
        leaves, tree = jax.tree_util.tree_flatten(_slot_parts(state))
        rows = copy_rows.take_rows(leaves, [1] * len(leaves), slot[None])
        window, comp, icomp, hcomp = jax.tree_util.tree_unflatten(tree, [r[:, 0] for r in rows])
        length = jnp.max(window.pos) + 1     # positions -1 everywhere: 0
        return RequestSnapshot(window, comp, icomp, hcomp, length.astype(jnp.int32),
                               cfg.compress_ratios, cfg.kv_format)
    window, comp, icomp, hcomp, length = _over_shards(
        state, _take_slot_entry, [slot], "sum")
    shapes = snapshot_shapes(cfg)
    window = jax.tree_util.tree_map(lambda b, s: _unbits(b, s.dtype), window, shapes.window)
    return RequestSnapshot(window, _unbits(comp, jnp.float32), _unbits(icomp, jnp.float32),
                           _unbits(hcomp, jnp.float32), length.astype(jnp.int32),
                           cfg.compress_ratios, cfg.kv_format)


def _take_slot_entry(st, first_slot, first_block, slot):
    return _take_slot(st, slot, first_slot)


def _restore_body(state: CacheState, slot, snap: RequestSnapshot, row) -> CacheState:
    parts = (snap.window, snap.csa_comp, snap.csa_icomp, snap.hca_comp)
    if _fused(state):
        # the block-table row travels in the same call (its row axis is 0)
        leaves, tree = jax.tree_util.tree_flatten(_slot_parts(state))
        rows = [x[:, None] for x in jax.tree_util.tree_leaves(parts)]
        new = copy_rows.put_rows(leaves + [state.block_table], [1] * len(leaves) + [0],
                                 slot[None], rows + [row[None]])
        window, comp, icomp, hcomp = jax.tree_util.tree_unflatten(tree, new[:-1])
        return dataclasses.replace(
            state, block_table=new[-1], swa=window,
            csa=dataclasses.replace(state.csa, comp=comp, icomp=icomp),
            hca=dataclasses.replace(state.hca, comp=hcomp))
    return _over_shards(state, lambda st, fs, fb, s, p, r: _put_slot(st, s, fs, p, r),
                        [slot, parts, row], "state")


def _read_blocks_body(state: CacheState, blocks) -> RequestBlocks:
    if _fused(state):
        leaves, tree = jax.tree_util.tree_flatten(_block_parts(state))
        return jax.tree_util.tree_unflatten(
            tree, copy_rows.take_rows(leaves, [1] * len(leaves), blocks))
    bits = _over_shards(state, lambda st, fs, fb, b: _take_blocks(st, b, fb), [blocks], "sum")
    shapes = blocks_shapes(state.config, blocks.shape[0])
    return jax.tree_util.tree_map(lambda b, s: _unbits(b, s.dtype), bits, shapes)


def _write_blocks_body(state: CacheState, blocks, data: RequestBlocks) -> CacheState:
    if _fused(state):
        leaves, tree = jax.tree_util.tree_flatten(_block_parts(state))
        new = jax.tree_util.tree_unflatten(tree, copy_rows.put_rows(
            leaves, [1] * len(leaves), blocks, jax.tree_util.tree_leaves(data)))
        return dataclasses.replace(
            state, csa=dataclasses.replace(state.csa, kv=new.csa_kv, index=new.csa_index),
            hca=dataclasses.replace(state.hca, kv=new.hca_kv))
    return _over_shards(state, lambda st, fs, fb, b, d: _put_blocks(st, b, fb, d),
                        [blocks, data], "state")


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
    """The jitted program of one kind of move, cached per config, placement
    and what impl "auto" stands for when it is traced (`default_impl`)."""
    return _program_for(kind, config, out_sharding, auto_means())


@functools.lru_cache(maxsize=None)
def _program_for(kind: str, config: CacheConfig, out_sharding, auto: str):
    if kind == "snapshot":
        return jax.jit(_snapshot_body, out_shardings=out_sharding)
    if kind == "read_blocks":
        return jax.jit(_read_blocks_body, out_shardings=out_sharding)
    if kind == "restore":
        return jax.jit(_restore_body, donate_argnums=0)
    return jax.jit(_write_blocks_body, donate_argnums=0)


def _to_state_memory(state: CacheState, tree):
    """`tree` moved next to the state (from host memory, another device, or
    numpy), unless it is already there."""
    target = _replicated(state, None)
    leaves = jax.tree_util.tree_leaves(tree)
    if all(isinstance(x, jax.Array) and x.sharding == target for x in leaves):
        return tree
    return jax.device_put(tree, target)


# ---- checks (before anything is donated) ---------------------------------------------------
def _check_slot(state: CacheState, slot) -> np.int32:
    R = state.config.max_requests
    if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool) or not 0 <= slot < R:
        raise ValueError(f"slot: expected an int in [0, {R}) (the cache's request slots"
                         f"{', global over the shards' if state.config.sharded else ''}), "
                         f"got {slot!r}")
    return np.int32(slot)


def check_snapshot(config: CacheConfig, snap) -> None:
    """ValueError unless `snap` is a `RequestSnapshot` of `config`'s layer
    pattern and kv_format with the shapes and dtypes that implies."""
    if not isinstance(snap, RequestSnapshot):
        raise ValueError(f"snapshot: expected a RequestSnapshot, got {type(snap).__name__}")
    if (snap.compress_ratios, snap.kv_format) != (config.compress_ratios, config.kv_format):
        raise ValueError(
            f"snapshot: taken from a cache of another layout (kv_format {snap.kv_format!r}, "
            f"{len(snap.compress_ratios)} layers {_ratios(snap.compress_ratios)}); this cache "
            f"has kv_format {config.kv_format!r}, {config.num_layers} layers "
            f"{_ratios(config.compress_ratios)}")
    check_tree("snapshot", snap, snapshot_shapes(config))


def _ratios(r):
    return str(r) if len(r) <= 6 else f"{r[:6]}..."


def check_tree(name, tree, want):
    """ValueError naming the first leaf of `tree` whose shape or dtype is not
    that of `want` (a pytree of ShapeDtypeStruct)."""
    got_leaves = jax.tree_util.tree_leaves_with_path(tree)
    want_leaves = jax.tree_util.tree_leaves(want)
    if len(got_leaves) != len(want_leaves):
        raise ValueError(f"{name}: expected {len(want_leaves)} arrays, got {len(got_leaves)}")
    for (path, x), w in zip(got_leaves, want_leaves):
        if tuple(np.shape(x)) != w.shape or np.dtype(x.dtype) != np.dtype(w.dtype):
            raise ValueError(f"{name}{jax.tree_util.keystr(path)}: expected {w.dtype}"
                             f"{list(w.shape)}, got {x.dtype}{list(np.shape(x))}")


def _check_blocks(state: CacheState, blocks, what="blocks") -> np.ndarray:
    """Block ids as int32, each in [0, N) (global over the shards) or -1 (padding)."""
    N = state.config.num_blocks
    ids = np.asarray(blocks)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"{what}: expected a 1-D sequence of int block ids, got "
                         f"{ids.dtype}{list(ids.shape)}")
    bad = ids[(ids < -1) | (ids >= N)]
    if bad.size:
        raise ValueError(f"{what}: expected ids in [0, {N}) or -1 (padding), got {int(bad[0])}")
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


# ---- public functions --------------------------------------------------------------------------
def snapshot(state: CacheState, slot: int, *, memory_kind: str | None = None,
             sharding=None) -> RequestSnapshot:
    """The per-slot state of request slot `slot`: every layer's window, the
    compressor accumulators and the length (`RequestSnapshot`). Reads only.

    memory_kind  None: where the state lives; "pinned_host" (or any memory
                 kind the device has) puts the snapshot there, copied by the
                 same program
    sharding     a `jax.sharding.Sharding` for the snapshot's leaves instead
                 of the state's device (sharded: replicated over its mesh)

    `slot` is a Python int in [0, R) (global under sharding); ValueError
    otherwise. Inside a trace it is inlined and places nothing."""
    slot = _check_slot(state, slot)
    if _is_traced(state):
        return _snapshot_body(state, jnp.int32(slot))
    out = _out_sharding(state, memory_kind, sharding)
    return _program("snapshot", state.config, out)(state, jnp.int32(slot))


def restore(state: CacheState, slot: int, snap: RequestSnapshot,
            block_row: Sequence[int] | None = None) -> CacheState:
    """Write a snapshot into request slot `slot`, in place: the slot's window in
    every layer, its accumulators, and its block-table row (`block_row`: the
    physical blocks of its logical blocks 0, 1, ..., then -1; shard-local ids).

    Every per-slot leaf is overwritten, so the slot needs no reset; the pages
    the row points at must hold the request's entries (shared prefix blocks,
    or blocks `write_blocks` filled). The state is donated: use the returned
    one. ValueError, before anything is donated, for a slot outside [0, R), a
    snapshot of another layer pattern or kv_format, or a bad row. A snapshot
    in host memory is moved to the device first."""
    slot = _check_slot(state, slot)
    check_snapshot(state.config, snap)
    row = _check_row(state, block_row)
    if _is_traced(state):
        return _restore_body(state, jnp.int32(slot), snap, jnp.asarray(row))
    snap = _to_state_memory(state, snap)
    row = _to_state_memory(state, row)
    return _program("restore", state.config, None)(state, jnp.int32(slot), snap, row)


def read_blocks(state: CacheState, blocks: Sequence[int], *, memory_kind: str | None = None,
                sharding=None) -> RequestBlocks:
    """The contents of physical blocks `blocks` in every compressed layer (CSA
    entries and indexer keys, HCA entries), in the order given; a -1 id reads
    as zero bytes (padding). Placement as `snapshot`."""
    ids = _check_blocks(state, blocks)
    if _is_traced(state):
        return _read_blocks_body(state, jnp.asarray(ids))
    out = _out_sharding(state, memory_kind, sharding)
    return _program("read_blocks", state.config, out)(state, _to_state_memory(state, ids))


def write_blocks(state: CacheState, blocks: Sequence[int], data: RequestBlocks) -> CacheState:
    """Write `data` (from `read_blocks`, any placement) into physical blocks
    `blocks`, in place, every row of every compressed layer; -1 ids are
    skipped. Ids must be distinct. The state is donated: use the returned one."""
    ids = _check_blocks(state, blocks)
    if not isinstance(data, RequestBlocks):
        raise ValueError(f"data: expected RequestBlocks, got {type(data).__name__}")
    check_tree("data", data, blocks_shapes(state.config, ids.size))
    real = ids[ids >= 0]
    if np.unique(real).size != real.size:
        raise ValueError(f"blocks: ids must be distinct, got {ids.tolist()}")
    if _is_traced(state):
        return _write_blocks_body(state, jnp.asarray(ids), data)
    data = _to_state_memory(state, data)
    return _program("write_blocks", state.config, None)(state, _to_state_memory(state, ids), data)
