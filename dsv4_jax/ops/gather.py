"""Gathers: read cache entries back as dense BF16 for attention (docs/design/operations.md).

Each returns its outputs and then the state, whose `errors` counted the bad
rows the gather dropped (the pools are untouched): thread that state on, as
the write ops' state is, and the count costs nothing. With
`return_state=False` only the outputs come back and the call's counts are
not kept (its `errors` result is then a scratch buffer, not aliased, so XLA
copies nothing). Dropped or invisible rows are zero.

FFI targets (operands in this order; `errors` aliased into the last result
when the state is returned;
the entry leaves nope, rope[, scale] come last, scale absent for bf16):
"dsv4_gather_window"
  attrs  kv_format
  args   layer i32[] (global, -1 = bad), slots i32[B], swa.pos i32[L, R, 128],
         errors i32[9] (54 with detail), swa.kv entries
  rets   kv bf16[B, 128, 512], pos i32[B, 128], errors
  Ring-slot order; slot -1 -> zero rows and pos -1 (no error); slot outside
  [0, R) -> BAD_SLOT, same output; ring slots with pos -1 -> zero rows.
"dsv4_gather_topk"
  attrs  kv_format
  args   layer i32[] (CSA index), token_slot i32[T], token_pos i32[T],
         indices i32[T, k], block_table i32[R, MB], errors, csa.kv entries
  rets   kv bf16[T, k, 512], valid bool[T, k], errors
  Entry i is visible to a query at position t iff 0 <= i < (t + 1) // 4.
  index -1 -> zero row, valid False, no error; index < -1 or not visible ->
  BAD_INDEX; block missing -> MISSING_BLOCK; token slot -1 -> whole row
  invalid, no error; bad slot -> BAD_SLOT; pos < 0 or >= max_context
  (= MB * 128, read off block_table's shape; append's and flush's rule) ->
  BAD_POSITION (once per token). A bad slot or position invalidates the
  whole row without examining its indices; a good position sees at most
  MB * 32 entries, so every visible index lies inside the block table.
"dsv4_gather_all"
  attrs  kv_format, max_context
  args   layer i32[] (HCA index), slots i32[B], lengths i32[B], block_table,
         errors, hca.kv entries
  rets   kv bf16[B, E, 512], count i32[B], errors
  count = length // 128 entries (rows >= count are zero). slot -1 -> count 0,
  no error; bad slot -> BAD_SLOT; length < 0, > max_context, or count > E ->
  BAD_LENGTH, count 0; a missing block -> MISSING_BLOCK, that row zero.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import config as C
from .. import reference
from ..error_detail import ErrorOp, query_rows, slot_rows, records_detail
from ..state import CacheState, check_state
from .dispatch import check_array, errors_alias, ffi_call, resolve_impl
from ._layer import layer_operand
from .shards import per_shard

_I32 = jnp.int32


def _sharded(op, state, layer, rows, return_state, **static):
    """A gather per shard: `rows` split by shard, its two outputs likewise."""
    outs = ("rows", "rows") + (("state",) if return_state else ())
    return per_shard(op, state, outs, layer=layer, rows=rows, return_state=return_state,
                     **static)


def _finish(state, outputs, errors, return_state):
    if not return_state:
        return outputs
    return (*outputs, dataclasses.replace(state, errors=errors))


@records_detail(ErrorOp.GATHER_WINDOW, slot_rows, state_at=2)
def gather_window(state: CacheState, layer, slots: jax.Array, *, impl: str = "auto",
                  return_state: bool = True):
    """The sliding window of `slots[B]`: kv bf16[B, 128, 512] and pos i32[B, 128]
    in ring-slot order (pos -1 = empty, its row zero).

    layer    global layer index, any kind (see "The layer argument")
    slots    i32[B] request slots, -1 = padding (zero rows, pos -1); sharded:
             S * B rows of shard-local slots, shard after shard
    returns  (kv, pos, state): kv bf16[B, 128, 512] dequantized, pos
             i32[B, 128] the position held in each ring slot; the state's
             errors count BAD_SLOT (same output as -1) and BAD_LAYER.
             With return_state=False, (kv, pos).

    Decode: append, then gather; a query at position t sees ring slots with
    t - 128 < pos <= t. Chunked prefill: gather the prior window, append,
    attend over window + chunk. With no query position it cannot tell a
    stale row (one holding another position than a query needs, which
    `attention` counts as STALE_WINDOW): `pos` says what each row holds."""
    check_state(state)
    cfg = state.config
    check_array("slots", slots, (None,), _I32)
    if cfg.sharded:
        return _sharded(gather_window, state, layer, dict(slots=slots), return_state,
                        impl=impl)
    layer_idx = layer_operand(cfg, layer, None)
    target = "dsv4_gather_window"
    impl = resolve_impl(impl, target, [state.swa.pos])
    if impl == "reference":
        kv, pos, errors = reference.gather_window(state, layer_idx, slots)
    else:
        B = slots.shape[0]
        kv, pos, errors = ffi_call(
            target, [layer_idx, slots, state.swa.pos, state.errors,
                     *jax.tree_util.tree_leaves(state.swa.kv)],
            [jax.ShapeDtypeStruct((B, C.WINDOW, C.HEAD_DIM), jnp.bfloat16),
             jax.ShapeDtypeStruct((B, C.WINDOW), _I32),
             jax.ShapeDtypeStruct(state.errors.shape, _I32)],
            errors_alias(target, return_state), kv_format=C.KV_FORMAT_CODE[cfg.kv_format])
    return _finish(state, (kv, pos), errors, return_state)


@records_detail(ErrorOp.GATHER_TOPK, query_rows, state_at=2)
def gather_topk(state: CacheState, layer, token_slot: jax.Array, token_pos: jax.Array,
                indices: jax.Array, *, impl: str = "auto", return_state: bool = True):
    """CSA entries `indices[T, k]` of each query token: kv bf16[T, k, 512] and
    valid bool[T, k].

    layer                 global index of a CSA layer
    token_slot, token_pos i32[T], the query rows' slots and positions
                          (usually meta.token_slot, meta.token_pos)
    indices               i32[T, k], k >= 1: entry indices of each row's
                          request in this layer (indexer_topk's output), -1 =
                          none (zero row, valid False, no error)
    returns               (kv, valid, state): kv bf16[T, k, 512] dequantized,
                          valid bool[T, k] (False rows are zero); with
                          return_state=False, (kv, valid)

    A query at position t sees entries i < (t + 1) // 4. A row with slot -1 is
    all invalid, nothing counted. Counted: BAD_SLOT and BAD_POSITION (pos < 0
    or >= max_context) once per row, which is then all invalid; per index
    BAD_INDEX (< -1 or not visible) and MISSING_BLOCK; BAD_LAYER."""
    check_state(state)
    cfg = state.config
    check_array("token_slot", token_slot, (None,), _I32)
    T = token_slot.shape[0]
    check_array("token_pos", token_pos, (T,), _I32)
    check_array("indices", indices, (T, None), _I32)
    if indices.shape[1] == 0:
        raise ValueError("indices: expected at least one index per token (k >= 1), got k = 0")
    if cfg.sharded:
        return _sharded(gather_topk, state, layer,
                        dict(token_slot=token_slot, token_pos=token_pos, indices=indices),
                        return_state, impl=impl)
    layer_idx = layer_operand(cfg, layer, C.CSA)
    target = "dsv4_gather_topk"
    impl = resolve_impl(impl, target, [state.block_table])
    if impl == "reference":
        kv, valid, errors = reference.gather_topk(state, layer_idx, token_slot, token_pos, indices)
    else:
        k = indices.shape[1]
        kv, valid, errors = ffi_call(
            target, [layer_idx, token_slot, token_pos, indices, state.block_table, state.errors,
                     *jax.tree_util.tree_leaves(state.csa.kv)],
            [jax.ShapeDtypeStruct((T, k, C.HEAD_DIM), jnp.bfloat16),
             jax.ShapeDtypeStruct((T, k), jnp.bool_),
             jax.ShapeDtypeStruct(state.errors.shape, _I32)],
            errors_alias(target, return_state), kv_format=C.KV_FORMAT_CODE[cfg.kv_format])
    return _finish(state, (kv, valid), errors, return_state)


@records_detail(ErrorOp.GATHER_ALL, slot_rows, state_at=2)
def gather_all(state: CacheState, layer, slots: jax.Array, lengths: jax.Array,
               max_entries: int, *, impl: str = "auto", return_state: bool = True):
    """Every HCA entry of `slots[B]` with `lengths[B]` tokens: kv
    bf16[B, max_entries, 512] and count i32[B] = lengths // 128.

    layer        global index of an HCA layer
    slots        i32[B] request slots, -1 = padding (count 0); sharded: S * B
                 rows of shard-local slots, shard after shard
    lengths      i32[B] tokens of each request (e.g. meta.lengths[slot] after
                 the step); entry i exists once i < lengths // 128
    max_entries  E, a Python int: rows of the output (max_context // 128
                 holds every entry)
    returns      (kv, count, state): kv bf16[B, E, 512] dequantized (rows >=
                 count zero), count i32[B]; with return_state=False, (kv, count)

    Counted: BAD_SLOT (count 0), BAD_LENGTH (length < 0, > max_context, or
    count > E; count 0), MISSING_BLOCK (that row zero), BAD_LAYER."""
    check_state(state)
    cfg = state.config
    check_array("slots", slots, (None,), _I32)
    B = slots.shape[0]
    check_array("lengths", lengths, (B,), _I32)
    if not isinstance(max_entries, int) or max_entries <= 0:
        raise ValueError(f"max_entries: expected a positive int, got {max_entries!r}")
    if cfg.sharded:
        return _sharded(gather_all, state, layer, dict(slots=slots, lengths=lengths),
                        return_state, max_entries=max_entries, impl=impl)
    layer_idx = layer_operand(cfg, layer, C.HCA)
    target = "dsv4_gather_all"
    impl = resolve_impl(impl, target, [state.block_table])
    if impl == "reference":
        kv, count, errors = reference.gather_all(state, layer_idx, slots, lengths, max_entries)
    else:
        kv, count, errors = ffi_call(
            target, [layer_idx, slots, lengths, state.block_table, state.errors,
                     *jax.tree_util.tree_leaves(state.hca.kv)],
            [jax.ShapeDtypeStruct((B, max_entries, C.HEAD_DIM), jnp.bfloat16),
             jax.ShapeDtypeStruct((B,), _I32),
             jax.ShapeDtypeStruct(state.errors.shape, _I32)],
            errors_alias(target, return_state), kv_format=C.KV_FORMAT_CODE[cfg.kv_format], max_context=cfg.max_context)
    return _finish(state, (kv, count), errors, return_state)
