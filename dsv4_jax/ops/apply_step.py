"""apply_step: the first op of every step (docs/design/operations.md).

Resets the slots of newly admitted requests (block-table row, window
positions, compressor accumulators) and writes the step's new block-table
entries; every block handed out is scrubbed so its new owner can never read
what the previous owner wrote (docs/design/host.md).

FFI target "dsv4_apply_step" (the same operands on CPU and CUDA):
  attrs  num_blocks (N, the pools' blocks)
  args   new_blocks i32[NB, 3] (slot, logical, physical; slot -1 = padding),
         reset_slots i32[NR] (-1 = padding),
         then the aliased: block_table i32[R, MB], swa.pos i32[L, R, 128],
         csa.comp f32[Lc, R, 2, 3, 512], csa.icomp f32[Lc, R, 2, 3, 128],
         hca.comp f32[Lh, R, 1, 3, 512], errors i32[9] (54 with detail),
         pools (the pool leaves to scrub: csa.kv's, csa.index's, hca.kv's; any
         dtype, dims [layers, N, ...]; at most 8)
  rets   the aliased buffers, same order.
Resets first, in order, then the new-block rows in order: a later row for
the same (slot, logical block) wins. Bad rows are dropped and counted.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import config as C
from .. import reference
from ..error_detail import ErrorOp, records_detail
from ..meta import StepMeta
from ..donation import warn_if_eager
from ..state import CacheState, check_state
from .dispatch import ffi_in_place, resolve_impl
from .shards import per_shard

TARGET = "dsv4_apply_step"


def _step_rows(args):
    """apply_step's error rows, per shard: the resets (rows [0, NR), their
    slot, no position), then the new blocks (row NR + i: its slot and the
    first position of its logical block, -1 for one out of [0, MB))."""
    meta = args["meta"]
    S, MB = meta.num_shards, args["state"].config.max_blocks_per_request
    resets = meta.reset_slots.reshape(S, -1)
    blocks = meta.new_blocks.reshape(S, -1, 3)
    logical = blocks[..., 1]
    start = jnp.where((logical >= 0) & (logical < MB), logical * C.BLOCK_TOKENS, -1)
    slot = jnp.concatenate([resets, blocks[..., 0]], axis=1)
    pos = jnp.concatenate([jnp.full(resets.shape, -1, jnp.int32), start], axis=1)
    return slot.reshape(-1), pos.reshape(-1)


@records_detail(ErrorOp.APPLY_STEP, _step_rows, layer_arg=False)
def apply_step(state: CacheState, meta: StepMeta, *, impl: str = "auto") -> CacheState:
    """Start a step: resets, then new blocks (later rows win), in place.

    state    CacheState, donated by the jitted step
    meta     StepMeta of the step (`CacheManager.prepare_step`); this op reads
             meta.reset_slots i32[NR] and meta.new_blocks i32[NB, 3]
    returns  the new CacheState

    Each reset slot gets its block-table row and window positions set to -1
    and its compressor accumulators emptied. Then each new-block row (slot,
    logical block, physical block) is written into the block table, and the
    physical block is scrubbed to blank in every pool of every layer, so its
    new owner never reads what a released request wrote. Call it first in
    every step, before any other op of that step.

    Bad rows (slot outside [0, R), logical/physical block out of range) are
    dropped and counted in `state.errors` (BAD_SLOT, BAD_BLOCK_ASSIGNMENT);
    -1 rows are padding. With error detail a new block's row is recorded
    at its slot and the first position of its logical block, a reset's at
    its slot (position -1)."""
    check_state(state)
    if not isinstance(meta, StepMeta):
        raise ValueError(f"meta: expected a StepMeta, got {type(meta).__name__}")
    meta.check(state.config)
    warn_if_eager(state, "apply_step")  # after the checks: a bad call raises, no warning
    if state.config.sharded:   # per shard, with shard-local slots and block ids
        return per_shard(apply_step, state, "state", rows=dict(meta=meta), impl=impl)
    new_blocks, reset_slots = meta.new_blocks, meta.reset_slots
    impl = resolve_impl(impl, TARGET, [state.block_table])
    if impl == "reference":
        return reference.apply_step(state, new_blocks, reset_slots)

    pools = (state.csa.kv, state.csa.index, state.hca.kv)   # blocks handed out are scrubbed
    pool_leaves, pool_tree = jax.tree_util.tree_flatten(pools)
    fixed = [state.block_table, state.swa.pos, state.csa.comp, state.csa.icomp,
             state.hca.comp, state.errors]
    out = ffi_in_place(TARGET, [new_blocks, reset_slots], fixed + pool_leaves,
                       num_blocks=state.config.num_blocks)
    block_table, pos, comp, icomp, hca_comp, errors = out[:6]
    csa_kv, csa_index, hca_kv = jax.tree_util.tree_unflatten(pool_tree, out[6:])
    return dataclasses.replace(
        state, block_table=block_table, errors=errors,
        swa=dataclasses.replace(state.swa, pos=pos),
        csa=dataclasses.replace(state.csa, kv=csa_kv, index=csa_index, comp=comp, icomp=icomp),
        hca=dataclasses.replace(state.hca, kv=hca_kv, comp=hca_comp))
