"""DESIGN §8 for the CPU handlers: under jit with the state donated, append
and flush update the pools in place (aliasing in the compiled HLO, no copy of
a pool, same buffer pointers after the call)."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax import _ffi

pytestmark = pytest.mark.skipif(not _ffi.has_target("cpu", "dsv4_append"),
                                reason="CPU FFI module not built")


def setup():
    cfg = D.CacheConfig.tiny(max_requests=2, max_context=256)
    st = D.init_state(cfg)
    bt = np.array([[0, 1], [2, 3]], np.int32)
    st = dataclasses.replace(st, block_table=jnp.asarray(bt))
    meta = D.StepMeta.build(token_slot=np.array([0, 1], np.int32), token_pos=np.array([0, 0], np.int32),
                            lengths=np.zeros(2, np.int32))
    return st, meta


def pointers(tree):
    return [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(tree)]


def check_in_place(step, st, args, leaves_of):
    compiled = jax.jit(step, donate_argnums=0).lower(st, *args).compile()
    text = compiled.as_text()
    assert "input_output_alias" in text
    # no copy instruction producing a pool-sized array
    for leaf in jax.tree_util.tree_leaves(leaves_of(st)):
        if leaf.size >= 4096:
            shape = ",".join(map(str, leaf.shape))
            assert not re.search(rf"\[{shape}\]\{{[^}}]*\}} copy\(", text), shape
    before = pointers(leaves_of(st))
    new = compiled(st, *args)
    assert pointers(leaves_of(new)) == before


def test_append_in_place():
    st, meta = setup()
    kv = jnp.ones((2, 512), jnp.bfloat16)
    check_in_place(lambda s, m, k: D.append(s, 2, m, k, impl="cpu"), st, (meta, kv),
                   lambda s: (s.swa, s.errors))


def test_flush_in_place():
    st, meta = setup()
    p = D.CompressorParams(jnp.zeros((4, 1024)), jnp.ones(512), jnp.ones(32),
                           D.CompressorParams(jnp.zeros((4, 256)), jnp.ones(128), jnp.ones(32)))
    z = lambda *s: jnp.ones(s, jnp.float32)
    check_in_place(lambda s, m, a, b, c, d: D.flush(s, 1, m, a, b, p, index_kv=c, index_score=d, impl="cpu"),
                   st, (meta, z(2, 1024), z(2, 1024), z(2, 256), z(2, 256)),
                   lambda s: (s.csa, s.errors))
    st, meta = setup()
    ph = D.CompressorParams(jnp.zeros((128, 512)), jnp.ones(512), jnp.ones(32))
    check_in_place(lambda s, m, a, b: D.flush(s, 2, m, a, b, ph, impl="cpu"),
                   st, (meta, z(2, 512), z(2, 512)), lambda s: (s.hca, s.errors))
