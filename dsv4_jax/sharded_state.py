"""A state split over a mesh axis, on the device side (docs/design/sharding.md):
the sharded config, each leaf's PartitionSpec and placement, and running an
op's single-device implementation per shard inside `jax.shard_map` (no
collectives, aliasing kept). The host's bookkeeping of the shards is
`ShardedCacheManager` (dsv4_jax/host/sharded_manager.py).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from .config import CacheConfig
from .state import CacheState, init_state, state_shapes


def shard_config(config: CacheConfig, mesh: jax.sharding.Mesh, axis: str) -> CacheConfig:
    """`config` split over mesh axis `axis` (R and N must divide evenly)."""
    if axis not in mesh.shape:
        raise ValueError(f"axis: expected one of the mesh axes {tuple(mesh.shape)}, got {axis!r}")
    return config.replace(num_shards=int(mesh.shape[axis]), shard_axis=axis)


def state_specs(config: CacheConfig) -> CacheState:
    """PartitionSpec of every state leaf: R (block table rows, window,
    accumulators) and N (pools) split over the shard axis, errors split so
    each shard has its own row of counters."""
    axis = config.shard_axis

    def spec(path, sds):
        name = jax.tree_util.keystr(path)
        if name.startswith((".block_table", ".errors")):
            return P(axis)
        return P(None, axis)          # [layers, R or N, ...]
    return jax.tree_util.tree_map_with_path(spec, state_shapes(config))


def state_sharding(config: CacheConfig, mesh: jax.sharding.Mesh) -> CacheState:
    """`NamedSharding`s of every state leaf on `mesh` (see `state_specs`), e.g.
    for `init_state(config, sharding=...)` or a jitted step's out_shardings."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), state_specs(config))


def init_sharded_state(config: CacheConfig, mesh: jax.sharding.Mesh) -> CacheState:
    """A fresh state created already placed on its shards."""
    if config.shard_axis is None:   # one shard is a valid mesh too
        raise ValueError("config: expected a config split over a mesh axis by "
                         "dsv4_jax.sharding.shard_config, got an unsharded one")
    return init_state(config, sharding=state_sharding(config, mesh))


def _context_mesh(config: CacheConfig):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or config.shard_axis not in mesh.shape:
        raise ValueError(
            f"state: sharded over mesh axis {config.shard_axis!r}; call the op under "
            f"`with jax.set_mesh(mesh):` with a mesh that has that axis")
    if mesh.shape[config.shard_axis] != config.num_shards:
        raise ValueError(f"state: sharded over {config.num_shards} shards, but mesh axis "
                         f"{config.shard_axis!r} has {mesh.shape[config.shard_axis]}")
    return mesh


def _with_config(tree, config: CacheConfig):
    """Replace the static config of every CacheState in `tree`."""
    is_state = lambda x: isinstance(x, CacheState)
    return jax.tree_util.tree_map(
        lambda x: dataclasses.replace(x, config=config) if is_state(x) else x, tree,
        is_leaf=is_state)


def run_sharded(fn: Callable, state: CacheState, sharded: Sequence, replicated: Sequence,
                out_specs) -> object:
    """Run `fn(local_state, *sharded, *replicated)` on every shard.

    `sharded` operands are split along their first axis, `replicated` ones are
    whole on every shard. `out_specs` names "state" where `fn` returns the
    state and "rows" for outputs split along their first axis (a pytree
    matching fn's output)."""
    cfg = state.config
    axis = cfg.shard_axis
    local = cfg.local()
    sspec = state_specs(cfg)

    def to_spec(o):
        return {"state": sspec, "rows": P(axis)}[o]
    outs = jax.tree_util.tree_map(to_spec, out_specs, is_leaf=lambda o: isinstance(o, str))

    def body(st, *args):
        return _with_config(fn(_with_config(st, local), *args), cfg)

    mesh = _context_mesh(cfg)
    in_specs = (sspec, *([P(axis)] * len(sharded)), *([P()] * len(replicated)))
    args = (state, *sharded, *replicated)
    if _explicit(mesh):
        # Under explicit axes (jax.make_mesh's default) shard_map takes only
        # operands already laid out as in_specs says; host-built metadata and
        # projections usually are not, so they are placed here.
        args = jax.tree_util.tree_map(
            lambda spec, x: jax.reshard(x, spec), in_specs, args,
            is_leaf=lambda x: isinstance(x, P))
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=outs,
                         check_vma=False)(*args)


def _explicit(mesh) -> bool:
    """Whether any axis of `mesh` is of the Explicit type."""
    types = getattr(mesh, "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)
