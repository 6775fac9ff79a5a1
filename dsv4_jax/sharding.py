"""Data-parallel sharding of the cache (docs/design/sharding.md).

The request axis R and the block axis N of every state leaf are split over one
mesh axis; each shard owns its requests and its blocks (slots and block ids
are shard-local). Ops on a sharded state run their single-device
implementation per shard inside `jax.shard_map`: no collectives, aliasing kept.

    cfg = shard_config(CacheConfig.flash(max_requests=16), mesh, "data")
    state = init_sharded_state(cfg, mesh)
    manager = ShardedCacheManager(cfg)
    with jax.set_mesh(mesh):
        state = step(state, manager.prepare_step({...}), ...)

Per-token and per-request operands (kv, score, slots, ...) are laid out shard
by shard along their first axis: rows [k*T, (k+1)*T) belong to shard k, with
the shard's local slots.

This module hands out the two halves, which nothing inside the package
imports through it:
sharded_state.py    the device side: the sharded config, PartitionSpecs,
                    placement, run_sharded (the ops and the request moves run
                    per shard through it)
host/sharded_manager.py  the host side: ShardedCacheManager, built on CacheManager
"""
from .host.sharded_manager import ShardedCacheManager
from .sharded_state import (init_sharded_state, run_sharded, shard_config, state_sharding,
                            state_specs)

__all__ = ["shard_config", "state_specs", "state_sharding", "init_sharded_state", "run_sharded",
           "ShardedCacheManager"]
