"""Error detail (docs/design/bad-input.md): with `CacheConfig(error_detail=True)`
the state records, per error kind, the op and layer that counted it first;
`check_errors` says so. Held to the step's own order of ops (which op meets
each bad row first), on every implementation (each against the same record); the counters are those of the same step without detail; a later count of a
kind keeps the first record; reset_errors clears it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax import config as C
from dsv4_jax.error_detail import ErrorOp
from dsv4_jax.errors import ErrorKind as K
from dsv4_jax.app.workload import layer_params
from support.marks import every_impl

CFG = dj.CacheConfig.tiny(max_requests=4, max_context=512)
PARAMS = layer_params(CFG, seed=3)


def operands(rng, T):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    return dict(kv=f(T, 512).astype(jnp.bfloat16), csa=(f(T, 1024), f(T, 1024)),
                index=(f(T, 256), f(T, 256)), hca=(f(T, 512), f(T, 512)),
                q=f(T, 4, 512).astype(jnp.bfloat16), qi=f(T, 64, 128).astype(jnp.bfloat16),
                wi=f(T, 64))


def write(state, layer, meta, x):
    kind = CFG.layer_kinds[layer]
    if kind == C.CSA:
        return dj.write_layer(state, layer, meta, x["kv"], *x["csa"], PARAMS[layer],
                              index_kv=x["index"][0], index_score=x["index"][1])
    if kind == C.HCA:
        return dj.write_layer(state, layer, meta, x["kv"], *x["hca"], PARAMS[layer])
    return dj.write_layer(state, layer, meta, x["kv"])


@jax.jit
def bad_step(state, meta, x, layer_one, topk):
    """apply_step (a new block at logical 9: BAD_BLOCK_ASSIGNMENT), every
    layer's write (a bad slot and a bad position: first in layer 0's write),
    attention on layer 2 (a NaN q: NONFINITE), indexer_topk on a traced
    layer 1, gather_topk on layer 3 (an index not visible: BAD_INDEX), then
    attention on layer 0, which counts the bad slot again."""
    state = dj.apply_step(state, meta)
    for layer in range(CFG.num_layers):
        state = write(state, layer, meta, x)
    slot, pos = meta.token_slot, meta.token_pos
    _, _, state = dj.attention(state, 2, x["q"], slot, pos, sink=jnp.zeros(4))
    _, state = dj.indexer_topk(state, layer_one, slot, pos, x["qi"], x["wi"], 4)
    _, _, state = dj.gather_topk(state, 3, slot, pos, topk)
    _, _, state = dj.attention(state, 0, x["q"], slot, pos, sink=jnp.zeros(4))
    return state


def prepared(cfg):
    m = dj.CacheManager(cfg)
    a, b = m.admit(), m.admit()
    state = jax.jit(lambda s, meta: dj.apply_step(s, meta))(dj.init_state(cfg),
                                                           m.prepare_step({a: 40, b: 20}))
    slot = np.int32([m.slot_of(a), m.slot_of(b), 7, m.slot_of(a), -1, -1, -1, -1])
    pos = np.int32([40, 20, 0, 1000, 0, 0, 0, 0])
    meta = dj.StepMeta.build(token_slot=slot, token_pos=pos,
                             lengths=np.int32([41, 21, 0, 0]), new_blocks=[[0, 9, 0]],
                             reset_slots=[-1])
    return state, meta


@every_impl
def test_first_op_and_layer_of_each_kind_are_recorded():
    rng = np.random.default_rng(0)
    x = operands(rng, 8)
    x["q"] = x["q"].at[1, 2, 7].set(jnp.nan)
    topk = np.full((8, 4), -1, np.int32)
    topk[0, 0] = 50                                  # visible at 40: (40 + 1) // 4 = 10
    plain_state, meta = prepared(CFG)
    plain = bad_step(plain_state, meta, x, jnp.int32(1), jnp.asarray(topk))
    cfg = CFG.replace(error_detail=True)
    state, meta = prepared(cfg)
    assert state.errors.shape == (6 * len(K),)
    out = bad_step(state, meta, x, jnp.int32(1), jnp.asarray(topk))
    errors = np.asarray(out.errors)
    n = len(K)
    np.testing.assert_array_equal(errors[:n], np.asarray(plain.errors))
    a = int(meta.token_slot[0])
    # (op, layer, slot, position) of the smallest row each op dropped first
    want = {K.BAD_BLOCK_ASSIGNMENT: (ErrorOp.APPLY_STEP, -1, 0, -1),   # logical 9 of MB 4
            K.BAD_SLOT: (ErrorOp.WRITE_LAYER, 0, 7, 0),
            K.BAD_POSITION: (ErrorOp.WRITE_LAYER, 0, a, 1000),
            K.NONFINITE: (ErrorOp.ATTENTION, 2, int(meta.token_slot[1]), 20),
            K.BAD_INDEX: (ErrorOp.GATHER_TOPK, 3, a, 40),
            # the windows were never written: attention's reads at 40 and 20 are stale
            K.STALE_WINDOW: (ErrorOp.ATTENTION, 2, a, 40)}
    got = {K(k): tuple(int(errors[f * n + k]) for f in (2, 3, 4, 5))
           for k in range(n) if errors[2 * n + k]}
    assert got == want
    assert all(errors[k] > 0 for k in want) and errors[K.BAD_SLOT] > CFG.num_layers
    with pytest.raises(dj.CacheInputError) as e:
        dj.check_errors(out)
    text = str(e.value)
    assert ("nonfinite: 2 (NaN or Inf in an input); first counted by attention, layer 2, "
            f"slot {int(meta.token_slot[1])}, position 20") in text
    assert "bad_block_assignment: 1 (new block with logical or physical id out of range); " \
           "first counted by apply_step, slot 0\n" in text + "\n"
    assert e.value.first[K.BAD_INDEX] == (None, ErrorOp.GATHER_TOPK, 3, a, 40)
    cleared = dj.reset_errors(out)
    assert not np.asarray(cleared.errors).any()
    dj.check_errors(cleared)
    # a second step keeps the first records and adds to the counts
    again = bad_step(out, meta, x, jnp.int32(1), jnp.asarray(topk))
    e2 = np.asarray(again.errors)
    np.testing.assert_array_equal(e2[2 * n:], errors[2 * n:])   # the records, after first_row
    np.testing.assert_array_equal(e2[:n], 2 * errors[:n])
