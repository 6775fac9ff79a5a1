"""Bad input at run time (docs/design/bad-input.md), property-based: random metadata with a
fraction of bad rows (and rows with NaN/Inf inputs), on every implementation. Each op must give exactly the
result of the same call with the bad rows turned into padding, leave every
other byte alone, and count each bad row once under its kind. flush is the
exception: a dropped row of a request keeps its expected position (docs/design/semantics.md), so
it is not padding; flush's result is held against the serial model of its
rule (support/flush_rule.py) and, exactly, against the call with its bad-slot
rows padded. attention is the other: a NaN/Inf in q drops only that query (in
a prefill chunk its kv row is still its neighbours' window row), and a NaN/Inf
chunk_kv row is seen by no query while its own query attends (docs/design/operations.md)."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import dsv4_jax as dj
from dsv4_jax import config as C
from dsv4_jax.errors import ErrorKind as K
from dsv4_jax.app.workload import layer_params
from support import attention_oracle as AO
from support.flush_rule import check_flush
from support.trees import assert_trees_bytes_equal

pytestmark = pytest.mark.usefixtures("impl_under_test")
# DSV4_BAD_INPUT_EXAMPLES shrinks the run (tools/sanitize.sh, under compute-sanitizer)
SETTINGS = settings(max_examples=int(os.environ.get("DSV4_BAD_INPUT_EXAMPLES", 12)),
                    deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
T = 32                                   # fixed row count: one compile per op
CFG = dj.CacheConfig.tiny(max_requests=4, max_context=512, num_blocks=16)
R, MAXCTX = CFG.max_requests, CFG.max_context


def sentinel_state():
    """Slots 0-2 hold requests with blocks for 512, 256 and 128 tokens; slot 3
    has none (its tokens meet MISSING_BLOCK). Every pool byte is 0xA5."""
    m = dj.CacheManager(CFG)
    for _ in range(3):
        m.admit()
    # jitted with the state donated, as a serving loop runs it (no NotDonatedWarning)
    apply = jax.jit(lambda st, step: dj.apply_step(st, step, impl="reference"), donate_argnums=0)
    state = apply(dj.init_state(CFG), m.prepare_step({0: 512, 1: 256, 2: 128}))

    def fill(x):
        raw = np.full(x.size * x.dtype.itemsize, 0xA5, np.uint8)
        return jnp.asarray(raw.view(x.dtype).reshape(x.shape))
    pools = jax.tree_util.tree_map(fill, (state.swa.kv, state.csa.kv, state.csa.index, state.hca.kv))
    return dataclasses.replace(
        state, swa=dataclasses.replace(state.swa, kv=pools[0]),
        csa=dataclasses.replace(state.csa, kv=pools[1], index=pools[2]),
        hca=dataclasses.replace(state.hca, kv=pools[3]))


BASE = sentinel_state()


def meta_of(slot, pos):
    return dj.StepMeta.build(token_slot=slot, token_pos=pos, lengths=np.zeros(R, np.int32),
                             new_blocks=np.full((1, 3), -1), reset_slots=[-1])


bad_slot = st.one_of(st.integers(R, R + 50), st.integers(-1000, -2))
bad_pos = st.one_of(st.integers(-1000, -1), st.integers(MAXCTX, MAXCTX + 1000))


@st.composite
def token_rows(draw, contiguous: bool):
    """T rows: per request contiguous positions from 0 (for flush) or random
    positions (for append), padding, and bad rows of each kind. Returns
    (slot, pos, kind) with kind 0 valid, 1 pad, 2 bad slot, 3 bad pos,
    4 missing block (slot 3), 5 a valid row whose inputs the test makes NaN/Inf.
    With contiguous positions every row of a request takes the next one, the
    bad ones too (flush's expected positions): a bad-pos row is then off it
    (outside [0, max_context), a jump, a repeat or a step back) and is never
    its request's first row, whose position sets the expected ones."""
    slot, pos, kind = [], [], []
    nxt = {0: 0, 1: 0, 2: 0, 3: 0}
    for _ in range(T):
        k = draw(st.sampled_from([0, 0, 0, 1, 2, 3, 4, 5]))
        if contiguous and k == 3:
            s = draw(st.integers(0, 2))
            if nxt[s] == 0:
                k = 0
            else:
                off = draw(st.one_of(bad_pos, st.integers(-3, 3).filter(bool).map(
                    lambda d, n=nxt[s]: n + d)))
                slot.append(s), pos.append(off), kind.append(k)
                nxt[s] += 1
                continue
        if k == 0:
            s = draw(st.integers(0, 2))
            p = nxt[s] if contiguous else draw(st.integers(0, MAXCTX - 1))
            nxt[s] += 1
        elif k == 1:
            s, p = -1, draw(st.integers(-5, 5))
        elif k == 2:
            s, p = draw(bad_slot), draw(st.integers(0, 100))
        elif k == 3:
            s, p = draw(st.integers(0, 2)), draw(bad_pos)
        elif k == 4:
            s, p = 3, nxt[3]
            nxt[3] += 1
        else:             # NaN/Inf inputs: a dropped row at its position
            s = draw(st.integers(0, 2))
            p = nxt[s] if contiguous else draw(st.integers(0, MAXCTX - 1))
            nxt[s] += 1
        slot.append(s), pos.append(p), kind.append(k)
    return np.array(slot, np.int32), np.array(pos, np.int32), np.array(kind)


def expected_counts(kind, missing_counts=True):
    c = {K.BAD_SLOT: int(np.sum(kind == 2)), K.BAD_POSITION: int(np.sum(kind == 3)),
         K.MISSING_BLOCK: int(np.sum(kind == 4)) if missing_counts else 0,
         K.NONFINITE: int(np.sum(kind == 5))}
    return {k: v for k, v in c.items() if v}


def poison_rows(arrays, kind, rng):
    """NaN, +Inf or -Inf in one channel of one of `arrays` per kind-5 row."""
    arrays = [np.array(a, np.float32) for a in arrays]
    for t in np.flatnonzero(kind == 5):
        a = arrays[rng.integers(len(arrays))]
        a[t, rng.integers(a.shape[1])] = rng.choice([np.nan, np.inf, -np.inf])
    return arrays


def counts_delta(new, old):
    d = np.asarray(new.errors) - np.asarray(old.errors)
    return {K(i): int(v) for i, v in enumerate(d) if v}


def padded(slot, kind, drop):
    slot = slot.copy()
    slot[np.isin(kind, drop)] = -1
    return slot


_append = jax.jit(lambda s, m, kv: dj.append(s, 0, m, kv))


@SETTINGS
@given(rows=token_rows(contiguous=False), seed=st.integers(0, 2**31 - 1))
def test_append_drops_exactly_the_bad_rows(rows, seed):
    slot, pos, kind = rows
    rng = np.random.default_rng(seed)
    kv, = poison_rows([rng.normal(0, 2, (T, 512))], kind, rng)
    kv = jnp.asarray(kv, jnp.bfloat16)
    got = _append(BASE, meta_of(slot, pos), kv)
    want = _append(BASE, meta_of(padded(slot, kind, [2, 3, 5]), pos), kv)
    # slot 3 has no blocks, but the window needs none: kind 4 rows are valid here
    assert counts_delta(got, BASE) == expected_counts(kind, missing_counts=False)
    assert counts_delta(want, BASE) == {}
    assert_trees_bytes_equal(dataclasses.replace(got, errors=want.errors), want)


_flush = jax.jit(lambda s, m, x, z, ix, iz, p: dj.flush(s, 1, m, x, z, p, index_kv=ix,
                                                          index_score=iz))
PARAMS = layer_params(CFG, seed=9)[1]


@SETTINGS
@given(rows=token_rows(contiguous=True), seed=st.integers(0, 2**31 - 1))
def test_flush_drops_exactly_the_bad_rows(rows, seed):
    slot, pos, kind = rows
    rng = np.random.default_rng(seed)
    x, z, ix, iz = map(jnp.asarray, poison_rows(
        [rng.normal(0, 2, (T, 1024)), rng.normal(0, 2, (T, 1024)),
         rng.normal(0, 2, (T, 256)), rng.normal(0, 2, (T, 256))], kind, rng))
    got = _flush(BASE, meta_of(slot, pos), x, z, ix, iz, PARAMS)
    assert counts_delta(got, BASE) == expected_counts(kind)
    # the rule's model: counts, accumulators, closed entries, untouched bytes
    check_flush(BASE, got, 0, True, slot, pos, [x, z, ix, iz], PARAMS)
    # rows of a bad slot belong to no request: exactly padding
    want = _flush(BASE, meta_of(padded(slot, kind, [2]), pos), x, z, ix, iz, PARAMS)
    assert counts_delta(want, BASE) == expected_counts(kind[kind != 2])
    assert_trees_bytes_equal(dataclasses.replace(got, errors=want.errors), want)
    for leaf in jax.tree_util.tree_leaves(got):    # no NaN stored, no 0xFF scale
        if leaf.dtype == jnp.float8_e8m0fnu:
            assert not np.any(np.asarray(leaf).view(np.uint8) == 0xFF)
        elif leaf.dtype != jnp.int32 and leaf.dtype != jnp.uint8:
            assert not np.any(np.isnan(np.asarray(leaf, np.float32)))
    # nothing outside the blocks of slots 0-2 changed (sentinel bytes intact)
    table = np.asarray(BASE.block_table)
    used = sorted(set(table[:3][table[:3] >= 0].tolist()))
    unused = [b for b in range(CFG.num_blocks) if b not in used]
    for leaf in jax.tree_util.tree_leaves((got.csa.kv, got.csa.index)):
        assert np.all(np.asarray(leaf)[:, unused].view(np.uint8) == 0xA5)


_gathers = jax.jit(lambda s, sl, tp, ix, ln: (
    dj.gather_window(s, 0, sl, return_state=True),
    dj.gather_topk(s, 1, sl, tp, ix, return_state=True),
    dj.gather_all(s, 2, sl, ln, 4, return_state=True)))


@SETTINGS
@given(data=st.data())
def test_gathers_give_zero_rows_for_bad_rows_and_count_them(data):
    B = 8
    kinds = np.array(data.draw(st.lists(st.sampled_from([0, 0, 1, 2]), min_size=B, max_size=B)))
    slot = np.array([data.draw(st.integers(0, 3)) if k == 0 else -1 if k == 1 else
                     data.draw(bad_slot) for k in kinds], np.int32)
    tpos = np.array(data.draw(st.lists(st.integers(0, MAXCTX - 1), min_size=B, max_size=B)),
                    np.int32)
    idx = np.array(data.draw(st.lists(st.lists(st.integers(-3, 140), min_size=4, max_size=4),
                                      min_size=B, max_size=B)), np.int32)
    lengths = np.array(data.draw(st.lists(st.integers(-5, MAXCTX + 200), min_size=B,
                                          max_size=B)), np.int32)
    got = _gathers(BASE, slot, tpos, idx, lengths)
    clean_slot = padded(slot, kinds, [2])
    want = _gathers(BASE, clean_slot, tpos, idx, lengths)
    for g, w, name in zip(got, want, ("window", "topk", "all")):
        for a, b in zip(g[:2], w[:2]):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype != bool else a,
                                          np.asarray(b).view(np.uint8) if b.dtype != bool else b,
                                          err_msg=name)
        assert counts_delta(g[2], w[2]) == ({K.BAD_SLOT: int(np.sum(kinds == 2))}
                                            if np.any(kinds == 2) else {}), name
    # bad slots read nothing
    bad = kinds == 2
    assert not np.asarray(got[0][0], np.float32)[bad].any()
    assert np.all(np.asarray(got[0][1])[bad] == -1)
    assert not np.asarray(got[1][1])[bad].any() and not np.asarray(got[2][1])[bad].any()


_indexer = jax.jit(lambda s, sl, tp, q, w: dj.indexer_topk(s, 1, sl, tp, q, w, 8,
                                                           return_state=True))


def missing_blocks(slot, pos, kind):
    """MISSING_BLOCK of indexer_topk's rule: per token that passes the
    earlier checks, each logical block j with j * 32 < (pos + 1) // 4 whose
    table entry is missing."""
    table = np.asarray(BASE.block_table)
    n = 0
    for s, p, k in zip(slot, pos, kind):
        if k in (0, 4):
            vis = (int(p) + 1) // C.CSA_RATIO
            n += sum(1 for j in range(-(-vis // 32)) if not 0 <= table[s, j] < CFG.num_blocks)
    return n


@SETTINGS
@given(rows=token_rows(contiguous=False), seed=st.integers(0, 2**31 - 1))
def test_indexer_drops_exactly_the_bad_rows(rows, seed):
    """Bad slot, position outside [0, max_context) and a NaN/Inf in q or the
    weights each make the row all -1 and count once; the other rows are those
    of the call with the bad rows as padding."""
    slot, pos, kind = rows
    rng = np.random.default_rng(seed)
    q, w = poison_rows([rng.normal(0, 1, (T, 64 * 128)), rng.normal(0, 1, (T, 64))], kind, rng)
    q = jnp.asarray(q.reshape(T, 64, 128), jnp.bfloat16)
    w = jnp.asarray(w, jnp.float32)
    got_idx, got = _indexer(BASE, slot, pos, q, w)
    want_idx, want = _indexer(BASE, padded(slot, kind, [2, 3, 5]), pos, q, w)
    counts = expected_counts(kind, missing_counts=False)
    missing = missing_blocks(slot, pos, kind)
    if missing:
        counts[K.MISSING_BLOCK] = missing
    assert counts_delta(got, BASE) == counts
    assert counts_delta(want, BASE) == ({K.MISSING_BLOCK: missing} if missing else {})
    np.testing.assert_array_equal(np.asarray(got_idx), np.asarray(want_idx))
    assert np.all(np.asarray(got_idx)[np.isin(kind, [1, 2, 3, 5])] == -1)


# ---- attention ------------------------------------------------------------------------------
# A cache built from random bytes (support.attention_oracle): ring rows of every
# slot (slot 2 none), every block of slots 0-2 but slot 1's logical block 2,
# no block at all for slot 3 (its picks and entries meet MISSING_BLOCK).
RING = {0: 300, 1: 140, 2: 0, 3: 200}
ATT = AO.random_state("ds_fp8", RING, R=R, max_context=MAXCTX, seed=50, missing=[(1, 2)],
                      capacity={0: MAXCTX, 1: MAXCTX, 2: 384})
# a prefill chunk of request s starts here: slot 0's overlaps its ring (the p0 cut)
CHUNK_START = {0: 280, 1: 140, 2: 0, 3: 200}
TA, HA, KA = 24, 4, 8
FREQ = jnp.asarray(dj.yarn_inv_freq(), jnp.float32)
ATT_SETTINGS = settings(SETTINGS, max_examples=min(SETTINGS.max_examples, 6))


@st.composite
def attention_rows(draw, chunk: bool):
    """TA rows of one attention call: (slot, pos, kind) with the kinds of
    token_rows (4 does not occur: slot 3 is a valid request here) and 6, a
    good row whose chunk_kv the test makes NaN/Inf. Decode rows take any
    position, often one near the end of the slot's ring; a chunk's rows of request s take CHUNK_START[s], +1, ... in
    the order drawn, bad ones too (then shuffled), and a kind-6 row is never
    its request's first row with a good slot and position, so padding it
    leaves p0 (and every other query's rows) as they are."""
    slot, pos, kind = [], [], []
    taken = {s: 0 for s in range(R)}
    has_ok = {s: False for s in range(R)}
    for _ in range(TA):
        k = draw(st.sampled_from([0, 0, 0, 1, 2, 3, 5] + ([6] if chunk else [])))
        if k == 1:
            slot.append(-1), pos.append(draw(st.integers(-5, 5))), kind.append(1)
            continue
        s = draw(st.integers(0, R - 1))
        if k == 6 and not has_ok[s]:
            k = 0
        if chunk:
            p = CHUNK_START[s] + taken[s]
        else:                       # anywhere, or near the ring's end (most of it in the window)
            p = draw(st.one_of(st.integers(0, MAXCTX - 1), st.integers(-30, 100).map(
                lambda d, s=s: min(max(RING[s] - 1 + d, 0), MAXCTX - 1))))
        taken[s] += 1
        has_ok[s] |= k in (0, 5, 6)
        if k == 2:
            s = draw(bad_slot)
        elif k == 3:
            p = draw(bad_pos)
        slot.append(s), pos.append(p), kind.append(k)
    order = np.array(draw(st.permutations(range(TA))))
    return (np.array(slot, np.int32)[order], np.array(pos, np.int32)[order],
            np.array(kind)[order])


def random_picks(rng, pos):
    """topk i32[TA, KA]: visible picks (repeats possible), -1, indices not
    visible yet and indices < -1."""
    out = np.empty((len(pos), KA), np.int32)
    for t, p in enumerate(pos):
        vis = (int(p) + 1) // C.CSA_RATIO if 0 <= p < MAXCTX else 10
        for j in range(KA):
            c = rng.choice(4, p=[0.55, 0.2, 0.15, 0.1])
            out[t, j] = (rng.integers(0, vis) if c == 0 and vis else -1 if c < 2 else
                         rng.integers(vis, vis + 40) if c == 2 else rng.integers(-50, -1))
    return out


_attend = jax.jit(lambda st, layer, q, s, p, sink, tk, ck: dj.attention(
    st, layer, q, s, p, sink=sink, topk=tk, chunk_kv=ck, rope_inv_freq=FREQ), static_argnums=1)


@ATT_SETTINGS
@pytest.mark.parametrize("layer", [1, 2], ids=["csa", "hca"])
@pytest.mark.parametrize("mode", ["decode", "chunk"])
@given(data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_attention_drops_exactly_the_bad_rows(mode, layer, data, seed):
    """Rows with a bad slot or position give exactly the call with them as
    padding (in a chunk too: no one's window row); a NaN/Inf in q drops only
    that query (its kv stays a chunk row its neighbours see); a NaN/Inf
    chunk_kv row is seen by no query, its own still attends. Dropped and
    padding rows are out 0, lse -inf; each bad row counts once, under the
    first rule it breaks (a bad slot or position with a NaN q too); BAD_INDEX
    and MISSING_BLOCK per index or entry of the good rows, as the oracle
    counts them; the rows that attend are within the bound of the oracle."""
    chunk_mode = mode == "chunk"
    slot, pos, kind = data.draw(attention_rows(chunk_mode))
    rng = np.random.default_rng(seed)
    clean_q = AO.queries(rng, TA, HA)
    q = clean_q.copy()
    for t in np.flatnonzero(np.isin(kind, [1, 2, 3, 5])):   # padding and earlier rules first
        if kind[t] == 5 or rng.random() < 0.5:
            q[t, rng.integers(HA), rng.integers(C.HEAD_DIM)] = rng.choice([np.nan, np.inf, -np.inf])
    chunk = None
    if chunk_mode:
        chunk = AO.bf16(rng.normal(0, 1, (TA, C.HEAD_DIM)))
        for t in np.flatnonzero(kind == 6):
            chunk[t, rng.integers(C.HEAD_DIM)] = rng.choice([np.nan, np.inf, -np.inf])
    sink = rng.normal(0, 1, HA).astype(np.float32)
    topk = random_picks(rng, pos) if layer == 1 else None

    def call(q_, slot_):
        out, lse, st_ = _attend(ATT, layer, *(None if x is None else jnp.asarray(x) for x in (
            q_, slot_, pos, sink, topk, chunk)))
        assert_trees_bytes_equal(dataclasses.replace(st_, errors=ATT.errors), ATT)
        return np.asarray(out, np.float32), np.asarray(lse), counts_delta(st_, ATT)
    out, lse, counts = call(q, slot)
    # the same call with bad slots, bad positions and NaN/Inf kv rows as padding
    # and finite queries in place of the NaN/Inf ones
    want_q = np.where((kind == 5)[:, None, None], clean_q, q)
    want_slot = padded(slot, kind, [2, 3, 6])
    want_out, want_lse, want_counts = call(want_q, want_slot)

    same = np.isin(kind, [0, 1])
    np.testing.assert_array_equal(out[same].view(np.uint32), want_out[same].view(np.uint32))
    np.testing.assert_array_equal(lse[same].view(np.uint32), want_lse[same].view(np.uint32))
    dropped = np.isin(kind, [1, 2, 3, 5])
    assert not out[dropped].any() and np.all(lse[dropped] == -np.inf)
    # against the float64 oracle: every row (kind 6 attends over its
    # neighbours' rows, not its own), and every count
    oracle_out, oracle_lse, M, oracle_counts = AO.attention(ATT, layer, q, slot, pos, sink, topk,
                                                            chunk, FREQ)
    AO.assert_within_bound(out, lse, oracle_out, oracle_lse, M)
    assert counts == oracle_counts
    per_token = {k: v for k, v in counts.items() if k in (K.BAD_SLOT, K.BAD_POSITION, K.NONFINITE)}
    assert per_token == expected_counts(kind, missing_counts=False)
    assert want_counts == AO.attention(ATT, layer, want_q, want_slot, pos, sink, topk, chunk,
                                       FREQ)[3]
