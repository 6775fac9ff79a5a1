"""gather_window. On every implementation: the rings of two filled requests,
bad and padding slots (counted, read as empty), layers never written. A
wrong operand that reaches the CPU handler is named in its error. (Entries
stored by append and read back: test_append.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax.errors import ErrorKind as EK

from support.marks import cpu_target_built, every_impl
from support.raw_ffi import call
from support.tiny_step import errs

cpu_module = cpu_target_built("dsv4_append")


# ---- every implementation --------------------------------------------------------------
@every_impl
def test_gather_window_slots(filled):
    state, mgr = filled["state"], filled["mgr"]
    a, b, _ = (mgr.slot_of(r) for r in filled["ids"])
    kv, pos, st = D.gather_window(state, 0, jnp.int32([a, b, -1, 5]), return_state=True)
    pos, kv = np.asarray(pos), np.asarray(kv, np.float32)
    ring = np.arange(128)
    assert np.array_equal(pos[0], 172 + (ring - 172) % 128)       # positions 172..299
    assert np.array_equal(pos[1], np.where(ring < 2, ring + 128, ring))   # 2..129
    assert np.all(pos[2:] == -1) and not kv[2:].any()
    assert errs(st) == {EK.BAD_SLOT: 1}
    # other layers were never written
    _, pos3 = D.gather_window(state, 3, jnp.int32([a]), return_state=False)
    assert np.all(np.asarray(pos3) == -1)


# ---- operands that reach the CPU handler -----------------------------------------------
@cpu_module
def test_gather_window_bad_slots(st):
    entries = jax.tree_util.tree_leaves(st.swa.kv)
    args = [jnp.int32(0), jnp.zeros((2, 1), jnp.int32), st.swa.pos, st.errors, *entries]
    outs = [jax.ShapeDtypeStruct((2, 128, 512), jnp.bfloat16), jax.ShapeDtypeStruct((2, 128), jnp.int32),
            st.errors]
    with pytest.raises(Exception, match=r"slots: expected shape \[\*\], got \[2, 1\]"):
        jax.block_until_ready(call("dsv4_gather_window", args, outs, {3: 2}, kv_format=0))


@cpu_module
def test_gather_window_bad_result_shape(st):
    entries = jax.tree_util.tree_leaves(st.swa.kv)
    args = [jnp.int32(0), jnp.zeros((2,), jnp.int32), st.swa.pos, st.errors, *entries]
    outs = [jax.ShapeDtypeStruct((2, 64, 512), jnp.bfloat16), jax.ShapeDtypeStruct((2, 128), jnp.int32),
            st.errors]
    with pytest.raises(Exception, match=r"kv \(result\): expected shape \[2, 128, 512\]"):
        jax.block_until_ready(call("dsv4_gather_window", args, outs, {3: 2}, kv_format=0))
