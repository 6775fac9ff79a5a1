"""A wrong shape, dtype, attribute or operand count that reaches a CPU FFI
handler comes back as a readable error naming the operand, not a crash. The
calls go through jax.ffi.ffi_call directly, past the Python trace-time checks."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax import _ffi

pytestmark = pytest.mark.skipif(not _ffi.has_target("cpu", "dsv4_append"),
                                reason="CPU FFI module not built")


@pytest.fixture(scope="module")
def st():
    return D.init_state(D.CacheConfig.tiny(max_requests=2, max_context=256))


def call(target, args, outs, aliases, **attrs):
    f = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs],
                         input_output_aliases=aliases)
    return f(*args, **{k: np.int64(v) for k, v in attrs.items()})


def append_call(st, kv=None, layer=None, entries=None, pos=None, **attrs):
    T = 3
    kv = jnp.zeros((T, 512), jnp.bfloat16) if kv is None else kv
    layer = jnp.int32(0) if layer is None else layer
    entries = jax.tree_util.tree_leaves(st.swa.kv) if entries is None else entries
    pos = st.swa.pos if pos is None else pos
    aliased = [pos, st.errors, *entries]
    args = [layer, jnp.zeros(T, jnp.int32), jnp.arange(T, dtype=jnp.int32), kv, *aliased]
    attrs = {"kv_format": 0, "max_context": 256, **attrs}
    return call("dsv4_append", args, aliased, {4 + i: i for i in range(len(aliased))}, **attrs)


def test_append_good_call_runs(st):
    out = append_call(st)
    assert np.asarray(out[0])[0, 0, :3].tolist() == [0, 1, 2]


@pytest.mark.parametrize("case, pattern", [
    ("kv_dtype", r"kv: expected dtype bfloat16, got float32"),
    ("kv_shape", r"kv: expected shape \[3, 512\], got \[3, 448\]"),
    ("layer_dtype", r"layer: expected dtype int32, got float32"),
    ("layer_rank", r"layer: expected shape \[\], got \[1\]"),
    ("leaf_count", r"swa.kv: expected 3 entry buffers .* got 2"),
    ("leaf_dtype", r"swa.kv.nope: expected dtype float8_e4m3fn, got bfloat16"),
    ("scale_shape", r"swa.kv.scale: expected shape \[4, 2, 128, 7\], got \[4, 2, 128, 1\]"),
    ("kv_format", r"kv_format: expected 0 \(ds_fp8\), 1 \(fp8_token\) or 2 \(bf16\), got 7"),
    ("max_context", r"max_context: expected a positive multiple of 128, got 0"),
    ("pos_shape", r"swa.pos: expected shape \[\*, \*, 128\], got \[4, 2, 64\]"),
])
def test_append_bad_operands(st, case, pattern):
    nope, rope, scale = jax.tree_util.tree_leaves(st.swa.kv)
    kw = {}
    if case == "kv_dtype":
        kw["kv"] = jnp.zeros((3, 512), jnp.float32)
    elif case == "kv_shape":
        kw["kv"] = jnp.zeros((3, 448), jnp.bfloat16)
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
    elif case == "kv_format":
        kw["kv_format"] = 7
    elif case == "max_context":
        kw["max_context"] = 0
    elif case == "pos_shape":
        kw["pos"] = st.swa.pos[..., :64]
    with pytest.raises(Exception, match=pattern):
        jax.block_until_ready(append_call(st, **kw))


def test_bf16_format_wants_two_leaves(st):
    nope, rope, scale = jax.tree_util.tree_leaves(st.swa.kv)
    with pytest.raises(Exception, match=r"expected 2 entry buffers \(nope, rope\) for kv_format 2, got 3"):
        jax.block_until_ready(append_call(st, kv_format=2))


def test_gather_window_bad_slots(st):
    entries = jax.tree_util.tree_leaves(st.swa.kv)
    args = [jnp.int32(0), jnp.zeros((2, 1), jnp.int32), st.swa.pos, st.errors, *entries]
    outs = [jax.ShapeDtypeStruct((2, 128, 512), jnp.bfloat16), jax.ShapeDtypeStruct((2, 128), jnp.int32),
            st.errors]
    with pytest.raises(Exception, match=r"slots: expected shape \[\*\], got \[2, 1\]"):
        jax.block_until_ready(call("dsv4_gather_window", args, outs, {3: 2}, kv_format=0))


def test_gather_window_bad_result_shape(st):
    entries = jax.tree_util.tree_leaves(st.swa.kv)
    args = [jnp.int32(0), jnp.zeros((2,), jnp.int32), st.swa.pos, st.errors, *entries]
    outs = [jax.ShapeDtypeStruct((2, 64, 512), jnp.bfloat16), jax.ShapeDtypeStruct((2, 128), jnp.int32),
            st.errors]
    with pytest.raises(Exception, match=r"kv \(result\): expected shape \[2, 128, 512\]"):
        jax.block_until_ready(call("dsv4_gather_window", args, outs, {3: 2}, kv_format=0))


def test_gather_topk_bad_indices(st):
    entries = jax.tree_util.tree_leaves(st.csa.kv)
    args = [jnp.int32(0), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros((2,), jnp.int32),
            st.block_table, st.errors, *entries]
    outs = [jax.ShapeDtypeStruct((2, 1, 512), jnp.bfloat16), jax.ShapeDtypeStruct((2, 1), jnp.bool_),
            st.errors]
    with pytest.raises(Exception, match=r"indices: expected shape \[2, \*\], got \[2\]"):
        jax.block_until_ready(call("dsv4_gather_topk", args, outs, {5: 2}, kv_format=0))


def test_gather_all_wrong_pool(st):
    # the CSA pool (32 entries per block) passed where HCA entries belong
    entries = jax.tree_util.tree_leaves(st.csa.kv)
    args = [jnp.int32(0), jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), st.block_table,
            st.errors, *entries]
    outs = [jax.ShapeDtypeStruct((2, 2, 512), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32),
            st.errors]
    with pytest.raises(Exception, match=r"hca.kv.nope: expected shape \[2, \d+, 1, 448\]"):
        jax.block_until_ready(call("dsv4_gather_all", args, outs, {4: 2}, kv_format=0, max_context=256))


def hca_flush_args(st, ape_rows=128, kv_dtype=jnp.float32):
    T = 2
    aliased = [st.hca.comp, st.errors, *jax.tree_util.tree_leaves(st.hca.kv)]
    args = [jnp.int32(0), jnp.zeros(T, jnp.int32), jnp.arange(T, dtype=jnp.int32),
            jnp.zeros((T, 512), kv_dtype), jnp.zeros((T, 512), jnp.float32),
            jnp.zeros((ape_rows, 512), jnp.float32), jnp.ones(512, jnp.float32),
            jnp.ones(32, jnp.float32), st.block_table, *aliased]
    return args, aliased


def test_flush_hca_bad_ape(st):
    args, aliased = hca_flush_args(st, ape_rows=4)
    with pytest.raises(Exception, match=r"params.ape: expected shape \[128, 512\], got \[4, 512\]"):
        jax.block_until_ready(call("dsv4_flush_hca", args, aliased,
                                   {9 + i: i for i in range(len(aliased))}, kv_format=0, max_context=256))


def test_flush_hca_bf16_projection_rejected(st):
    args, aliased = hca_flush_args(st, kv_dtype=jnp.bfloat16)
    with pytest.raises(Exception, match=r"kv: expected dtype float32, got bfloat16"):
        jax.block_until_ready(call("dsv4_flush_hca", args, aliased,
                                   {9 + i: i for i in range(len(aliased))}, kv_format=0, max_context=256))


def test_flush_csa_missing_indexer_state(st):
    T = 2
    z = lambda *s: jnp.zeros(s, jnp.float32)
    # icomp left out: every later aliased operand shifts by one
    aliased = [st.csa.comp, st.csa.index.packed, st.csa.index.scale, st.errors,
               *jax.tree_util.tree_leaves(st.csa.kv)]
    args = [jnp.int32(0), jnp.zeros(T, jnp.int32), jnp.arange(T, dtype=jnp.int32), z(T, 1024), z(T, 1024),
            z(4, 1024), z(512), z(32), z(T, 256), z(T, 256), z(4, 256), z(128), z(32), st.block_table,
            *aliased]
    with pytest.raises(Exception, match=r"csa.icomp: expected dtype float32, got uint8"):
        jax.block_until_ready(call("dsv4_flush_csa", args, aliased,
                                   {14 + i: i for i in range(len(aliased))}, kv_format=0, max_context=256))
