"""The jnp reference updates the cache in place in memory too: the ops that
write the pools (apply_step's scrub, append, flush) compile on XLA's CPU to a
few MiB of temporaries whatever the pool size, as the FFI handlers do.

XLA's CPU backend has no scatter on 8- and 16-bit floats: written as a plain
`.at[].set` into an fp8 / bf16 pool, each write widened the whole pool to f32
and back (a decode step over an 85 MiB state took 234 MiB of temporaries).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax.state import state_shapes, tree_bytes

MIB = 1 << 20
BOUND = 8 * MIB


def _shapes(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _decode_meta(cfg, new_blocks, resets):
    R = cfg.max_requests
    return dj.StepMeta.build(token_slot=np.arange(R), token_pos=np.full(R, 1000),
                             lengths=np.full(R, 1001), new_blocks=new_blocks,
                             reset_slots=resets, device_put=False)


def _write_step(state, meta, params):
    """apply_step, then append on every layer and flush on every compressed
    layer: every op that writes a pool, on the reference."""
    cfg = state.config
    T = meta.num_tokens
    state = dj.apply_step(state, meta, impl="reference")
    for layer, kind in enumerate(cfg.layer_kinds):
        state = dj.append(state, layer, meta, jnp.full((T, 512), 0.5, jnp.bfloat16),
                          impl="reference")
        if kind == "csa":
            state = dj.flush(state, layer, meta, jnp.ones((T, 1024)), jnp.ones((T, 1024)),
                             params, index_kv=jnp.ones((T, 256)),
                             index_score=jnp.ones((T, 256)), impl="reference")
        elif kind == "hca":
            state = dj.flush(state, layer, meta, jnp.ones((T, 512)), jnp.ones((T, 512)),
                             dj.CompressorParams.neutral("hca"), impl="reference")
    return state


@pytest.mark.parametrize("kv_format", ["ds_fp8", pytest.param("bf16", marks=pytest.mark.slow(
    reason="bf16 pools; the ds_fp8 run stays"))])
def test_reference_write_step_temporaries_stay_small(kv_format):
    cfg = dj.CacheConfig.tiny(max_requests=8, max_context=32768, kv_format=kv_format)
    state = state_shapes(cfg)
    assert tree_bytes(state) > 80 * MIB          # pools of tens of MiB
    R = cfg.max_requests
    # every slot takes a recycled block (scrubbed in every pool) and one resets
    new_blocks = np.stack([np.arange(R), np.full(R, 7), 100 + np.arange(R)], axis=1)
    meta = _shapes(_decode_meta(cfg, new_blocks, [3]))
    params = dj.CompressorParams.neutral("csa")
    for name, fn in [("apply_step", lambda s, m: dj.apply_step(s, m, impl="reference")),
                     ("write step", lambda s, m: _write_step(s, m, params))]:
        compiled = jax.jit(fn, donate_argnums=0).lower(state, meta).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        print(f"{kv_format} {name}: state {tree_bytes(state) / MIB:.1f} MiB, "
              f"temporaries {temp / MIB:.2f} MiB")
        assert temp <= BOUND, f"{name}: {temp / MIB:.1f} MiB of temporaries"


def test_reference_scrub_writes_exactly_the_recycled_blocks():
    """The select that replaces the scatter on the CPU writes exactly the
    blocks the rows hand out (bad rows dropped) and leaves every other byte
    as it was: checked on random bytes against numpy."""
    cfg = dj.CacheConfig.tiny(max_requests=2, max_context=512)
    N = cfg.num_blocks
    rng = np.random.default_rng(1)

    def random_bits(a):
        raw = rng.integers(0, 256, a.size * a.dtype.itemsize, dtype=np.uint8)
        return raw.view(a.dtype).reshape(a.shape)

    fresh = dj.init_state(cfg)
    host = jax.tree_util.tree_map(lambda a: random_bits(np.asarray(a)), fresh)
    state = jax.tree_util.tree_map(jnp.asarray, host)
    state = dataclasses.replace(state, errors=jnp.zeros_like(state.errors))
    # slot 1 gets physical blocks 2 and 5; a bad row (physical N) is dropped
    new_blocks = np.array([[1, 0, 2], [1, 1, 5], [0, 0, N], [-1, -1, -1]], np.int32)
    meta = dj.StepMeta.build(token_slot=[-1], token_pos=[0], lengths=[0, 0],
                             new_blocks=new_blocks, reset_slots=[-1])
    out = jax.jit(lambda s, m: dj.apply_step(s, m, impl="reference"))(state, meta)
    for name in ("csa.kv.nope", "csa.kv.rope", "csa.kv.scale", "csa.index.packed",
                 "csa.index.scale", "hca.kv.nope", "hca.kv.rope", "hca.kv.scale"):
        got = np.asarray(_leaf(out, name))
        want = np.array(_leaf(host, name))
        # the blank entry: scales 1.0 (e8m0 has no zero), everything else 0
        blank = np.ones((), want.dtype) if want.dtype == jnp.float8_e8m0fnu else 0
        want[:, [2, 5]] = blank
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=name)
    assert dj.errors.error_counts(out) == {dj.ErrorKind.BAD_BLOCK_ASSIGNMENT: 1}


def _leaf(state, dotted):
    for part in dotted.split("."):
        state = getattr(state, part)
    return state


def test_reference_writes_of_no_rows_change_nothing():
    """A step without tokens: append and flush on the reference leave every
    byte as it was."""
    cfg = dj.CacheConfig.tiny(max_requests=2, max_context=256)
    state = dj.init_state(cfg)
    meta = dj.StepMeta.build(token_slot=np.zeros(0), token_pos=np.zeros(0), lengths=[0, 0])

    def step(s, m):
        s = dj.append(s, 1, m, jnp.zeros((0, 512), jnp.bfloat16), impl="reference")
        return dj.flush(s, 1, m, jnp.zeros((0, 1024)), jnp.zeros((0, 1024)),
                        dj.CompressorParams.neutral("csa"), index_kv=jnp.zeros((0, 256)),
                        index_score=jnp.zeros((0, 256)), impl="reference")
    out = jax.jit(step)(state, meta)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(out), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8),
                                      err_msg=jax.tree_util.keystr(path))
