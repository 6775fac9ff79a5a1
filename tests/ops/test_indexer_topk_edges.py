"""indexer_topk at its edges, on every implementation: positions at and past
max_context (BAD_POSITION), and a NaN or Inf in a token's q or weights
(NONFINITE, counted once, the row all -1) next to good tokens, whose rows
are checked against a float64 oracle of the score. The CUDA cases add grids
that pick each score kernel (bf16: four lanes an entry on small grids, one
thread an entry on large ones; mxfp4: pairs of warps or single warps) and a
select spread over a cluster."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax.errors import ErrorKind as EK

from support import npq
from support.indexer import IMPLS, Q_FORMATS, make_state, queries
from support.marks import CUDA

LAYER = 3                        # a CSA layer of the tiny preset (SWA, CSA, HCA, CSA)


def run(st, slot, pos, q, w, k, impl, q_format):
    f = jax.jit(lambda st, s, p, q, w: D.indexer_topk(st, LAYER, s, p, q, w, k, impl=impl,
                                                      q_format=q_format, return_state=True))
    got, st2 = f(st, jnp.asarray(slot, jnp.int32), jnp.asarray(pos, jnp.int32),
                 jnp.asarray(q), jnp.asarray(w))
    return np.asarray(got), {EK(i): int(v) for i, v in enumerate(np.asarray(st2.errors)) if v}


def oracle_scores(st, slot, pos, q, w, q_format):
    """float64 scores of the entries a good token sees (NaN where the
    entry's block is missing), from npq's independent MXFP4 decoder."""
    cfg = st.config
    n = min((int(pos) + 1) // 4, cfg.max_blocks_per_request * 32)
    kind = cfg.kind_index(LAYER, "csa")
    i = np.arange(n)
    block = np.asarray(st.block_table)[slot][i // 32]
    ok = (block >= 0) & (block < cfg.num_blocks)
    b = np.where(ok, block, 0)
    packed = np.asarray(st.csa.index.packed)[kind][b, i % 32]
    scale = np.asarray(st.csa.index.scale)[kind][b, i % 32]
    keys = npq.unpack_mxfp4(packed, scale).astype(np.float64)
    qv = np.asarray(q, np.float32)
    if q_format == "mxfp4":
        qv = npq.mxfp4_roundtrip(qv)[0]
    s = np.maximum(keys @ qv.astype(np.float64).T, 0) @ np.asarray(w, np.float64)
    return np.where(ok, s, np.nan)


def assert_top_k(row, scores, k):
    """`row` holds the k best entries by the float64 score (fp32 rounding
    aside: a returned entry is at most 1e-4 of the scale below the best left
    out), best first, then -1."""
    cand = np.flatnonzero(~np.isnan(scores))
    m = min(k, len(cand))
    assert np.all(row[m:] == -1) and len(set(row[:m])) == m and set(row[:m]) <= set(cand)
    if m == 0:
        return
    tol = 1e-4 * np.max(np.abs(scores[cand]))
    got = scores[row[:m]]
    assert np.all(np.diff(got) <= tol)                           # best first
    rest = np.setdiff1d(cand, row[:m])
    if len(rest):
        assert got.min() >= scores[rest].max() - tol


# ---- positions ------------------------------------------------------------------------
@pytest.mark.parametrize("q_format", Q_FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
def test_positions_at_and_past_max_context(impl, q_format):
    """pos max_context - 1 sees the whole table; max_context and 2^31 - 1
    (where (pos + 1) // 4 would overflow int32) are BAD_POSITION, row -1,
    as for gather_topk, append and flush."""
    rng = np.random.default_rng(31)
    st = make_state(rng, R=2, max_context=512, blocks={0: [3, 1, 0, 2]})
    top = st.config.max_context
    slot = np.int32([0, 0, 0, 0])
    pos = np.int32([top - 1, top, 2 ** 31 - 1, 99])
    q, w = queries(rng, 4)
    k = 200                                      # more than the 128 entries of the table
    got, errs = run(st, slot, pos, q, w, k, impl, q_format)
    assert errs == {EK.BAD_POSITION: 2}
    assert np.all(got[1:3] == -1)
    assert sorted(got[0][:128]) == list(range(128)) and np.all(got[0][128:] == -1)
    for t in (0, 3):
        assert_top_k(got[t], oracle_scores(st, slot[t], pos[t], q[t], w[t], q_format), k)


# ---- NaN or Inf in q or weights -------------------------------------------------------
def poisoned_batch(rng, T_good, max_pos):
    """T_good good tokens of slots 0 and 1 at random positions < max_pos,
    then tokens whose q or weights hold a NaN or an Inf, and tokens that
    break an earlier rule as well (counted under that rule only). Returns
    slot, pos, q, w, the indices of the bad tokens and the expected counts."""
    slot = list(rng.integers(0, 2, T_good))
    pos = list(rng.integers(4, max_pos, T_good))
    spoil = []   # (slot, pos, where, value)
    spoil += [(0, max_pos - 1, "q", np.nan), (1, 200, "q", np.inf), (0, 300, "q", -np.inf),
              (1, 50, "w", np.nan), (0, 77, "w", -np.inf), (1, 120, "w", np.inf)]
    spoil += [(0, 2, "q", np.nan)]               # sees no entry yet: still counted
    spoil += [(3, 90, "q", np.nan)]              # no blocks at all: NONFINITE, not MISSING_BLOCK
    spoil += [(-1, 90, "q", np.nan)]             # padding: nothing counted
    spoil += [(9, 90, "w", np.nan)]              # bad slot first
    spoil += [(0, -4, "q", np.nan), (1, max_pos, "w", np.inf)]   # bad position first
    T = T_good + len(spoil)
    q, w = queries(rng, T)
    for j, (s, p, where, value) in enumerate(spoil):
        t = T_good + j
        slot.append(s)
        pos.append(p)
        if where == "q":
            q[t, rng.integers(64), rng.integers(128)] = value
        else:
            w[t, rng.integers(64)] = value
    order = rng.permutation(T)                   # bad tokens among the good ones
    bad = np.flatnonzero(order >= T_good)
    want = {EK.NONFINITE: 8, EK.BAD_SLOT: 1, EK.BAD_POSITION: 2}
    return (np.int32(slot)[order], np.int32(pos)[order], q[order], w[order], bad, want)


def check_poisoned(st, impl, q_format, T_good, k, seed):
    rng = np.random.default_rng(seed)
    max_pos = st.config.max_context
    slot, pos, q, w, bad, want = poisoned_batch(rng, T_good, max_pos)
    got, errs = run(st, slot, pos, q, w, k, impl, q_format)
    assert errs == want
    assert np.all(got[bad] == -1)
    good = np.setdiff1d(np.arange(len(slot)), bad)
    for t in good:
        assert_top_k(got[t], oracle_scores(st, slot[t], pos[t], q[t], w[t], q_format), k)
    # the good tokens alone give the same rows and count nothing
    alone, errs = run(st, slot[good], pos[good], q[good], w[good], k, impl, q_format)
    assert errs == {}
    np.testing.assert_array_equal(got[good], alone)


@pytest.mark.parametrize("q_format", Q_FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
def test_nonfinite_inputs_drop_the_token(impl, q_format):
    """A small grid: on CUDA the bf16 four-lane score kernel and the mxfp4
    kernel in pairs of warps. Slot 3 has no blocks: its NaN token counts
    NONFINITE only, not MISSING_BLOCK."""
    rng = np.random.default_rng(5)
    st = make_state(rng, R=4, max_context=512,
                     blocks={0: [0, 1, 2, 3], 1: [4, 5, 6, 7], 2: [8, 9, 10, 11]})
    check_poisoned(st, impl, q_format, T_good=6, k=24, seed=6)


@pytest.mark.parametrize("q_format", Q_FORMATS)
@pytest.mark.parametrize("max_context", [
    16384,        # bf16: one thread an entry; mxfp4: single warps (T * E / 256 > 132)
    131072,       # and the select over a cluster of 2 CTAs (E = 32768 > 16384)
])
@pytest.mark.parametrize("impl", [pytest.param("cuda", marks=CUDA)])
def test_nonfinite_inputs_drop_the_token_large_grids(impl, max_context, q_format):
    rng = np.random.default_rng(7)
    MB = max_context // 128
    st = make_state(rng, R=4, max_context=max_context,
                     blocks={0: list(range(MB)), 1: list(range(MB, 2 * MB)),
                             2: list(range(2 * MB, 3 * MB))})
    check_poisoned(st, impl, q_format, T_good=16, k=64, seed=8)
