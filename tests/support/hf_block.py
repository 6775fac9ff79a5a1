"""Float64 oracle of DeepSeek-V4's attention core over the tensors Hugging
Face's implementation attended (the golden set of
tools/gen_hf_block_golden.py): per checked token and head, a plain softmax
with the sink over its window rows (positions t-127..t) and its CSA picks or
visible HCA entries, then the inverse RoPE, written from the formulas of
docs/design/operations.md (not from dsv4_jax). The rows can be replaced by what a
pool of a kv_format stores (support.oracle's encoders, ml_dtypes casts)."""
from __future__ import annotations

import json
import math

import numpy as np

from support import oracle

WINDOW = 128


def stored_rows(rows_f64, fmt):
    """What a pool of `fmt` holds for rows [..., 512] given in float64 (bf16
    first, as the library receives them), read back in float64. "exact"
    keeps them as given."""
    if fmt == "exact":
        return rows_f64
    bf = oracle.to_bf16(np.asarray(rows_f64, np.float32))
    return oracle.decode_kv(oracle.encode_kv(bf, fmt), fmt).astype(np.float64)


def visible_entries(kind, t, picks_row):
    """The compressed entries query t attends: its picks (-1 dropped) on a
    CSA layer, i < (t + 1) // 128 on an HCA layer."""
    if kind == "csa":
        return picks_row[picks_row >= 0]
    if kind == "hca":
        return np.arange((t + 1) // 128)
    return np.zeros(0, np.int64)


def core(q, kv, entries, kind, positions, picks, sinks, inv_freq):
    """(out f64[C, H, 512], M f64[C]: the largest |v| seen) for the checked positions:
    q f64[C, H, 512] (already roped), kv f64[S, 512] window rows, entries
    f64[E, 512], picks i32[S, k] (CSA)."""
    C, H = q.shape[:2]
    out, M = np.zeros((C, H, 512)), np.zeros(C)
    for j, t in enumerate(positions):
        lo = max(0, t - WINDOW + 1)
        rows = [kv[lo:t + 1]]
        e = visible_entries(kind, t, picks[t] if picks is not None else None)
        if len(e):
            rows.append(entries[e])
        V = np.concatenate(rows)
        M[j] = np.abs(V).max()
        z = np.concatenate([q[j] @ V.T / math.sqrt(512), sinks[:, None]], axis=1)
        w = np.exp(z - z.max(axis=1, keepdims=True))
        o = (w[:, :-1] @ V) / w.sum(axis=1)[:, None]
        ang = (np.float32(t) * np.asarray(inv_freq, np.float32)).astype(np.float64)
        c, s = np.cos(ang), np.sin(ang)
        a, b = o[:, 448::2].copy(), o[:, 449::2].copy()
        o[:, 448::2], o[:, 449::2] = a * c + b * s, b * c - a * s
        out[j] = o
    return out, M


def pick_mass(q, kv, entries, positions, picks_a, picks_b, sinks):
    """Per checked position and head, the attention weight (under q's
    logits over the window, the union of both pick sets and the sink) of
    the entries one pick set holds and the other does not: f64[C, H]. Two
    attentions over sets differing in entries of total weight d differ by
    at most 2 d M."""
    C, H = q.shape[:2]
    out = np.zeros((C, H))
    for j, t in enumerate(positions):
        a = set(picks_a[t][picks_a[t] >= 0].tolist())
        b = set(picks_b[t][picks_b[t] >= 0].tolist())
        union = sorted(a | b)
        diff = np.array([i in (a ^ b) for i in union], bool)
        V = np.concatenate([kv[max(0, t - WINDOW + 1):t + 1], entries[union]]) \
            if union else kv[max(0, t - WINDOW + 1):t + 1]
        z = np.concatenate([q[j] @ V.T / math.sqrt(512), sinks[:, None]], axis=1)
        w = np.exp(z - z.max(axis=1, keepdims=True))
        w /= w.sum(axis=1, keepdims=True)
        n_win = V.shape[0] - len(union)
        out[j] = w[:, n_win:n_win + len(union)][:, diff].sum(axis=1) if union else 0.0
    return out


def read_safetensors(path) -> dict:
    """The float32 tensors of a .safetensors file, read from its layout
    (8-byte little-endian header size, a JSON header of dtype, shape and
    byte offsets, then the data): the golden weights on a machine without
    the safetensors package (the GPU runs), whose loader has its own test."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", (name, info["dtype"])
        start, stop = info["data_offsets"]
        out[name] = np.frombuffer(data[start:stop], "<f4").reshape(info["shape"])
    return out
