"""flush. The CPU handler against independent numpy computations
(support/npq.py, float64 softmax pooling and epilogue): HCA entries of equal
scores are the mean and any chunking gives the same bits; CSA entries read
back through gather_topk and indexer keys read from the pool; two requests
interleaved in one batch; bad tokens dropped and counted. A wrong operand
that reaches the handler is named in its error; the pools are updated in
place under jit. Against Hugging Face's compressors: test_flush_golden.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax.errors import ErrorKind as EK

from support import npq, write_attrs
from support.cpu_ops import (FORMATS, csa_oracle, csa_params, errors, hca_params, meta_for,
                             new_state, quantized_compare, rng, setup, softmax_pool)
from support.inplace import check_in_place
from support.marks import cpu_target_built
from support.raw_ffi import call

pytestmark = cpu_target_built("dsv4_append")


# ---- HCA -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_flush_hca_constant_score_is_mean(fmt):
    """Equal scores: each HCA entry is the plain mean of its 128 kv rows."""
    st = new_state(fmt, blocks={2: [5, 9, 1]})
    cfg = st.config
    p = hca_params(const_score=True)
    n = 300                                             # windows 0, 1 close; 2 stays open
    kv = np.round(rng.standard_normal((n, 512)) * 16) / 16   # sums exact in fp32
    score = np.full((n, 512), 0.75, np.float32)
    slots, pos = np.full(n, 2, np.int32), np.arange(n, dtype=np.int32)
    st = D.flush(st, 2, meta_for(cfg, slots, pos), jnp.asarray(kv, jnp.float32),
                 jnp.asarray(score), p, impl="cpu")
    assert errors(st).sum() == 0
    out, count = D.gather_all(st, 2, jnp.array([2], jnp.int32), jnp.array([n], jnp.int32), 4,
                              impl="cpu", return_state=False)
    out, count = np.asarray(out.astype(jnp.float32)), np.asarray(count)
    assert count[0] == 2 and (out[0, 2:] == 0).all()
    pooled = kv[:256].reshape(2, 128, 512).mean(1)
    want = npq.epilogue64(pooled, np.asarray(p.norm), np.asarray(p.inv_freq), np.array([0, 128]))
    quantized_compare(out[0, :2], want, fmt)
    # the open window's accumulator holds 44 tokens: max = score, sum = 44
    comp = np.asarray(st.hca.comp)[0, 2, 0]
    assert (comp[0] == 0.75).all() and (comp[1] == 44).all()
    np.testing.assert_allclose(comp[2], kv[256:].sum(0), rtol=1e-6, atol=1e-6)


def test_flush_hca_chunking_invariant_and_softmax():
    """Any chunking across calls gives the same pool bits; values match a
    float64 two-pass softmax through the epilogue."""
    n = 256
    p = hca_params()
    kv = rng.standard_normal((n, 512)).astype(np.float32)
    score = rng.normal(0, 2, (n, 512)).astype(np.float32)
    results = []
    for cuts in ([n], [1, 37, 64, 3, 100, 51], [128, 128]):
        st = new_state("ds_fp8", blocks={0: [3, 4]})
        cfg = st.config
        start = 0
        for c in cuts:
            sl = slice(start, start + c)
            st = D.flush(st, 2, meta_for(cfg, np.zeros(c, np.int32), np.arange(start, start + c, dtype=np.int32)),
                         jnp.asarray(kv[sl]), jnp.asarray(score[sl]), p, impl="cpu")
            start += c
        results.append([np.asarray(x).view(np.uint8) for x in jax.tree_util.tree_leaves(st.hca.kv)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)
    out, count = D.gather_all(st, 2, jnp.array([0], jnp.int32), jnp.array([n], jnp.int32), 2, impl="cpu", return_state=False)
    out = np.asarray(out.astype(jnp.float32))[0]
    z = score + np.asarray(p.ape)[np.arange(n) % 128]
    pooled = np.stack([softmax_pool(z[i * 128:(i + 1) * 128], kv[i * 128:(i + 1) * 128]) for i in range(2)])
    want = npq.epilogue64(pooled, np.asarray(p.norm), np.asarray(p.inv_freq), np.array([0, 128]))
    quantized_compare(out, want, "ds_fp8")


def test_flush_bad_tokens_dropped():
    p = hca_params()
    n = 128
    kv = rng.standard_normal((n, 512)).astype(np.float32)
    score = rng.normal(0, 1, (n, 512)).astype(np.float32)
    st0 = new_state(blocks={0: [3]})           # slot 1 has no block
    cfg = st0.config
    good = D.flush(st0, 2, meta_for(cfg, np.zeros(n, np.int32), np.arange(n, dtype=np.int32)),
                   jnp.asarray(kv), jnp.asarray(score), p, impl="cpu")
    # the same tokens with bad rows mixed in; slot 0's two bad rows come
    # after its good ones (its rows 128 and 129: expected positions past
    # window 0, closing nothing), the other slots' in the middle
    slots = np.r_[np.zeros(n), [-1, 9, 1, 0, 0]].astype(np.int32)
    pos = np.r_[np.arange(n), [5, 5, 5, -1, 600]].astype(np.int32)
    kv2 = np.r_[kv, rng.standard_normal((5, 512))].astype(np.float32)
    sc2 = np.r_[score, rng.standard_normal((5, 512))].astype(np.float32)
    perm = np.r_[np.arange(60), n + np.arange(3), np.arange(60, n), n + np.arange(3, 5)]
    bad = D.flush(st0, 2, meta_for(cfg, slots[perm], pos[perm]), jnp.asarray(kv2[perm]),
                  jnp.asarray(sc2[perm]), p, impl="cpu")
    e = errors(bad)
    assert e[EK.BAD_SLOT] == 1 and e[EK.MISSING_BLOCK] == 1 and e[EK.BAD_POSITION] == 2
    assert e.sum() == 4
    for a, b in zip(jax.tree_util.tree_leaves(good.hca), jax.tree_util.tree_leaves(bad.hca)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# ---- CSA -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["ds_fp8", "bf16"])
def test_flush_csa_and_gather_topk(fmt):
    n = 150                                     # 37 entries; token 148, 149 stay open
    st = new_state(fmt, blocks={1: [7, 2]})
    cfg = st.config
    p = csa_params()
    kv = rng.standard_normal((n, 1024)).astype(np.float32)
    score = rng.normal(0, 2, (n, 1024)).astype(np.float32)
    ikv = rng.standard_normal((n, 256)).astype(np.float32)
    iscore = rng.normal(0, 2, (n, 256)).astype(np.float32)
    start = 0
    for c in (5, 1, 1, 1, 64, 78):              # prefill chunk, decode steps, chunks
        sl = slice(start, start + c)
        st = D.flush(st, 1, meta_for(cfg, np.full(c, 1, np.int32), np.arange(start, start + c, dtype=np.int32)),
                     jnp.asarray(kv[sl]), jnp.asarray(score[sl]), p,
                     index_kv=jnp.asarray(ikv[sl]), index_score=jnp.asarray(iscore[sl]), impl="cpu")
        start += c
    assert errors(st).sum() == 0
    E = n // 4
    pos = np.arange(E) * 4
    want = npq.epilogue64(csa_oracle(kv, score, np.asarray(p.ape), 512),
                          np.asarray(p.norm), np.asarray(p.inv_freq), pos)
    # query at position n-1 sees all E entries; ask for them in a shuffled order
    order = rng.permutation(E)
    idx = np.r_[order, [-1, E, -5]].astype(np.int32)[None]
    out, valid = D.gather_topk(st, 1, jnp.array([1], jnp.int32), jnp.array([n - 1], jnp.int32),
                               jnp.asarray(idx), impl="cpu", return_state=False)
    out, valid = np.asarray(out.astype(jnp.float32))[0], np.asarray(valid)[0]
    np.testing.assert_array_equal(valid, np.r_[np.ones(E, bool), [False] * 3])
    assert (out[E:] == 0).all()
    quantized_compare(out[:E], want[order], fmt)
    # indexer keys: entry i in block_table[1, i // 32], row i % 32 (layer 1 -> CSA index 0)
    blocks = np.array([7, 2])[np.arange(E) // 32]
    packed = np.asarray(st.csa.index.packed)[0, blocks, np.arange(E) % 32]
    iscale = np.asarray(st.csa.index.scale)[0, blocks, np.arange(E) % 32]
    keys = npq.unpack_mxfp4(packed, iscale)
    iwant = npq.index_key64(csa_oracle(ikv, iscore, np.asarray(p.index.ape), 128),
                            np.asarray(p.index.norm), np.asarray(p.index.inv_freq), pos)
    wq, ws = npq.mxfp4_roundtrip(iwant)
    npq.assert_within_one_code(keys, wq, ws, rel=0.5, sub=0.5, min_exact=0.97)


def test_flush_csa_requests_interleaved_in_one_batch():
    """Two requests whose tokens share calls (rows interleaved, different
    chunkings) leave the same pool bytes as each request flushed alone."""
    p = csa_params()
    n = {0: 70, 3: 45}
    data = {s: [rng.standard_normal((n[s], w)).astype(np.float32) for w in (1024, 1024, 256, 256)]
            for s in n}
    blocks = {0: [5, 1, 6], 3: [2, 7]}

    def flush_rows(st, rows):
        """rows: list of (slot, pos) flushed in one call, in that order."""
        slots = np.array([r[0] for r in rows], np.int32)
        pos = np.array([r[1] for r in rows], np.int32)
        arrs = [np.stack([data[s][k][q] for s, q in rows]) for k in range(4)]
        return D.flush(st, 3, meta_for(st.config, slots, pos), jnp.asarray(arrs[0]), jnp.asarray(arrs[1]),
                       p, index_kv=jnp.asarray(arrs[2]), index_score=jnp.asarray(arrs[3]), impl="cpu")

    alone = new_state(blocks=blocks)
    for s in n:
        alone = flush_rows(alone, [(s, q) for q in range(n[s])])
    mixed = new_state(blocks=blocks)
    nxt = {0: 0, 3: 0}
    for sizes in [(9, 1), (1, 1), (13, 20), (0, 3), (47, 20)]:
        rows = []
        for s, k in zip(n, sizes):
            rows += [(s, q) for q in range(nxt[s], nxt[s] + k)]
            nxt[s] += k
        order = rng.permutation(len(rows))
        # keep each request's own rows in increasing position order
        by_slot = {s: iter([r for r in rows if r[0] == s]) for s in n}
        rows = [next(by_slot[rows[i][0]]) for i in order]
        mixed = flush_rows(mixed, rows)
    assert nxt == n
    assert errors(mixed).sum() == 0
    for a, b in zip(jax.tree_util.tree_leaves(alone.csa), jax.tree_util.tree_leaves(mixed.csa)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    # and something was written for both requests (layer 3 = CSA index 1)
    nope = np.asarray(alone.csa.kv.nope)[1].view(np.uint8)
    assert nope[5, :17].any() and nope[2, :11].any() and not nope[2, 11:].any()


# ---- operands that reach the CPU handler -----------------------------------------------
def hca_flush_args(st, ape_rows=128, kv_dtype=jnp.float32):
    T = 2
    aliased = [st.hca.comp, st.errors, *jax.tree_util.tree_leaves(st.hca.kv)]
    meta = jnp.concatenate([jnp.zeros(T, jnp.int32), jnp.arange(T, dtype=jnp.int32)])
    args = [jnp.int32(0), meta, jnp.zeros((T, 512), kv_dtype), jnp.zeros((T, 512), jnp.float32),
            jnp.zeros((ape_rows, 512), jnp.float32), jnp.ones(512, jnp.float32),
            jnp.ones(32, jnp.float32), st.block_table, *aliased]
    return args, aliased


def test_flush_hca_bad_ape(st):
    args, aliased = hca_flush_args(st, ape_rows=4)
    with pytest.raises(Exception, match=r"params.ape: expected shape \[128, 512\], got \[4, 512\]"):
        jax.block_until_ready(call("dsv4_flush_hca", args, aliased,
                                   {8 + i: i for i in range(len(aliased))}, kv_format=0, max_context=256,
                                   max_rows_per_slot=0))


def test_flush_hca_bf16_projection_rejected(st):
    args, aliased = hca_flush_args(st, kv_dtype=jnp.bfloat16)
    with pytest.raises(Exception, match=r"kv: expected dtype float32, got bfloat16"):
        jax.block_until_ready(call("dsv4_flush_hca", args, aliased,
                                   {8 + i: i for i in range(len(aliased))}, kv_format=0, max_context=256,
                                   max_rows_per_slot=0))


# The attributes arrive as one struct (ffi/include/dsv4/attrs.h): each member
# checked by name (kv_format an enum the decoding does not bound), and the call
# must hold exactly its members. Append's test takes the same cases.
@pytest.mark.parametrize("change, pattern", write_attrs.BAD)
def test_flush_bad_attributes_rejected(st, change, pattern):
    args, aliased = hca_flush_args(st)
    with pytest.raises(Exception, match=pattern):
        jax.block_until_ready(call("dsv4_flush_hca", args, aliased,
                                   {8 + i: i for i in range(len(aliased))},
                                   **write_attrs.changed(change)))


@pytest.mark.parametrize("bad", [-1, True, 2.0])
def test_step_meta_row_bound_checked(bad):
    with pytest.raises(ValueError, match=r"max_rows_per_slot: expected an int >= 0"):
        D.StepMeta.build(token_slot=[0], token_pos=[0], lengths=[1], max_rows_per_slot=bad)


def test_flush_csa_missing_indexer_state(st):
    T = 2
    z = lambda *s: jnp.zeros(s, jnp.float32)
    # icomp left out: every later aliased operand shifts by one
    aliased = [st.csa.comp, st.csa.index.packed, st.csa.index.scale, st.errors,
               *jax.tree_util.tree_leaves(st.csa.kv)]
    meta = jnp.concatenate([jnp.zeros(T, jnp.int32), jnp.arange(T, dtype=jnp.int32)])
    args = [jnp.int32(0), meta, z(T, 1024), z(T, 1024), z(4, 1024), z(512), z(32), z(T, 256), z(T, 256), z(4, 256), z(128), z(32), st.block_table,
            *aliased]
    with pytest.raises(Exception, match=r"csa.icomp: expected dtype float32, got uint8"):
        jax.block_until_ready(call("dsv4_flush_csa", args, aliased,
                                   {13 + i: i for i in range(len(aliased))}, kv_format=0, max_context=256,
                                   max_rows_per_slot=0))


# ---- in place --------------------------------------------------------------------------
def test_flush_in_place():
    st, meta = setup()
    p = D.CompressorParams(jnp.zeros((4, 1024)), jnp.ones(512), jnp.ones(32),
                           D.CompressorParams(jnp.zeros((4, 256)), jnp.ones(128), jnp.ones(32)))
    z = lambda *s: jnp.ones(s, jnp.float32)
    check_in_place(lambda s, m, a, b, c, d: D.flush(s, 1, m, a, b, p, index_kv=c, index_score=d, impl="cpu"),
                   st, (meta, z(2, 1024), z(2, 1024), z(2, 256), z(2, 256)),
                   lambda s: (s.csa, s.errors))
    st, meta = setup()
    ph = D.CompressorParams(jnp.zeros((128, 512)), jnp.ones(512), jnp.ones(32))
    check_in_place(lambda s, m, a, b: D.flush(s, 2, m, a, b, ph, impl="cpu"),
                   st, (meta, z(2, 512), z(2, 512)), lambda s: (s.hca, s.errors))
