"""The lightning indexer's top-k selection over the MXFP4 keys of a CSA layer
(rules and arithmetic order in dsv4_jax/ops/indexer.py), in pure jnp.

Every float sum is written as a chain of adds over slices, so XLA evaluates
it in exactly the documented order (XLA does not reassociate float adds; no
jnp.sum / dot, whose order is the backend's). Every product k * q is exact
(a 2-bit-mantissa key times a bf16 query fits in fp32), so fusing it into an
FMA could not change a bit either; the weighted head terms w * relu(d) are
not exact, so they pass an optimization barrier before they are summed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import config as C
from ..errors import ErrorKind
from ..state import CacheState
from . import quant
from ._rows import add_errors, layer_ok, read_index, token_checks, visible_entries

_I32 = jnp.int32
_CHUNK_BLOCKS = 8          # logical blocks (of 32 entries) scored per map step
_SENTINEL = np.int32(np.iinfo(np.int32).min)   # rank key of a non-candidate


def score_entries(kf, qf, w):
    """Scores f32[n] of dequantized keys kf f32[n, 128] for one query
    (qf f32[64, 128], w f32[64]) in the fixed order."""
    kb = kf.reshape(kf.shape[0], 1, C.INDEX_SCALES, C.MXFP4_BLOCK)
    qb = qf.reshape(1, C.INDEX_HEADS, C.INDEX_SCALES, C.MXFP4_BLOCK)
    prod = kb * qb                                   # [n, 64, 4, 32], exact
    blk = prod[..., 0]
    for j in range(1, C.MXFP4_BLOCK):                # j = 0..31 in order
        blk = blk + prod[..., j]
    d = ((blk[..., 0] + blk[..., 1]) + blk[..., 2]) + blk[..., 3]   # [n, 64]
    r = jnp.where(d > 0, d, jnp.float32(0))          # ReLU; NaN -> 0
    c = jax.lax.optimization_barrier(w[None, :] * r)
    s = c[:, 0]
    for h in range(1, C.INDEX_HEADS):                # h = 0..63 in order
        s = s + c[:, h]
    return s


def query_mxfp4(q):
    """q bf16[64, 128] rounded to MXFP4: codes as int8 twice the e2m1 value
    [64, 128] and the factors Q = 2^(scale byte - 129) f32[64, 4]."""
    codes, e = quant.mxfp4_codes(q)
    u = e.astype(jnp.uint32)
    bits = jnp.where(e >= 3, (u - 2) << 23,
                     jnp.uint32(0x800000) >> jnp.clip(3 - e, 0, 31).astype(jnp.uint32))
    return quant.e2m1_twice(codes), jax.lax.bitcast_convert_type(bits, jnp.float32)


def score_entries_mxfp4(packed, scale, q2, qfac, w):
    """Scores f32[n] of MXFP4 keys (packed u8[n, 64], scale e8m0[n, 4]) for
    one MXFP4 query (q2 int8[64, 128], qfac f32[64, 4], w f32[64]), in the
    order of dsv4/indexer.h (q_format "mxfp4")."""
    n = packed.shape[0]
    k2 = quant.e2m1_twice(quant.unpack_mxfp4(packed)).reshape(n, C.INDEX_SCALES, C.MXFP4_BLOCK)
    qb = q2.reshape(C.INDEX_HEADS, C.INDEX_SCALES, C.MXFP4_BLOCK)
    # integer block sums: exact, so the backend's summation order is free
    s = jnp.einsum("nbj,hbj->nhb", k2, qb, preferred_element_type=_I32)
    u = s.astype(jnp.float32) * quant.e8m0_to_f32(scale)[:, None, :]     # [n, 64, 4]
    # each product rounded before it is added (an overflowing product is
    # +-inf): times_pow2 keeps XLA from fusing product and add into an FMA
    d = quant.times_pow2(u[..., 0], qfac[None, :, 0])
    for b in range(1, C.INDEX_SCALES):
        d = d + quant.times_pow2(u[..., b], qfac[None, :, b])
    r = jnp.where(d > 0, d, jnp.float32(0))
    c = jax.lax.optimization_barrier(w[None, :] * r)
    # balanced pairwise tree in head order, on per-head columns: XLA's CPU
    # backend turns strided or reshaped pair adds into a reduction of its
    # own order (seen: other bits on 1 score in 4)
    cols = [c[:, h] for h in range(C.INDEX_HEADS)]
    while len(cols) > 1:
        cols = [cols[2 * i] + cols[2 * i + 1] for i in range(len(cols) // 2)]
    return cols[0]


def rank_keys(score):
    """int32 keys ordered like the scores: NaN ranks as -inf, -0 as +0."""
    s = jnp.where(jnp.isnan(score), jnp.float32(-jnp.inf), score)
    s = jnp.where(s == 0, jnp.float32(0), s)
    b = jax.lax.bitcast_convert_type(s, _I32)
    return b ^ ((b >> 31) & np.int32(0x7FFFFFFF))


def indexer_topk(state: CacheState, kind_idx, token_slot, token_pos, q, weights, k: int,
                 q_format: str = "mxfp4"):
    """indices i32[T, k], errors. See dsv4_jax/ops/indexer.py."""
    cfg = state.config
    R, MB, N = cfg.max_requests, cfg.max_blocks_per_request, cfg.num_blocks
    per_block = C.BLOCK_TOKENS // C.CSA_RATIO
    E = MB * per_block
    Lc = state.csa.comp.shape[0]
    ok_layer = layer_ok(kind_idx, Lc)
    T = token_slot.shape[0]

    token_ok, bad_slot, bad_pos = token_checks(token_slot, token_pos, R, cfg.max_context)
    # a good token whose q or weights hold a NaN or Inf: counted, row dropped
    finite = jnp.all(jnp.isfinite(q), axis=(1, 2)) & jnp.all(jnp.isfinite(weights), axis=1)
    nonfinite = token_ok & ~finite
    row_ok = token_ok & finite & ok_layer
    n_vis = jnp.where(row_ok, visible_entries(token_pos, E), 0)          # [T]

    blocks = state.block_table[read_index(token_slot, R)]                # [T, MB]
    logical = jnp.arange(MB, dtype=_I32)[None, :]
    needed = logical * per_block < n_vis[:, None]
    missing = needed & ((blocks < 0) | (blocks >= N))
    errors = add_errors(state.errors, ok_layer, {ErrorKind.BAD_SLOT: bad_slot,
                                                 ErrorKind.BAD_POSITION: bad_pos,
                                                 ErrorKind.NONFINITE: nonfinite,
                                                 ErrorKind.MISSING_BLOCK: missing})

    layer = read_index(kind_idx, Lc)
    packed = state.csa.index.packed[layer]                               # [N, 32, 64]
    scale = state.csa.index.scale[layer]                                 # [N, 32, 4]
    nchunks = -(-MB // _CHUNK_BLOCKS)
    MBp = nchunks * _CHUNK_BLOCKS
    usable = jnp.pad(needed & ~missing, ((0, 0), (0, MBp - MB)))
    blocks = jnp.pad(blocks, ((0, 0), (0, MBp - MB)))
    qf = q if q_format == "mxfp4" else q.astype(jnp.float32)
    wf = weights.astype(jnp.float32)
    Ep = MBp * per_block

    def one_token(args):
        blk_t, use_t, q_t, w_t, n_t = args
        if q_format == "mxfp4":
            q2, qfac = query_mxfp4(q_t)

        def chunk(c):
            sl = jax.lax.dynamic_slice_in_dim(blk_t, c * _CHUNK_BLOCKS, _CHUNK_BLOCKS)
            b = read_index(sl, N)
            if q_format == "mxfp4":
                return score_entries_mxfp4(packed[b].reshape(-1, C.INDEX_PACKED),
                                           scale[b].reshape(-1, C.INDEX_SCALES), q2, qfac, w_t)
            kf = quant.dequantize_mxfp4(packed[b], scale[b])             # [8, 32, 128]
            return score_entries(kf.reshape(-1, C.INDEX_DIM), q_t, w_t)
        scores = jax.lax.map(chunk, jnp.arange(nchunks, dtype=_I32)).reshape(Ep)
        i = jnp.arange(Ep, dtype=_I32)
        cand = jnp.repeat(use_t, per_block) & (i < n_t)
        key = jnp.where(cand, rank_keys(scores), _SENTINEL)
        if Ep < k:
            key = jnp.pad(key, (0, k - Ep), constant_values=_SENTINEL)
            i = jnp.arange(k, dtype=_I32)
        # ascending in ~key = descending key; equal keys by ascending index
        _, order = jax.lax.sort((~key, i), num_keys=2)
        top = order[:k]
        return jnp.where(key[top] != _SENTINEL, top, -1)

    if T == 0:
        return jnp.zeros((0, k), _I32), errors
    idx = jax.lax.map(one_token, (blocks, usable, qf, wf, n_vis))
    return idx.astype(_I32), errors
