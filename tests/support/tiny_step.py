"""One jitted step of the tiny preset as the visibility and error-rule cases
drive it (apply_step, append on layer 0, CSA flush on layer 1, HCA flush on
layer 2), its random inputs, and the views they compare states by: error
counts by kind, byte equality of subtrees."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

import dsv4_jax as D
from dsv4_jax import config as C
from dsv4_jax.errors import ErrorKind as K

from support.harness import raw


CFG = C.CacheConfig.tiny()          # R 4, MB 4 (512 tokens), N 16
R, MB, N = CFG.max_requests, CFG.max_blocks_per_request, CFG.num_blocks


def errs(state):
    e = np.asarray(state.errors)
    return {K(i): int(v) for i, v in enumerate(e) if v}


def same(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(raw(x), raw(y)) for x, y in zip(la, lb))


def inputs(rng, T):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    return dict(win=f(T, 512).astype(jnp.bfloat16), ckv=f(T, 1024), csc=f(T, 1024),
                ikv=f(T, 256), isc=f(T, 256), hkv=f(T, 512), hsc=f(T, 512))


def _ops(state, meta, x, csa_p, hca_p):
    state = D.append(state, 0, meta, x["win"])
    state = D.flush(state, 1, meta, x["ckv"], x["csc"], csa_p, index_kv=x["ikv"],
                    index_score=x["isc"])
    return D.flush(state, 2, meta, x["hkv"], x["hsc"], hca_p)


@functools.partial(jax.jit, donate_argnames=("state",))
def step(state, meta, x, csa_p, hca_p):
    return _ops(D.apply_step(state, meta), meta, x, csa_p, hca_p)
