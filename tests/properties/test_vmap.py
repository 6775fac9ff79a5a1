"""jax.vmap over the ops (the package docstring, "Batching with vmap"): each
element of a mapped call is exactly the unbatched call on that element,
for the compiled handlers (run once per element) and for the jnp reference
(vectorized by JAX); a write mapped over a batch of operands against one
cache returns one cache per element. Random inputs; every output and state
byte compared."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D

from support.harness import raw
from support.marks import CUDA, requires_cpu_ffi

IMPLS = ["reference", pytest.param("cpu", marks=requires_cpu_ffi),
         pytest.param("cuda", marks=CUDA)]
BATCH = 3


def assert_trees_equal(got, want, what):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got),
                            jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(raw(x), raw(y), err_msg=what + jax.tree_util.keystr(path))


def element(tree, i):
    return jax.tree_util.tree_map(lambda x: x[i], tree)


def decode_tokens(filled):
    """One decode token of each filled request: slots and positions."""
    mgr, (a, b, _) = filled["mgr"], filled["ids"]
    slot = jnp.asarray([mgr.slot_of(a), mgr.slot_of(b)], jnp.int32)
    pos = jnp.asarray([mgr.length_of(a) - 1, mgr.length_of(b) - 1], jnp.int32)
    return slot, pos


@pytest.mark.parametrize("impl", IMPLS)
def test_mapped_write_is_one_write_per_element(filled, impl):
    """write_layer on a CSA layer mapped over a batch of projections, the
    cache not batched: element i is the cache after writing projections i."""
    rng = np.random.default_rng(5)
    T = 2
    slot, pos = decode_tokens(filled)           # the next token of each request
    meta = D.StepMeta.build(token_slot=slot, token_pos=pos + 1, lengths=np.zeros(4, np.int32))
    f = lambda *s: jnp.asarray(rng.standard_normal((BATCH, T) + s), jnp.float32)
    x = dict(kv=f(512).astype(jnp.bfloat16), ckv=f(1024), csc=f(1024), ikv=f(256), isc=f(256))

    def write(state, x):
        return D.write_layer(state, 1, meta, x["kv"], x["ckv"], x["csc"], filled["csa_p"],
                             index_kv=x["ikv"], index_score=x["isc"], impl=impl)
    state = filled["state"]
    mapped = jax.jit(jax.vmap(write, in_axes=(None, 0)))(state, x)
    assert mapped.csa.kv.nope.shape[0] == BATCH
    one = jax.jit(write)
    for i in range(BATCH):
        assert_trees_equal(element(mapped, i), one(state, element(x, i)), f"{impl} element {i}")


@pytest.mark.parametrize("impl", IMPLS)
def test_mapped_reads_are_one_read_per_element(filled, impl):
    """indexer_topk and attention (CSA layer 1) mapped over a batch of
    queries against one cache, gather_window over a batch of caches: element
    i is the unbatched read of element i, its outputs and the state's error
    counts alike."""
    rng = np.random.default_rng(6)
    slot, pos = decode_tokens(filled)
    T, H = 2, 4
    iq = jnp.asarray(rng.standard_normal((BATCH, T, 64, 128)), jnp.bfloat16)
    iw = jnp.asarray(rng.standard_normal((BATCH, T, 64)), jnp.float32)
    q = jnp.asarray(0.05 * rng.standard_normal((BATCH, T, H, 512)), jnp.bfloat16)
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    inv = jnp.asarray(D.yarn_inv_freq())

    def read(state, iq, iw, q):
        topk, state = D.indexer_topk(state, 1, slot, pos, iq, iw, 8, impl=impl)
        out, lse, state = D.attention(state, 1, q, slot, pos, sink=sink, topk=topk,
                                      rope_inv_freq=inv, impl=impl)
        return topk, out, lse, state
    state = filled["state"]
    mapped = jax.jit(jax.vmap(read, in_axes=(None, 0, 0, 0)))(state, iq, iw, q)
    one = jax.jit(read)
    for i in range(BATCH):
        assert_trees_equal(element(mapped, i), one(state, iq[i], iw[i], q[i]),
                           f"{impl} element {i}")
    assert (np.asarray(mapped[0]) >= 0).any()        # the indexer found entries

    states = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), state)
    slots = jnp.asarray([[slot[0]], [slot[1]]])
    gather = lambda st, sl: D.gather_window(st, 0, sl, impl=impl)
    windows = jax.jit(jax.vmap(gather))(states, slots)
    for i in range(2):
        assert_trees_equal(element(windows, i), jax.jit(gather)(state, slots[i]),
                           f"{impl} window {i}")
