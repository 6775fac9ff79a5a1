"""Attention straight from the cache (docs/design/operations.md, `attention`), as
dense jnp: the rows each query sees are read back as the gathers read them
(window ring, the prefill chunk's own rows, CSA picks or HCA entries), each
with a mask, and one two-pass softmax runs over all of them with the sink.

The rounding points are the contract's, in its order: fp32 logits times
512^-0.5; m = max(sink, logits); e = exp(s - m); D = sum(e) + exp(sink - m);
acc = sum(bf16(e) * v); o = bf16(acc / D); the RoPE channels of o rotated
back at the query's position in fp32 and rounded to bf16; lse = m + log(D).
Sources are kept apart (one logit block per source) so the prefill chunk,
seen by every query of its request, is never copied per query.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import config as C
from ..errors import ErrorKind
from ..state import CacheState
from . import quant
from ._rows import (add_errors, layer_ok, read_entries, read_index, token_checks,
                    visible_entries)

_HIGHEST = jax.lax.Precision.HIGHEST
SCALE = float(np.float32(1.0 / math.sqrt(C.HEAD_DIM)))


def _ring(state, layer, slot, pos, good, p0):
    """Window rows of each token's ring: values [T, 128, 512], seen mask and
    the STALE_WINDOW mask [T, 128]. Ring row j of a query at t should hold w, the
    position of (t - 128, t] that is j mod 128; it is needed when w >= 0 and
    w comes before the call's own rows of the request (p0), and a needed row
    holding anything else (-1 included) is stale: counted, not read."""
    cfg = state.config
    s = read_index(slot, cfg.max_requests)
    ring_pos = state.swa.pos[layer][s]                                     # [T, 128]
    entries = jax.tree_util.tree_map(lambda p: p[layer][s], state.swa.kv)
    kv = quant.dequantize_kv(entries, cfg.kv_format)
    t = pos[:, None]
    w = t - (t - jnp.arange(C.WINDOW, dtype=jnp.int32)[None, :]) % C.WINDOW
    need = good[:, None] & (w >= 0)
    if p0 is not None:
        need = need & (w < p0[s][:, None])
    seen = need & (ring_pos == w)
    return kv, seen, need & ~seen


def _chunk(cfg, chunk_kv, slot, pos, good, row_ok):
    """The call's own rows as append stores them: values [T, 512] shared by
    every query, seen mask [T (query), T (row)], and p0 per slot (the first
    position of each request in the call)."""
    finite = jnp.all(jnp.isfinite(chunk_kv.astype(jnp.float32)), axis=-1)
    usable = row_ok & finite
    stored = quant.dequantize_kv(quant.quantize_kv(chunk_kv, cfg.kv_format), cfg.kv_format)
    # zeros in the rows no query sees: every query's P.V sums over all T rows
    # with weight 0 there, and 0 * NaN would poison the whole call
    stored = jnp.where(usable[:, None], stored, jnp.zeros((), stored.dtype))
    t = pos[:, None]
    p = pos[None, :]
    seen = (good[:, None] & usable[None, :] & (slot[:, None] == slot[None, :])
            & (p <= t) & (p > t - C.WINDOW))
    R = cfg.max_requests
    big = jnp.iinfo(jnp.int32).max
    p0 = jnp.full((R,), big, jnp.int32).at[jnp.where(row_ok, slot, R)].min(pos, mode="drop")
    return stored, seen, p0


def _csa(state, kind_idx, slot, pos, good, topk):
    """The picked CSA entries: values [T, k, 512], seen mask, and the counts
    BAD_INDEX, MISSING_BLOCK of the tokens that are `good` (masks [T, k])."""
    cfg = state.config
    R, MB, N = cfg.max_requests, cfg.max_blocks_per_request, cfg.num_blocks
    per_block = C.BLOCK_TOKENS // C.CSA_RATIO
    visible = visible_entries(pos, MB * per_block)[:, None]
    examined = good[:, None] & (topk != -1)
    bad_index = examined & ((topk < -1) | (topk >= visible))
    col = jnp.clip(topk // per_block, 0, MB - 1)
    block = state.block_table[read_index(slot, R)[:, None], col]
    missing = examined & ~bad_index & ((block < 0) | (block >= N))
    seen = examined & ~bad_index & ~missing
    row = jnp.where(seen, topk, 0) % per_block
    kv = read_entries(state.csa.kv, read_index(kind_idx, state.csa.comp.shape[0]), block, row,
                       cfg.kv_format, seen)
    return kv, seen, {ErrorKind.BAD_INDEX: bad_index, ErrorKind.MISSING_BLOCK: missing}


def _hca(state, kind_idx, slot, pos, good):
    """Every HCA entry i < (t + 1) // 128 of each token: values [T, MB, 512],
    seen mask, MISSING_BLOCK mask [T, MB]."""
    cfg = state.config
    R, MB, N = cfg.max_requests, cfg.max_blocks_per_request, cfg.num_blocks
    n = pos // C.HCA_RATIO + (pos % C.HCA_RATIO == C.HCA_RATIO - 1)      # (pos+1)//128, no overflow
    j = jnp.arange(MB, dtype=jnp.int32)[None, :]
    need = good[:, None] & (j < n[:, None])
    block = state.block_table[read_index(slot, R)[:, None], j]
    missing = need & ((block < 0) | (block >= N))
    seen = need & ~missing
    kv = read_entries(state.hca.kv, read_index(kind_idx, state.hca.comp.shape[0]), block,
                       jnp.zeros_like(block), cfg.kv_format, seen)
    return kv, seen, {ErrorKind.MISSING_BLOCK: missing}


def _inverse_rope(o, pos, inv_freq):
    """Rotate the trailing 64 channels of bf16 o [T, H, 512] back by the
    query's angle: (a, b) -> (a cos + b sin, b cos - a sin), fp32, to bf16."""
    head, tail = o[..., :C.NOPE_DIM], o[..., C.NOPE_DIM:].astype(jnp.float32)
    angle = pos.astype(jnp.float32)[:, None] * inv_freq.astype(jnp.float32)   # [T, 32]
    c, s = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    pairs = tail.reshape(tail.shape[:-1] + (C.ROPE_DIM // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([a * c + b * s, b * c - a * s], axis=-1).reshape(tail.shape)
    return jnp.concatenate([head, quant.to_bf16(out)], axis=-1)


def attention(state: CacheState, kind: str, layer_idx, kind_idx, q, token_slot, token_pos,
              sink, topk=None, chunk_kv=None, inv_freq=None):
    """out bf16[T, H, 512], lse f32[T, H], errors (docs/design/operations.md)."""
    cfg = state.config
    ok_layer = layer_ok(layer_idx, cfg.num_layers)
    if kind == C.CSA:
        ok_layer = ok_layer & layer_ok(kind_idx, state.csa.comp.shape[0])
    elif kind == C.HCA:
        ok_layer = ok_layer & layer_ok(kind_idx, state.hca.comp.shape[0])
    row_ok, bad_slot, bad_pos = token_checks(token_slot, token_pos, cfg.max_requests,
                                             cfg.max_context)
    qf = q.astype(jnp.float32)
    nonfinite = row_ok & ~jnp.all(jnp.isfinite(qf), axis=(1, 2))
    good = row_ok & ~nonfinite & ok_layer
    counts = {ErrorKind.BAD_SLOT: bad_slot, ErrorKind.BAD_POSITION: bad_pos,
              ErrorKind.NONFINITE: nonfinite}
    layer = read_index(layer_idx, cfg.num_layers)

    # (values, seen, einsum of q with the values) per source
    sources = []
    p0 = None
    if chunk_kv is not None:
        stored, seen, p0 = _chunk(cfg, chunk_kv, token_slot, token_pos, good, row_ok)
        sources.append((stored, seen, "thd,rd->thr", "thr,rd->thd"))
    ring, seen, stale = _ring(state, layer, token_slot, token_pos, good, p0)
    sources.append((ring, seen, "thd,tsd->ths", "ths,tsd->thd"))
    counts[ErrorKind.STALE_WINDOW] = stale
    if kind == C.CSA:
        kv, seen, c = _csa(state, kind_idx, token_slot, token_pos, good, topk)
        sources.append((kv, seen, "thd,tsd->ths", "ths,tsd->thd"))
        counts.update(c)
    elif kind == C.HCA:
        kv, seen, c = _hca(state, kind_idx, token_slot, token_pos, good)
        sources.append((kv, seen, "thd,tsd->ths", "ths,tsd->thd"))
        counts.update(c)
    errors = add_errors(state.errors, ok_layer, counts)

    sink = sink.astype(jnp.float32)[None, :]                                 # [1, H]
    logits = []
    for values, seen, qk, _ in sources:
        s = jnp.einsum(qk, qf, values.astype(jnp.float32), precision=_HIGHEST) * jnp.float32(SCALE)
        logits.append(jnp.where(seen[:, None, :], s, -jnp.inf))
    m = sink
    for s in logits:
        m = jnp.maximum(m, jnp.max(s, axis=-1, initial=-jnp.inf))
    live = m > -jnp.inf                                                     # a sink or a row seen
    m_safe = jnp.where(live, m, 0.0)
    denom = jnp.exp(sink - m_safe)
    acc = jnp.zeros(q.shape, jnp.float32)
    for s, (values, seen, _, pv) in zip(logits, sources):
        e = jnp.where(seen[:, None, :], jnp.exp(s - m_safe[..., None]), 0.0)
        denom = denom + jnp.sum(e, axis=-1)
        e16 = quant.to_bf16(e).astype(jnp.float32)
        acc = acc + jnp.einsum(pv, e16, values.astype(jnp.float32), precision=_HIGHEST)
    out = quant.to_bf16(quant.ieee_div(acc, denom[..., None]))
    if inv_freq is not None:
        out = _inverse_rope(out, token_pos, inv_freq)
    keep = (good[:, None] & live)
    out = jnp.where(keep[..., None], out, jnp.zeros((), jnp.bfloat16))
    lse = jnp.where(keep, m_safe + jnp.log(denom), -jnp.inf)
    return out, lse, errors
