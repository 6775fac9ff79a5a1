"""Sharded serving (docs/design/sharding.md): every op per shard inside shard_map, no
collectives, in place; per-shard managers."""
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from dsv4_jax import CacheConfig, CacheFullError, CacheManager, apply_step, init_state
from dsv4_jax.errors import NUM_ERROR_KINDS
from dsv4_jax.sharding import ShardedCacheManager, init_sharded_state, shard_config
from support.inplace import assert_in_place, compiled_text
from support.sharding import unshard
from support.trees import assert_trees_bytes_equal

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def mesh_of(n, explicit=False):
    """A 1-D mesh "data" of n devices; `explicit`: built as jax.make_mesh
    builds it by default, its axis of the Explicit type."""
    devices = jax.devices()   # the default backend's: 4 CPU devices in CI, the GPUs on a GPU host
    if len(devices) < n:
        pytest.skip(f"needs {n} devices")
    if explicit:
        return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,),
                             devices=devices[:n])
    return Mesh(np.array(devices[:n]), ("data",))


@pytest.mark.slow(reason="sharded apply_step; the 2-device sharded workload stays")
def test_sharded_apply_step_equals_unsharded_per_shard_and_stays_in_place():
    mesh = mesh_of(4)
    cfg = shard_config(CacheConfig.tiny(max_requests=8, num_blocks=32), mesh, "data")
    state = init_sharded_state(cfg, mesh)
    assert state.errors.shape == (4 * NUM_ERROR_KINDS,)
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


@pytest.mark.parametrize("n,explicit", [(2, False), pytest.param(4, False, marks=pytest.mark.slow(
    reason="4 devices; the 2-device runs stay")), (2, True)])
def test_sharded_workload_equals_each_shard_run_alone(n, explicit):
    """apply_step + append + flush on every layer, then every gather, on n
    shards (CPU devices in CI, GPUs on a multi-GPU machine); each shard's
    slice equals the same requests run unsharded, the compiled step has no
    collectives and keeps the pools in place. `explicit`: on a mesh of
    jax.make_mesh's default (Explicit) axis type, whose shard_map takes only
    operands already laid out as its specs say."""
    from dsv4_jax.app.workload import layer_params
    from support.workload import read_step, step_inputs, write_step
    mesh = mesh_of(n, explicit)
    cfg = shard_config(CacheConfig.tiny(max_requests=8, num_blocks=32), mesh, "data")
    local = cfg.local()
    params = layer_params(cfg, seed=3)
    manager = ShardedCacheManager(cfg)
    singles = [CacheManager(local, shard=k) for k in range(n)]
    refs = [init_state(local) for _ in range(n)]
    state = init_sharded_state(cfg, mesh)
    rng = np.random.default_rng(5)
    write = jax.jit(lambda s, m, x: write_step(s, m, x, params, "auto"), donate_argnums=0)
    read = jax.jit(lambda s, m, q: read_step(s, m, q, "auto"))
    for step in range(4):
        for _ in range(3 if step == 0 else 0):
            for _ in range(2):
                rid = manager.admit()
                singles[manager.shard_of(rid)].admit(rid)
        tokens = {r: (int(rng.integers(60, 200)) if step < 2 else 1)
                  for r in manager._shard_of}
        meta = manager.prepare_step(tokens)
        T = manager.tokens_per_shard
        inputs = step_inputs(cfg, n * T, rng)
        # per-shard slots for the gathers, padded with -1 to a common count
        per = [[manager.slot_of(r) for r in manager.shards[k].requests] for k in range(n)]
        width = max(len(p) for p in per) + 1
        slots = np.full((n, width), -1, np.int32)
        lengths = np.zeros((n, width), np.int32)
        for k in range(n):
            slots[k, :len(per[k])] = per[k]
            lengths[k, :len(per[k])] = [manager.shards[k].length_of(r)
                                        for r in manager.shards[k].requests]
        topk = rng.integers(-1, 40, (n * T, 8)).astype(np.int32)
        queries = {"slots": jax.numpy.asarray(slots.reshape(-1)),
                   "lengths": jax.numpy.asarray(lengths.reshape(-1)),
                   "topk": jax.numpy.asarray(topk)}
        with jax.set_mesh(mesh):
            if step == 0:
                hlo = compiled_text(write, state, meta, inputs)
                found = [c for c in COLLECTIVES if c in hlo]
                assert not found, f"collectives in a sharded step: {found}"
                state = assert_in_place(write, state, meta, inputs)
            else:
                state = write(state, meta, inputs)
            got = read(state, meta, queries)
        for k in range(n):
            rows = slice(k * T, (k + 1) * T)
            m = singles[k].prepare_step({r: t for r, t in tokens.items()
                                         if manager.shard_of(r) == k},
                                        min_tokens=T, min_new_blocks=meta.num_new_blocks,
                                        min_resets=meta.num_resets)
            x = jax.tree_util.tree_map(lambda a: a[rows], inputs)
            refs[k] = write_step(refs[k], m, x, params, "auto")
            q = {"slots": jax.numpy.asarray(slots[k]), "lengths": jax.numpy.asarray(lengths[k]),
                 "topk": jax.numpy.asarray(topk[rows])}
            want = read_step(refs[k], m, q, "auto")
            for key in want:
                for a, b in zip(jax.tree_util.tree_leaves(got[key][:2]),
                                jax.tree_util.tree_leaves(want[key][:2])):
                    size = a.shape[0] // n
                    np.testing.assert_array_equal(
                        np.asarray(a)[k * size:(k + 1) * size].view(np.uint8),
                        np.asarray(b).view(np.uint8), err_msg=f"step {step} shard {k} {key}")
    for k, got_state in enumerate(unshard(state, cfg)):
        assert_trees_bytes_equal(got_state, refs[k], f"shard {k}: ")
