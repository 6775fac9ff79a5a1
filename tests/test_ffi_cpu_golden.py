"""CPU FFI flush against entries computed by an independent implementation
(Hugging Face transformers' DeepSeek-V4 compressors, tests/data/README.md):
window boundaries, the CSA overlap, ape indexing, RMSNorm and RoPE position.
Run in the bf16 KV format; tolerance 1e-2 of the row's max magnitude (the
official bf16 rounding points are absent from the golden float32 run)."""
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax import _ffi

from support import npq

DATA = pathlib.Path(__file__).parent / "data" / "hf_dsv4_compressor.npz"
pytestmark = [pytest.mark.skipif(not _ffi.has_target("cpu", "dsv4_flush_csa"),
                                 reason="CPU FFI module not built"),
              pytest.mark.skipif(not DATA.exists(), reason="golden data missing")]


@pytest.fixture(scope="module")
def g():
    return dict(np.load(DATA))


def state_with_blocks(blocks):
    cfg = D.CacheConfig.tiny(max_requests=2, max_context=512, kv_format="bf16")
    st = D.init_state(cfg)
    bt = np.full((2, cfg.max_blocks_per_request), -1, np.int32)
    bt[1, :len(blocks)] = blocks
    return dataclasses.replace(st, block_table=jnp.asarray(bt))


def params(g, p, index=None):
    return D.CompressorParams(jnp.asarray(g[f"{p}_ape"]), jnp.asarray(g[f"{p}_norm"]),
                              jnp.asarray(g["inv_freq"]), index)


def proj(g, p, x):
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


@pytest.mark.parametrize("chunks", [[10 ** 6], [37, 1, 1, 1, 64, 3, 37, 200]])
def test_csa_matches_hf(g, chunks):
    x = g["csa_x"][0]
    n = len(x)
    kv, score = proj(g, "csa_main", x)
    ikv, iscore = proj(g, "csa_idx", x)
    p = params(g, "csa_main", params(g, "csa_idx"))
    blocks = [3, 0, 2]
    st = state_with_blocks(blocks)

    def step(st, layer, meta, sl):
        return D.flush(st, layer, meta, jnp.asarray(kv[sl]), jnp.asarray(score[sl]), p,
                       index_kv=jnp.asarray(ikv[sl]), index_score=jnp.asarray(iscore[sl]), impl="cpu")

    st = run_chunks(st, 1, n, chunks, step)
    E = n // 4
    out, valid = D.gather_topk(st, 1, jnp.array([1], jnp.int32), jnp.array([n - 1], jnp.int32),
                               jnp.arange(E, dtype=jnp.int32)[None], impl="cpu")
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


@pytest.mark.parametrize("chunks", [[10 ** 6], [37, 1, 1, 1, 64, 3, 37, 240]])
def test_hca_matches_hf(g, chunks):
    x = g["hca_x"][0]
    n = len(x)
    kv, score = proj(g, "hca_main", x)
    p = params(g, "hca_main")
    st = state_with_blocks([2, 1, 3])

    def step(st, layer, meta, sl):
        return D.flush(st, layer, meta, jnp.asarray(kv[sl]), jnp.asarray(score[sl]), p, impl="cpu")

    st = run_chunks(st, 2, n, chunks, step)
    out, count = D.gather_all(st, 2, jnp.array([1], jnp.int32), jnp.array([n], jnp.int32), 3, impl="cpu")
    assert int(count[0]) == 3
    close_rows(np.asarray(out.astype(jnp.float32))[0], g["hca_main_expected"][0])
