"""Gathers of compressed entries: gather_topk (CSA) and gather_all (HCA)
(docs/design/operations.md; per-row rules in dsv4_jax/ops/gather.py).

Rows are read with clipped indices and masked to zero where they are not
valid, so nothing outside the pools is ever addressed.
"""
from __future__ import annotations

import jax.numpy as jnp

from .. import config as C
from ..errors import ErrorKind
from ..state import CacheState
from ._rows import (add_errors, layer_ok, read_entries, read_index, token_checks,
                    visible_entries)


def gather_topk(state: CacheState, kind_idx, token_slot, token_pos, indices):
    """kv bf16[T, k, 512], valid bool[T, k], errors.

    A query at position t sees entry i iff 0 <= i < (t + 1) // 4. Per token:
    slot -1 -> the row is invalid, nothing counted; slot outside [0, R) ->
    BAD_SLOT once; pos < 0 or >= max_context -> BAD_POSITION once; in those
    cases the indices of the row are not examined. Per index of a good token:
    -1 -> invalid, no error; < -1 or not visible -> BAD_INDEX (a good
    position sees at most MB * 32 entries, so a visible index is inside the
    block table); block table entry outside [0, N) -> MISSING_BLOCK."""
    cfg = state.config
    R, MB = cfg.max_requests, cfg.max_blocks_per_request
    N = cfg.num_blocks
    Lc = state.csa.comp.shape[0]
    per_block = C.BLOCK_TOKENS // C.CSA_RATIO
    ok_layer = layer_ok(kind_idx, Lc)

    row_ok, bad_slot, bad_pos = token_checks(token_slot, token_pos, R, cfg.max_context)
    row_ok = row_ok[:, None]
    visible = visible_entries(token_pos, MB * per_block)[:, None]
    examined = row_ok & (indices != -1)
    bad_index = examined & ((indices < -1) | (indices >= visible))
    col = jnp.clip(indices // per_block, 0, MB - 1)
    block = state.block_table[read_index(token_slot, R)[:, None], col]
    missing = examined & ~bad_index & ((block < 0) | (block >= N))
    valid = examined & ~bad_index & ~missing & ok_layer
    errors = add_errors(state.errors, ok_layer, {ErrorKind.BAD_SLOT: bad_slot,
                                                 ErrorKind.BAD_POSITION: bad_pos,
                                                 ErrorKind.BAD_INDEX: bad_index,
                                                 ErrorKind.MISSING_BLOCK: missing})
    row = jnp.where(valid, indices, 0) % per_block
    kv = read_entries(state.csa.kv, read_index(kind_idx, Lc), block, row, cfg.kv_format, valid)
    return kv, valid, errors


def gather_all(state: CacheState, kind_idx, slots, lengths, max_entries: int):
    """kv bf16[B, E, 512], count i32[B], errors.

    count = length // 128. Slot -1 -> count 0, no error; slot outside [0, R)
    -> BAD_SLOT, count 0; length < 0, > max_context or count > E ->
    BAD_LENGTH, count 0; an entry below count whose block table entry is
    outside [0, N) -> MISSING_BLOCK, that row zero (count unchanged)."""
    cfg = state.config
    R, MB, N = cfg.max_requests, cfg.max_blocks_per_request, cfg.num_blocks
    E = max_entries
    Lh = state.hca.comp.shape[0]
    ok_layer = layer_ok(kind_idx, Lh)

    slot_ok = (slots >= 0) & (slots < R)
    bad_slot = (slots != -1) & ~slot_ok
    n = lengths // C.HCA_RATIO
    bad_length = slot_ok & ((lengths < 0) | (lengths > cfg.max_context) | (n > E))
    n = jnp.where(slot_ok & ~bad_length & ok_layer, n, 0)
    j = jnp.arange(E, dtype=jnp.int32)[None, :]
    need = j < n[:, None]
    block = state.block_table[read_index(slots, R)[:, None], jnp.clip(j, 0, MB - 1)]
    missing = need & ((block < 0) | (block >= N))
    ok = need & ~missing
    errors = add_errors(state.errors, ok_layer, {ErrorKind.BAD_SLOT: bad_slot,
                                                 ErrorKind.BAD_LENGTH: bad_length,
                                                 ErrorKind.MISSING_BLOCK: missing})
    kv = read_entries(state.hca.kv, read_index(kind_idx, Lh), block, jnp.zeros_like(block),
                       cfg.kv_format, ok)
    return kv, n, errors
