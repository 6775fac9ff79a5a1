"""Sharded serving (DESIGN §10): every op per shard inside shard_map, no
collectives, in place; per-shard managers."""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from conftest import assert_trees_bytes_equal
from inplace import assert_in_place, compiled_text
from dsv4_jax import CacheConfig, CacheFullError, CacheManager, apply_step, init_state
from dsv4_jax.sharding import (ShardedCacheManager, init_sharded_state, shard_config,
                               state_specs)

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def mesh_of(n):
    devices = jax.devices()
    if len(devices) < n:
        pytest.skip(f"needs {n} devices")
    return Mesh(np.array(devices[:n]), ("data",))


def unshard(state, cfg):
    """Per-shard slices of a sharded state as separate single-shard states."""
    local = cfg.local()
    n = cfg.num_shards
    specs = jax.tree_util.tree_leaves(state_specs(cfg))
    leaves, _ = jax.tree_util.tree_flatten(state)
    out = []
    for k in range(n):
        parts = []
        for x, spec in zip(leaves, specs):
            axis = 0 if spec[0] == "data" else 1
            x = np.asarray(x)
            size = x.shape[axis] // n
            parts.append(np.take(x, range(k * size, (k + 1) * size), axis=axis))
        out.append(jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(init_state(local)), parts))
    return out


def test_sharded_apply_step_equals_unsharded_per_shard_and_stays_in_place():
    mesh = mesh_of(4)
    cfg = shard_config(CacheConfig.tiny(max_requests=8, num_blocks=32), mesh, "data")
    state = init_sharded_state(cfg, mesh)
    assert state.errors.shape == (4 * 8,)
    manager = ShardedCacheManager(cfg)
    singles = [CacheManager(cfg.local(), shard=k) for k in range(4)]
    refs = [init_state(cfg.local()) for _ in range(4)]
    rng = np.random.default_rng(0)
    step = jax.jit(lambda s, m: apply_step(s, m), donate_argnames=("s",))
    ids = []
    for i in range(6):
        new = [manager.admit() for _ in range(int(rng.integers(0, 3)))]
        for rid in new:
            singles[manager.shard_of(rid)].admit(rid)
        ids += new
        if i == 3 and ids:                       # release one, reuse its blocks
            gone = ids.pop(0)
            singles[manager.shard_of(gone)].release(gone)
            manager.release(gone)
        tokens = {r: int(rng.integers(1, 140)) for r in ids}
        with jax.set_mesh(mesh):
            meta = manager.prepare_step(tokens)
            if i == 0:
                hlo = compiled_text(step, state, meta)
                assert not [c for c in COLLECTIVES if c in hlo], "collective in a sharded step"
                state = assert_in_place(step, state, meta)
            else:
                state = step(state, meta)
        # the same requests on single-shard managers and states, shard by shard
        for k in range(4):
            local_tokens = {r: n for r, n in tokens.items() if manager.shard_of(r) == k}
            m = singles[k].prepare_step(local_tokens, min_tokens=manager.tokens_per_shard,
                                        min_new_blocks=meta.num_new_blocks,
                                        min_resets=meta.num_resets)
            refs[k] = apply_step(refs[k], m, impl="reference")
    for k, got in enumerate(unshard(state, cfg)):
        assert_trees_bytes_equal(got, refs[k], f"shard {k}: ")


def test_sharded_op_needs_the_mesh_in_context():
    mesh = mesh_of(2)
    cfg = shard_config(CacheConfig.tiny(max_requests=4, num_blocks=8), mesh, "data")
    state = init_sharded_state(cfg, mesh)
    meta = ShardedCacheManager(cfg).prepare_step({})
    with pytest.raises(ValueError, match="jax.set_mesh"):
        apply_step(state, meta)


def test_full_shard_is_named_and_the_others_keep_working():
    mesh = mesh_of(2)
    cfg = shard_config(CacheConfig.tiny(max_requests=4, num_blocks=4), mesh, "data")
    manager = ShardedCacheManager(cfg)
    a = manager.admit(shard=0)
    b = manager.admit(shard=1)
    manager.prepare_step({a: 256, b: 10})            # shard 0: both of its blocks in use
    with pytest.raises(CacheFullError, match="on shard 0"):
        manager.prepare_step({a: 1, b: 1})
    assert manager.shards[0].length_of(a) == 256      # nothing changed on either shard
    assert manager.shards[1].length_of(b) == 10
    manager.prepare_step({b: 200})                   # shard 1 keeps working
    assert manager.shards[1].length_of(b) == 210
    manager.admit(shard=0)
    with pytest.raises(CacheFullError, match="on shard 0"):
        manager.admit(shard=0)
    c = manager.admit()                                # least loaded: shard 1
    assert manager.shard_of(c) == 1


def test_admission_balances_shards():
    mesh = mesh_of(4)
    cfg = shard_config(CacheConfig.tiny(max_requests=8, num_blocks=16), mesh, "data")
    manager = ShardedCacheManager(cfg)
    shards = [manager.shard_of(manager.admit()) for _ in range(8)]
    assert sorted(shards) == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="multiple of num_shards"):
        shard_config(CacheConfig.tiny(max_requests=6), mesh, "data")
