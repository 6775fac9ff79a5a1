"""A sharded state cut into its shards, each a single-shard state."""
from __future__ import annotations

import jax
import numpy as np

from dsv4_jax import init_state
from dsv4_jax.sharding import state_specs


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


def data_mesh(n: int):
    """A mesh of the first n devices on axis "data"; the test is skipped
    where there are fewer."""
    import pytest
    devices = jax.devices()
    if len(devices) < n:
        pytest.skip(f"needs {n} devices")
    return jax.sharding.Mesh(np.array(devices[:n]), ("data",))
