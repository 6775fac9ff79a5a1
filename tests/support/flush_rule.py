"""flush's rule for one call (docs/design/semantics.md, "Order of a request's
tokens"), as a plain serial numpy model in float64, written from the rule's
text and not from any implementation, and the check of a state an
implementation produced against it.

The rule, per request slot s of the call:
1. its rows in row order; the k-th has expected position ep = p0 + k, p0 the
   position of its first row, n_s rows;
2. a row is dropped as BAD_POSITION (pos != ep, or outside [0, max_context)),
   MISSING_BLOCK (block_table[s, pos // 128] outside [0, N)) or NONFINITE,
   counted once under the first; BAD_SLOT rows belong to no slot;
3. f = max(p0, 0), L = min(p0 + n_s - 1, max_context - 1); nothing of s
   changes when f > L;
4. the carried accumulators are windows f // m + j;
5. window w closes iff f <= (w+1)m - 1 <= L: its entry pools the carried data
   of w and the good rows' contributions (CSA: b halves of rows in w, a halves
   of rows in w - 1), 0 when empty; stored at block_table[s, w*m // 128] if
   that block exists;
6. afterwards s holds windows (L+1) // m + j.
"""
from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from dsv4_jax.errors import ErrorKind as K

from support import oracle as O
from support.harness import FlipStats, assert_accumulators_close, compare_index, compare_kv, raw


@dataclasses.dataclass
class Compressor:
    """One compressor's inputs of a call and its carried accumulators."""
    kv: np.ndarray        # [T, coff*d]
    score: np.ndarray     # [T, coff*d]
    ape: np.ndarray       # [m, coff*d]
    carried: np.ndarray   # [R, nacc, 3, d] (max, sum, weighted kv)


@dataclasses.dataclass
class Outcome:
    counts: dict          # ErrorKind -> rows dropped under it
    closed: list          # (slot, window, block or None, [pooled f64 per compressor])
    after: dict           # slot -> [accumulators f64 [nacc, 3, d] per compressor]


def _empty(d):
    return np.stack([np.full(d, -np.inf), np.zeros(d), np.zeros(d)])


def _pool(carried, contributions):
    """(max, sum, weighted kv) of a carried accumulator and a list of (z, kv)
    contributions, as one float64 softmax."""
    M, S, V = (np.asarray(x, np.float64) for x in carried)
    if not contributions:
        return np.stack([M, S, V])
    z = np.stack([c[0] for c in contributions])
    v = np.stack([c[1] for c in contributions])
    mx = np.maximum(M, z.max(0))
    w_c = np.where(np.isneginf(M), 0.0, np.exp(M - mx))
    w = np.exp(z - mx)
    return np.stack([mx, S * w_c + w.sum(0), V * w_c + (w * v).sum(0)])


def _value(acc):
    return np.where(acc[1] == 0, 0.0, acc[2] / np.where(acc[1] == 0, 1.0, acc[1]))


def model(slot, pos, comps: list, block_table, num_blocks, max_context, m, overlap):
    """The rule applied to one call (the docstring's steps). `comps`: the
    layer's compressors (main, then CSA's indexer)."""
    R, MB = block_table.shape
    counts = collections.Counter()
    closed, after = [], {}
    f64 = lambda a: np.asarray(a, np.float64)
    for t in range(len(slot)):
        if slot[t] != -1 and not 0 <= slot[t] < R:
            counts[K.BAD_SLOT] += 1
    for s in range(R):
        rows = np.flatnonzero(slot == s)
        if not len(rows):
            continue
        p0, n = int(pos[rows[0]]), len(rows)
        contrib = [collections.defaultdict(list) for _ in comps]
        for k, t in enumerate(rows):
            ep, p = p0 + k, int(pos[t])
            if p != ep or not 0 <= p < max_context or p // 128 >= MB:
                counts[K.BAD_POSITION] += 1
                continue
            if not 0 <= block_table[s, p // 128] < num_blocks:
                counts[K.MISSING_BLOCK] += 1
                continue
            if not all(np.isfinite(c.kv[t]).all() and np.isfinite(c.score[t]).all()
                       for c in comps):
                counts[K.NONFINITE] += 1
                continue
            for c, acc in zip(comps, contrib):
                z, v = f64(c.score[t]) + f64(c.ape[ep % m]), f64(c.kv[t])
                if overlap:
                    d = z.shape[0] // 2
                    acc[ep // m].append((z[d:], v[d:]))
                    acc[ep // m + 1].append((z[:d], v[:d]))
                else:
                    acc[ep // m].append((z, v))
        f, L = max(p0, 0), min(p0 + n - 1, max_context - 1)
        if f > L:
            continue
        nacc = comps[0].carried.shape[1]
        carried = [{f // m + j: c.carried[s, j] for j in range(nacc)} for c in comps]

        def window(ci, w):
            d = comps[ci].carried.shape[-1]
            return _pool(carried[ci].get(w, _empty(d)), contrib[ci][w])
        for w in range(f // m, L // m + 1):
            if f <= (w + 1) * m - 1 <= L:
                b = int(block_table[s, w * m // 128])
                closed.append((s, w, b if 0 <= b < num_blocks else None,
                               [_value(window(ci, w)) for ci in range(len(comps))]))
        after[s] = [np.stack([window(ci, (L + 1) // m + j) for j in range(nacc)])
                    for ci in range(len(comps))]
    return Outcome(dict(counts), closed, after)


def _comps_of(state, kind_idx, csa, inputs, params):
    pool = state.csa if csa else state.hca
    comps = [Compressor(*map(np.asarray, inputs[:2]), np.asarray(params.ape),
                        np.asarray(pool.comp)[kind_idx])]
    if csa:
        comps.append(Compressor(*map(np.asarray, inputs[2:]), np.asarray(params.index.ape),
                                np.asarray(pool.icomp)[kind_idx]))
    return comps


def check_flush(before, after, kind_idx, csa, slot, pos, inputs, params, stats=None):
    """Asserts that `after` is `before` after one flush call of the CSA (or
    HCA) layer `kind_idx` (index among its kind) with rows (slot, pos) and
    inputs (kv, score[, index_kv, index_score]): the model's counts exactly;
    its accumulators to fp32 rounding; its closed entries up to one code;
    every other byte unchanged. Returns the model's outcome."""
    cfg = before.config
    m = 4 if csa else 128
    stats = stats or FlipStats()
    bt = np.asarray(before.block_table)
    comps = _comps_of(before, kind_idx, csa, inputs, params)
    out = model(np.asarray(slot), np.asarray(pos), comps, bt, cfg.num_blocks,
                cfg.max_context, m, csa)
    got = np.asarray(after.errors) - np.asarray(before.errors)
    assert {K(i): int(v) for i, v in enumerate(got) if v} == out.counts

    name = "csa" if csa else "hca"
    pb, pa = getattr(before, name), getattr(after, name)
    fields = ("comp", "icomp") if csa else ("comp",)
    for ci, field in enumerate(fields):
        b, a = raw(getattr(pb, field)).copy(), raw(getattr(pa, field))
        for s in range(cfg.max_requests):
            if s in out.after:
                assert_accumulators_close(a.view(np.float32)[kind_idx, s], out.after[s][ci],
                                          f"{field} slot {s}")
                b[kind_idx, s] = a[kind_idx, s]
        np.testing.assert_array_equal(a, b, err_msg=f"{field}: bytes of untouched slots")

    fmt = cfg.kv_format
    per_block = 128 // m
    got_kv = {k: raw(v) for k, v in pa.kv.__dict__.items() if v is not None}
    old_kv = {k: raw(v) for k, v in pb.kv.__dict__.items() if v is not None}
    written = np.zeros(got_kv["nope"].shape[1:3], bool)
    for s, w, block, pooled in out.closed:
        if block is None:
            continue
        row = w % per_block
        assert not written[block, row], "two entries of the model in one pool cell"
        written[block, row] = True
        enc = O.encode_kv(O.finish(pooled[0][None], m, params.norm, params.inv_freq, [w]), fmt)
        where = f" ({name} slot {s} window {w})"
        compare_kv(stats, fmt, {k: v[kind_idx, block, row][None] for k, v in got_kv.items()},
                   enc, where)
        if csa:
            p = params.index
            key = O.index_keys(O.finish(pooled[1][None], m, p.norm, p.inv_freq, [w]))
            got_i = {k: raw(v)[kind_idx, block, row][None] for k, v in pa.index.__dict__.items()}
            compare_index(stats, got_i, O.encode_mxfp4(key), where)
    for k in got_kv:
        np.testing.assert_array_equal(got_kv[k][kind_idx][~written], old_kv[k][kind_idx][~written],
                                      err_msg=f"{name} pool {k}: cells no window closed into")
        others = np.arange(got_kv[k].shape[0]) != kind_idx
        np.testing.assert_array_equal(got_kv[k][others], old_kv[k][others])
    if csa:
        for k, v in pa.index.__dict__.items():
            old = raw(getattr(pb.index, k))
            np.testing.assert_array_equal(raw(v)[kind_idx][~written], old[kind_idx][~written],
                                          err_msg=f"index {k}: cells no window closed into")
            others = np.arange(old.shape[0]) != kind_idx
            np.testing.assert_array_equal(raw(v)[others], old[others])
    # the rest of the state: the window, the block table, the other kind's pools
    other = before.hca if csa else before.csa
    other_after = after.hca if csa else after.csa
    for x, y in zip(jax.tree_util.tree_leaves((before.swa, before.block_table, other)),
                    jax.tree_util.tree_leaves((after.swa, after.block_table, other_after))):
        np.testing.assert_array_equal(raw(x), raw(y))
    return out
