"""Moving requests with their cache (docs/design/host.md): prefix sharing,
preemption to host memory and back, export and import as plain arrays.

Each function pairs a `CacheManager` (or `ShardedCacheManager`) change with
the device copies of requests/transfer.py, checks everything it can first, and
leaves the manager and the state unchanged when it raises. Called between
steps; the writes donate the state (take back the state they return).

    key = share_prefix(state, manager, a)                # a holds 128*n tokens now
    state, b = admit_on_prefix(state, manager, key)      # b starts with a's prefix
    parked = preempt(state, manager, c)                  # c's cache to host memory
    state, c = resume(state, manager, parked)            # back as c, other slot and blocks
    arrays = export_request(state, manager, d)           # dict of numpy arrays
    state, d = import_request(other_state, other_manager, arrays)
"""
from __future__ import annotations

import dataclasses
from typing import Hashable

import jax
import numpy as np

from ..config import BLOCK_TOKENS
from ..meta import bucket
from ..state import check_tree
from .transfer import read_request, request_ids, restore, snapshot, write_request
from .types import (RequestBlocks, RequestSnapshot, blocks_shapes, check_snapshot,
                    snapshot_shapes)


@dataclasses.dataclass(frozen=True)
class OffloadedRequest:
    """A request's whole cache outside the cache: its per-slot state and the
    contents of its blocks (padded with zero blocks to a power of two, so
    requests of similar length share compiled copies), its length, and the
    id it had when `preempt` released it (None for a copy `offload` took of
    a request that stays admitted), which `resume` gives it back."""
    snapshot: RequestSnapshot
    blocks: RequestBlocks
    num_blocks: int          # real blocks: the first num_blocks of `blocks`
    length: int              # tokens, from the manager
    request_id: Hashable | None = None

    @property
    def nbytes(self) -> int:
        """Bytes moved: the snapshot and the real blocks."""
        per_block = sum(x.nbytes // x.shape[1] for x in jax.tree_util.tree_leaves(self.blocks))
        snap = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.snapshot))
        return snap + self.num_blocks * per_block


def host_memory_kind(state) -> str | None:
    """"pinned_host" where the state's device has that memory (GPUs and the
    CPU backend), else None (then an offload is a numpy copy)."""
    device = next(iter(state.block_table.devices()))
    kinds = {m.kind for m in device.addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds else None


def _padded(ids) -> np.ndarray:
    ids = np.asarray(ids, np.int32)
    out = np.full(bucket(max(ids.size, 1)), -1, np.int32)
    out[:ids.size] = ids
    return out


# ---- prefix sharing ---------------------------------------------------------------------------
def share_prefix(state, manager, request_id, *, key: Hashable | None = None,
                 memory_kind: str | None = None) -> Hashable:
    """Cache the request's whole current content as a prefix: its length must
    be a positive multiple of 128 (ValueError otherwise). Takes the snapshot
    of its slot (on the device, or in `memory_kind`) and registers it with
    the manager; returns the prefix key. Reads the state only."""
    length = manager.length_of(request_id)
    if length <= 0 or length % BLOCK_TOKENS:     # before any device work
        raise ValueError(f"request {request_id!r} holds {length} tokens: a prefix is a "
                         f"positive multiple of {BLOCK_TOKENS} tokens; share it at such a "
                         f"boundary")
    if key is not None and key in manager.prefixes:
        raise ValueError(f"key: a prefix {key!r} is already cached")
    snap = snapshot(state, manager.global_slot(request_id), memory_kind=memory_kind)
    return manager.cache_prefix(request_id, snap, key=key)


def admit_on_prefix(state, manager, key, request_id: Hashable | None = None, *,
                    slot: int | None = None):
    """Admit a request on a cached prefix: it shares the prefix's blocks and
    its slot gets the prefix's windows and accumulators (`restore`). Returns
    (state, request id); the request's next token is at position
    `manager.prefix_tokens(key)`."""
    snap = manager.prefix_snapshot(key)
    check_snapshot(state.config.local(), snap)
    rid = manager.admit(request_id, prefix=key, slot=slot)
    return restore(state, manager.global_slot(rid), snap, manager.block_row(rid)), rid


# ---- preemption -----------------------------------------------------------------------------------
def offload(state, manager, request_id, *, memory_kind: str | None = "host") -> OffloadedRequest:
    """Copy a request's cache (snapshot + blocks, one `read_request`) out of
    the state, leaving the request in place. memory_kind "host" (default): `host_memory_kind`;
    None: the state's device; or any memory kind of the device."""
    if memory_kind == "host":
        memory_kind = host_memory_kind(state)
    blocks = manager.global_blocks(request_id)
    here = request_ids(state, manager.global_slot(request_id), _padded(blocks))
    snap, data = read_request(state, here, memory_kind=memory_kind)
    return OffloadedRequest(snap, data, len(blocks), manager.length_of(request_id))


def preempt(state, manager, request_id, *, memory_kind: str | None = "host") -> OffloadedRequest:
    """`offload`, then release the request: its slot and the blocks no one
    else holds go back to the manager. `resume` brings it back under the
    same id."""
    parked = offload(state, manager, request_id, memory_kind=memory_kind)
    manager.release(request_id)
    return dataclasses.replace(parked, request_id=request_id)


def resume(state, manager, parked: OffloadedRequest, request_id: Hashable | None = None, *,
           slot: int | None = None, shard: int | None = None):
    """Bring an offloaded request back: a free slot (or `slot`) and fresh
    blocks from the manager, its block contents written into them and its
    snapshot into the slot. Returns (state, request id): `request_id` if
    given, else the id `preempt` took it from (`parked.request_id`; a new
    id for a copy `offload` took). The cache is bit for bit the one it
    left, moved to other blocks and maybe another slot."""
    if not isinstance(parked, OffloadedRequest):
        raise ValueError(f"parked: expected an OffloadedRequest, got {type(parked).__name__}")
    cfg = state.config.local()
    check_snapshot(cfg, parked.snapshot)
    padded_count = jax.tree_util.tree_leaves(parked.blocks)[0].shape[1]
    if parked.num_blocks != cfg.blocks_for_context(parked.length) \
            or padded_count < parked.num_blocks:
        raise ValueError(f"parked: holds {parked.num_blocks} of {padded_count} blocks for "
                         f"{parked.length} tokens, expected "
                         f"{cfg.blocks_for_context(parked.length)}")
    if not isinstance(parked.blocks, RequestBlocks):
        raise ValueError(f"parked.blocks: expected RequestBlocks, got "
                         f"{type(parked.blocks).__name__}")
    check_tree("parked.blocks", parked.blocks, blocks_shapes(cfg, padded_count))
    kw = {} if shard is None else {"shard": shard}
    if request_id is None:
        request_id = parked.request_id
    rid = manager.admit_restored(parked.length, request_id, slot=slot, **kw)
    ids = np.full(padded_count, -1, np.int32)
    ids[:parked.num_blocks] = manager.global_blocks(rid)
    there = request_ids(state, manager.global_slot(rid), ids, manager.block_row(rid))
    return write_request(state, there, parked.snapshot, parked.blocks), rid


# ---- export / import ---------------------------------------------------------------------------------
def export_request(state, manager, request_id) -> dict:
    """One request's cache as plain numpy arrays (host memory), e.g. to decode
    on another mesh what one mesh prefilled. Keys: "length", "kv_format",
    "compress_ratios", "snapshot.<leaf>" (the `RequestSnapshot`),
    "blocks.<leaf>" (its blocks in logical order, `RequestBlocks`)."""
    parked = offload(state, manager, request_id, memory_kind=None)
    out = {"length": np.asarray(parked.length, np.int64),
           "kv_format": np.asarray(state.config.kv_format),
           "compress_ratios": np.asarray(state.config.compress_ratios, np.int32)}
    for name, tree, n in (("snapshot", parked.snapshot, None),
                          ("blocks", parked.blocks, parked.num_blocks)):
        for path, x in jax.tree_util.tree_leaves_with_path(tree):
            x = np.asarray(x)
            out[name + jax.tree_util.keystr(path)] = x if n is None else x[:, :n]
    return out


def import_request(state, manager, arrays: dict, request_id: Hashable | None = None, *,
                   slot: int | None = None, shard: int | None = None):
    """Admit a request from `export_request`'s arrays into this cache (any R,
    N and sharding of the same model and kv_format): fresh blocks and a free
    slot. Returns (state, request id). ValueError, nothing changed, for arrays
    of another layout or shape."""
    cfg = state.config.local()
    layout = (tuple(int(r) for r in np.asarray(arrays["compress_ratios"])),
              str(arrays["kv_format"]))
    if layout != (cfg.compress_ratios, cfg.kv_format):
        raise ValueError(f"arrays: exported from a cache of another layout (kv_format "
                         f"{layout[1]!r}, {len(layout[0])} layers); this cache has kv_format "
                         f"{cfg.kv_format!r}, {cfg.num_layers} layers")
    length = int(arrays["length"])
    n = cfg.blocks_for_context(length)
    snap = _tree_from("snapshot", arrays, snapshot_shapes(cfg))
    blocks = _tree_from("blocks", arrays, blocks_shapes(cfg, n))
    pad = bucket(max(n, 1)) - n
    blocks = jax.tree_util.tree_map(
        lambda x: np.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)), blocks)
    parked = OffloadedRequest(snap, blocks, n, length)
    return resume(state, manager, parked, request_id, slot=slot, shard=shard)


def _tree_from(prefix, arrays, shapes):
    """The pytree `shapes` describes, its leaves from arrays["<prefix><path>"]."""
    def leaf(path, sds):
        name = prefix + jax.tree_util.keystr(path)
        if name not in arrays:
            raise ValueError(f"arrays: missing {name!r}")
        x = np.asarray(arrays[name])
        if x.shape != sds.shape or x.dtype != sds.dtype:
            raise ValueError(f"arrays[{name!r}]: expected {np.dtype(sds.dtype)}{list(sds.shape)}, "
                             f"got {x.dtype}{list(x.shape)}")
        return x
    return jax.tree_util.tree_map_with_path(leaf, shapes)
