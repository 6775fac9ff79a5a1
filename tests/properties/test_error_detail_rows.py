"""Error detail's slot and position (docs/design/bad-input.md): each op, fed
known bad rows, records per kind the slot and position of the smallest row
it dropped (the rows out of order, so the smallest is not the first
counted), on every implementation alike; with detail off the same calls
leave every leaf bit for bit as with detail on, the counters included."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax import config as C
from dsv4_jax.error_detail import ErrorOp
from dsv4_jax.errors import NUM_ERROR_KINDS, ErrorKind as K
from dsv4_jax.ops.dispatch import auto_means
from dsv4_jax.app.workload import layer_params
from support.marks import every_impl

CFG = dj.CacheConfig.tiny(max_requests=4, max_context=512)
PARAMS = layer_params(CFG, seed=5)
FREE = 2            # a slot no request holds: no blocks


def _filled(cfg):
    """Requests a (slot 0, 40 tokens) and b (slot 1, 20 tokens), written."""
    return _filled_under(cfg, auto_means())


@functools.cache    # once a config and implementation: the steps below do not donate it
def _filled_under(cfg, impl):
    m = dj.CacheManager(cfg)
    a, b = m.admit(), m.admit()
    assert (m.slot_of(a), m.slot_of(b)) == (0, 1)
    meta = m.prepare_step({a: 40, b: 20})
    return jax.jit(lambda s, meta: dj.apply_step(s, meta))(dj.init_state(cfg), meta)


def _meta(slot, pos, **kw):
    return dj.StepMeta.build(token_slot=np.int32(slot), token_pos=np.int32(pos),
                             lengths=np.zeros(4, np.int32), **kw)


def _rand(rng, *shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


def _state_of(out):
    return out if isinstance(out, dj.CacheState) else out[-1]


def _records(step, *args):
    """{kind: (op, layer, slot, position)} that `step(state, *args)` records on
    a filled state with error detail, after checking the same step without
    detail leaves every leaf as it does with detail (the counters too)."""
    plain = _state_of(jax.jit(step)(_filled(CFG), *args))
    cfg = CFG.replace(error_detail=True)
    detailed = _state_of(jax.jit(step)(_filled(cfg), *args))
    n = NUM_ERROR_KINDS
    assert plain.errors.shape == (n,) and detailed.errors.shape == (6 * n,)
    errors = np.asarray(detailed.errors)
    np.testing.assert_array_equal(errors[:n], np.asarray(plain.errors))
    for x, y in zip(jax.tree_util.tree_leaves(_without_errors(plain)),
                    jax.tree_util.tree_leaves(_without_errors(detailed))):
        np.testing.assert_array_equal(_bytes(x), _bytes(y))
    return {K(k): tuple(int(errors[f * n + k]) for f in (2, 3, 4, 5))
            for k in range(n) if errors[k]}


def _without_errors(state):
    return dataclasses.replace(state, errors=jnp.zeros((1,), jnp.int32))


def _bytes(x):
    return np.asarray(x).reshape(-1).view(np.uint8)


@every_impl
def test_apply_step_records_the_row_of_a_reset_or_a_new_block():
    # error rows: resets 0..1, then new blocks 2..5
    meta = _meta([-1], [0], reset_slots=[-1, -1],
                 new_blocks=[[2, 3, 5], [9, 0, 6], [0, 2, 99], [0, 9, 7]])
    got = _records(lambda s, meta: dj.apply_step(s, meta), meta)
    assert got == {K.BAD_SLOT: (ErrorOp.APPLY_STEP, -1, 9, 0),
                   K.BAD_BLOCK_ASSIGNMENT: (ErrorOp.APPLY_STEP, -1, 0, 256)}
    meta = _meta([-1], [0], reset_slots=[-1, 6], new_blocks=[[8, 0, 1]])
    got = _records(lambda s, meta: dj.apply_step(s, meta), meta)
    assert got == {K.BAD_SLOT: (ErrorOp.APPLY_STEP, -1, 6, -1)}


@every_impl
@pytest.mark.parametrize("op", ["append", "write_layer"])
def test_append_records_each_kind_at_its_smallest_row(op):
    meta = _meta([0, 0, -1, 5, 1, 0, 7, 1], [40, 41, 0, 2, 600, -5, 1, 21])
    kv = _rand(np.random.default_rng(1), 8, 512, dtype=jnp.bfloat16).at[7, 3].set(jnp.inf)
    fn = dj.append if op == "append" else dj.write_layer
    got = _records(lambda s, meta, kv: fn(s, 0, meta, kv), meta, kv)
    code = ErrorOp.APPEND if op == "append" else ErrorOp.WRITE_LAYER
    assert got == {K.BAD_SLOT: (code, 0, 5, 2), K.BAD_POSITION: (code, 0, 1, 600),
                   K.NONFINITE: (code, 0, 1, 21)}


@every_impl
def test_flush_records_each_kind_at_its_smallest_row():
    # a's rows expected at 40, 41, 42: the third is at 50; the free slot has no block
    meta = _meta([0, 0, FREE, 9, 0, 1, 1], [40, 41, 0, 0, 50, 20, 21])
    rng = np.random.default_rng(2)
    kv, score = _rand(rng, 7, 1024), _rand(rng, 7, 1024)
    kv = kv.at[6, 100].set(jnp.nan)
    ikv, iscore = _rand(rng, 7, 256), _rand(rng, 7, 256)
    got = _records(lambda s, meta, kv, score, ikv, iscore: dj.flush(
        s, 1, meta, kv, score, PARAMS[1], index_kv=ikv, index_score=iscore),
        meta, kv, score, ikv, iscore)
    assert got == {K.BAD_SLOT: (ErrorOp.FLUSH, 1, 9, 0), K.BAD_POSITION: (ErrorOp.FLUSH, 1, 0, 50),
                   K.MISSING_BLOCK: (ErrorOp.FLUSH, 1, FREE, 0),
                   K.NONFINITE: (ErrorOp.FLUSH, 1, 1, 21)}


@every_impl
def test_indexer_topk_records_each_kind_at_its_smallest_row():
    slot, pos = jnp.int32([0, 9, 0, 1, FREE, 8]), jnp.int32([39, 0, -1, 19, 10, 0])
    rng = np.random.default_rng(3)
    q = _rand(rng, 6, 64, 128, dtype=jnp.bfloat16).at[3, 5, 9].set(jnp.nan)
    w = _rand(rng, 6, 64)
    got = _records(lambda s, slot, pos, q, w: dj.indexer_topk(s, 1, slot, pos, q, w, 4),
                   slot, pos, q, w)
    op = ErrorOp.INDEXER_TOPK
    assert got == {K.BAD_SLOT: (op, 1, 9, 0), K.BAD_POSITION: (op, 1, 0, -1),
                   K.NONFINITE: (op, 1, 1, 19), K.MISSING_BLOCK: (op, 1, FREE, 10)}


@every_impl
def test_attention_records_each_kind_at_its_smallest_row():
    # the windows were never appended: every good query's ring is stale
    slot, pos = jnp.int32([-1, 9, 0, 1, 0, FREE, 8]), jnp.int32([0, 0, 40, 20, 2000, 300, 1])
    q = _rand(np.random.default_rng(4), 7, 4, 512, dtype=jnp.bfloat16).at[3, 1, 2].set(jnp.nan)
    got = _records(lambda s, slot, pos, q: dj.attention(s, 2, q, slot, pos, sink=jnp.zeros(4)),
                   slot, pos, q)
    op = ErrorOp.ATTENTION
    assert got == {K.BAD_SLOT: (op, 2, 9, 0), K.STALE_WINDOW: (op, 2, 0, 40),
                   K.NONFINITE: (op, 2, 1, 20), K.BAD_POSITION: (op, 2, 0, 2000),
                   K.MISSING_BLOCK: (op, 2, FREE, 300)}


@every_impl
def test_gathers_record_their_rows():
    got = _records(lambda s, slots: dj.gather_window(s, 0, slots), jnp.int32([0, -1, 7, 5]))
    assert got == {K.BAD_SLOT: (ErrorOp.GATHER_WINDOW, 0, 7, -1)}
    slot, pos = jnp.int32([0, 9, 0, FREE, 6]), jnp.int32([40, 0, 40, 10, 3])
    indices = jnp.int32([[0, -1], [0, 0], [50, 1], [1, -1], [0, 0]])   # 50: not visible at 40
    got = _records(lambda s, slot, pos, idx: dj.gather_topk(s, 3, slot, pos, idx),
                   slot, pos, indices)
    op = ErrorOp.GATHER_TOPK
    assert got == {K.BAD_SLOT: (op, 3, 9, 0), K.BAD_INDEX: (op, 3, 0, 40),
                   K.MISSING_BLOCK: (op, 3, FREE, 10)}
    slots, lengths = jnp.int32([0, 9, 1, FREE, 1]), jnp.int32([40, 0, 600, 300, -1])
    got = _records(lambda s, slots, lengths: dj.gather_all(s, 2, slots, lengths, 4),
                   slots, lengths)
    op = ErrorOp.GATHER_ALL
    assert got == {K.BAD_SLOT: (op, 2, 9, -1), K.BAD_LENGTH: (op, 2, 1, -1),
                   K.MISSING_BLOCK: (op, 2, FREE, -1)}


@every_impl
def test_a_bad_layer_is_recorded_without_a_row():
    got = _records(lambda s, layer, slots: dj.gather_window(s, layer, slots),
                   jnp.int32(7), jnp.int32([0, 7]))
    assert got == {K.BAD_LAYER: (ErrorOp.GATHER_WINDOW, 7, -1, -1)}


@every_impl
def test_verify_commit_records_the_slot_of_a_bad_accepted_count():
    cfg = CFG.replace(error_detail=True)
    m = dj.CacheManager(cfg)
    a, b = m.admit(), m.admit()
    state = jax.jit(lambda s, meta: dj.apply_step(s, meta))(dj.init_state(cfg),
                                                           m.prepare_step({a: 40, b: 20}))
    meta = m.prepare_step({a: 3, b: 3}, speculative=True)

    @jax.jit
    def step(state, meta, accepted):
        state = dj.apply_step(state, meta)
        spec = dj.verify_begin(state, meta, drafts=2)
        state, _ = dj.verify_commit(state, spec, accepted)
        return state

    accepted = jnp.int32([1, 7, 0, 0])          # slot 1 verified 3 rows: 7 is beyond
    errors = np.asarray(step(state, meta, accepted).errors)
    n = NUM_ERROR_KINDS
    assert errors[K.BAD_LENGTH] == 1
    assert [int(errors[f * n + K.BAD_LENGTH]) for f in (2, 3, 4, 5)] == \
        [ErrorOp.VERIFY_COMMIT, -1, 1, -1]


def test_a_sharded_state_records_each_shard_with_its_local_rows():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs 2 devices")
    from dsv4_jax.sharding import init_sharded_state, shard_config
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("data",))
    cfg = shard_config(CFG.replace(error_detail=True), mesh, "data")
    state = init_sharded_state(cfg, mesh)
    # shard 0: rows fine; shard 1: local row 2 at slot 5 (of 2 a shard), row 3 at position -1
    slot = np.int32([0, 1, -1, -1, 0, 1, 5, 1])
    pos = np.int32([0, 0, 0, 0, 0, 1, 7, -1])
    meta = dj.StepMeta(jnp.asarray(np.concatenate([np.concatenate([slot[:4], pos[:4], [0, 0]]),
                                                   np.concatenate([slot[4:], pos[4:], [0, 0]])])
                                   .astype(np.int32)), 4, 2, 0, 0)
    kv = _rand(np.random.default_rng(6), 8, 512, dtype=jnp.bfloat16)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda s, meta, kv: dj.append(s, 0, meta, kv))(state, meta, kv)
    with pytest.raises(dj.CacheInputError) as e:
        dj.check_errors(out)
    assert e.value.first[K.BAD_SLOT] == (1, ErrorOp.APPEND, 0, 5, 7)
    assert e.value.first[K.BAD_POSITION] == (1, ErrorOp.APPEND, 0, 1, -1)
    assert "first counted by append, layer 0, slot 5, position 7 on shard 1" in str(e.value)
