"""indexer_topk at its edges, on every implementation: positions at and past
max_context (BAD_POSITION) next to good tokens, whose rows are checked
against a float64 oracle of the score."""
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax import _ffi
from dsv4_jax.errors import ErrorKind as EK

from support import npq
from support.marks import CUDA, requires_cpu_ffi

LAYER = 3                        # a CSA layer of the tiny preset (SWA, CSA, HCA, CSA)
needs_cpu_target = pytest.mark.skipif(not _ffi.has_target("cpu", "dsv4_indexer_topk"),
                                      reason="dsv4_indexer_topk not built for the CPU")
IMPLS = ["reference", pytest.param("cpu", marks=[requires_cpu_ffi, needs_cpu_target]),
         pytest.param("cuda", marks=CUDA)]
Q_FORMATS = ["bf16", "mxfp4"]


def keyed_state(rng, R, max_context, blocks):
    """Tiny state with random MXFP4 indexer keys in every CSA block (scale
    bytes near 127) and block table rows `blocks` (slot -> physical ids)."""
    cfg = D.CacheConfig.tiny(max_requests=R, max_context=max_context)
    st = D.init_state(cfg)
    Lc, N = st.csa.index.packed.shape[:2]
    packed = rng.integers(0, 256, (Lc, N, 32, 64), dtype=np.uint8)
    scale = rng.integers(119, 132, (Lc, N, 32, 4), dtype=np.uint8)
    bt = np.full((R, cfg.max_blocks_per_request), -1, np.int32)
    for s, phys in blocks.items():
        bt[s, :len(phys)] = phys
    keys = D.IndexerKeys(jnp.asarray(packed), jnp.asarray(scale.view(ml_dtypes.float8_e8m0fnu)))
    return dataclasses.replace(st, block_table=jnp.asarray(bt),
                               csa=dataclasses.replace(st.csa, index=keys))


def queries(rng, T):
    q = rng.standard_normal((T, 64, 128)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((T, 64)).astype(np.float32)
    return q, w


def run(st, slot, pos, q, w, k, impl, q_format):
    f = jax.jit(lambda st, s, p, q, w: D.indexer_topk(st, LAYER, s, p, q, w, k, impl=impl,
                                                      q_format=q_format, return_state=True))
    got, st2 = f(st, jnp.asarray(slot, jnp.int32), jnp.asarray(pos, jnp.int32),
                 jnp.asarray(q), jnp.asarray(w))
    return np.asarray(got), {EK(i): int(v) for i, v in enumerate(np.asarray(st2.errors)) if v}


def oracle_scores(st, slot, pos, q, w, q_format):
    """float64 scores of the entries a good token sees (NaN where the
    entry's block is missing), from npq's independent MXFP4 decoder."""
    cfg = st.config
    n = min((int(pos) + 1) // 4, cfg.max_blocks_per_request * 32)
    kind = cfg.kind_index(LAYER, "csa")
    i = np.arange(n)
    block = np.asarray(st.block_table)[slot][i // 32]
    ok = (block >= 0) & (block < cfg.num_blocks)
    b = np.where(ok, block, 0)
    packed = np.asarray(st.csa.index.packed)[kind][b, i % 32]
    scale = np.asarray(st.csa.index.scale)[kind][b, i % 32]
    keys = npq.unpack_mxfp4(packed, scale).astype(np.float64)
    qv = np.asarray(q, np.float32)
    if q_format == "mxfp4":
        qv = npq.mxfp4_roundtrip(qv)[0]
    s = np.maximum(keys @ qv.astype(np.float64).T, 0) @ np.asarray(w, np.float64)
    return np.where(ok, s, np.nan)


def assert_top_k(row, scores, k):
    """`row` holds the k best entries by the float64 score (fp32 rounding
    aside: a returned entry is at most 1e-4 of the scale below the best left
    out), best first, then -1."""
    cand = np.flatnonzero(~np.isnan(scores))
    m = min(k, len(cand))
    assert np.all(row[m:] == -1) and len(set(row[:m])) == m and set(row[:m]) <= set(cand)
    if m == 0:
        return
    tol = 1e-4 * np.max(np.abs(scores[cand]))
    got = scores[row[:m]]
    assert np.all(np.diff(got) <= tol)                           # best first
    rest = np.setdiff1d(cand, row[:m])
    if len(rest):
        assert got.min() >= scores[rest].max() - tol


# ---- positions ------------------------------------------------------------------------
@pytest.mark.parametrize("q_format", Q_FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
def test_positions_at_and_past_max_context(impl, q_format):
    """pos max_context - 1 sees the whole table; max_context and 2^31 - 1
    (where (pos + 1) // 4 would overflow int32) are BAD_POSITION, row -1,
    as for gather_topk, append and flush."""
    rng = np.random.default_rng(31)
    st = keyed_state(rng, R=2, max_context=512, blocks={0: [3, 1, 0, 2]})
    top = st.config.max_context
    slot = np.int32([0, 0, 0, 0])
    pos = np.int32([top - 1, top, 2 ** 31 - 1, 99])
    q, w = queries(rng, 4)
    k = 200                                      # more than the 128 entries of the table
    got, errs = run(st, slot, pos, q, w, k, impl, q_format)
    assert errs == {EK.BAD_POSITION: 2}
    assert np.all(got[1:3] == -1)
    assert sorted(got[0][:128]) == list(range(128)) and np.all(got[0][128:] == -1)
    for t in (0, 3):
        assert_top_k(got[t], oracle_scores(st, slot[t], pos[t], q[t], w[t], q_format), k)
