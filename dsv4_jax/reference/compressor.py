"""Compressor: flush (docs/design/semantics.md, docs/design/state.md).

Accumulators. Each compressed entry is a per-channel softmax pool, kept as an
online softmax (max M, sum S, weighted kv V) in f32; empty = (-inf, 0, 0).
A CSA layer keeps two per request and compressor — *current* (entry w) and
*next* (entry w + 1) — an HCA layer one. The entry an accumulator belongs to
is implied by the request's length: with f the first position a call gates
for a request, accumulator k holds entry f // m + k.

One call, per compressor:
0. Expected positions (docs/design/semantics.md). The k-th row of a request slot in
   the call (a stable sort by slot ranks them) has ep = p0 + k, p0 the
   position of its first row. A row gates if 0 <= ep < max_context; a gating
   row whose position is not ep is BAD_POSITION, and so is every row that
   does not gate. The gating expected positions of a slot are [f, L].
1. Contributions. A gating row at ep of a CSA layer gives two: its b half
   (channels [d, 2d) of kv and z) to entry ep // 4 and its a half (channels
   [0, d)) to entry ep // 4 + 1. An HCA row gives one, to entry ep // 128.
   z = score + ape[ep mod m] (f32 add). A dropped gating row contributes
   weight 0 (z = -inf): it still makes its entries' segments exist, so every
   window it closes is written and every carried accumulator is merged.
2. Segments. Contributions are grouped by (slot, entry) with a sort; the
   segment's maximum over its contributions is taken first, then
   S = sum exp(z - M) and V = sum exp(z - M) * kv (two passes within the call).
3. The stored accumulator k of a slot is merged into the segment of entry
   f // m + k (the row at f gives it a segment):  M' = max(M1, M2),
   S' = S1 e^(M1-M') + S2 e^(M2-M'), the same for V; an all-empty merge stays
   (-inf, 0, 0) (the exponent uses M' = 0 when M' = -inf, so no -inf - -inf
   NaN appears).
4. Entries e < (L + 1) // m are closed: pooled V / S (0 where S = 0),
   epilogue, quantization, and a write to pool[layer, block_table[slot,
   e*m // 128], e % (128 // m)] when that block exists. Segments of entries
   (L + 1) // m + k (k < number of accumulators) become the slot's new
   accumulators; the others of a slot with gating rows are emptied.

Epilogue of an entry at position P = e*m (the order of the official code):
  y  = bf16(pooled)
  n  = bf16((y * (1 / sqrt(sum(y^2) / d + 1e-6))) * w)      all in f32
  rope on the trailing 64 channels, pairs (2k, 2k+1), in f32:
       a = float32(P) * inv_freq[k];  c = cos(a), s = sin(a)
       out_2k = x_2k * c - x_2k+1 * s;  out_2k+1 = x_2k * s + x_2k+1 * c
  key = bf16(rope result)
Indexer keys then go through the normalized Sylvester Hadamard transform:
  a fast Walsh-Hadamard transform in f32 (7 butterfly stages, stage h = 1, 2,
  ..., 64 maps (x_i, x_i+h) -> (x_i + x_i+h, x_i - x_i+h) for i with bit h
  clear), times float32(128^-0.5), rounded to bf16, then MXFP4.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import config as C
from ..errors import ErrorKind
from ..state import ACC_KV, ACC_MAX, ACC_SUM, CacheState, empty_accumulator
from . import quant
from ._rows import add_errors, layer_ok, read_index, set_pool_rows

_NEG_INF = -jnp.inf
HADAMARD_SCALE = float(np.float32(1.0 / np.sqrt(C.INDEX_DIM)))


# ---- epilogue ---------------------------------------------------------------------------------
def rms_norm(x, weight):
    """bf16 [..., d] -> bf16, computed in f32 without rsqrt."""
    xf = x.astype(jnp.float32)
    var = quant.ieee_div(jnp.sum(xf * xf, axis=-1, keepdims=True), x.shape[-1])
    inv = quant.ieee_div(1.0, jnp.sqrt(var + jnp.float32(C.NORM_EPS)))
    return quant.to_bf16((xf * inv) * weight.astype(jnp.float32))


def rope(x, positions, inv_freq):
    """Interleaved (GPT-J pair) RoPE on the trailing 64 channels of bf16
    x[..., d] at int32 `positions[...]`; returns bf16."""
    head, tail = x[..., :-C.ROPE_DIM], x[..., -C.ROPE_DIM:].astype(jnp.float32)
    angle = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
    c, s = jnp.cos(angle), jnp.sin(angle)
    pairs = tail.reshape(tail.shape[:-1] + (C.ROPE_DIM // 2, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(tail.shape)
    return jnp.concatenate([head, quant.to_bf16(out)], axis=-1)


def hadamard(x):
    """Normalized Sylvester Hadamard transform of bf16 x[..., 128] in f32
    (butterfly order of the module docstring); returns bf16."""
    n = x.shape[-1]
    y = x.astype(jnp.float32)
    lead = y.shape[:-1]
    h = 1
    while h < n:
        z = y.reshape(lead + (n // (2 * h), 2, h))
        a, b = z[..., 0, :], z[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2).reshape(lead + (n,))
        h *= 2
    return quant.to_bf16(y * jnp.float32(HADAMARD_SCALE))


def epilogue(pooled, positions, params):
    """f32 pooled values [..., d] of entries at `positions` -> bf16 keys."""
    y = quant.to_bf16(pooled)
    y = rms_norm(y, params.norm)
    return rope(y, positions, params.inv_freq)


# ---- accumulators -------------------------------------------------------------------------------
def merge(a, b):
    """Merge two (M, S, V) triples (arrays [..., 3, d]) of online softmax."""
    m = jnp.maximum(a[..., ACC_MAX, :], b[..., ACC_MAX, :])
    ref = jnp.where(m == _NEG_INF, 0.0, m)
    fa, fb = jnp.exp(a[..., ACC_MAX, :] - ref), jnp.exp(b[..., ACC_MAX, :] - ref)
    s = a[..., ACC_SUM, :] * fa + b[..., ACC_SUM, :] * fb
    v = a[..., ACC_KV, :] * fa + b[..., ACC_KV, :] * fb
    return jnp.stack([m, s, v], axis=-2)


def _fold(acc, slot, ep, gated, folded, kv, z, m: int, overlap: bool):
    """Fold one call's gating rows into one compressor's accumulators.

    acc f32[R, nacc, 3, d] (this layer); kv, z f32[T, coff*d]; ep the rows'
    expected positions, `gated` the rows that gate, `folded` those of them
    whose inputs are folded (the others weigh 0). Returns (new acc, seg_slot,
    seg_entry, closed, pooled f32[G, d]) where the G = coff*T segments are the
    (slot, entry) groups of the call (unused segments have slot R)."""
    R, nacc, _, d = acc.shape
    entry = ep // m
    z = jnp.where(folded[:, None], z, _NEG_INF)
    kv = jnp.where(folded[:, None], kv, 0.0)
    if overlap:   # b half -> entry ep // m, a half -> entry ep // m + 1
        c_slot, c_entry = jnp.concatenate([slot, slot]), jnp.concatenate([entry, entry + 1])
        c_z = jnp.concatenate([z[:, d:], z[:, :d]])
        c_kv = jnp.concatenate([kv[:, d:], kv[:, :d]])
        c_valid = jnp.concatenate([gated, gated])
    else:
        c_slot, c_entry, c_z, c_kv, c_valid = slot, entry, z, kv, gated
    G = c_slot.shape[0]

    # segment id of each contribution: rank of its (slot, entry) among the call's
    key_slot = jnp.where(c_valid, c_slot, R)
    key_entry = jnp.where(c_valid, c_entry, 0)
    order = jnp.lexsort((key_entry, key_slot))
    ss, se = key_slot[order], key_entry[order]
    new = jnp.concatenate([jnp.ones((1,), bool), (ss[1:] != ss[:-1]) | (se[1:] != se[:-1])])
    rank = jnp.cumsum(new.astype(jnp.int32)) - 1
    seg = jnp.zeros((G,), jnp.int32).at[order].set(jnp.where(ss < R, rank, G))
    seg_read = jnp.minimum(seg, G - 1)
    seg_slot = jnp.full((G,), R, jnp.int32).at[seg].set(c_slot, mode="drop")
    seg_entry = jnp.zeros((G,), jnp.int32).at[seg].set(c_entry, mode="drop")
    used = seg_slot < R
    s_read = jnp.minimum(seg_slot, R - 1)

    # the gating range [f, L] of each slot in this call
    t_slot = jnp.where(gated, slot, R)
    first = jnp.full((R,), jnp.iinfo(jnp.int32).max, jnp.int32).at[t_slot].min(ep, mode="drop")
    last = jnp.full((R,), -1, jnp.int32).at[t_slot].max(ep, mode="drop")
    active = last >= 0

    # the call's own two-pass softmax per segment
    mx = jnp.full((G, d), _NEG_INF, jnp.float32).at[seg].max(c_z, mode="drop")
    w = jnp.exp(c_z - jnp.where(mx[seg_read] == _NEG_INF, 0.0, mx[seg_read]))
    sm = jnp.zeros((G, d), jnp.float32).at[seg].add(w, mode="drop")
    vs = jnp.zeros((G, d), jnp.float32).at[seg].add(w * c_kv, mode="drop")
    seg_acc = jnp.stack([mx, sm, vs], axis=-2)

    # merge the stored accumulator k into the segment of entry first // m + k
    k = seg_entry - first[s_read] // m
    has_stored = used & (k >= 0) & (k < nacc)
    stored = acc[s_read, jnp.clip(k, 0, nacc - 1)]
    stored = jnp.where(has_stored[:, None, None], stored,
                       empty_accumulator(stored.shape, stored.dtype))
    seg_acc = merge(seg_acc, stored)

    # closed entries and the new accumulators
    length = last[s_read] + 1
    closed = used & (seg_entry < length // m)
    s_acc, s_sum = seg_acc[:, ACC_KV], seg_acc[:, ACC_SUM]
    pooled = jnp.where(s_sum > 0, quant.ieee_div(s_acc, jnp.where(s_sum > 0, s_sum, 1.0)), 0.0)
    acc = jnp.where(active[:, None, None, None], empty_accumulator(acc.shape, acc.dtype), acc)
    k_new = seg_entry - length // m
    keep = used & (k_new >= 0) & (k_new < nacc)
    acc = acc.at[jnp.where(keep, seg_slot, R), jnp.clip(k_new, 0, nacc - 1)].set(
        seg_acc, mode="drop")
    return acc, seg_slot, seg_entry, closed, pooled


def expected_positions(token_slot, token_pos, slot_ok, R: int, max_context: int):
    """Per row: (ep, gated). ep = p0 + k for the k-th row of its slot in row
    order (p0 = the position of the slot's first row), in int32 wrapping
    arithmetic; gated = a good slot and 0 <= ep < max_context. Where p0 <
    max_context a wrapped ep is >= 2^31 in truth, so never gates; p0 >=
    max_context gates nothing."""
    key = jnp.where(slot_ok, token_slot, R)
    T = key.shape[0]
    order = jnp.argsort(key, stable=True)
    n = jnp.zeros((R + 1,), jnp.int32).at[key].add(1)
    start = jnp.cumsum(n) - n
    rank = jnp.zeros((T,), jnp.int32).at[order].set(
        jnp.arange(T, dtype=jnp.int32) - start[key[order]])
    p0 = jnp.zeros((R + 1,), jnp.int32).at[jnp.where(rank == 0, key, R + 1)].set(
        token_pos, mode="drop")[key]
    ep = p0 + rank
    gated = slot_ok & (p0 < max_context) & (ep >= 0) & (ep < max_context)
    return ep, gated


def _write_pool(pool, layer, slot_rows, entry, ok, m: int, block_table, values):
    """Write `values` (a pytree of [G, ...]) of closed entries into the paged
    `pool` (same structure, [Lk, N, 128 // m, ...])."""
    N = jax.tree_util.tree_leaves(pool)[0].shape[1]
    R, MB = block_table.shape
    per_block = C.BLOCK_TOKENS // m
    col = jnp.clip(entry * m // C.BLOCK_TOKENS, 0, MB - 1)
    block = block_table[jnp.minimum(slot_rows, R - 1), col]
    ok = ok & (block >= 0) & (block < N)
    block = jnp.where(ok, block, N)                               # N = dropped
    row = entry % per_block
    return jax.tree_util.tree_map(
        lambda p, v: set_pool_rows(p, (layer, block, row), v), pool, values)


def flush(state: CacheState, kind: str, kind_idx, token_slot, token_pos, kv, score, params,
          index_kv=None, index_score=None) -> CacheState:
    cfg = state.config
    R, N, MB = cfg.max_requests, cfg.num_blocks, cfg.max_blocks_per_request
    csa = kind == C.CSA
    pool_state = state.csa if csa else state.hca
    Lk = pool_state.comp.shape[0]
    m = C.CSA_RATIO if csa else C.HCA_RATIO

    ok_layer = layer_ok(kind_idx, Lk)
    slot_ok = (token_slot >= 0) & (token_slot < R)
    bad_slot = (token_slot != -1) & ~slot_ok
    ep, gated = expected_positions(token_slot, token_pos, slot_ok, R, cfg.max_context)
    bad_pos = slot_ok & (~gated | (token_pos != ep))
    col = jnp.clip(ep // C.BLOCK_TOKENS, 0, MB - 1)
    block = state.block_table[read_index(token_slot, R), col]
    missing = gated & ~bad_pos & ((block < 0) | (block >= N))
    inputs = (kv, score) + ((index_kv, index_score) if csa else ())
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x), axis=-1) for x in inputs]), axis=0)
    nonfinite = gated & ~bad_pos & ~missing & ~finite
    gated = gated & ok_layer
    folded = gated & ~bad_pos & ~missing & ~nonfinite
    errors = add_errors(state.errors, ok_layer, {ErrorKind.BAD_SLOT: bad_slot,
                                                 ErrorKind.BAD_POSITION: bad_pos,
                                                 ErrorKind.MISSING_BLOCK: missing,
                                                 ErrorKind.NONFINITE: nonfinite})
    layer = read_index(kind_idx, Lk)
    layer_w = jnp.where(ok_layer, kind_idx, Lk)                   # Lk = dropped
    slot = jnp.where(gated, token_slot, 0)
    pos = jnp.where(gated, ep, 0)

    def run(comp, kv, score, p):
        z = score + p.ape[pos % m]
        acc, seg_slot, seg_entry, closed, pooled = _fold(
            comp[layer], slot, pos, gated, folded, kv, z, m, overlap=csa)
        keys = epilogue(pooled, seg_entry * m, p)
        comp = set_pool_rows(comp, (jnp.reshape(layer_w, (1,)),), acc[None])
        return comp, seg_slot, seg_entry, closed, keys

    comp, seg_slot, seg_entry, closed, keys = run(pool_state.comp, kv, score, params)
    kv_pool = _write_pool(pool_state.kv, layer_w, seg_slot, seg_entry, closed, m,
                          state.block_table, quant.quantize_kv(keys, cfg.kv_format))
    if not csa:
        hca = pool_state.__class__(kv_pool, comp)
        return CacheState(state.block_table, state.swa, state.csa, hca, errors, cfg)

    icomp, iseg_slot, iseg_entry, iclosed, ikeys = run(
        pool_state.icomp, index_kv, index_score, params.index)
    packed, iscale = quant.quantize_mxfp4(hadamard(ikeys))
    index_pool = _write_pool(pool_state.index, layer_w, iseg_slot, iseg_entry, iclosed, m,
                             state.block_table, pool_state.index.__class__(packed, iscale))
    csa_state = pool_state.__class__(kv_pool, index_pool, comp, icomp)
    return CacheState(state.block_table, state.swa, csa_state, state.hca, errors, cfg)
