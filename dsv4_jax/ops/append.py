"""append: new tokens' KV into the sliding window of a layer
(docs/design/semantics.md, docs/design/operations.md).

FFI target "dsv4_append" (operands in this order; the attributes are every
write op's struct, WriteAttrs in ffi/include/dsv4/attrs.h: exactly these
three, Python ints, each checked as flush checks it):
  attrs  kv_format (KV_FORMAT_CODE, the enum KvFormat), max_context (= MB * 128),
         max_rows_per_slot (StepMeta.max_rows_per_slot; append's kernels
         ignore it)
  args   layer i32[] (global index, -1 = bad), meta i32[P >= 2T] (meta.token_fields:
         token_slot, then token_pos, then what the handler ignores),
         kv bf16[T, 512], then the aliased: swa.pos i32[L, R, 128], errors i32[9] (54 with detail),
         swa.kv.nope, swa.kv.rope[, swa.kv.scale]  (scale absent for bf16)
  rets   the aliased buffers, same order.
Per token: slot -1 is padding; slot outside [0, R) -> BAD_SLOT; pos < 0 or
pos >= max_context -> BAD_POSITION; a kv row holding NaN or Inf -> NONFINITE;
all dropped (counted under the first rule they break, in that order). Ring slot = pos mod 128; when
several tokens of one call land on the same (slot, ring slot), the largest
position wins (ties: the later row). Layer -1 -> BAD_LAYER once, nothing written.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import config as C
from .. import reference
from ..error_detail import ErrorOp, meta_rows, records_detail
from ..meta import StepMeta
from ..donation import warn_if_eager
from ..state import CacheState, check_state
from .dispatch import check_array, ffi_in_place, resolve_impl
from ._layer import layer_operand
from .shards import per_shard

TARGET = "dsv4_append"


def check_append_args(state: CacheState, meta: StepMeta, kv) -> None:
    """append's trace-time checks (also write_layer's)."""
    check_state(state)
    cfg = state.config
    meta.check(cfg)
    check_array("kv", kv, (meta.num_tokens * cfg.num_shards, C.HEAD_DIM), jnp.bfloat16)


def append_ffi_operands(state: CacheState):
    """append's aliased FFI operands other than the error counters (swa.pos,
    then the window's entry leaves), and a function that puts their results
    back into `state`."""
    tree = jax.tree_util.tree_structure(state.swa.kv)

    def rebuild(st, out):
        kv_entries = jax.tree_util.tree_unflatten(tree, out[1:])
        return dataclasses.replace(st, swa=dataclasses.replace(st.swa, kv=kv_entries,
                                                               pos=out[0]))
    return [state.swa.pos, *jax.tree_util.tree_leaves(state.swa.kv)], rebuild


@records_detail(ErrorOp.APPEND, meta_rows)
def append(state: CacheState, layer, meta: StepMeta, kv: jax.Array, *,
           impl: str = "auto") -> CacheState:
    """Write `kv: bf16[T, 512]` (normed and roped by the model) of the step's
    tokens into the sliding window of `layer`.

    state    CacheState, donated by the jitted step
    layer    global layer index, any kind (see "The layer argument")
    meta     StepMeta of the step: the rows' meta.token_slot, meta.token_pos i32[T]
    kv       bf16[T, 512]: per token row, the layer's KV after its RMSNorm and
             RoPE on the last 64 channels (T = meta.num_tokens; S * T sharded)
    returns  the new CacheState

    The window keeps the last 128 positions of each request, position p in
    ring slot p % 128, quantized to the config's kv_format (the nope channels
    to fp8 for ds_fp8 and fp8_token). Dropped and counted: BAD_SLOT,
    BAD_POSITION (pos < 0 or >= max_context), NONFINITE (NaN or Inf in the
    row), BAD_LAYER."""
    check_append_args(state, meta, kv)
    warn_if_eager(state, "append")      # after the checks: a bad call raises, no warning
    cfg = state.config
    if cfg.sharded:
        return per_shard(append, state, "state", layer=layer, rows=dict(meta=meta, kv=kv),
                         impl=impl)
    layer_idx = layer_operand(cfg, layer, None)
    impl = resolve_impl(impl, TARGET, [state.swa.pos])
    if impl == "reference":
        return reference.append(state, layer_idx, meta.token_slot, meta.token_pos, kv)
    window, rebuild = append_ffi_operands(state)
    pos, errors, *entries = ffi_in_place(
        TARGET, [layer_idx, meta.token_fields, kv], [window[0], state.errors, *window[1:]],
        kv_format=C.KV_FORMAT_CODE[cfg.kv_format], max_context=cfg.max_context,
        max_rows_per_slot=meta.max_rows_per_slot)
    return dataclasses.replace(rebuild(state, [pos, *entries]), errors=errors)
