"""append. The CPU handler against numpy (support/npq.py): entries stored in
every format read back through gather_window, bad tokens dropped and
counted, a bad traced layer; a wrong operand that reaches the handler named
in its error; the pools updated in place under jit. On every implementation:
several tokens on one window slot in one call."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax.errors import ErrorKind as EK
from dsv4_jax.meta import StepMeta

from support import npq, write_attrs
from support.cpu_ops import FORMATS, errors, meta_for, new_state, rand_bf16, setup
from support.inplace import check_in_place
from support.marks import cpu_target_built, every_impl
from support.raw_ffi import call
from support.tiny_step import CFG, R

cpu_module = cpu_target_built("dsv4_append")


# ---- the CPU handler against numpy -----------------------------------------------------
@cpu_module
@pytest.mark.parametrize("fmt", FORMATS)
def test_append_then_gather_window_roundtrip(fmt):
    st = new_state(fmt)
    cfg = st.config
    # slot 1: positions 0..9; slot 3: a 200-token chunk 0..199 (only 72..199 stay)
    slots = np.r_[np.full(10, 1), np.full(200, 3)].astype(np.int32)
    pos = np.r_[np.arange(10), np.arange(200)].astype(np.int32)
    kv = rand_bf16(len(slots), 512, scale=3.0)
    kv[5, :64] = npq.bf16(kv[5, :64] * 1e-6)   # a tile below the amax floor
    layer = 2
    st = D.append(st, layer, meta_for(cfg, slots, pos), jnp.asarray(kv, jnp.bfloat16), impl="cpu")
    out, wpos = D.gather_window(st, layer, jnp.array([1, 3, 0, -1], jnp.int32), impl="cpu", return_state=False)
    out, wpos = np.asarray(out.astype(jnp.float32)), np.asarray(wpos)
    assert errors(st).sum() == 0
    # slot 1: ring r holds position r for r < 10
    np.testing.assert_array_equal(wpos[0], np.r_[np.arange(10), np.full(118, -1)])
    np.testing.assert_array_equal(out[0, :10], npq.entry_roundtrip(kv[:10], fmt))
    assert (out[0, 10:] == 0).all()
    # slot 3: ring r holds the largest position = r (mod 128) of 0..199
    want_pos = np.array([r + 128 if r + 128 < 200 else r for r in range(128)])
    np.testing.assert_array_equal(wpos[1], want_pos)
    np.testing.assert_array_equal(out[1], npq.entry_roundtrip(kv[10 + want_pos], fmt))
    # untouched slot and padding slot: empty
    assert (wpos[2:] == -1).all() and (out[2:] == 0).all()
    # other layers untouched
    for leaf, leaf0 in zip(jax.tree_util.tree_leaves(st.swa.kv),
                           jax.tree_util.tree_leaves(new_state(fmt).swa.kv)):
        a, b = np.asarray(leaf), np.asarray(leaf0)
        np.testing.assert_array_equal(np.delete(a, layer, 0).view(np.uint8),
                                      np.delete(b, layer, 0).view(np.uint8))


@cpu_module
def test_append_bad_tokens_dropped_and_counted():
    st = new_state()
    cfg = st.config
    slots = np.array([0, -1, 4, 7, 0, 0], np.int32)
    pos = np.array([0, 1, 1, 2, -3, 512], np.int32)     # 512 = max_context
    kv = rand_bf16(6, 512)
    st = D.append(st, 0, meta_for(cfg, slots, pos), jnp.asarray(kv, jnp.bfloat16), impl="cpu")
    e = errors(st)
    assert e[EK.BAD_SLOT] == 2 and e[EK.BAD_POSITION] == 2 and e.sum() == 4
    _, wpos = D.gather_window(st, 0, jnp.arange(4, dtype=jnp.int32), impl="cpu", return_state=False)
    wpos = np.asarray(wpos)
    assert wpos[0, 0] == 0 and (wpos[0, 1:] == -1).all() and (wpos[1:] == -1).all()


@cpu_module
def test_append_traced_bad_layer():
    st = new_state()
    cfg = st.config
    m = meta_for(cfg, np.array([0], np.int32), np.array([0], np.int32))
    kv = jnp.asarray(rand_bf16(1, 512), jnp.bfloat16)
    f = jax.jit(lambda s, l: D.append(s, l, m, kv, impl="cpu"))
    st2 = f(st, jnp.int32(9))
    assert errors(st2)[EK.BAD_LAYER] == 1
    assert (np.asarray(st2.swa.pos) == -1).all()


# ---- operands that reach the CPU handler -----------------------------------------------
def append_call(st, kv=None, layer=None, entries=None, pos=None, meta=None, **attrs):
    T = 3
    kv = jnp.zeros((T, 512), jnp.bfloat16) if kv is None else kv
    layer = jnp.int32(0) if layer is None else layer
    entries = jax.tree_util.tree_leaves(st.swa.kv) if entries is None else entries
    pos = st.swa.pos if pos is None else pos
    # token_slot (all 0), token_pos 0..T-1, then a field the handler ignores
    meta = jnp.int32([0] * T + list(range(T)) + [7]) if meta is None else meta
    aliased = [pos, st.errors, *entries]
    args = [layer, meta, kv, *aliased]
    attrs = write_attrs.changed(attrs)
    return call("dsv4_append", args, aliased, {3 + i: i for i in range(len(aliased))}, **attrs)


@cpu_module
def test_append_good_call_runs(st):
    out = append_call(st)
    assert np.asarray(out[0])[0, 0, :3].tolist() == [0, 1, 2]


@cpu_module
@pytest.mark.parametrize("case, pattern", [
    ("kv_dtype", r"kv: expected dtype bfloat16, got float32"),
    ("kv_shape", r"kv: expected shape \[\*, 512\], got \[3, 448\]"),
    ("meta_short", r"meta: expected at least 2 \* T = 6 int32s .* got 5"),
    ("meta_dtype", r"meta: expected dtype int32, got float32"),
    ("meta_rank", r"meta: expected shape \[\*\], got \[2, 3\]"),
    ("layer_dtype", r"layer: expected dtype int32, got float32"),
    ("layer_rank", r"layer: expected shape \[\], got \[1\]"),
    ("leaf_count", r"swa.kv: expected 3 entry buffers .* got 2"),
    ("leaf_dtype", r"swa.kv.nope: expected dtype float8_e4m3fn, got bfloat16"),
    ("scale_shape", r"swa.kv.scale: expected shape \[4, 2, 128, 7\], got \[4, 2, 128, 1\]"),
    ("pos_shape", r"swa.pos: expected shape \[\*, \*, 128\], got \[4, 2, 64\]"),
])
def test_append_bad_operands(st, case, pattern):
    nope, rope, scale = jax.tree_util.tree_leaves(st.swa.kv)
    kw = {}
    if case == "kv_dtype":
        kw["kv"] = jnp.zeros((3, 512), jnp.float32)
    elif case == "kv_shape":
        kw["kv"] = jnp.zeros((3, 448), jnp.bfloat16)
    elif case == "meta_short":
        kw["meta"] = jnp.zeros(5, jnp.int32)
    elif case == "meta_dtype":
        kw["meta"] = jnp.zeros(6, jnp.float32)
    elif case == "meta_rank":
        kw["meta"] = jnp.zeros((2, 3), jnp.int32)
    elif case == "layer_dtype":
        kw["layer"] = jnp.float32(0)
    elif case == "layer_rank":
        kw["layer"] = jnp.zeros((1,), jnp.int32)
    elif case == "leaf_count":
        kw["entries"] = [nope, rope]
    elif case == "leaf_dtype":
        kw["entries"] = [nope.astype(jnp.bfloat16), rope, scale]
    elif case == "scale_shape":
        kw["entries"] = [nope, rope, scale[..., :1]]
    elif case == "pos_shape":
        kw["pos"] = st.swa.pos[..., :64]
    with pytest.raises(Exception, match=pattern):
        jax.block_until_ready(append_call(st, **kw))


@cpu_module
@pytest.mark.parametrize("change, pattern", write_attrs.BAD)
def test_append_bad_attributes_rejected(st, change, pattern):
    """Append's attributes are the write ops' one struct (WriteAttrs),
    checked by flush's code (test_flush.py takes the same cases)."""
    with pytest.raises(Exception, match=pattern):
        jax.block_until_ready(append_call(st, **change))


@cpu_module
def test_bf16_format_wants_two_leaves(st):
    nope, rope, scale = jax.tree_util.tree_leaves(st.swa.kv)
    with pytest.raises(Exception, match=r"expected 2 entry buffers \(nope, rope\) for kv_format 2, got 3"):
        jax.block_until_ready(append_call(st, kv_format=2))


# ---- in place --------------------------------------------------------------------------
@cpu_module
def test_append_in_place():
    st, meta = setup()
    kv = jnp.ones((2, 512), jnp.bfloat16)
    check_in_place(lambda s, m, k: D.append(s, 2, m, k, impl="cpu"), st, (meta, kv),
                   lambda s: (s.swa, s.errors))


# ---- every implementation --------------------------------------------------------------
@every_impl
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
    out, pos = D.gather_window(state, 2, jnp.int32([0, 1, 2]), return_state=False)
    out, pos = np.asarray(out, np.float32), np.asarray(pos)
    ref = np.asarray(D.gather_window(
        jax.jit(lambda s: D.append(s, 2, StepMeta.build(
            token_slot=np.int32([0, 1, 2]), token_pos=np.int32([300, 5, 9]),
            lengths=np.zeros(R, np.int32)), kv[jnp.array([0, 4, 5])]))(D.init_state(CFG)),
        2, jnp.int32([0, 1, 2]), return_state=False)[0], np.float32)
    assert pos[0, 44] == 300 and pos[1, 5] == 5 and pos[2, 9] == 9
    assert (pos >= 0).sum() == 3
    np.testing.assert_array_equal(out, ref)       # rows 0, 4 (the later of the 5s), 5
