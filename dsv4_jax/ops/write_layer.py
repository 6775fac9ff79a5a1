"""write_layer: the whole write path of one layer, append then flush, in one
call: one FFI call, and on CUDA one kernel launch (docs/design/operations.md).

A model calls, per layer, `append` and, on CSA and HCA layers, `flush`;
`write_layer` does both. Append and flush write disjoint parts of the state
(the window; the layer's accumulators, pool entries and indexer keys) and
count into `state.errors` by addition, so the new state and the counts are
exactly those of `append(state, layer, meta, kv)` followed by
`flush(state, layer, meta, comp_kv, comp_score, params, ...)`, on every
implementation. In particular each part counts what it drops: a bad slot is
BAD_SLOT twice, a bad traced layer BAD_LAYER once per part, as the two calls
would count them. On an SWA layer write_layer is append (pass no compressor
operands).

FFI targets (operands in this order; the attributes are every write op's
struct, WriteAttrs in ffi/include/dsv4/attrs.h: exactly these three, Python
ints):
"dsv4_write_layer_csa"
  attrs  kv_format, max_context, max_rows_per_slot (StepMeta.max_rows_per_slot:
         the rows any one slot has in the call at most, 0 = no bound; a hint
         for the kernel's choice, never a reason for another result)
  args   window_layer i32[] (global index, -1 = bad), layer i32[] (CSA index, -1 = bad),
         meta i32[P >= 2T] (meta.token_fields: token_slot, then token_pos, then what
         the handler ignores), kv bf16[T, 512],
         comp_kv f32[T, 1024], comp_score f32[T, 1024], ape f32[4, 1024], norm f32[512],
         inv_freq f32[32], index_kv f32[T, 256], index_score f32[T, 256],
         index_ape f32[4, 256], index_norm f32[128], index_inv_freq f32[32],
         block_table i32[R, MB],
         then the aliased: swa.pos i32[L, R, 128], swa.kv.nope, swa.kv.rope[, swa.kv.scale],
         csa.comp, csa.icomp, csa.index.packed, csa.index.scale, errors i32[9] (54 with detail),
         csa.kv.nope, csa.kv.rope[, csa.kv.scale]
  rets   the aliased buffers, same order.
"dsv4_write_layer_hca"
  attrs  kv_format, max_context, max_rows_per_slot
  args   window_layer i32[], layer i32[] (HCA index), meta, kv bf16[T, 512],
         comp_kv f32[T, 512], comp_score f32[T, 512], ape f32[128, 512], norm f32[512],
         inv_freq f32[32], block_table i32[R, MB],
         then the aliased: swa.pos, swa.kv leaves, hca.comp f32[Lh, R, 1, 3, 512],
         errors, hca.kv leaves
  rets   the aliased buffers, same order.
The per-token rules are append's (dsv4_jax/ops/append.py) for the window and
flush's (dsv4_jax/ops/flush.py) for the compressor.
"""
from __future__ import annotations

import jax

from .. import config as C
from .. import reference
from ..donation import warn_if_eager
from ..error_detail import ErrorOp, meta_rows, records_detail
from ..meta import StepMeta
from ..params import CompressorParams
from ..state import CacheState
from .dispatch import ffi_in_place, resolve_impl
from ._layer import layer_operand
from .shards import per_shard
from .append import append, append_ffi_operands, check_append_args
from .flush import check_flush_args, flush_ffi_operands

TARGETS = {C.CSA: "dsv4_write_layer_csa", C.HCA: "dsv4_write_layer_hca"}


def compressor_operands_given(cfg, layer, comp_kv, comp_score, params, index_kv,
                              index_score) -> bool:
    """Whether a layer's write has compressor operands (False: the window
    only). ValueError for some given without the rest, and for a static
    layer whose kind disagrees (SWA with any of them, CSA or HCA without)."""
    compressed = any(x is not None for x in (comp_kv, comp_score, params, index_kv, index_score))
    complete = comp_kv is not None and comp_score is not None and params is not None
    if isinstance(layer, int) and not isinstance(layer, bool):
        cfg.kind_index(layer)   # ValueError for an out-of-range layer
        kind = cfg.layer_kinds[layer]
        if kind == C.SWA and compressed:
            raise ValueError(f"comp_kv: layer {layer} is SWA and has no compressor; "
                             f"pass no comp_kv, comp_score, params, index_kv or index_score")
        if kind != C.SWA and not complete:
            raise ValueError(f"comp_kv: layer {layer} is {kind.upper()}: it needs comp_kv, "
                             f"comp_score and params")
    if compressed and not complete:
        raise ValueError("comp_kv: a compressed layer needs comp_kv, comp_score and params")
    return compressed


@records_detail(ErrorOp.WRITE_LAYER, meta_rows)
def write_layer(state: CacheState, layer, meta: StepMeta, kv: jax.Array,
                comp_kv: jax.Array | None = None, comp_score: jax.Array | None = None,
                params: CompressorParams | None = None, *, index_kv: jax.Array | None = None,
                index_score: jax.Array | None = None, impl: str = "auto") -> CacheState:
    """append(state, layer, meta, kv), then on a CSA or HCA layer
    flush(state, layer, meta, comp_kv, comp_score, params, index_kv=...,
    index_score=...), as one call.

    kv: bf16[T, 512] for the window; comp_kv, comp_score: f32 or bf16
    [T, coff*512] (coff 2 for CSA, 1 for HCA); CSA layers also take the
    indexer's `index_kv`, `index_score` [T, 256] and `params.index`. A traced
    `layer` with no compressor operands is an append; with them, its kind is
    read off the width of comp_kv (as flush does). The compressor part
    follows flush's rule for a request's rows: the k-th is expected at its
    first row's position + k (else BAD_POSITION), and a window closes at the
    row expected at its last position, dropped or not."""
    check_append_args(state, meta, kv)
    cfg = state.config
    if not compressor_operands_given(cfg, layer, comp_kv, comp_score, params, index_kv,
                                     index_score):
        return append(state, layer, meta, kv, impl=impl)
    kind, comp_kv, comp_score, index_kv, index_score = check_flush_args(
        state, layer, meta, comp_kv, comp_score, params, index_kv, index_score, prefix="comp_")
    warn_if_eager(state, "write_layer")  # after the checks: a bad call raises, no warning
    if cfg.sharded:   # every per-token operand split by shard, params whole
        return per_shard(write_layer, state, "state", layer=layer,
                         rows=dict(meta=meta, kv=kv, comp_kv=comp_kv, comp_score=comp_score,
                                   index_kv=index_kv, index_score=index_score),
                         whole=dict(params=params), impl=impl)
    window_idx = layer_operand(cfg, layer, None)
    layer_idx = layer_operand(cfg, layer, kind)
    target = TARGETS[kind]
    impl = resolve_impl(impl, target, [state.block_table])
    if impl == "reference":
        slot, pos = meta.token_slot, meta.token_pos
        state = reference.append(state, window_idx, slot, pos, kv)
        return reference.flush(state, kind, layer_idx, slot, pos, comp_kv, comp_score, params,
                               index_kv, index_score)
    window, put_window = append_ffi_operands(state)
    inputs, aliased, put_flush = flush_ffi_operands(state, kind, comp_kv, comp_score, params,
                                                    index_kv, index_score)
    out = ffi_in_place(target, [window_idx, layer_idx, meta.token_fields, kv, *inputs],
                       [*window, *aliased], kv_format=C.KV_FORMAT_CODE[cfg.kv_format],
                       max_context=cfg.max_context, max_rows_per_slot=meta.max_rows_per_slot)
    return put_window(put_flush(out[len(window):]), out[:len(window)])
