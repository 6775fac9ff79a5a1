"""The values a request's cache moves as (docs/design/state.md, "Request state
that moves"): `RequestSnapshot` (the slot's state outside the pages),
`RequestBlocks` (the contents of physical blocks), and `RequestIds` (where
in a cache they go, held on the device); their shapes under a config, and
the check that a snapshot fits a cache. requests/transfer.py moves them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import config as C
from ..config import CacheConfig
from ..state import (IndexerKeys, KVEntries, WindowState, check_tree, index_key_shapes,
                     kv_entry_shapes, pytree_dataclass, state_shapes)


@pytree_dataclass(static=("compress_ratios", "kv_format"))
class RequestSnapshot:
    """The state of one request outside the paged pools.

    window     WindowState: kv KVEntries[L, 128, ...], pos i32[L, 128]
    csa_comp   f32[Lc, 2, 3, 512]   CSA compressor accumulators (current, next)
    csa_icomp  f32[Lc, 2, 3, 128]   CSA indexer compressor accumulators
    hca_comp   f32[Lh, 1, 3, 512]   HCA compressor accumulator

    `length` (a property, not a leaf: the snapshot holds exactly the slot's
    bytes) is 1 + the largest position the windows hold, 0 for an empty slot.

    Static: the layer pattern and kv_format it was taken under; `restore`
    refuses a snapshot of another layout. R, N and the shard count do not
    matter: a snapshot restores into any cache of the same model and format.
    """
    window: WindowState
    csa_comp: jax.Array
    csa_icomp: jax.Array
    hca_comp: jax.Array
    compress_ratios: tuple
    kv_format: str

    @property
    def length(self):
        """i32: the request's length when its last token reached every window
        (1 + the largest window position; 0 for an empty slot). Read from
        `window.pos` wherever it lives (a sync); traced inside a trace."""
        pos = self.window.pos
        if isinstance(pos, jax.core.Tracer):
            return (jnp.max(pos) + 1).astype(jnp.int32)
        return np.int32(np.max(np.asarray(pos)) + 1)


@pytree_dataclass
class RequestBlocks:
    """The contents of `nb` physical blocks in every compressed layer.

    csa_kv     KVEntries [Lc, nb, 32, ...]
    csa_index  IndexerKeys [Lc, nb, 32, ...]
    hca_kv     KVEntries [Lh, nb, 1, ...]
    """
    csa_kv: KVEntries
    csa_index: IndexerKeys
    hca_kv: KVEntries


@pytree_dataclass(static=("has_slot", "bounds"))
class RequestIds:
    """Where one request's copies go in one cache (`request_ids`): checked on
    the host once and held on the device, so the moves given it send no
    index from the host.

    ids       i32[1 + nb]  the slot (global under sharding; -1 where none was
                           given), then nb block ids (global; -1: padding)
    row       i32[MB]      the slot's block-table row (shard-local block ids,
                           then -1)
    has_slot  static: whether a slot was given
    bounds    static: (R, N, MB) of the cache the ids were checked against; a
              move refuses them in a cache of other sizes
    """
    ids: jax.Array
    row: jax.Array
    has_slot: bool
    bounds: tuple

    @property
    def num_blocks(self) -> int:
        """nb, the block ids it holds (padding included)."""
        return self.ids.shape[0] - 1


def snapshot_shapes(config: CacheConfig) -> RequestSnapshot:
    """`RequestSnapshot` of `config` as `jax.ShapeDtypeStruct`s."""
    full = state_shapes(config.local())
    drop_slot = lambda s: jax.ShapeDtypeStruct(s.shape[:1] + s.shape[2:], s.dtype)
    window = jax.tree_util.tree_map(drop_slot, full.swa)
    return RequestSnapshot(window, drop_slot(full.csa.comp), drop_slot(full.csa.icomp),
                           drop_slot(full.hca.comp), config.compress_ratios, config.kv_format)


def blocks_shapes(config: CacheConfig, num_blocks: int) -> RequestBlocks:
    """`RequestBlocks` of `num_blocks` blocks as `jax.ShapeDtypeStruct`s."""
    csa = (config.num_csa, num_blocks, CacheConfig.entries_per_block(C.CSA))
    hca = (config.num_hca, num_blocks, CacheConfig.entries_per_block(C.HCA))
    return RequestBlocks(kv_entry_shapes(config.kv_format, csa), index_key_shapes(csa),
                         kv_entry_shapes(config.kv_format, hca))


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
