"""flush reproduces the compressor entries of an independent implementation
(Hugging Face transformers DeepseekV4, tests/data/README.md), whole sequence
and chunked, in the bf16 KV format: on every implementation through the
public ops (apply_step + flush, read back by gather_topk / gather_all and
from the indexer pool), and through the CPU handler with blocks placed by
hand (window boundaries, the CSA overlap, ape indexing, RMSNorm and RoPE
position).

That implementation stores float entries without the official bf16 rounding
points, so entries agree to ~1e-2 of the row's max magnitude. Indexer keys
are stored as MXFP4 after the Hadamard transform: they are compared in the
Hadamard domain within one MXFP4 rounding step, and the pre-Hadamard keys of
the numpy oracle (which the reference matches byte for byte, see
properties/test_chunking.py) are compared with the golden ones at 1e-2.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax import config as C
from dsv4_jax.reference import quant as Q

from support import DATA, npq
from support import oracle as O
from support.harness import FlipStats, compare_index, raw
from support.marks import cpu_target_built, every_impl

GOLDEN = DATA / "hf_dsv4_compressor.npz"
TOL = 1e-2


@pytest.fixture(scope="module")
def g():
    return dict(np.load(GOLDEN))


def chunk_sizes(total):
    """The golden set's chunk pattern 37, 1, 1, 1, 64, 3, repeated."""
    pattern, out = [37, 1, 1, 1, 64, 3], []
    while sum(out) < total:
        out.append(min(pattern[len(out) % len(pattern)], total - sum(out)))
    return out


def params(g, p, index=None):
    return D.CompressorParams(jnp.asarray(g[f"{p}_ape"]), jnp.asarray(g[f"{p}_norm"]),
                              jnp.asarray(g["inv_freq"]), index)


def proj(g, x, p):
    x = g[x][0].astype(np.float64)
    return ((x @ g[f"{p}_wkv"].T).astype(np.float32), (x @ g[f"{p}_wgate"].T).astype(np.float32))


@functools.partial(jax.jit, static_argnames=("layer",), donate_argnames=("state",))
def _flush(state, meta, kv, score, prm, ikv, isc, *, layer):
    state = D.apply_step(state, meta)
    return D.flush(state, layer, meta, kv, score, prm, index_kv=ikv, index_score=isc)


def run(layer, chunks, kv, score, prm, ikv=None, isc=None):
    """Feed one request's projections in `chunks` through apply_step + flush."""
    cfg = C.CacheConfig.tiny(kv_format="bf16")
    state = D.init_state(cfg)
    mgr = D.CacheManager(cfg)
    rid = mgr.admit()
    start = 0
    for n in chunks:
        meta = mgr.prepare_step({rid: n}, min_tokens=64)
        T = meta.num_tokens
        rows = slice(0, n)

        def pad(a):
            if a is None:
                return None
            out = np.random.default_rng(n).standard_normal((T, a.shape[1])).astype(np.float32)
            out[rows] = a[start:start + n]
            return out
        state = _flush(state, meta, pad(kv), pad(score), prm, pad(ikv), pad(isc), layer=layer)
        start += n
    assert not np.asarray(state.errors).any()
    return state, mgr.slot_of(rid), mgr.length_of(rid)


def assert_rows_close(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.abs(want).max(axis=-1, keepdims=True)
    err = np.abs(got - want) / scale
    assert err.max() < TOL, f"{what}: worst row error {err.max():.3g} of the row max"


@every_impl
def test_inv_freq_is_the_official_yarn(g):
    np.testing.assert_array_equal(D.yarn_inv_freq().view(np.uint32), g["inv_freq"].view(np.uint32))


@every_impl
@pytest.mark.parametrize("mode", ["whole", "chunked"])
def test_csa_entries(g, mode):
    kv, score = proj(g, "csa_x", "csa_main")
    ikv, isc = proj(g, "csa_x", "csa_idx")
    S = kv.shape[0]
    prm = params(g, "csa_main", params(g, "csa_idx"))
    chunks = [S] if mode == "whole" else chunk_sizes(S)
    state, slot, length = run(1, chunks, kv, score, prm, ikv, isc)
    suffix = "_expected" if mode == "whole" else "_expected_chunked"
    n = S // 4

    # main entries through gather_topk: a query at the last position sees all
    idx = jnp.arange(n, dtype=jnp.int32)[None]
    out, valid = D.gather_topk(state, 1, jnp.int32([slot]), jnp.int32([length - 1]), idx, return_state=False)
    assert np.asarray(valid).all()
    assert_rows_close(np.asarray(out[0], np.float32), g["csa_main" + suffix][0], "csa_main")

    # indexer keys: read the pool (MXFP4 after Hadamard)
    blocks = np.asarray(state.block_table)[slot]
    e = np.arange(n)
    packed = np.asarray(state.csa.index.packed)[0, blocks[e // 32], e % 32]
    scale = np.asarray(state.csa.index.scale)[0, blocks[e // 32], e % 32]
    deq = np.asarray(Q.dequantize_mxfp4(jnp.asarray(packed), jnp.asarray(scale)), np.float64)
    golden = g["csa_idx" + suffix][0].astype(np.float64)
    golden_h = golden @ (O.hadamard_matrix() / np.sqrt(128))
    s = np.asarray(Q.e8m0_to_f32(jnp.asarray(scale)), np.float64).repeat(32, axis=-1)
    bound = s + TOL * np.abs(golden_h).max(axis=-1, keepdims=True)
    worst = (np.abs(deq - golden_h) / bound).max()
    assert worst <= 1, f"indexer keys beyond one MXFP4 step of the golden keys ({worst:.3g})"
    # undoing the Hadamard (H is symmetric and orthogonal) recovers the keys
    # to the MXFP4 resolution
    undone = deq @ (O.hadamard_matrix() / np.sqrt(128))
    rel = np.linalg.norm(undone - golden, axis=-1) / np.linalg.norm(golden, axis=-1)
    assert rel.max() < 0.2, rel.max()

    # the oracle's pre-Hadamard keys agree with the golden ones at 1e-2, and
    # the stored bytes are the oracle's up to one-code flips
    keys = O.csa_keys(ikv, isc, g["csa_idx_ape"], g["csa_idx_norm"], g["inv_freq"])
    assert_rows_close(keys.astype(np.float32), golden, "csa_idx (oracle, pre-Hadamard)")
    main = O.csa_keys(kv, score, g["csa_main_ape"], g["csa_main_norm"], g["inv_freq"])
    assert_rows_close(main.astype(np.float32), g["csa_main" + suffix][0], "csa_main (oracle)")
    stats = FlipStats()
    compare_index(stats, {"packed": packed, "scale": raw(scale)},
                  O.encode_mxfp4(O.index_keys(keys)), " golden indexer keys")
    print(f"\n[golden {mode}] indexer keys vs oracle: {stats.summary()}")
    assert stats.rate() < 1e-3, stats


@every_impl
@pytest.mark.parametrize("mode", ["whole", "chunked"])
def test_hca_entries(g, mode):
    kv, score = proj(g, "hca_x", "hca_main")
    S = kv.shape[0]
    chunks = [S] if mode == "whole" else chunk_sizes(S)
    state, slot, length = run(2, chunks, kv, score, params(g, "hca_main"))
    suffix = "_expected" if mode == "whole" else "_expected_chunked"
    out, count = D.gather_all(state, 2, jnp.int32([slot]), jnp.int32([length]), 4, return_state=False)
    assert int(count[0]) == S // 128
    assert_rows_close(np.asarray(out[0, :S // 128], np.float32), g["hca_main" + suffix][0],
                      "hca_main")
    assert not np.asarray(out[0, S // 128:], np.float32).any()


# ---- the CPU handler, blocks placed by hand --------------------------------------------
def state_with_blocks(blocks):
    cfg = D.CacheConfig.tiny(max_requests=2, max_context=512, kv_format="bf16")
    st = D.init_state(cfg)
    bt = np.full((2, cfg.max_blocks_per_request), -1, np.int32)
    bt[1, :len(blocks)] = blocks
    return dataclasses.replace(st, block_table=jnp.asarray(bt))


def proj_f32(g, p, x):
    return (x @ g[f"{p}_wkv"].T).astype(np.float32), (x @ g[f"{p}_wgate"].T).astype(np.float32)


def run_chunks(st, layer, n, chunks, fn):
    start = 0
    for c in chunks:
        c = min(c, n - start)
        if c <= 0:
            break
        meta = D.StepMeta.build(token_slot=np.ones(c, np.int32),
                                token_pos=np.arange(start, start + c, dtype=np.int32),
                                lengths=np.zeros(2, np.int32))
        st = fn(st, layer, meta, slice(start, start + c))
        start += c
    assert start == n
    return st


def close_rows(got, want):
    tol = 1e-2 * np.abs(want).max(-1, keepdims=True)
    assert (np.abs(got - want) <= tol).all(), np.abs(got - want).max()


@cpu_target_built("dsv4_flush_csa")
@pytest.mark.skipif(not GOLDEN.exists(), reason="golden data missing")
@pytest.mark.parametrize("chunks", [[10 ** 6], [37, 1, 1, 1, 64, 3, 37, 200]])
def test_csa_matches_hf(g, chunks):
    x = g["csa_x"][0]
    n = len(x)
    kv, score = proj_f32(g, "csa_main", x)
    ikv, iscore = proj_f32(g, "csa_idx", x)
    p = params(g, "csa_main", params(g, "csa_idx"))
    blocks = [3, 0, 2]
    st = state_with_blocks(blocks)

    def step(st, layer, meta, sl):
        return D.flush(st, layer, meta, jnp.asarray(kv[sl]), jnp.asarray(score[sl]), p,
                       index_kv=jnp.asarray(ikv[sl]), index_score=jnp.asarray(iscore[sl]), impl="cpu")

    st = run_chunks(st, 1, n, chunks, step)
    E = n // 4
    out, valid = D.gather_topk(st, 1, jnp.array([1], jnp.int32), jnp.array([n - 1], jnp.int32),
                               jnp.arange(E, dtype=jnp.int32)[None], impl="cpu", return_state=False)
    assert np.asarray(valid).all()
    close_rows(np.asarray(out.astype(jnp.float32))[0], g["csa_main_expected"][0])
    # indexer keys: MXFP4 of H @ key; compare with H @ golden key within a code step
    i = np.arange(E)
    bt = np.array(blocks)[i // 32]
    keys = npq.unpack_mxfp4(np.asarray(st.csa.index.packed)[0, bt, i % 32],
                            np.asarray(st.csa.index.scale)[0, bt, i % 32])
    want = g["csa_idx_expected"][0].astype(np.float64) @ npq.sylvester(128).T * 128 ** -0.5
    _, scale = npq.mxfp4_roundtrip(want.astype(np.float32))
    assert (np.abs(keys - want) <= scale * 1.0 + 2e-2 * np.abs(want).max(-1, keepdims=True)).all()


@cpu_target_built("dsv4_flush_csa")
@pytest.mark.skipif(not GOLDEN.exists(), reason="golden data missing")
@pytest.mark.parametrize("chunks", [[10 ** 6], [37, 1, 1, 1, 64, 3, 37, 240]])
def test_hca_matches_hf(g, chunks):
    x = g["hca_x"][0]
    n = len(x)
    kv, score = proj_f32(g, "hca_main", x)
    p = params(g, "hca_main")
    st = state_with_blocks([2, 1, 3])

    def step(st, layer, meta, sl):
        return D.flush(st, layer, meta, jnp.asarray(kv[sl]), jnp.asarray(score[sl]), p, impl="cpu")

    st = run_chunks(st, 2, n, chunks, step)
    out, count = D.gather_all(st, 2, jnp.array([1], jnp.int32), jnp.array([n], jnp.int32), 3, impl="cpu", return_state=False)
    assert int(count[0]) == 3
    close_rows(np.asarray(out.astype(jnp.float32))[0], g["hca_main_expected"][0])
