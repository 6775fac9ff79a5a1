"""What the CPU handler cases of tests/ops/ share: tiny states with chosen
block tables, step metadata, random bf16 rows and compressor parameters, and
the float64 numpy oracles (softmax pooling, CSA entries) their results are
held against. One random generator for all of them, as when these cases
shared a file."""
import dataclasses

import jax.numpy as jnp
import numpy as np

import dsv4_jax as D

from support import npq


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


def softmax_pool(z, v):
    """Per-channel softmax pooling over axis 0 in float64."""
    z, v = np.asarray(z, np.float64), np.asarray(v, np.float64)
    w = np.exp(z - z.max(0))
    return (w * v).sum(0) / w.sum(0)


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


def setup():
    cfg = D.CacheConfig.tiny(max_requests=2, max_context=256)
    st = D.init_state(cfg)
    bt = np.array([[0, 1], [2, 3]], np.int32)
    st = dataclasses.replace(st, block_table=jnp.asarray(bt))
    meta = D.StepMeta.build(token_slot=np.array([0, 1], np.int32), token_pos=np.array([0, 0], np.int32),
                            lengths=np.zeros(2, np.int32))
    return st, meta
