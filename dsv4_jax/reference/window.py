"""Sliding window: append and gather_window (docs/design/semantics.md,
docs/design/operations.md).

The window of a request is a ring of 128 entries per layer; a token at
position p goes to ring slot p mod 128. Within one call several tokens of a
request may land on the same ring slot (a chunk longer than 128): the one of
largest position wins, ties going to the later row. That rule is applied
explicitly (two scatter-max passes over an [R, 128] grid) rather than relying
on the order in which a scatter applies duplicate indices, which XLA leaves
unspecified.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import config as C
from ..errors import ErrorKind
from ..state import CacheState
from . import quant
from ._rows import add_errors, layer_ok, read_index, set_pool_rows, token_checks


def _winners(slot, pos, valid, R: int):
    """Mask of the rows that end up in the window: per (slot, pos mod 128) the
    largest position, then the last row among equal positions."""
    W = C.WINDOW
    T = slot.shape[0]
    cell = jnp.where(valid, slot * W + pos % W, R * W)          # R*W = dropped
    best_pos = jnp.full((R * W,), -1, jnp.int32).at[cell].max(
        jnp.where(valid, pos, -1), mode="drop")
    top = valid & (pos == best_pos[jnp.minimum(cell, R * W - 1)])
    rows = jnp.arange(T, dtype=jnp.int32)
    best_row = jnp.full((R * W,), -1, jnp.int32).at[jnp.where(top, cell, R * W)].max(
        rows, mode="drop")
    return top & (rows == best_row[jnp.minimum(cell, R * W - 1)])


def append(state: CacheState, layer_idx, token_slot, token_pos, kv) -> CacheState:
    cfg = state.config
    L, R = cfg.num_layers, cfg.max_requests
    ok_layer = layer_ok(layer_idx, L)
    valid, bad_slot, bad_pos = token_checks(token_slot, token_pos, R, cfg.max_context)
    nonfinite = valid & ~jnp.all(jnp.isfinite(kv), axis=-1)
    valid = valid & ~nonfinite & ok_layer
    errors = add_errors(state.errors, ok_layer, {ErrorKind.BAD_SLOT: bad_slot,
                                                 ErrorKind.BAD_POSITION: bad_pos,
                                                 ErrorKind.NONFINITE: nonfinite})
    win = _winners(token_slot, token_pos, valid, R)
    layer = read_index(layer_idx, L)
    slot = jnp.where(win, token_slot, R)                         # R = dropped
    ring = jnp.where(win, token_pos % C.WINDOW, 0)
    entries = quant.quantize_kv(kv, cfg.kv_format)
    new_kv = jax.tree_util.tree_map(
        lambda pool, val: set_pool_rows(pool, (layer, slot, ring), val),
        state.swa.kv, entries)
    new_pos = state.swa.pos.at[layer, slot, ring].set(token_pos, mode="drop")
    swa = state.swa.__class__(new_kv, new_pos)
    return CacheState(state.block_table, swa, state.csa, state.hca, errors, cfg)


def gather_window(state: CacheState, layer_idx, slots):
    """kv bf16[B, 128, 512], pos i32[B, 128], errors. Slot -1: zero rows and
    pos -1, no error; a slot outside [0, R): the same and BAD_SLOT; ring slots
    with pos -1: zero rows."""
    cfg = state.config
    L, R = cfg.num_layers, cfg.max_requests
    ok_layer = layer_ok(layer_idx, L)
    slot_ok = (slots >= 0) & (slots < R)
    errors = add_errors(state.errors, ok_layer,
                        {ErrorKind.BAD_SLOT: (slots != -1) & ~slot_ok})
    layer = read_index(layer_idx, L)
    s = read_index(slots, R)
    use = (slot_ok & ok_layer)[:, None]
    pos = jnp.where(use, state.swa.pos[layer][s], -1)
    entries = jax.tree_util.tree_map(lambda pool: pool[layer][s], state.swa.kv)
    kv = quant.dequantize_kv(entries, cfg.kv_format)
    kv = jnp.where((pos >= 0)[..., None], kv, jnp.zeros((), kv.dtype))
    return kv, pos, errors
