"""Rules every op keeps within a step (docs/design/bad-input.md, docstrings of
dsv4_jax/ops), on every implementation: bad rows mixed into a step's batch
are dropped and counted and the valid rows give what they give without
them; a bad traced layer counts BAD_LAYER once per op and changes nothing;
a traced layer equals the same static layer."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax.errors import ErrorKind as K
from dsv4_jax.meta import StepMeta

from support.harness import make_params
from support.tiny_step import CFG, R, errs, inputs, same, step

# every test here runs once per implementation (reference, CPU FFI, CUDA)
pytestmark = pytest.mark.usefixtures("impl_under_test")


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
    # counts BAD_SLOT 2, BAD_POSITION 3 (sa@-1, sa@512, and sb@200, which is
    # not sb's expected position 9 in the call, docs/design/semantics.md),
    # MISSING_BLOCK 1 (free@0). sa's two bad rows take expected positions 140
    # and 141, which close no window, so the state is the clean one.
    assert errs(dirty) == {K.BAD_SLOT: 6, K.BAD_POSITION: 8, K.MISSING_BLOCK: 2}
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
