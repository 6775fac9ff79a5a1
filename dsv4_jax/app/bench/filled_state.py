"""A full cache state for the decode-step benchmark: every pool holds random
valid entries and every request `context` tokens, so a step's reads find a
whole context and its writes close windows (flush's worst case).

Valid means what the ops accept without counting bad input and what
quantized data looks like: fp8 codes that are no NaN, scales of unit-sized
rows, indexer keys of MXFP4 codes whose four block scales lie within a byte
(as quantized keys do), finite online-softmax accumulators. The window ring
holds positions context-129 .. context-2 and the block table is a random
permutation of the blocks, so the step's token at context-1 closes a CSA
and an HCA window.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ... import config as C
from ...state import state_shapes

F32 = jnp.float32


# The pools are filled by a counter hash rather than jax.random: one fused
# elementwise kernel per leaf that compiles in a blink (threefry over a dozen
# leaf shapes took ~30 s to compile on the CPU, and would recompile per case)
# and needs no temporaries beside its output (the 64k x 256 state is 56 GiB).
def _mix(h):
    """murmur3's 32-bit finalizer: every input bit moves every output bit."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _hash(shape, salt, axes=None):
    """u32 pseudo-random bits per element of `shape`, hashed over its
    indices along `axes` (default all): equal along the others."""
    h = jnp.full(shape, salt * 0x9E3779B1 & 0xFFFFFFFF, jnp.uint32)
    for axis in range(len(shape)) if axes is None else axes:
        h = _mix(h + jax.lax.broadcasted_iota(jnp.uint32, shape, axis))
    return h


def _unit(h):
    """[0, 1) from the top 24 bits."""
    return (h >> 8).astype(F32) * (1.0 / (1 << 24))


def _pool_leaf(name, shape, dtype, salt):
    """Valid random values of one pool leaf."""
    h = _hash(shape, salt)
    if dtype == jnp.float8_e4m3fn:   # every code but the two NaNs (S.1111.111)
        b = (h & 0xFF).astype(jnp.uint8)
        return jax.lax.bitcast_convert_type(jnp.where((b & 0x7F) == 0x7F, b - 1, b), dtype)
    if name.endswith(".index.scale"):
        # a key's four block scales within a byte of each other (122..129), as
        # MXFP4 rounding of a Gaussian key leaves them
        key = _hash(shape, salt, axes=range(len(shape) - 1))
        b = 122 + key % 7 + (h & 1)
        return jax.lax.bitcast_convert_type(b.astype(jnp.uint8), dtype)
    if dtype == jnp.float8_e8m0fnu:  # 2^-9 .. 2^-5: rows of a few units (codes reach 448)
        return jax.lax.bitcast_convert_type((118 + h % 5).astype(jnp.uint8), dtype)
    if dtype == jnp.bfloat16:
        return (4 * _unit(h) - 2).astype(dtype)
    if dtype == F32:                 # fp8_token scales: amax / 448 of unit-sized rows
        return 0.002 + 0.018 * _unit(h)
    return (h & 0xFF).astype(dtype)  # u8: packed e2m1 codes, all valid


def _accumulators(shape, salt):
    """Online-softmax accumulators (max, sum, weighted kv) on axis -2 of a
    window some tokens were folded into: finite max, sum >= 1."""
    row = shape[:-2] + (1, shape[-1])
    total = 1 + 3 * _unit(_hash(row, salt + 1))
    return jnp.concatenate([4 * _unit(_hash(row, salt)) - 2, total,
                            (4 * _unit(_hash(row, salt + 2)) - 2) * total], axis=-2)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _filled(cfg, context, seed, block_table):
    shapes, tree = jax.tree_util.tree_flatten_with_path(state_shapes(cfg))
    # ring slot j holds the one position of context-129 .. context-2 that is j mod 128
    first = context - 1 - C.WINDOW
    ring = jnp.asarray(first + (np.arange(C.WINDOW) - first) % C.WINDOW, jnp.int32)
    leaves = []
    for i, (path, x) in enumerate(shapes):
        name, salt = jax.tree_util.keystr(path), 1000 * seed + 7 * i
        if name.endswith("block_table"):
            leaves.append(block_table)
        elif name.endswith(".pos"):
            leaves.append(jnp.broadcast_to(ring, x.shape))
        elif name.endswith("errors"):
            leaves.append(jnp.zeros(x.shape, x.dtype))
        elif name.endswith("comp"):
            leaves.append(_accumulators(x.shape, salt))
        else:
            leaves.append(_pool_leaf(name, x.shape, x.dtype, salt))
    return jax.tree_util.tree_unflatten(tree, leaves)


def filled_state(cfg, context, seed=0):
    """A state whose `max_requests` requests each hold `context` tokens (the
    block table a random permutation of the blocks)."""
    R, MB = cfg.max_requests, cfg.max_blocks_per_request
    table = np.random.default_rng(seed).permutation(cfg.num_blocks)[:R * MB].reshape(R, MB)
    return _filled(cfg, context, seed, jnp.asarray(table, jnp.int32))
