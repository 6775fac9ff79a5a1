"""Helpers of the indexer_topk tests: tiny states holding random MXFP4 index
keys, queries, the numpy float32 replays of the documented score orders, the
float64 oracle of the formula, the expected ranking, the op run under jit
once per implementation (IMPLS, with the skip marks of the CPU target), and
a handler's per-entry rank keys (its scratch result) beside their replay."""
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax import _ffi

from support import npq
from support.marks import CUDA, requires_cpu_ffi

CSA_LAYERS = (1, 3)      # tiny preset: SWA, CSA, HCA, CSA
# the value of each e2m1 code 0..15 (8..15 the negatives), to decode keys by hand
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def make_state(rng, R=4, max_context=1024, blocks=None, num_blocks=None):
    """Tiny state with random MXFP4 keys in every CSA block (scale bytes near
    127, no NaN byte) and the block table `blocks` (slot -> physical ids)."""
    cfg = D.CacheConfig.tiny(max_requests=R, max_context=max_context, num_blocks=num_blocks)
    st = D.init_state(cfg)
    Lc, N = st.csa.index.packed.shape[:2]
    packed = rng.integers(0, 256, (Lc, N, 32, 64), dtype=np.uint8)
    scale = rng.integers(119, 132, (Lc, N, 32, 4), dtype=np.uint8)
    bt = np.full((R, cfg.max_blocks_per_request), -1, np.int32)
    for s, phys in (blocks or {}).items():
        bt[s, :len(phys)] = phys
    st = dataclasses.replace(st, block_table=jnp.asarray(bt))
    return with_index_keys(st, packed, scale)


def with_index_keys(st, packed=None, scale=None):
    """`st` with its CSA indexer keys replaced: packed u8 codes and/or scale
    bytes (numpy u8, viewed as e8m0)."""
    packed = st.csa.index.packed if packed is None else jnp.asarray(packed)
    scale = (st.csa.index.scale if scale is None
             else jnp.asarray(scale.view(ml_dtypes.float8_e8m0fnu)))
    return dataclasses.replace(st, csa=dataclasses.replace(
        st.csa, index=D.IndexerKeys(packed, scale)))


def random_blocks(rng, cfg, slots):
    """Distinct random physical blocks for every logical block of `slots`."""
    MB = cfg.max_blocks_per_request
    perm = rng.permutation(cfg.num_blocks)
    return {s: perm[i * MB:(i + 1) * MB] for i, s in enumerate(slots)}


def with_random_blocks(rng, st, n_slots):
    """`st` whose first `n_slots` slots own distinct random blocks, every
    logical block of each (random_blocks)."""
    bt = np.stack([np.r_[b] for b in random_blocks(rng, st.config, range(n_slots)).values()])
    return dataclasses.replace(st, block_table=jnp.asarray(bt.astype(np.int32)))


def queries(rng, T, qscale=1.0):
    """Random queries bf16[T, 64, 128] (normal, times `qscale`) and head
    weights f32[T, 64]."""
    q = (rng.standard_normal((T, 64, 128)) * qscale).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((T, 64)).astype(np.float32)
    return q, w


def host_keys(st, kind_idx, slot, n, with_codes=False):
    """Decoded keys f64[n, 128] of entries 0..n-1 of `slot` (numpy only),
    and whether each entry's block exists; with_codes: also their e2m1 codes
    [n, 128] and scale bytes [n, 4]."""
    packed = np.asarray(st.csa.index.packed)[kind_idx]
    scale = np.asarray(st.csa.index.scale).view(np.uint8)[kind_idx].astype(np.int64)
    bt = np.asarray(st.block_table)[slot]
    N = packed.shape[0]
    i = np.arange(n)
    b = bt[i // 32]
    ok = (b >= 0) & (b < N)
    by = packed[np.where(ok, b, 0), i % 32]                      # [n, 64]
    codes = np.where(ok[:, None], np.stack([by & 15, by >> 4], -1).reshape(n, 128), 0)
    sbytes = np.where(ok[:, None], scale[np.where(ok, b, 0), i % 32], 127)
    keys = np.where(ok[:, None], E2M1[codes] * np.repeat(2.0 ** (sbytes - 127), 32, axis=1), 0.)
    if with_codes:
        return keys, ok, codes, sbytes
    return keys, ok


def visible(p, MB):
    """Index entries a token at position `p` sees: one per 4 tokens up to and
    including p, at most the block table's MB * 32."""
    return min((p + 1) // 4, MB * 32)


def replay_f32(keys, q, w):
    """The documented fp32 order, replayed in numpy float32."""
    k = keys.astype(np.float32).reshape(-1, 1, 4, 32)
    qq = np.asarray(q, np.float32).reshape(1, 64, 4, 32)
    prod = k * qq
    blk = prod[..., 0]
    for j in range(1, 32):
        blk = blk + prod[..., j]
    d = ((blk[..., 0] + blk[..., 1]) + blk[..., 2]) + blk[..., 3]
    c = np.asarray(w, np.float32)[None, :] * np.where(d > 0, d, np.float32(0))
    s = c[:, 0]
    for h in range(1, 64):
        s = s + c[:, h]
    return s


def replay_f32_mxfp4(key_codes, key_scale, q, w):
    """The documented q_format "mxfp4" order (dsv4/indexer.h) in numpy
    float32: keys as e2m1 codes [n, 128] and scale bytes [n, 4], q rounded by
    npq's independent MXFP4 quantizer."""
    k2 = (2 * E2M1[key_codes]).astype(np.int64).reshape(-1, 4, 32)
    K = np.exp2(key_scale.astype(np.float64) - 127).astype(np.float32)
    qv, qs = npq.mxfp4_roundtrip(np.asarray(q, np.float32))
    qs = qs.reshape(64, 4, 32)[..., 0]
    q2 = np.rint(2 * qv.reshape(64, 4, 32) / qs[..., None]).astype(np.int64)
    # exact integers (|S| <= 32 * 12 * 12), in float64 for the BLAS
    S = np.einsum("nbj,hbj->nhb", k2.astype(np.float64), q2.astype(np.float64),
                  optimize=True).astype(np.int64)
    u = S.astype(np.float32) * K[:, None, :]
    Q = (qs / 4).astype(np.float32)
    d = u[..., 0] * Q[None, :, 0]
    for b in range(1, 4):
        d = d + u[..., b] * Q[None, :, b]      # the product rounded, then added
    c = np.asarray(w, np.float32)[None, :] * np.where(d > 0, d, np.float32(0))
    while c.shape[1] > 1:                      # balanced pairwise tree over the heads
        c = c[:, 0::2] + c[:, 1::2]
    return c[:, 0]


def oracle_f64(keys, q, w):
    """The formula in float64: per entry, the sum over heads of
    w * relu(key . q)."""
    d = keys @ np.asarray(q, np.float64).T                       # [n, 64]
    return np.maximum(d, 0) @ np.asarray(w, np.float64)


def rank(scores, cand, k):
    """Indices of the k best candidates (descending score, NaN as -inf,
    ascending index), -1 padded."""
    idx = np.nonzero(cand)[0]
    s = np.where(np.isnan(scores[idx]), -np.inf, scores[idx])   # NaN ranks as -inf
    order = idx[np.lexsort((idx, -s))][:k]
    return np.r_[order, np.full(k - len(order), -1)].astype(np.int32)


def expected(st, layer, slot, pos, q, w, k, q_format="bf16"):
    """Per token: the replayed-fp32 ranking, and (scores64, cand) for the
    float64 oracle (of the formula with q rounded to MXFP4 for "mxfp4")."""
    cfg = st.config
    MB = cfg.max_blocks_per_request
    kind_idx = cfg.kind_index(layer, "csa")
    rows, info = [], []
    for t in range(len(slot)):
        if not (0 <= slot[t] < cfg.max_requests) or not 0 <= pos[t] < cfg.max_context:
            rows.append(np.full(k, -1, np.int32))
            info.append(None)
            continue
        n = visible(int(pos[t]), MB)
        keys, ok, codes, sbytes = host_keys(st, kind_idx, slot[t], n, with_codes=True)
        if q_format == "mxfp4":
            qt = npq.mxfp4_roundtrip(np.asarray(q[t], np.float32))[0]
            rows.append(rank(replay_f32_mxfp4(codes, sbytes, q[t], w[t]), ok, k))
        else:
            qt = q[t]
            rows.append(rank(replay_f32(keys, q[t], w[t]), ok, k))
        info.append((oracle_f64(keys, qt, w[t]), ok))
    return np.stack(rows), info


def run(st, layer, slot, pos, q, w, k, impl, return_state=True, q_format="bf16",
        rows_per_request=None):
    """indexer_topk of `layer` under jit with `impl`: the indices (and the
    state, if return_state). q_format=None (rows_per_request=None) leaves it
    to the op's default."""
    kw = {} if q_format is None else {"q_format": q_format}
    if rows_per_request is not None:
        kw["rows_per_request"] = rows_per_request
    f = jax.jit(lambda st, s, p, q, w: D.indexer_topk(st, layer, s, p, q, w, k, impl=impl,
                                                      return_state=return_state, **kw))
    return f(st, jnp.asarray(slot, jnp.int32), jnp.asarray(pos, jnp.int32), jnp.asarray(q),
             jnp.asarray(w))


def np_rank_keys(s):
    """uint32 rank keys of float32 scores (NaN as -inf, -0 as +0)."""
    s = np.where(np.isnan(s), np.float32(-np.inf), s).astype(np.float32)
    s = np.where(s == 0, np.float32(0), s).astype(np.float32)
    b = s.view(np.uint32)
    key = np.where(b & 0x80000000, b ^ 0x7FFFFFFF, b)
    return (key ^ 0x80000000).astype(np.uint32)


def handler_scratch(impl, st, slot, pos, q, w, q_format, rows_per_request=1):
    """The handler's scratch result (rank keys of every entry), poisoned first."""
    from dsv4_jax.ops.dispatch import ffi_call
    from dsv4_jax.ops.indexer import QUERY_SCRATCH_BYTES, Q_FORMATS as ATTR
    T = len(slot)
    E = st.config.max_blocks_per_request * 32
    qbytes = QUERY_SCRATCH_BYTES if q_format == "mxfp4" else 0

    def call(st, s, p, q, w):
        return ffi_call("dsv4_indexer_topk", [jnp.int32(1), s, p, q, w, st.block_table, st.errors,
                                              st.csa.index.packed, st.csa.index.scale],
                        [jax.ShapeDtypeStruct((T, 8), jnp.int32),
                         jax.ShapeDtypeStruct((T, E), jnp.uint32),
                         jax.ShapeDtypeStruct((T, qbytes), jnp.uint8),
                         jax.ShapeDtypeStruct(st.errors.shape, jnp.int32)], {6: 3},
                        q_format=ATTR[q_format], rows_per_request=rows_per_request)
    args = jax.device_put((st, jnp.asarray(slot), jnp.asarray(pos), jnp.asarray(q),
                           jnp.asarray(w)), jax.devices(impl)[0])
    return np.asarray(jax.jit(call)(*args)[1])


# the CPU target of this op may be missing from an older build of the module
needs_cpu_target = pytest.mark.skipif(not _ffi.has_target("cpu", "dsv4_indexer_topk"),
                                      reason="dsv4_indexer_topk not built for the CPU")
# every implementation of the op, each with the marks that skip it where absent
IMPLS = ["reference", pytest.param("cpu", marks=[requires_cpu_ffi, needs_cpu_target]),
         pytest.param("cuda", marks=CUDA)]
Q_FORMATS = ["bf16", "mxfp4"]


def workload(seed, k=40):
    """Several requests, one short (fewer visible entries than k), padding
    and a token at position 0 (nothing visible)."""
    rng = np.random.default_rng(seed)
    st = make_state(rng, R=4, max_context=1024)
    st = with_random_blocks(rng, st, 4)
    slot = np.array([0, 2, -1, 1, 3, 0, 2, 1], np.int32)
    pos = np.array([1023, 700, 5, 90, 0, 511, 130, 3], np.int32)
    q, w = queries(rng, len(slot))
    return st, slot, pos, q, w, k
