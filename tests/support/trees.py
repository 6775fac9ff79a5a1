"""Byte-level comparison of pytrees (NaN-safe, dtype-agnostic) and a state
filled with random bytes."""
from __future__ import annotations

import jax
import numpy as np


def as_bytes(x) -> np.ndarray:
    """The raw bytes of an array (NaN-safe, dtype-agnostic comparison)."""
    a = np.ascontiguousarray(np.asarray(x))
    return a.view(np.uint8).reshape(-1)


def assert_trees_bytes_equal(a, b, what=""):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for (path, x), y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype, jax.tree_util.keystr(path)
        bx, by = as_bytes(x), as_bytes(y)
        if not np.array_equal(bx, by):
            n = int(np.sum(bx != by))
            raise AssertionError(f"{what}{jax.tree_util.keystr(path)}: {n} bytes differ")


def poison(tree, seed=0):
    """Every leaf filled with random bytes (pools with garbage, not zeros).
    NaN patterns become the 0xA5 sentinel: XLA may canonicalize a NaN payload
    it copies, and real pools never hold NaN."""
    rng = np.random.default_rng(seed)

    def fill(x):
        raw = rng.integers(0, 256, size=x.size * x.dtype.itemsize, dtype=np.uint8)
        vals = raw.view(x.dtype).reshape(x.shape)
        if np.issubdtype(x.dtype, np.floating) or x.dtype.kind == "V" or "float" in str(x.dtype):
            nan = np.isnan(vals.astype(np.float32))
            vals.view(np.uint8).reshape(*x.shape, -1)[nan] = 0xA5
        return jax.numpy.asarray(vals)
    return jax.tree_util.tree_map(fill, tree)
