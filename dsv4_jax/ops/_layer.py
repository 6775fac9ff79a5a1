"""Layer indices: a Python int is checked at trace time; a traced int32 scalar
(models that lax.scan over layers) is mapped through a constant table and
checked at run time (BAD_LAYER, the call is dropped)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..config import CacheConfig


def layer_operand(config: CacheConfig, layer, kind: str | None) -> jax.Array:
    """i32[] operand for the FFI / reference: the global layer index when
    `kind` is None (window ops, stacked over all layers), else the index among
    layers of `kind` (per-kind pools). Out-of-range or wrong-kind traced layers
    become -1, which every implementation counts as BAD_LAYER."""
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
        layer = int(layer)
        idx = layer if kind is None else config.kind_index(layer, kind)
        if kind is None:
            config.kind_index(layer)   # range check, ValueError naming `layer`
        return jnp.int32(idx)
    layer = jnp.asarray(layer)
    if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise ValueError(f"layer: expected a Python int or an int32 scalar, "
                         f"got shape {layer.shape} dtype {layer.dtype}")
    layer = layer.astype(jnp.int32)
    n = config.num_layers
    if kind is None:
        return jnp.where((layer >= 0) & (layer < n), layer, -1)
    table = jnp.asarray(np.asarray(config.kind_index_table(kind), np.int32))
    return jnp.where((layer >= 0) & (layer < n), table[jnp.clip(layer, 0, n - 1)], -1)


def traced_layer(layer) -> list:
    """Operands that carry `layer` into a shard_map body: none for a Python
    int (it stays static), the scalar itself otherwise."""
    return [] if isinstance(layer, (int, np.integer)) else [layer]


def pick_layer(layer, carried):
    """Inside a shard_map body: the layer, static or carried in."""
    return carried[0] if carried else layer
