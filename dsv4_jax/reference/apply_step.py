"""jnp reference of apply_step (semantics in ffi/include/dsv4/apply_step.h)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..errors import ErrorKind, add_counts
from ..state import CacheState, E8M0, empty_accumulator
from ._rows import set_pool_rows


def scrub_value(dtype):
    """Value a recycled block is reset to: 0, or 1.0 for e8m0 scales."""
    return jnp.ones((), dtype) if dtype == E8M0 else jnp.zeros((), dtype)


def apply_step(state: CacheState, new_blocks: jax.Array, reset_slots: jax.Array) -> CacheState:
    cfg = state.config
    R, MB, N = cfg.max_requests, cfg.max_blocks_per_request, cfg.num_blocks
    errors = state.errors

    # 1. resets of newly admitted slots
    reset_ok = (reset_slots >= 0) & (reset_slots < R)
    NR = reset_slots.shape[0]
    errors = add_counts(errors, {ErrorKind.BAD_SLOT: (reset_slots != -1) & ~reset_ok})
    rs = jnp.where(reset_ok, reset_slots, R)        # R = dropped by mode="drop"
    block_table = set_pool_rows(state.block_table, (rs,), -1)
    pos = set_pool_rows(state.swa.pos, (slice(None), rs), -1)

    def reset(comp):
        return set_pool_rows(comp, (slice(None), rs), empty_accumulator(comp.shape[2:], comp.dtype))

    csa_comp, csa_icomp, hca_comp = reset(state.csa.comp), reset(state.csa.icomp), reset(state.hca.comp)

    # 2. new blocks, in row order (a later row for the same cell wins)
    s, logical, physical = new_blocks[:, 0], new_blocks[:, 1], new_blocks[:, 2]
    slot_ok = (s >= 0) & (s < R)
    assign_ok = (logical >= 0) & (logical < MB) & (physical >= 0) & (physical < N)
    valid = slot_ok & assign_ok
    # error rows: the resets are rows [0, NR), new block i is row NR + i
    before = jnp.zeros((NR,), bool)
    errors = add_counts(errors, {
        ErrorKind.BAD_SLOT: jnp.concatenate([before, (s != -1) & ~slot_ok]),
        ErrorKind.BAD_BLOCK_ASSIGNMENT: jnp.concatenate([before, slot_ok & ~assign_ok])})
    nb = new_blocks.shape[0]
    later = jnp.arange(nb)[None, :] > jnp.arange(nb)[:, None]
    superseded = jnp.any(later & valid[None, :] & (s[:, None] == s[None, :])
                         & (logical[:, None] == logical[None, :]), axis=1)
    write = valid & ~superseded
    block_table = set_pool_rows(block_table, (jnp.where(write, s, R), logical), physical)

    # 3. scrub every block handed out, in every pool
    scrub_at = jnp.where(valid, physical, N)
    csa_kv, csa_index, hca_kv = jax.tree_util.tree_map(
        lambda p: set_pool_rows(p, (slice(None), scrub_at), scrub_value(p.dtype)),
        (state.csa.kv, state.csa.index, state.hca.kv))
    return dataclasses.replace(
        state, block_table=block_table, errors=errors,
        swa=dataclasses.replace(state.swa, pos=pos),
        csa=dataclasses.replace(state.csa, kv=csa_kv, index=csa_index, comp=csa_comp,
                                icomp=csa_icomp),
        hca=dataclasses.replace(state.hca, kv=hca_kv, comp=hca_comp))
