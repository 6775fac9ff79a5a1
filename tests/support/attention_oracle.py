"""Float64 oracle of `attention` (docs/design/operations.md), written from the formula:
per query token a Python walk over the rows it sees (window positions,
prefill-chunk rows, CSA picks, HCA entries), each decoded from the pool's raw
bytes by support.oracle (ml_dtypes casts, not dsv4_jax), then a plain
softmax with the sink in float64 and the inverse RoPE with float64 cos/sin.
No bf16 rounding of weights or output: the exact value the implementations
are held to within their bound.

Also builds random caches straight from raw bytes (no op writes them), so a
test controls every ring position, block and entry."""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np

import dsv4_jax as D
from dsv4_jax.errors import ErrorKind as EK

from support import oracle

WINDOW = 128


def _raw(entries):
    """KVEntries of jnp arrays -> the raw dict support.oracle decodes."""
    out = {"nope": oracle.bits(np.asarray(entries.nope)), "rope": oracle.bits(np.asarray(entries.rope))}
    if entries.scale is not None:
        out["scale"] = oracle.bits(np.asarray(entries.scale))
    return out


def _decoded(entries, fmt):
    """Every row of a pool decoded, float64 [..., 512]."""
    return oracle.decode_kv(_raw(entries), fmt).astype(np.float64)


def stored(rows_bf16, fmt):
    """What append stores for bf16 rows [..., 512], read back (float64); a
    row holding NaN or Inf (never stored: append drops it) reads as NaN."""
    rows = np.asarray(rows_bf16)
    finite = np.all(np.isfinite(rows.astype(np.float32)), axis=-1, keepdims=True)
    back = oracle.decode_kv(oracle.encode_kv(np.where(finite, rows, 0), fmt), fmt)
    return np.where(finite, back.astype(np.float64), np.nan)


def attention(state, layer: int, q, slot, pos, sink, topk=None, chunk_kv=None, inv_freq=None):
    """(out f64[T, H, 512], lse f64[T, H], M f64[T] = max |v| over the rows
    each token sees, errors {ErrorKind: count})."""
    cfg = state.config
    fmt = cfg.kv_format
    kind = cfg.layer_kinds[layer]
    kidx = cfg.kind_index(layer)
    R, MB, N, ctx = cfg.max_requests, cfg.max_blocks_per_request, cfg.num_blocks, cfg.max_context
    q = np.asarray(q).astype(np.float64)
    slot, pos = np.asarray(slot, np.int64), np.asarray(pos, np.int64)
    sink = np.asarray(sink, np.float64)
    T, H = q.shape[:2]
    table = np.asarray(state.block_table)
    ring_pos = np.asarray(state.swa.pos)[layer]
    ring = _decoded(state.swa.kv, fmt)[layer]
    pool = _decoded({"csa": state.csa.kv, "hca": state.hca.kv}[kind], fmt)[kidx] \
        if kind != "swa" else None
    chunk = None if chunk_kv is None else np.asarray(chunk_kv)
    chunk_rows = None if chunk is None else stored(chunk, fmt)
    errors = {}
    out = np.zeros((T, H, 512))
    lse = np.full((T, H), -np.inf)
    M = np.zeros(T)

    def bump(kind_):
        errors[kind_] = errors.get(kind_, 0) + 1

    if chunk is not None:
        # per slot, its rows of the call with a position in range, in row
        # order, and which of them are finite: the same for every query
        finite = np.all(np.isfinite(chunk.astype(np.float64)), axis=-1)
        in_range = (pos >= 0) & (pos < ctx)
        rows_of = {int(v): np.flatnonzero((slot == v) & in_range) for v in np.unique(slot)}

    for t in range(T):
        s, p = int(slot[t]), int(pos[t])
        if s == -1:
            continue
        if not 0 <= s < R:
            bump(EK.BAD_SLOT)
            continue
        if not 0 <= p < ctx:
            bump(EK.BAD_POSITION)
            continue
        if not np.all(np.isfinite(q[t])):
            bump(EK.NONFINITE)
            continue
        rows = []
        p0 = None
        if chunk is not None:
            mine = rows_of[s]
            p0 = int(pos[mine].min())
            seen = mine[finite[mine] & (pos[mine] > p - WINDOW) & (pos[mine] <= p)]
            rows += list(chunk_rows[seen])
        # every position of the window before the call's own rows must be in
        # the ring: a row holding another position is stale, counted, unread
        for w in range(max(0, p - WINDOW + 1), p + 1 if p0 is None else min(p + 1, p0)):
            if int(ring_pos[s, w % WINDOW]) == w:
                rows.append(ring[s, w % WINDOW])
            else:
                bump(EK.STALE_WINDOW)
        if kind == "csa":
            visible = min((p + 1) // 4, MB * 32)
            for i in np.asarray(topk)[t]:
                i = int(i)
                if i == -1:
                    continue
                if i < -1 or i >= visible:
                    bump(EK.BAD_INDEX)
                    continue
                b = int(table[s, i // 32])
                if not 0 <= b < N:
                    bump(EK.MISSING_BLOCK)
                    continue
                rows.append(pool[b, i % 32])
        elif kind == "hca":
            for i in range((p + 1) // 128):
                b = int(table[s, i])
                if not 0 <= b < N:
                    bump(EK.MISSING_BLOCK)
                    continue
                rows.append(pool[b, 0])
        V = np.array(rows).reshape(-1, 512)
        M[t] = np.abs(V).max() if len(rows) else 0.0
        z = np.concatenate([q[t] @ V.T / math.sqrt(512), sink[:, None]], axis=1)   # [H, n + 1]
        top = z.max(axis=1, keepdims=True)
        w = np.exp(z - top)
        den = w.sum(axis=1)
        o = (w[:, :-1] @ V) / den[:, None]
        if inv_freq is not None:
            ang = (np.float32(p) * np.asarray(inv_freq, np.float32)).astype(np.float64)
            c, sn = np.cos(ang), np.sin(ang)
            a, b = o[:, 448::2].copy(), o[:, 449::2].copy()
            o[:, 448::2], o[:, 449::2] = a * c + b * sn, b * c - a * sn
        out[t] = o
        lse[t] = top[:, 0] + np.log(den)
    return out, lse, M, errors



def bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def queries(rng, T, H):
    """Per-head RMS-normalized bf16 queries [T, H, 512], as the model's
    q_b_norm leaves them."""
    q = rng.standard_normal((T, H, 512))
    return bf16(q / np.sqrt(np.mean(q * q, axis=-1, keepdims=True)))

BOUND = 2.0 ** -6           # each implementation's distance from exact, in units of M


def assert_within_bound(out, lse, want, want_lse, M, rows=None):
    """An implementation's (out, lse) against this oracle's on `rows` (all
    by default): every output within 2^-6 * M of exact, lse finite exactly
    where the oracle's is and within 1e-5 of it there."""
    rows = slice(None) if rows is None else rows
    got = np.asarray(out, np.float32).astype(np.float64)[rows]
    want, M = np.asarray(want)[rows], np.asarray(M)[rows]
    err = np.abs(got - want)
    bad = ~(err <= BOUND * M[:, None, None] + 1e-30)             # a NaN output is bad too
    assert not bad.any(), (f"{bad.sum()} outputs past 2^-6 M; worst ratio "
                           f"{np.max(err / np.maximum(M[:, None, None], 1e-30)):.3g}")
    lse, want_lse = np.asarray(lse, np.float64)[rows], np.asarray(want_lse)[rows]
    fin = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-5, atol=1e-5)

# ---- random caches ------------------------------------------------------------------------
def random_state(fmt: str, lengths: dict, *, R=4, max_context=1024, seed=0, missing=(),
                 capacity=None):
    """A tiny-config state whose requests (slot -> tokens so far) hold random
    rows: each ring slot the largest position < length with that residue, every
    block of the request's capacity (slot -> tokens, default its length) a
    distinct physical block (except the logical blocks listed in `missing` as
    (slot, logical), left -1), and every pool row random entries (also rows
    no request owns)."""
    rng = np.random.default_rng(seed)
    cfg = D.CacheConfig.tiny(max_requests=R, max_context=max_context, kv_format=fmt)
    st = D.init_state(cfg)
    MB, N = cfg.max_blocks_per_request, cfg.num_blocks
    table = np.full((R, MB), -1, np.int32)
    free = list(rng.permutation(N))
    ring_pos = np.full(st.swa.pos.shape, -1, np.int32)
    for s, n in (capacity or lengths).items():
        for b in range(-(-n // 128)):
            table[s, b] = free.pop()
    for s, n in lengths.items():
        for j in range(WINDOW):
            last = (n - 1 - j) // WINDOW * WINDOW + j if n > j else -1
            ring_pos[:, s, j] = last
    for s, b in missing:
        table[s, b] = -1

    def entries(shape):
        x = (rng.standard_normal(shape + (512,)) * rng.uniform(0.5, 2.0, shape + (1,))).astype(
            np.float32).astype(ml_dtypes.bfloat16)
        raw = oracle.encode_kv(x, fmt)
        leaves = [jnp.asarray(raw["nope"].view(np.uint16).view(ml_dtypes.bfloat16) if fmt == "bf16"
                              else raw["nope"].view(ml_dtypes.float8_e4m3fn)),
                  jnp.asarray(raw["rope"].view(ml_dtypes.bfloat16))]
        if fmt == "ds_fp8":
            leaves.append(jnp.asarray(raw["scale"].view(ml_dtypes.float8_e8m0fnu)))
        elif fmt == "fp8_token":
            leaves.append(jnp.asarray(raw["scale"].view(np.float32)))
        return D.KVEntries(*leaves) if len(leaves) == 3 else D.KVEntries(leaves[0], leaves[1], None)

    swa = dataclasses.replace(st.swa, kv=entries(st.swa.pos.shape), pos=jnp.asarray(ring_pos))
    csa = dataclasses.replace(st.csa, kv=entries(st.csa.kv.nope.shape[:-1]))
    hca = dataclasses.replace(st.hca, kv=entries(st.hca.kv.nope.shape[:-1]))
    return dataclasses.replace(st, block_table=jnp.asarray(table), swa=swa, csa=csa, hca=hca)
