"""Visibility of compressed entries and the per-row error rules of the ops
(DESIGN §9, docstrings of dsv4_jax/ops): bad rows are dropped and counted,
valid rows in the same call are unaffected, a bad traced layer counts
BAD_LAYER once and changes nothing."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax import config as C
from dsv4_jax.errors import ErrorKind as K
from dsv4_jax.meta import StepMeta

from support.harness import make_params, raw

# every test here runs once per implementation (reference, CPU FFI, CUDA)
pytestmark = pytest.mark.usefixtures("impl_under_test")

CFG = C.CacheConfig.tiny()          # R 4, MB 4 (512 tokens), N 16
R, MB, N = CFG.max_requests, CFG.max_blocks_per_request, CFG.num_blocks


def errs(state):
    e = np.asarray(state.errors)
    return {K(i): int(v) for i, v in enumerate(e) if v}


def same(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(raw(x), raw(y)) for x, y in zip(la, lb))


def inputs(rng, T):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    return dict(win=f(T, 512).astype(jnp.bfloat16), ckv=f(T, 1024), csc=f(T, 1024),
                ikv=f(T, 256), isc=f(T, 256), hkv=f(T, 512), hsc=f(T, 512))


def _ops(state, meta, x, csa_p, hca_p):
    state = D.append(state, 0, meta, x["win"])
    state = D.flush(state, 1, meta, x["ckv"], x["csc"], csa_p, index_kv=x["ikv"],
                    index_score=x["isc"])
    return D.flush(state, 2, meta, x["hkv"], x["hsc"], hca_p)


@functools.partial(jax.jit, donate_argnames=("state",))
def step(state, meta, x, csa_p, hca_p):
    return _ops(D.apply_step(state, meta), meta, x, csa_p, hca_p)


@jax.jit
def ops_only(state, meta, x, csa_p, hca_p):
    return _ops(state, meta, x, csa_p, hca_p)


@pytest.fixture(scope="module")
def filled():
    """Two requests of 300 and 130 tokens (one prefill step each), a third
    admitted with no tokens (no blocks)."""
    rng = np.random.default_rng(0)
    csa_p, hca_p = make_params(rng)
    state = D.init_state(CFG)
    mgr = D.CacheManager(CFG)
    a, b, c = mgr.admit(), mgr.admit(), mgr.admit()
    meta = mgr.prepare_step({a: 300, b: 130, c: 0})
    state = step(state, meta, inputs(rng, meta.num_tokens), csa_p[0], hca_p)
    assert not errs(state)
    return dict(state=state, mgr=mgr, ids=(a, b, c), csa_p=csa_p[0], hca_p=hca_p)


def test_topk_visibility_and_errors(filled):
    state, mgr = filled["state"], filled["mgr"]
    a, b, c = (mgr.slot_of(r) for r in filled["ids"])
    slot = np.int32([a, a, a, b, -1, 7, a, c, a])
    pos = np.int32([299, 2, 3, 129, 50, 10, -5, 40, 520])
    idx = np.int32([
        [0, 74, 75, -1, 40, -2, 1000, 74],    # t 299 sees 0..74
        [0, -1, -1, -1, -1, -1, -1, -1],      # t 2 sees nothing yet (entry 0 exists)
        [0, 1, -1, -1, -1, -1, -1, -1],       # t 3 sees entry 0
        [31, 32, 33, 0, -1, -1, -1, -1],      # t 129 sees 0..31 (130 tokens: 32 entries)
        [0, 1, 2, 3, 4, 5, 6, 7],             # padding token: nothing counted
        [0, 1, 2, 3, 4, 5, 6, 7],             # bad slot: BAD_SLOT once
        [0, 1, 2, 3, 4, 5, 6, 7],             # negative position: BAD_POSITION once
        [0, 5, -1, -1, -1, -1, -1, -1],       # no blocks: MISSING_BLOCK per index
        [127, 128, -1, -1, -1, -1, -1, -1],   # t past max context: 127 has no block,
                                              # 128 is past the block table (BAD_INDEX)
    ])
    kv, valid, st = D.gather_topk(state, 1, jnp.asarray(slot), jnp.asarray(pos),
                                  jnp.asarray(idx), return_state=True)
    kv, valid = np.asarray(kv, np.float32), np.asarray(valid)
    want = np.zeros_like(valid)
    want[0, [0, 1, 4, 7]] = True
    want[2, 0] = True
    want[3, [0, 3]] = True
    assert np.array_equal(valid, want), valid.astype(int)
    assert not kv[~valid].any()
    assert np.all(np.abs(kv[valid]).sum(-1) > 0)
    np.testing.assert_array_equal(kv[0, 0], kv[2, 0])        # the same entry 0
    assert errs(st) == {K.BAD_INDEX: 3 + 1 + 1 + 2 + 1, K.BAD_SLOT: 1, K.BAD_POSITION: 1,
                        K.MISSING_BLOCK: 2 + 1}
    assert same(st.csa, state.csa) and same(st.swa, state.swa)


def test_gather_all_counts_and_errors(filled):
    state, mgr = filled["state"], filled["mgr"]
    a, b, c = (mgr.slot_of(r) for r in filled["ids"])
    slots = np.int32([a, b, a, -1, 9, a, a, a, c])
    lengths = np.int32([300, 130, 127, 300, 300, 513, -1, 300, 256])
    kv, count, st = D.gather_all(state, 2, jnp.asarray(slots), jnp.asarray(lengths), 2,
                                 return_state=True)
    count, kv = np.asarray(count), np.asarray(kv, np.float32)
    assert count.tolist() == [2, 1, 0, 0, 0, 0, 0, 2, 2]
    assert np.all(np.abs(kv[0, :2]).sum(-1) > 0) and np.all(np.abs(kv[1, 0]).sum() > 0)
    assert not kv[1, 1:].any() and not kv[2:7].any() and not kv[8].any()
    np.testing.assert_array_equal(kv[0], kv[7])
    assert errs(st) == {K.BAD_SLOT: 1, K.BAD_LENGTH: 2, K.MISSING_BLOCK: 2}
    # count > max_entries is a bad length too
    _, count, st = D.gather_all(state, 2, jnp.int32([a]), jnp.int32([300]), 1, return_state=True)
    assert count.tolist() == [0] and errs(st) == {K.BAD_LENGTH: 1}


def test_gather_window_slots(filled):
    state, mgr = filled["state"], filled["mgr"]
    a, b, _ = (mgr.slot_of(r) for r in filled["ids"])
    kv, pos, st = D.gather_window(state, 0, jnp.int32([a, b, -1, 5]), return_state=True)
    pos, kv = np.asarray(pos), np.asarray(kv, np.float32)
    ring = np.arange(128)
    assert np.array_equal(pos[0], 172 + (ring - 172) % 128)       # positions 172..299
    assert np.array_equal(pos[1], np.where(ring < 2, ring + 128, ring))   # 2..129
    assert np.all(pos[2:] == -1) and not kv[2:].any()
    assert errs(st) == {K.BAD_SLOT: 1}
    # other layers were never written
    _, pos3 = D.gather_window(state, 3, jnp.int32([a]))
    assert np.all(np.asarray(pos3) == -1)


def test_bad_tokens_are_dropped_and_counted():
    """The same two requests with and without bad tokens mixed into the
    batch give identical pools, windows and accumulators."""
    rng = np.random.default_rng(1)
    csa_p, hca_p = make_params(rng)
    mgr = D.CacheManager(CFG)
    a, b = mgr.admit(), mgr.admit()
    meta = mgr.prepare_step({a: 140, b: 9}, min_tokens=256)
    T = meta.num_tokens
    x = inputs(rng, T)
    clean = step(D.init_state(CFG), meta, x, csa_p[0], hca_p)
    assert not errs(clean)

    slot, pos = np.array(meta.token_slot), np.array(meta.token_pos)
    n = 149
    sa, sb = mgr.slot_of(a), mgr.slot_of(b)
    free = [s for s in range(R) if s not in (sa, sb)][0]
    bad = {n: (7, 3), n + 1: (-3, 3), n + 2: (sa, -1), n + 3: (sa, 512), n + 4: (sb, 200),
           n + 5: (free, 0), n + 6: (-1, -9)}
    # -3 is a bad slot (not padding); sb at 200 has no block for positions 128+;
    # a slot without blocks is MISSING_BLOCK for flush but fine for the window
    for row, (s, p) in bad.items():
        slot[row], pos[row] = s, p
    meta_bad = StepMeta.build(token_slot=slot, token_pos=pos, lengths=meta.lengths,
                              new_blocks=meta.new_blocks, reset_slots=meta.reset_slots)
    dirty = step(D.init_state(CFG), meta_bad, x, csa_p[0], hca_p)
    # per op: append counts BAD_SLOT 2, BAD_POSITION 2; each flush (CSA, HCA)
    # counts BAD_SLOT 2, BAD_POSITION 2, MISSING_BLOCK 2 (sb@200, free@0)
    assert errs(dirty) == {K.BAD_SLOT: 6, K.BAD_POSITION: 6, K.MISSING_BLOCK: 4}
    for part in ("csa", "hca", "block_table"):
        assert same(getattr(dirty, part), getattr(clean, part)), part
    # the window took the two tokens of valid slots and positions
    win_c, win_d = np.asarray(clean.swa.pos), np.asarray(dirty.swa.pos)
    diff = np.argwhere(win_c != win_d)
    assert sorted(map(tuple, diff.tolist())) == sorted([(0, free, 0), (0, sb, 200 % 128)])
    assert win_d[0, sb, 200 % 128] == 200 and win_d[0, free, 0] == 0


def test_traced_bad_layer_counts_once_and_changes_nothing(filled):
    state = filled["state"]
    rng = np.random.default_rng(2)
    meta = StepMeta.build(token_slot=np.int32([0, 1]), token_pos=np.int32([300, 130]),
                          lengths=np.zeros(R, np.int32))
    x = inputs(rng, 2)

    @jax.jit
    def bad_calls(state, layer, hca_layer):
        s = D.append(state, layer, meta, x["win"])
        s = D.flush(s, layer, meta, x["ckv"], x["csc"], filled["csa_p"], index_kv=x["ikv"],
                    index_score=x["isc"])
        s = D.flush(s, hca_layer, meta, x["hkv"], x["hsc"], filled["hca_p"])
        _, _, s = D.gather_window(s, layer, jnp.int32([0, -1]), return_state=True)
        kv, valid, s = D.gather_topk(s, layer, jnp.int32([0]), jnp.int32([299]),
                                     jnp.int32([[0, 1]]), return_state=True)
        kv2, cnt, s = D.gather_all(s, hca_layer, jnp.int32([0]), jnp.int32([300]), 2,
                                   return_state=True)
        return s, valid, kv, cnt, kv2

    # 9 is out of range for every op; 0 is SWA (not CSA/HCA) for the pool ops
    for layer, hca_layer, calls in ((9, 9, 6), (0, 0, 4), (-3, 1, 6)):
        s, valid, kv, cnt, kv2 = bad_calls(state, jnp.int32(layer), jnp.int32(hca_layer))
        assert errs(s) == {K.BAD_LAYER: calls}, (layer, errs(s))
        assert not np.asarray(valid).any() and not np.asarray(kv, np.float32).any()
        assert np.asarray(cnt).tolist() == [0] and not np.asarray(kv2, np.float32).any()
        for part in ("swa", "csa", "hca", "block_table"):
            if layer == 0 and part == "swa":
                continue        # layer 0 is a valid window layer: append wrote there
            assert same(getattr(s, part), getattr(state, part)), (layer, part)


def test_window_collisions_largest_position_then_later_row():
    """Several tokens of one call on the same (slot, ring slot): the largest
    position wins whatever the row order; equal positions: the later row."""
    rng = np.random.default_rng(3)
    state = D.init_state(CFG)
    kv = jnp.asarray(rng.standard_normal((6, 512)), jnp.bfloat16)
    meta = StepMeta.build(token_slot=np.int32([0, 0, 0, 1, 1, 2]),
                          token_pos=np.int32([300, 44, 172, 5, 5, 9]),
                          lengths=np.zeros(R, np.int32))
    state = jax.jit(lambda s: D.append(s, 2, meta, kv))(state)
    out, pos = D.gather_window(state, 2, jnp.int32([0, 1, 2]))
    out, pos = np.asarray(out, np.float32), np.asarray(pos)
    ref = np.asarray(D.gather_window(
        jax.jit(lambda s: D.append(s, 2, StepMeta.build(
            token_slot=np.int32([0, 1, 2]), token_pos=np.int32([300, 5, 9]),
            lengths=np.zeros(R, np.int32)), kv[jnp.array([0, 4, 5])]))(D.init_state(CFG)),
        2, jnp.int32([0, 1, 2]))[0], np.float32)
    assert pos[0, 44] == 300 and pos[1, 5] == 5 and pos[2, 9] == 9
    assert (pos >= 0).sum() == 3
    np.testing.assert_array_equal(out, ref)       # rows 0, 4 (the later of the 5s), 5


def test_traced_layer_equals_static_layer():
    """Models that lax.scan over layers pass the layer as a traced int32."""
    rng = np.random.default_rng(4)
    csa_p, hca_p = make_params(rng)
    mgr = D.CacheManager(CFG)
    a, b = mgr.admit(), mgr.admit()
    meta = mgr.prepare_step({a: 9, b: 6}, min_tokens=16)
    x = inputs(rng, meta.num_tokens)
    base = D.apply_step(D.init_state(CFG), meta)

    def ops(state, layer):
        s = D.append(state, layer, meta, x["win"])
        return D.flush(s, layer, meta, x["ckv"], x["csc"], csa_p[1], index_kv=x["ikv"],
                       index_score=x["isc"])

    static = jax.jit(lambda s: ops(s, 3))(base)
    traced = jax.jit(ops)(base, jnp.int32(3))
    assert same(static, traced) and not errs(traced)
    assert not same(static.csa.kv, base.csa.kv)   # entries were written (9 and 6 tokens)
