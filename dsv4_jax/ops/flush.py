"""flush: fold a step's compressor projections into the online-softmax
accumulators of a CSA or HCA layer and write every entry the step closes
(epilogue + quantization) into the paged pool (docs/design/semantics.md,
docs/design/formats.md, docs/design/state.md, docs/design/operations.md).

FFI targets (operands in this order; the three attributes are decoded as
every write op's one struct, WriteAttrs in ffi/include/dsv4/attrs.h, so a call
passes exactly these, Python ints; kv_format is the enum KvFormat,
KV_FORMAT_CODE's codes):
"dsv4_flush_csa"
  attrs  kv_format, max_context, max_rows_per_slot (StepMeta.max_rows_per_slot:
         the rows any one slot has in the call at most, 0 = no bound; a hint
         for the kernel's choice, never a reason for another result)
  args   layer i32[] (CSA index, -1 = bad), meta i32[P >= 2T] (meta.token_fields:
         token_slot, then token_pos, then what the handler ignores),
         kv f32[T, 1024], score f32[T, 1024], ape f32[4, 1024], norm f32[512],
         inv_freq f32[32], index_kv f32[T, 256], index_score f32[T, 256],
         index_ape f32[4, 256], index_norm f32[128], index_inv_freq f32[32],
         block_table i32[R, MB],
         then the aliased: csa.comp f32[Lc, R, 2, 3, 512], csa.icomp f32[Lc, R, 2, 3, 128],
         csa.index.packed u8[Lc, N, 32, 64], csa.index.scale e8m0[Lc, N, 32, 4],
         errors i32[9] (54 with detail), csa.kv.nope, csa.kv.rope[, csa.kv.scale]
  rets   the aliased buffers, same order.
"dsv4_flush_hca"
  attrs  kv_format, max_context, max_rows_per_slot
  args   layer i32[] (HCA index), meta, kv f32[T, 512],
         score f32[T, 512], ape f32[128, 512], norm f32[512], inv_freq f32[32],
         block_table i32[R, MB],
         then the aliased: hca.comp f32[Lh, R, 1, 3, 512], errors i32[9] (54 with detail),
         hca.kv.nope, hca.kv.rope[, hca.kv.scale]
  rets   the aliased buffers, same order.
Expected positions: the k-th row of a request slot in the call (k = 0, 1,
...; other requests' rows may sit in between) has ep = p0 + k, p0 the
position of the slot's first row whatever its value.
Per token: slot -1 padding; bad slot -> BAD_SLOT; pos != ep, or pos < 0 or
>= max_context -> BAD_POSITION; block_table[slot, pos // 128] outside [0, N)
-> MISSING_BLOCK; NaN or Inf in the token's kv or score row (CSA: also
index_kv/index_score) -> NONFINITE; such tokens are dropped (not folded),
counted under the first rule they break, in that order.
Windows: with f = max(p0, 0) and L = min(p0 + n - 1, max_context - 1) for a
request of n rows, window w closes iff f <= (w+1)m - 1 <= L, whether or not
the row at that position was dropped: its entry pools what it holds (0 if
nothing) and is stored if block_table[slot, w*m // 128] is in [0, N). The
accumulators carried in are windows f // m (+1), those carried out windows
(L+1) // m (+1). So a dropped token removes only its own contribution.
Each request's tokens must continue across calls at its next position (what
CacheManager produces); that is not checked, the state holds no position.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import config as C
from .. import reference
from ..error_detail import ErrorOp, meta_rows, records_detail
from ..meta import StepMeta
from ..params import CompressorParams
from ..donation import warn_if_eager
from ..state import CacheState, check_state
from .dispatch import check_array, ffi_in_place, resolve_impl
from ._layer import layer_operand
from .shards import per_shard

TARGETS = {C.CSA: "dsv4_flush_csa", C.HCA: "dsv4_flush_hca"}
_FLOATS = (jnp.float32, jnp.bfloat16)


def _check_params(name, p, m, width, d):
    if not isinstance(p, CompressorParams):
        raise ValueError(f"{name}: expected CompressorParams, got {type(p).__name__}")
    check_array(f"{name}.ape", p.ape, (m, width), jnp.float32)
    check_array(f"{name}.norm", p.norm, (d,), jnp.float32)
    check_array(f"{name}.inv_freq", p.inv_freq, (C.ROPE_DIM // 2,), jnp.float32)


def _kind_of(cfg, layer, kv) -> str:
    if isinstance(layer, (int,)) and not isinstance(layer, bool):
        return cfg.layer_kinds[layer] if 0 <= layer < cfg.num_layers else "?"
    # traced layer: the width of the projections says which kind is meant
    return {2 * C.HEAD_DIM: C.CSA, C.HEAD_DIM: C.HCA}.get(kv.shape[-1], "?")


def check_flush_args(state: CacheState, layer, meta: StepMeta, kv, score, params,
                     index_kv, index_score, prefix: str = ""):
    """flush's trace-time checks (also write_layer's, which names the
    projections with `prefix` "comp_"). Returns the layer's kind and the
    projections as f32: (kind, kv, score, index_kv, index_score)."""
    check_state(state)
    cfg = state.config
    meta.check(cfg)
    kind = _kind_of(cfg, layer, kv)
    if kind not in (C.CSA, C.HCA):
        if isinstance(layer, int):
            cfg.kind_index(layer)   # raises for an out-of-range layer
            raise ValueError(f"layer: expected a CSA or HCA layer, got layer {layer} "
                             f"which is {cfg.layer_kinds[layer].upper()}")
        raise ValueError(f"{prefix}kv: expected last dim {2 * C.HEAD_DIM} (CSA) or "
                         f"{C.HEAD_DIM} (HCA) for a traced layer, got {kv.shape[-1]}")
    coff = 2 if kind == C.CSA else 1
    m = C.CSA_RATIO if kind == C.CSA else C.HCA_RATIO
    T = meta.num_tokens * cfg.num_shards
    check_array(f"{prefix}kv", kv, (T, coff * C.HEAD_DIM), _FLOATS)
    check_array(f"{prefix}score", score, (T, coff * C.HEAD_DIM), _FLOATS)
    _check_params("params", params, m, coff * C.HEAD_DIM, C.HEAD_DIM)
    kv, score = kv.astype(jnp.float32), score.astype(jnp.float32)
    if kind == C.CSA:
        if index_kv is None or index_score is None or params.index is None:
            raise ValueError("index_kv: a CSA layer needs index_kv, index_score and "
                             "params.index (the indexer compressor)")
        check_array("index_kv", index_kv, (T, 2 * C.INDEX_DIM), _FLOATS)
        check_array("index_score", index_score, (T, 2 * C.INDEX_DIM), _FLOATS)
        _check_params("params.index", params.index, C.CSA_RATIO, 2 * C.INDEX_DIM, C.INDEX_DIM)
        index_kv, index_score = index_kv.astype(jnp.float32), index_score.astype(jnp.float32)
    elif index_kv is not None or index_score is not None:
        raise ValueError("index_kv: HCA layers have no indexer; pass None")
    return kind, kv, score, index_kv, index_score


def flush_ffi_operands(state: CacheState, kind: str, kv, score, params, index_kv, index_score):
    """flush's FFI operands after (layer, token_slot, token_pos): the read-only
    inputs, the aliased buffers, and a function that puts the aliased results
    back into `state`."""
    inputs = [kv, score, params.ape, params.norm, params.inv_freq]
    if kind == C.CSA:
        pool = state.csa
        inputs += [index_kv, index_score, params.index.ape, params.index.norm,
                   params.index.inv_freq]
        fixed = [pool.comp, pool.icomp, pool.index.packed, pool.index.scale]
    else:
        pool = state.hca
        fixed = [pool.comp]
    entries = jax.tree_util.tree_leaves(pool.kv)
    tree = jax.tree_util.tree_structure(pool.kv)

    def rebuild(out):
        n = len(fixed)
        kv_entries = jax.tree_util.tree_unflatten(tree, out[n + 1:])
        if kind == C.CSA:
            comp, icomp, packed, iscale = out[:n]
            index = dataclasses.replace(pool.index, packed=packed, scale=iscale)
            new = dataclasses.replace(pool, kv=kv_entries, index=index, comp=comp, icomp=icomp)
            return dataclasses.replace(state, csa=new, errors=out[n])
        new = dataclasses.replace(pool, kv=kv_entries, comp=out[0])
        return dataclasses.replace(state, hca=new, errors=out[n])
    return inputs + [state.block_table], fixed + [state.errors, *entries], rebuild


@records_detail(ErrorOp.FLUSH, meta_rows)
def flush(state: CacheState, layer, meta: StepMeta, kv: jax.Array, score: jax.Array,
          params: CompressorParams, *, index_kv: jax.Array | None = None,
          index_score: jax.Array | None = None, impl: str = "auto") -> CacheState:
    """Compress the step's tokens of a CSA or HCA layer.

    state        CacheState, donated by the jitted step
    layer        global index of a CSA or HCA layer (see "The layer argument")
    meta         StepMeta of the step: meta.token_slot, meta.token_pos i32[T]
    kv, score    f32 or bf16 [T, coff * 512], the compressor's projections
                 x @ wkv.T and x @ wgate.T per token row (coff 2 for CSA,
                 1 for HCA; bf16 is upcast)
    params       CompressorParams of the layer's compressor (CSA: with .index)
    index_kv, index_score
                 CSA only: f32 or bf16 [T, 256], the indexer compressor's
                 projections; None for HCA
    returns      the new CacheState

    Folds every token into its request's online-softmax accumulators and
    writes each entry the step closes (CSA: one per 4 positions, HCA: one per
    128) into the paged pool, quantized to the kv_format; CSA layers also
    write the entry's MXFP4 indexer key. Each request's tokens must come in
    increasing, contiguous positions, within a call (rows of one request in
    row order, other requests' rows in between allowed) and across calls
    (what CacheManager produces). The k-th row of a request in the call is
    expected at position p0 + k (p0: its first row's); a row elsewhere is
    BAD_POSITION. A window closes at the row expected at its last position,
    even when that row is dropped, so a dropped token removes only its own
    contribution. Dropped and counted (the token is not folded): BAD_SLOT,
    BAD_POSITION, MISSING_BLOCK, NONFINITE (NaN or Inf in the token's rows),
    BAD_LAYER."""
    kind, kv, score, index_kv, index_score = check_flush_args(
        state, layer, meta, kv, score, params, index_kv, index_score)
    warn_if_eager(state, "flush")       # after the checks: a bad call raises, no warning
    cfg = state.config
    if cfg.sharded:   # rows of every per-token operand split by shard, params whole
        return per_shard(flush, state, "state", layer=layer,
                         rows=dict(meta=meta, kv=kv, score=score, index_kv=index_kv,
                                   index_score=index_score),
                         whole=dict(params=params), impl=impl)
    layer_idx = layer_operand(cfg, layer, kind)
    target = TARGETS[kind]
    impl = resolve_impl(impl, target, [state.block_table])
    if impl == "reference":
        return reference.flush(state, kind, layer_idx, meta.token_slot, meta.token_pos, kv, score,
                               params, index_kv, index_score)
    inputs, aliased, rebuild = flush_ffi_operands(state, kind, kv, score, params, index_kv,
                                                  index_score)
    return rebuild(ffi_in_place(target, [layer_idx, meta.token_fields, *inputs],
                                aliased, kv_format=C.KV_FORMAT_CODE[cfg.kv_format],
                                max_context=cfg.max_context,
                                max_rows_per_slot=meta.max_rows_per_slot))
