"""Sanity tests of the CPU FFI path of every op, each against an independent
numpy computation (tests/support/npq.py) rather than the jnp reference."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax import _ffi
from dsv4_jax.errors import ErrorKind as EK

from support import npq

pytestmark = pytest.mark.skipif(not _ffi.has_target("cpu", "dsv4_append"),
                                reason="CPU FFI module not built")
FORMATS = ("ds_fp8", "fp8_token", "bf16")
rng = np.random.default_rng(7)


def new_state(fmt="ds_fp8", R=4, max_context=512, blocks=None):
    """A fresh tiny state; `blocks` maps slot -> physical blocks in order."""
    cfg = D.CacheConfig.tiny(max_requests=R, max_context=max_context, kv_format=fmt)
    st = D.init_state(cfg)
    bt = np.full((R, cfg.max_blocks_per_request), -1, np.int32)
    for s, phys in (blocks or {}).items():
        bt[s, :len(phys)] = phys
    return dataclasses.replace(st, block_table=jnp.asarray(bt))


def meta_for(cfg, slots, pos):
    return D.StepMeta.build(token_slot=slots, token_pos=pos,
                            lengths=np.zeros(cfg.max_requests, np.int32))


def errors(st):
    return np.asarray(st.errors)


def rand_bf16(*shape, scale=1.0):
    return npq.bf16(rng.standard_normal(shape) * scale)


def entry_values(kv_pool, idx):
    """Host-side decode of stored entries (for checking untouched rows)."""
    return [np.asarray(x)[idx] for x in jax.tree_util.tree_leaves(kv_pool)]


# ---- append + gather_window ---------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_append_then_gather_window_roundtrip(fmt):
    st = new_state(fmt)
    cfg = st.config
    # slot 1: positions 0..9; slot 3: a 200-token chunk 0..199 (only 72..199 stay)
    slots = np.r_[np.full(10, 1), np.full(200, 3)].astype(np.int32)
    pos = np.r_[np.arange(10), np.arange(200)].astype(np.int32)
    kv = rand_bf16(len(slots), 512, scale=3.0)
    kv[5, :64] = npq.bf16(kv[5, :64] * 1e-6)   # a tile below the amax floor
    layer = 2
    st = D.append(st, layer, meta_for(cfg, slots, pos), jnp.asarray(kv, jnp.bfloat16), impl="cpu")
    out, wpos = D.gather_window(st, layer, jnp.array([1, 3, 0, -1], jnp.int32), impl="cpu")
    out, wpos = np.asarray(out.astype(jnp.float32)), np.asarray(wpos)
    assert errors(st).sum() == 0
    # slot 1: ring r holds position r for r < 10
    np.testing.assert_array_equal(wpos[0], np.r_[np.arange(10), np.full(118, -1)])
    np.testing.assert_array_equal(out[0, :10], npq.entry_roundtrip(kv[:10], fmt))
    assert (out[0, 10:] == 0).all()
    # slot 3: ring r holds the largest position = r (mod 128) of 0..199
    want_pos = np.array([r + 128 if r + 128 < 200 else r for r in range(128)])
    np.testing.assert_array_equal(wpos[1], want_pos)
    np.testing.assert_array_equal(out[1], npq.entry_roundtrip(kv[10 + want_pos], fmt))
    # untouched slot and padding slot: empty
    assert (wpos[2:] == -1).all() and (out[2:] == 0).all()
    # other layers untouched
    for leaf, leaf0 in zip(jax.tree_util.tree_leaves(st.swa.kv),
                           jax.tree_util.tree_leaves(new_state(fmt).swa.kv)):
        a, b = np.asarray(leaf), np.asarray(leaf0)
        np.testing.assert_array_equal(np.delete(a, layer, 0).view(np.uint8),
                                      np.delete(b, layer, 0).view(np.uint8))


def test_append_bad_tokens_dropped_and_counted():
    st = new_state()
    cfg = st.config
    slots = np.array([0, -1, 4, 7, 0, 0], np.int32)
    pos = np.array([0, 1, 1, 2, -3, 512], np.int32)     # 512 = max_context
    kv = rand_bf16(6, 512)
    st = D.append(st, 0, meta_for(cfg, slots, pos), jnp.asarray(kv, jnp.bfloat16), impl="cpu")
    e = errors(st)
    assert e[EK.BAD_SLOT] == 2 and e[EK.BAD_POSITION] == 2 and e.sum() == 4
    _, wpos = D.gather_window(st, 0, jnp.arange(4, dtype=jnp.int32), impl="cpu")
    wpos = np.asarray(wpos)
    assert wpos[0, 0] == 0 and (wpos[0, 1:] == -1).all() and (wpos[1:] == -1).all()


def test_append_traced_bad_layer():
    st = new_state()
    cfg = st.config
    m = meta_for(cfg, np.array([0], np.int32), np.array([0], np.int32))
    kv = jnp.asarray(rand_bf16(1, 512), jnp.bfloat16)
    f = jax.jit(lambda s, l: D.append(s, l, m, kv, impl="cpu"))
    st2 = f(st, jnp.int32(9))
    assert errors(st2)[EK.BAD_LAYER] == 1
    assert (np.asarray(st2.swa.pos) == -1).all()


# ---- flush HCA -----------------------------------------------------------------------------

def hca_params(const_score=False):
    inv_freq = (1.0 / 160000.0 ** (np.arange(32) / 32)).astype(np.float32)
    ape = np.zeros((128, 512), np.float32) if const_score else \
        rng.normal(0, 0.5, (128, 512)).astype(np.float32)
    return D.CompressorParams(jnp.asarray(ape), jnp.asarray(rng.uniform(0.5, 1.5, 512).astype(np.float32)),
                              jnp.asarray(inv_freq))


def quantized_compare(got, want_rows, fmt):
    """got: gathered rows; want_rows: float64-epilogue oracle rows (bf16-valued)."""
    want = npq.entry_roundtrip(want_rows, fmt)
    if fmt == "ds_fp8":
        scale = npq.ds_fp8_roundtrip(want_rows[..., :448])[1]
    elif fmt == "fp8_token":
        scale = npq.fp8_token_roundtrip(want_rows[..., :448])[1]
    else:
        scale = np.zeros(want_rows[..., :448].shape)
    npq.assert_within_one_code(got[..., :448], want[..., :448], scale,
                               rel=2.0 ** -3 if fmt != "bf16" else 2.0 ** -7)
    # the RoPE channels are bf16 in every format
    npq.assert_within_one_code(got[..., 448:], want[..., 448:], 0 * want[..., 448:],
                               rel=2.0 ** -7, min_exact=0.9)


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
                              impl="cpu")
    out, count = np.asarray(out.astype(jnp.float32)), np.asarray(count)
    assert count[0] == 2 and (out[0, 2:] == 0).all()
    pooled = kv[:256].reshape(2, 128, 512).mean(1)
    want = npq.epilogue64(pooled, np.asarray(p.norm), np.asarray(p.inv_freq), np.array([0, 128]))
    quantized_compare(out[0, :2], want, fmt)
    # the open window's accumulator holds 44 tokens: max = score, sum = 44
    comp = np.asarray(st.hca.comp)[0, 2, 0]
    assert (comp[0] == 0.75).all() and (comp[1] == 44).all()
    np.testing.assert_allclose(comp[2], kv[256:].sum(0), rtol=1e-6, atol=1e-6)


def softmax_pool(z, v):
    """Per-channel softmax pooling over axis 0 in float64."""
    z, v = np.asarray(z, np.float64), np.asarray(v, np.float64)
    w = np.exp(z - z.max(0))
    return (w * v).sum(0) / w.sum(0)


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
    out, count = D.gather_all(st, 2, jnp.array([0], jnp.int32), jnp.array([n], jnp.int32), 2, impl="cpu")
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
    # the same tokens with bad rows mixed in
    slots = np.r_[np.zeros(n), [-1, 9, 1, 0, 0]].astype(np.int32)
    pos = np.r_[np.arange(n), [5, 5, 5, -1, 600]].astype(np.int32)
    kv2 = np.r_[kv, rng.standard_normal((5, 512))].astype(np.float32)
    sc2 = np.r_[score, rng.standard_normal((5, 512))].astype(np.float32)
    perm = np.r_[np.arange(60), n + np.arange(5), np.arange(60, n)]
    bad = D.flush(st0, 2, meta_for(cfg, slots[perm], pos[perm]), jnp.asarray(kv2[perm]),
                  jnp.asarray(sc2[perm]), p, impl="cpu")
    e = errors(bad)
    assert e[EK.BAD_SLOT] == 1 and e[EK.MISSING_BLOCK] == 1 and e[EK.BAD_POSITION] == 2
    assert e.sum() == 4
    for a, b in zip(jax.tree_util.tree_leaves(good.hca), jax.tree_util.tree_leaves(bad.hca)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# ---- flush CSA + gather_topk ----------------------------------------------------------------

def csa_params():
    inv_freq = (1.0 / 160000.0 ** (np.arange(32) / 32)).astype(np.float32)
    f = lambda *s: jnp.asarray(rng.normal(0, 0.5, s).astype(np.float32))
    idx = D.CompressorParams(f(4, 256), jnp.asarray(rng.uniform(0.5, 1.5, 128).astype(np.float32)),
                             jnp.asarray(inv_freq))
    return D.CompressorParams(f(4, 1024), jnp.asarray(rng.uniform(0.5, 1.5, 512).astype(np.float32)),
                              jnp.asarray(inv_freq), idx)


def csa_oracle(kv, score, ape, d, m=4):
    """Entries of a whole sequence: entry i pools the a half of window i-1 and
    the b half of window i (float64 two-pass softmax per channel)."""
    z = score + ape[np.arange(len(kv)) % m]
    out = []
    for i in range(len(kv) // m):
        zs = [z[i * m:(i + 1) * m, d:]]
        vs = [kv[i * m:(i + 1) * m, d:]]
        if i > 0:
            zs.insert(0, z[(i - 1) * m:i * m, :d])
            vs.insert(0, kv[(i - 1) * m:i * m, :d])
        out.append(softmax_pool(np.concatenate(zs), np.concatenate(vs)))
    return np.stack(out)


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


def test_gather_topk_error_rules():
    st = new_state(blocks={0: [4], 2: [-1]})
    cfg = st.config
    p = csa_params()
    n = 16
    mk = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    st = D.flush(st, 1, meta_for(cfg, np.zeros(n, np.int32), np.arange(n, dtype=np.int32)),
                 mk(n, 1024), mk(n, 1024), p, index_kv=mk(n, 256), index_score=mk(n, 256), impl="cpu")
    slots = jnp.array([0, 0, -1, 9, 2, 0], jnp.int32)
    pos = jnp.array([15, 6, 15, 15, 15, -2], jnp.int32)
    idx = jnp.array([[3, -1, 0], [1, 2, -7], [0, 1, 2], [0, 1, 2], [0, -1, -1], [0, 0, 0]], jnp.int32)
    out, valid, st2 = D.gather_topk(st, 1, slots, pos, idx, impl="cpu", return_state=True)
    valid, out = np.asarray(valid), np.asarray(out.astype(jnp.float32))
    # pos 15 sees entries 0..3; pos 6 sees 0..0 (entry 1 emitted at token 7)
    np.testing.assert_array_equal(valid, [[1, 0, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0],
                                          [0, 0, 0]])
    assert (out[~valid] == 0).all() and (np.abs(out[valid]).sum(-1) > 0).all()
    e = errors(st2)
    assert e[EK.BAD_INDEX] == 3 and e[EK.BAD_SLOT] == 1 and e[EK.MISSING_BLOCK] == 1
    assert e[EK.BAD_POSITION] == 1 and e.sum() == 6
    # the same entry read twice gives the same row
    out2, _ = D.gather_topk(st, 1, jnp.array([0], jnp.int32), jnp.array([15], jnp.int32),
                            jnp.array([[0]], jnp.int32), impl="cpu")
    np.testing.assert_array_equal(np.asarray(out2.astype(jnp.float32))[0, 0], out[0, 2])


def test_gather_all_error_rules():
    st = new_state(blocks={0: [1, 2], 1: [3, -1]})
    cfg = st.config
    p = hca_params()
    n = 256
    for s in (0, 1):
        st = D.flush(st, 2, meta_for(cfg, np.full(n, s, np.int32), np.arange(n, dtype=np.int32)),
                     jnp.asarray(rng.standard_normal((n, 512)).astype(np.float32)),
                     jnp.asarray(rng.standard_normal((n, 512)).astype(np.float32)), p, impl="cpu")
    e0 = errors(st)
    assert e0[EK.MISSING_BLOCK] == 128 and e0.sum() == 128     # slot 1's second block
    slots = jnp.array([0, 1, -1, 5, 0, 0, 0], jnp.int32)
    lengths = jnp.array([256, 256, 256, 10, -1, 600, 300], jnp.int32)
    out, count, st2 = D.gather_all(st, 2, slots, lengths, 2, impl="cpu", return_state=True)
    out, count = np.asarray(out.astype(jnp.float32)), np.asarray(count)
    np.testing.assert_array_equal(count, [2, 2, 0, 0, 0, 0, 2])
    e = errors(st2) - e0
    assert e[EK.MISSING_BLOCK] == 1 and e[EK.BAD_SLOT] == 1 and e[EK.BAD_LENGTH] == 2
    assert e.sum() == 4
    assert (np.abs(out[0]).sum(-1) > 0).all() and (np.abs(out[1, 0]).sum() > 0)
    assert (out[1, 1] == 0).all() and (out[2:6] == 0).all()
    np.testing.assert_array_equal(out[6], out[0])


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
