"""gather_topk. On every implementation: which entries a token sees, and
the per-index error rules (bad slot, position, index, missing block). The
CPU handler's error rules on a state it flushed; a wrong operand that
reaches it is named in its error. (Entry values: test_flush.py, CSA.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax.errors import ErrorKind as EK

from support.cpu_ops import csa_params, errors, meta_for, new_state, rng
from support.marks import cpu_target_built, every_impl
from support.raw_ffi import call
from support.tiny_step import errs, same

cpu_module = cpu_target_built("dsv4_append")


# ---- every implementation --------------------------------------------------------------
@every_impl
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
        [127, 128, -1, -1, -1, -1, -1, -1],   # t past max context (512): BAD_POSITION
                                              # once, its indices not examined
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
    assert errs(st) == {EK.BAD_INDEX: 3 + 1 + 1 + 2, EK.BAD_SLOT: 1, EK.BAD_POSITION: 1 + 1,
                        EK.MISSING_BLOCK: 2}
    assert same(st.csa, state.csa) and same(st.swa, state.swa)


@every_impl
def test_topk_positions_at_and_past_max_context(filled):
    """A query position must lie in [0, max_context) (= 512 here), the rule of
    append and flush: at 511 every entry of the table is visible; at 512 and
    at 2^31 - 1 (where (t + 1) // 4 overflows int32) the token counts one
    BAD_POSITION and its row is invalid without its indices being examined."""
    state, mgr = filled["state"], filled["mgr"]
    a = mgr.slot_of(filled["ids"][0])            # 300 tokens: entries 0..74, blocks 0..2
    top = state.config.max_context
    slot = np.int32([a, a, a, a])
    pos = np.int32([top - 1, top, 2 ** 31 - 1, 299])
    idx = np.int32([[0, 74, 127, -7],            # 127 visible, its logical block 3 missing
                    [0, 74, 127, -7],
                    [0, 74, 127, -7],
                    [0, 74, 75, -1]])            # t 299 sees 0..74
    kv, valid, st = D.gather_topk(state, 1, jnp.asarray(slot), jnp.asarray(pos),
                                  jnp.asarray(idx), return_state=True)
    kv, valid = np.asarray(kv, np.float32), np.asarray(valid)
    want = np.zeros((4, 4), bool)
    want[0, [0, 1]] = want[3, [0, 1]] = True
    np.testing.assert_array_equal(valid, want)
    assert not kv[~valid].any() and np.all(np.abs(kv[valid]).sum(-1) > 0)
    np.testing.assert_array_equal(kv[0, :2], kv[3, :2])        # the same entries 0 and 74
    assert errs(st) == {EK.BAD_POSITION: 2, EK.MISSING_BLOCK: 1, EK.BAD_INDEX: 2}


# ---- the CPU handler -------------------------------------------------------------------
@cpu_module
def test_gather_topk_error_rules():
    st = new_state(blocks={0: [4], 2: [-1]})
    cfg = st.config
    p = csa_params()
    n = 16
    mk = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    st = D.flush(st, 1, meta_for(cfg, np.zeros(n, np.int32), np.arange(n, dtype=np.int32)),
                 mk(n, 1024), mk(n, 1024), p, index_kv=mk(n, 256), index_score=mk(n, 256), impl="cpu")
    slots = jnp.array([0, 0, -1, 9, 2, 0], jnp.int32)
    pos = jnp.array([15, 6, 15, 15, 15, -2], jnp.int32)
    idx = jnp.array([[3, -1, 0], [1, 2, -7], [0, 1, 2], [0, 1, 2], [0, -1, -1], [0, 0, 0]], jnp.int32)
    out, valid, st2 = D.gather_topk(st, 1, slots, pos, idx, impl="cpu", return_state=True)
    valid, out = np.asarray(valid), np.asarray(out.astype(jnp.float32))
    # pos 15 sees entries 0..3; pos 6 sees 0..0 (entry 1 emitted at token 7)
    np.testing.assert_array_equal(valid, [[1, 0, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0],
                                          [0, 0, 0]])
    assert (out[~valid] == 0).all() and (np.abs(out[valid]).sum(-1) > 0).all()
    e = errors(st2)
    assert e[EK.BAD_INDEX] == 3 and e[EK.BAD_SLOT] == 1 and e[EK.MISSING_BLOCK] == 1
    assert e[EK.BAD_POSITION] == 1 and e.sum() == 6
    # the same entry read twice gives the same row
    out2, _ = D.gather_topk(st, 1, jnp.array([0], jnp.int32), jnp.array([15], jnp.int32),
                            jnp.array([[0]], jnp.int32), impl="cpu", return_state=False)
    np.testing.assert_array_equal(np.asarray(out2.astype(jnp.float32))[0, 0], out[0, 2])


@cpu_module
def test_gather_topk_bad_indices(st):
    entries = jax.tree_util.tree_leaves(st.csa.kv)
    args = [jnp.int32(0), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros((2,), jnp.int32),
            st.block_table, st.errors, *entries]
    outs = [jax.ShapeDtypeStruct((2, 1, 512), jnp.bfloat16), jax.ShapeDtypeStruct((2, 1), jnp.bool_),
            st.errors]
    with pytest.raises(Exception, match=r"indices: expected shape \[2, \*\], got \[2\]"):
        jax.block_until_ready(call("dsv4_gather_topk", args, outs, {5: 2}, kv_format=0))
