"""The caches and inputs the benchmarks time the ops on, and the bytes each
op must move: every byte it reads or writes counted once (pool entries,
rows, accumulators, metadata), a lower bound on its traffic."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ... import config as C
from ...config import CacheConfig
from ...params import CompressorParams, yarn_inv_freq
from ...state import kv_entry_shapes, tree_bytes

ROW = C.HEAD_DIM * 2    # one gathered / appended bf16 row
INDEX_KEY = C.INDEX_PACKED + C.INDEX_SCALES


def entry_bytes(kv_format: str) -> int:
    """One stored entry of a pool (or window) in `kv_format`."""
    return tree_bytes(kv_entry_shapes(kv_format, (1,)))


def flush_bytes(kind: str, token_pos, requests: int, kv_format: str) -> int:
    """flush over tokens at `token_pos` of `requests` requests: the f32
    projections read, each request's accumulators read and written, and the
    entries (CSA: and indexer keys) of the windows the tokens close."""
    ratio = C.CSA_RATIO if kind == C.CSA else C.HCA_RATIO
    closed = int(np.sum((np.asarray(token_pos) + 1) % ratio == 0))
    if kind == C.CSA:
        proj = 2 * C.HEAD_DIM + 2 * C.INDEX_DIM     # a kv (or score) row of both compressors
        acc = 2 * 3 * 4 * (C.HEAD_DIM + C.INDEX_DIM)   # comp [2, 3, 512] + icomp [2, 3, 128]
        out = entry_bytes(kv_format) + INDEX_KEY
    else:
        proj, acc, out = C.HEAD_DIM, 3 * 4 * C.HEAD_DIM, entry_bytes(kv_format)
    return len(token_pos) * 2 * 4 * proj + requests * 2 * acc + closed * out


def pool_config(kind, layers, R, MB, N=None, kv_format="ds_fp8"):
    """`layers` layers of one kind, R requests of MB blocks each."""
    ratio = {C.SWA: 0, C.CSA: C.CSA_RATIO, C.HCA: C.HCA_RATIO}[kind]
    return CacheConfig((ratio,) * layers, R, N or R * MB, MB, kv_format)


def with_blocks(state, R, MB):
    """Request r owns physical blocks r*MB ... r*MB + MB - 1."""
    bt = np.arange(R * MB, dtype=np.int32).reshape(R, MB)
    return dataclasses.replace(state, block_table=jnp.asarray(bt))


def random_pools(state, rng):
    """Pools filled on the device with valid random entries (not zeros):
    fp8 codes below NaN, scales near 1, normal bf16."""
    # XLA's RngBitGenerator ("rbg"): threefry's bits over pools this size
    # take XLA several times longer to compile than the benchmark to run
    return _fill_pools(state, jax.random.key(int(rng.integers(1 << 30)), impl="rbg"))


def _random_entry(x, key):
    if x.size == 0:
        return x
    if x.dtype == jnp.float8_e4m3fn:
        codes = jax.random.bits(key, x.shape, jnp.uint8) % jnp.uint8(0x7e)
        return jax.lax.bitcast_convert_type(codes, x.dtype)
    if x.dtype == jnp.float8_e8m0fnu:
        codes = jnp.uint8(120) + jax.random.bits(key, x.shape, jnp.uint8) % jnp.uint8(10)
        return jax.lax.bitcast_convert_type(codes, x.dtype)
    if x.dtype == jnp.bfloat16:
        return jax.random.normal(key, x.shape, jnp.bfloat16)
    return x


@jax.jit
def _fill_pools(state, key):
    def fill(entries, pool):
        leaves, tree = jax.tree_util.tree_flatten(entries)
        keys = jax.random.split(jax.random.fold_in(key, pool), len(leaves))
        return tree.unflatten([_random_entry(x, k) for x, k in zip(leaves, keys)])
    return dataclasses.replace(
        state, swa=dataclasses.replace(state.swa, kv=fill(state.swa.kv, 0)),
        csa=dataclasses.replace(state.csa, kv=fill(state.csa.kv, 1)),
        hca=dataclasses.replace(state.hca, kv=fill(state.hca.kv, 2)))


def flush_params(kind, rng):
    """Random compressor parameters of a CSA (with its indexer's) or HCA layer."""
    inv = jnp.asarray(yarn_inv_freq())

    def one(m, w, d):
        return CompressorParams(jnp.asarray(rng.normal(0, .5, (m, w)), jnp.float32),
                                jnp.asarray(rng.uniform(.5, 1.5, d), jnp.float32), inv)
    if kind == C.CSA:
        return dataclasses.replace(one(C.CSA_RATIO, 2 * C.HEAD_DIM, C.HEAD_DIM),
                                   index=one(C.CSA_RATIO, 2 * C.INDEX_DIM, C.INDEX_DIM))
    return one(C.HCA_RATIO, C.HEAD_DIM, C.HEAD_DIM)


def inner_layers(rows):
    """Op calls per timed jit call: many for small ops, one for large ones."""
    return 64 if rows <= 256 else (16 if rows <= 4096 else 4)
