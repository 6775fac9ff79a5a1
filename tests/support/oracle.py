"""Whole-sequence oracle of docs/design/semantics.md and docs/design/formats.md in
numpy / float64.

Written independently of dsv4_jax.reference: no cache, no online softmax, no
bit tricks. Each entry is a plain two-pass softmax over its window(s) in
float64; the official bf16 rounding points are emulated by rounding to float32
(the official code computes in fp32) and then to ml_dtypes.bfloat16; fp8,
e8m0 and e2m1 roundings are ml_dtypes casts, and power-of-two scales come from
math.frexp.

Encoded entries are dicts of raw unsigned arrays (the byte patterns a pool
holds): KV entries {"nope", "rope", "scale"}, indexer keys {"packed", "scale"}.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
E2M1 = ml_dtypes.float4_e2m1fn

D, NOPE, ROPE = 512, 448, 64
IDX_D = 128
WINDOW, BLOCK = 128, 128
EPS = 1e-6


# ---- roundings ----------------------------------------------------------------------------
def to_bf16(x):
    """float64 -> bf16 through float32 (fp32 compute, then the cast)."""
    return np.asarray(x, np.float64).astype(np.float32).astype(BF16)


def bits(a):
    """Raw bit pattern of an array as an unsigned int array of the same width."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def pow2_at_least(r):
    """Smallest power of two >= r (positive float32 array), as float64."""
    out = np.empty(np.shape(r), np.float64)
    for i, v in np.ndenumerate(np.asarray(r, np.float64)):
        mant, exp = math.frexp(v)          # v = mant * 2^exp, mant in [0.5, 1)
        out[i] = math.ldexp(1.0, exp - 1 if mant == 0.5 else exp)
    return out


# ---- storage formats ------------------------------------------------------------------------
def encode_kv(x_bf16, fmt):
    """bf16 entries [..., 512] -> raw storage of `fmt`."""
    x = np.asarray(x_bf16).astype(BF16)
    nope = x[..., :NOPE].astype(np.float32)
    rope = bits(x[..., NOPE:])
    if fmt == "bf16":
        return {"nope": bits(x[..., :NOPE]), "rope": rope}
    if fmt == "ds_fp8":
        t = nope.reshape(nope.shape[:-1] + (7, 64))
        amax = np.maximum(np.abs(t).max(-1), np.float32(1e-4)).astype(np.float32)
        s = pow2_at_least(amax / np.float32(448.0))
        v = np.clip(t.astype(np.float64) / s[..., None], -448, 448).astype(np.float32)
        return {"nope": bits(v.astype(E4M3)).reshape(nope.shape), "rope": rope,
                "scale": bits(s.astype(np.float32).astype(E8M0))}
    if fmt == "fp8_token":
        amax = np.maximum(np.abs(nope).max(-1, keepdims=True), np.float32(1e-4))
        s = (amax / np.float32(448.0)).astype(np.float32)
        v = np.clip(nope / s, -448, 448).astype(np.float32)     # float32 IEEE division
        return {"nope": bits(v.astype(E4M3)), "rope": rope, "scale": bits(s)}
    raise ValueError(fmt)


def decode_kv(enc, fmt):
    """Raw storage -> bf16 [..., 512] (float64 arithmetic, one rounding)."""
    rope = enc["rope"].view(BF16)
    if fmt == "bf16":
        nope = enc["nope"].view(BF16)
    elif fmt == "ds_fp8":
        q = enc["nope"].view(E4M3).astype(np.float64)
        s = enc["scale"].view(E8M0).astype(np.float64)
        q = q.reshape(q.shape[:-1] + (7, 64)) * s[..., None]
        nope = q.reshape(enc["nope"].shape).astype(np.float32).astype(BF16)
    elif fmt == "fp8_token":
        q = enc["nope"].view(E4M3).astype(np.float32)
        nope = (q * enc["scale"].view(np.float32)).astype(BF16)   # fp32 product, then bf16
    else:
        raise ValueError(fmt)
    return np.concatenate([nope, rope], axis=-1)


def blank_kv(shape, fmt):
    """What a scrubbed / never written pool row holds."""
    z = lambda n, dt: np.zeros(shape + (n,), dt)
    if fmt == "bf16":
        return {"nope": z(NOPE, np.uint16), "rope": z(ROPE, np.uint16)}
    if fmt == "ds_fp8":
        return {"nope": z(NOPE, np.uint8), "rope": z(ROPE, np.uint16),
                "scale": np.full(shape + (7,), 0x7F, np.uint8)}
    return {"nope": z(NOPE, np.uint8), "rope": z(ROPE, np.uint16), "scale": z(1, np.uint32)}


def blank_index(shape):
    return {"packed": np.zeros(shape + (64,), np.uint8),
            "scale": np.full(shape + (4,), 0x7F, np.uint8)}


def encode_mxfp4(x_bf16):
    """bf16 keys [..., 128] -> {"packed" u8[..., 64], "scale" u8[..., 4]}."""
    x = np.asarray(x_bf16).astype(BF16).astype(np.float32)
    b = x.reshape(x.shape[:-1] + (4, 32))
    amax = np.maximum(np.abs(b).max(-1), np.float32(6.0 * 2.0 ** -126)).astype(np.float32)
    s = pow2_at_least(amax / np.float32(6.0))
    v = np.clip(b.astype(np.float64) / s[..., None], -6, 6).astype(np.float32)
    codes = bits(v.astype(E2M1)).reshape(x.shape) & 0xF
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return {"packed": packed.astype(np.uint8), "scale": bits(s.astype(np.float32).astype(E8M0))}


def decode_mxfp4(enc):
    p = enc["packed"]
    codes = np.stack([p & 15, p >> 4], axis=-1).reshape(p.shape[:-1] + (128,))
    v = codes.astype(np.uint8).view(E2M1).astype(np.float64)
    s = enc["scale"].view(E8M0).astype(np.float64)
    return (v.reshape(v.shape[:-1] + (4, 32)) * s[..., None]).reshape(v.shape)


def hadamard_matrix(n=IDX_D):
    """Sylvester construction H_{2n} = [[H, H], [H, -H]], unnormalized."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


# ---- compressor ------------------------------------------------------------------------------
def _softmax_pool(z, kv):
    """Per channel softmax over rows of z, weights applied to kv (float64)."""
    z = np.asarray(z, np.float64)
    w = np.exp(z - z.max(axis=0))
    return (w / w.sum(axis=0) * kv).sum(axis=0)


def pooled_entries(kv, score, ape, m, overlap):
    """Pooled f64 values [length // m, d] of one request's whole sequence."""
    kv = np.asarray(kv, np.float64)
    L = kv.shape[0]
    z = np.asarray(score, np.float64) + np.asarray(ape, np.float64)[np.arange(L) % m]
    d = kv.shape[1] // (2 if overlap else 1)
    out = []
    for i in range(L // m):
        win = slice(i * m, (i + 1) * m)
        if not overlap:
            out.append(_softmax_pool(z[win], kv[win]))
            continue
        zs, ks = [z[win, d:]], [kv[win, d:]]              # b half of window i
        if i > 0:
            prev = slice((i - 1) * m, i * m)                # a half of window i - 1
            zs.append(z[prev, :d])
            ks.append(kv[prev, :d])
        out.append(_softmax_pool(np.concatenate(zs), np.concatenate(ks)))
    return np.array(out).reshape(-1, d)


def finish(pooled, m, norm, inv_freq, entries=None):
    """Epilogue: bf16 -> RMSNorm -> bf16 -> interleaved RoPE at i*m -> bf16,
    row j being entry i = entries[j] (default: entries 0, 1, ...)."""
    y = to_bf16(pooled).astype(np.float64)
    var = (y * y).mean(axis=-1, keepdims=True)
    y = to_bf16(y / np.sqrt(var + EPS) * np.asarray(norm, np.float64)).astype(np.float64)
    pos = (np.arange(y.shape[0]) if entries is None else np.asarray(entries)) * m
    angle = (pos.astype(np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None, :]
             ).astype(np.float64)                   # the angle is defined in float32
    c, s = np.cos(angle), np.sin(angle)
    x0, x1 = y[:, -ROPE::2], y[:, -ROPE + 1::2]
    r = np.empty_like(y[:, -ROPE:])
    r[:, 0::2] = x0 * c - x1 * s
    r[:, 1::2] = x0 * s + x1 * c
    y[:, -ROPE:] = r
    return to_bf16(y)


def csa_keys(kv, score, ape, norm, inv_freq):
    return finish(pooled_entries(kv, score, ape, 4, True), 4, norm, inv_freq)


def hca_keys(kv, score, ape, norm, inv_freq):
    return finish(pooled_entries(kv, score, ape, 128, False), 128, norm, inv_freq)


def index_keys(key_bf16):
    """Hadamard (normalized, float64) of bf16 keys, rounded to bf16."""
    h = hadamard_matrix() / math.sqrt(IDX_D)
    return to_bf16(np.asarray(key_bf16).astype(np.float64) @ h)


def accumulators(kv, score, ape, m, overlap, length):
    """The online-softmax state a cache should hold after `length` tokens:
    f64 [nacc, 3, d] of (max, sum of exp(z - max), sum of exp(z - max) kv)
    for entries length // m + k, k < nacc; empty = (-inf, 0, 0)."""
    kv = np.asarray(kv, np.float64)[:length]
    z = (np.asarray(score, np.float64)[:length]
         + np.asarray(ape, np.float64)[np.arange(length) % m])
    d = kv.shape[1] // (2 if overlap else 1)
    w = length // m
    out = []
    for k in range(2 if overlap else 1):
        e = w + k
        zs, ks = [], []
        if overlap:
            b = slice(e * m, min((e + 1) * m, length))
            a = slice(max((e - 1) * m, 0), min(e * m, length)) if e > 0 else slice(0, 0)
            zs += [z[b, d:], z[a, :d]]
            ks += [kv[b, d:], kv[a, :d]]
        else:
            b = slice(e * m, min((e + 1) * m, length))
            zs.append(z[b])
            ks.append(kv[b])
        zz, kk = np.concatenate(zs), np.concatenate(ks)
        if zz.shape[0] == 0:
            out.append(np.stack([np.full(d, -np.inf), np.zeros(d), np.zeros(d)]))
            continue
        mx = zz.max(axis=0)
        ex = np.exp(zz - mx)
        out.append(np.stack([mx, ex.sum(axis=0), (ex * kk).sum(axis=0)]))
    return np.array(out)
