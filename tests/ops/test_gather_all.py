"""gather_all. On every implementation: entry counts of filled requests, bad
slots and lengths (counted, read as empty), a count past max_entries. The
CPU handler's error rules on a state it flushed; a wrong operand that
reaches it is named in its error. (Entry values: test_flush.py, HCA.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax.errors import ErrorKind as EK

from support.cpu_ops import errors, hca_params, meta_for, new_state, rng
from support.marks import cpu_target_built, every_impl
from support.raw_ffi import call
from support.tiny_step import errs

cpu_module = cpu_target_built("dsv4_append")


# ---- every implementation --------------------------------------------------------------
@every_impl
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
    assert errs(st) == {EK.BAD_SLOT: 1, EK.BAD_LENGTH: 2, EK.MISSING_BLOCK: 2}
    # count > max_entries is a bad length too
    _, count, st = D.gather_all(state, 2, jnp.int32([a]), jnp.int32([300]), 1, return_state=True)
    assert count.tolist() == [0] and errs(st) == {EK.BAD_LENGTH: 1}


# ---- the CPU handler -------------------------------------------------------------------
@cpu_module
def test_gather_all_error_rules():
    st = new_state(blocks={0: [1, 2], 1: [3, -1]})
    cfg = st.config
    p = hca_params()
    n = 256
    for s in (0, 1):
        st = D.flush(st, 2, meta_for(cfg, np.full(n, s, np.int32), np.arange(n, dtype=np.int32)),
                     jnp.asarray(rng.standard_normal((n, 512)).astype(np.float32)),
                     jnp.asarray(rng.standard_normal((n, 512)).astype(np.float32)), p, impl="cpu")
    e0 = errors(st)
    assert e0[EK.MISSING_BLOCK] == 128 and e0.sum() == 128     # slot 1's second block
    slots = jnp.array([0, 1, -1, 5, 0, 0, 0], jnp.int32)
    lengths = jnp.array([256, 256, 256, 10, -1, 600, 300], jnp.int32)
    out, count, st2 = D.gather_all(st, 2, slots, lengths, 2, impl="cpu", return_state=True)
    out, count = np.asarray(out.astype(jnp.float32)), np.asarray(count)
    np.testing.assert_array_equal(count, [2, 2, 0, 0, 0, 0, 2])
    e = errors(st2) - e0
    assert e[EK.MISSING_BLOCK] == 1 and e[EK.BAD_SLOT] == 1 and e[EK.BAD_LENGTH] == 2
    assert e.sum() == 4
    assert (np.abs(out[0]).sum(-1) > 0).all() and (np.abs(out[1, 0]).sum() > 0)
    assert (out[1, 1] == 0).all() and (out[2:6] == 0).all()
    np.testing.assert_array_equal(out[6], out[0])


@cpu_module
def test_gather_all_wrong_pool(st):
    # the CSA pool (32 entries per block) passed where HCA entries belong
    entries = jax.tree_util.tree_leaves(st.csa.kv)
    args = [jnp.int32(0), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), st.block_table,
            st.errors, *entries]
    outs = [jax.ShapeDtypeStruct((2, 2, 512), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32),
            st.errors]
    with pytest.raises(Exception, match=r"hca.kv.nope: expected shape \[2, \d+, 1, 448\]"):
        jax.block_until_ready(call("dsv4_gather_all", args, outs, {4: 2}, kv_format=0, max_context=256))
