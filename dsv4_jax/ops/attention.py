"""DeepSeek-V4 attention straight from the cache (docs/design/operations.md,
`attention`): each query token attends over its sliding window (the ring,
plus the prefill chunk's own rows), the CSA entries its indexer picked or
every visible HCA entry, and the per-head sink, with the entries
dequantized from the pools as they are read. No dense BF16 copy of the
window or the entries is made.

The rounding points, the rows a query sees and the error rules are the
design's; the state comes back after (out, lse) with its `errors` counting
what the call dropped, as for the gathers (`return_state=False`: only
(out, lse), the counts not kept).

FFI target "dsv4_attention" (the same operands on CPU and CUDA):
  attrs  kv_format, kind (0 SWA, 1 CSA, 2 HCA), kernel (0 auto, 1 mma.sync:
         which CUDA kernel; the CPU handler ignores it)
  args   layer i32[] (global, -1 = bad), comp_layer i32[] (index among the
         layers of `kind`, -1 = bad; ignored for SWA), q bf16[T, H, 512],
         token_slot i32[T], token_pos i32[T], topk i32[T, k] (k = 0 unless
         CSA), chunk_kv bf16[T or 0, 512] (0 rows: decode), sink f32[H],
         inv_freq f32[32 or 0] (0: no inverse RoPE), block_table i32[R, MB],
         swa.pos i32[L, R, 128], errors i32[9] (54 with detail), entries (the
         swa.kv leaves, then the kind's pool leaves: csa.kv or hca.kv, none for SWA)
  rets   out bf16[T, H, 512], lse f32[T, H], errors (aliased to the errors
         argument when the state is returned), scratch u8[T * 2064 or 0]
         (discarded: in a prefill chunk the CUDA kernels encode the chunk's
         rows there once, as append stores them, and decode them once to
         bf16; 0 bytes in decode and for the CPU handler)
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import config as C
from .. import reference
from ..error_detail import ErrorOp, query_rows, records_detail
from ..state import CacheState, check_state
from .dispatch import check_array, errors_alias, ffi_call, resolve_impl
from ._layer import layer_operand
from .shards import per_shard

_I32 = jnp.int32
KIND_CODE = {C.SWA: 0, C.CSA: 1, C.HCA: 2}
# the `kernel` attribute (ffi/include/dsv4/attention_rules.h AttnKernel)
KERNELS = {"auto": 0, "mma_sync": 1}

def _layer_kind(cfg, layer, kind):
    """The layer's kind: read off the config for a Python int (a `kind`
    given must agree), required for a traced layer."""
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
        cfg.kind_index(int(layer))          # range check, ValueError naming `layer`
        actual = cfg.layer_kinds[int(layer)]
        if kind is not None and kind != actual:
            raise ValueError(f"kind: layer {int(layer)} is {actual!r}, got kind={kind!r}")
        return actual
    if kind not in KIND_CODE:
        raise ValueError(f"kind: a traced layer needs kind= one of {tuple(KIND_CODE)}, "
                         f"got {kind!r}")
    return kind


def _check(cfg, kind, q, token_slot, token_pos, sink, topk, chunk_kv, rope_inv_freq):
    check_array("q", q, (None, None, C.HEAD_DIM), jnp.bfloat16)
    T, H = q.shape[0], q.shape[1]
    if H == 0:
        raise ValueError("q: expected at least one head, got shape " + str(list(q.shape)))
    check_array("token_slot", token_slot, (T,), _I32)
    check_array("token_pos", token_pos, (T,), _I32)
    check_array("sink", sink, (H,), jnp.float32)
    if kind == C.CSA:
        if topk is None:
            raise ValueError("topk: a CSA layer needs topk i32[T, k] (indexer_topk's output)")
        check_array("topk", topk, (T, None), _I32)
        if topk.shape[1] == 0:
            raise ValueError("topk: expected at least one index per token (k >= 1), got k = 0")
    elif topk is not None:
        raise ValueError(f"topk: only CSA layers take topk, this layer is {kind.upper()}")
    if chunk_kv is not None:
        check_array("chunk_kv", chunk_kv, (T, C.HEAD_DIM), jnp.bfloat16)
    if rope_inv_freq is not None:
        check_array("rope_inv_freq", rope_inv_freq, (C.ROPE_DIM // 2,), jnp.float32)


@records_detail(ErrorOp.ATTENTION, query_rows, state_at=2)
def attention(state: CacheState, layer, q: jax.Array, token_slot: jax.Array,
              token_pos: jax.Array, *, sink: jax.Array, topk: jax.Array | None = None,
              chunk_kv: jax.Array | None = None, rope_inv_freq: jax.Array | None = None,
              kind: str | None = None, impl: str = "auto", kernel: str = "auto",
              return_state: bool = True):
    """DeepSeek-V4 attention of `q[T, H, 512]` over what each token sees in
    the cache: `out bf16[T, H, 512]`, `lse f32[T, H]`.

    layer          global layer index of any kind (a traced one needs `kind`)
    q              bf16[T, H, 512], the query after its per-head RMSNorm and
                   RoPE (channels 448..511 roped at the token's position)
    token_slot, token_pos  i32[T] (meta.token_slot, meta.token_pos); slot -1
                   is padding (out 0, lse -inf, nothing counted)
    sink           f32[H], the layer's per-head attention-sink logit
    topk           CSA layers only: i32[T, k] entry indices (indexer_topk's
                   output), -1 = none
    chunk_kv       None for decode (the window is the ring, after this
                   token's append); in a prefill chunk bf16[T, 512], the rows
                   this call's tokens will append (call before append): a
                   query sees the chunk's rows of its request as append will
                   store them plus the ring rows before the chunk
    rope_inv_freq  f32[32]: rotate the output's RoPE channels back at the
                   query's position with these frequencies (the model's
                   rope of this layer); None leaves them as attended
    kind           "swa", "csa" or "hca": needed for a traced layer
    kernel         CUDA only (the other implementations have one): "auto"
                   runs the wgmma kernel on Hopper and the warp-level
                   mma.sync kernel elsewhere (Blackwell); "mma_sync" runs the
                   latter on any GPU (same results within the bound)
    returns        (out, lse, state), or (out, lse) with return_state=False

    Per token and head: logits s_j = (q . v_j) * 512^-0.5 over the rows v_j
    seen (K = V); m = max(sink, s); out = bf16(sum_j bf16(e^(s_j - m)) v_j /
    (sum_j e^(s_j - m) + e^(sink - m))), then the inverse RoPE; lse = m +
    log(denominator). Window: positions t-127..t (those >= 0); a ring row
    holding another position than the one needed (below the chunk's first
    position of the request, in a chunk) is STALE_WINDOW per (token, row),
    not read: a chunk appended before its own reads, a gap or a rewind of
    the request's positions. CSA: the picks (per index BAD_INDEX if < -1 or
    not visible, MISSING_BLOCK). HCA: entries
    i < (t+1) // 128 (MISSING_BLOCK per missing one). Counted once per token
    and dropping it (out 0, lse -inf): BAD_SLOT, BAD_POSITION, NONFINITE (NaN
    or Inf in its q); BAD_LAYER for a bad traced layer or kind."""
    check_state(state)
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {tuple(KERNELS)}, got {kernel!r}")
    cfg = state.config
    kind = _layer_kind(cfg, layer, kind)
    _check(cfg, kind, q, token_slot, token_pos, sink, topk, chunk_kv, rope_inv_freq)
    if cfg.sharded:   # per shard: the per-token operands split, sink and frequencies whole
        outs = ("rows", "rows") + (("state",) if return_state else ())
        return per_shard(attention, state, outs, layer=layer,
                         rows=dict(q=q, token_slot=token_slot, token_pos=token_pos, topk=topk,
                                   chunk_kv=chunk_kv),
                         whole=dict(sink=sink, rope_inv_freq=rope_inv_freq), kind=kind,
                         impl=impl, kernel=kernel, return_state=return_state)

    layer_idx = layer_operand(cfg, layer, None)
    if isinstance(layer, (int, np.integer)):
        kind_idx = jnp.int32(cfg.kind_index(int(layer)) if kind != C.SWA else 0)
    elif kind == C.SWA:
        kind_idx = jnp.int32(0)
    else:
        kind_idx = layer_operand(cfg, layer, kind)
    target = "dsv4_attention"
    impl = resolve_impl(impl, target, [state.block_table])
    if impl == "reference":
        out, lse, errors = reference.attention(state, kind, layer_idx, kind_idx, q, token_slot,
                                               token_pos, sink, topk, chunk_kv, rope_inv_freq)
    else:
        T, H = q.shape[0], q.shape[1]
        topk_arg = topk if topk is not None else jnp.zeros((T, 0), _I32)
        chunk_arg = chunk_kv if chunk_kv is not None else jnp.zeros((0, C.HEAD_DIM), jnp.bfloat16)
        freq_arg = rope_inv_freq if rope_inv_freq is not None else jnp.zeros((0,), jnp.float32)
        pool = {C.CSA: state.csa.kv, C.HCA: state.hca.kv, C.SWA: None}[kind]
        scratch = T * C.ATTN_CHUNK_SCRATCH_ROW if chunk_kv is not None and impl == "cuda" else 0
        out, lse, errors, _ = ffi_call(
            target, [layer_idx, kind_idx, q, token_slot, token_pos, topk_arg, chunk_arg, sink,
                     freq_arg, state.block_table, state.swa.pos, state.errors,
                     *jax.tree_util.tree_leaves(state.swa.kv),
                     *(jax.tree_util.tree_leaves(pool) if pool is not None else [])],
            [jax.ShapeDtypeStruct((T, H, C.HEAD_DIM), jnp.bfloat16),
             jax.ShapeDtypeStruct((T, H), jnp.float32),
             jax.ShapeDtypeStruct(state.errors.shape, _I32),
             jax.ShapeDtypeStruct((scratch,), jnp.uint8)],
            errors_alias(target, return_state), kv_format=C.KV_FORMAT_CODE[cfg.kv_format],
            kind=KIND_CODE[kind], kernel=KERNELS[kernel])
    if not return_state:
        return out, lse
    return out, lse, dataclasses.replace(state, errors=errors)
