"""pytest's set-up of the suite: the helpers' import path, the host devices,
and the fixtures that test files in several folders use."""
from __future__ import annotations

import os
import sys

# test files import their helpers as `support.<module>` (tests/support/)
sys.path.insert(0, os.path.dirname(__file__))

# Four CPU devices for the sharding tests; must be set before jax initializes.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# No --xla_allow_excess_precision=false here: the reference rounds to bf16
# on the bits (reference/quant.py to_bf16), so it must hold under XLA's
# default, which lets the GPU compiler drop f32 -> bf16 -> f32 round trips.

import jax
import numpy as np
import pytest

import dsv4_jax as D

from support.harness import make_params
from support.marks import CUDA, requires_cpu_ffi
from support.tiny_step import CFG, errs, inputs, step


@pytest.fixture(params=["reference", pytest.param("cpu", marks=requires_cpu_ffi),
                        pytest.param("cuda", marks=CUDA)])
def impl_under_test(request):
    """Runs a test once per implementation, as what impl="auto" resolves to.
    Jit caches are cleared around it so no trace of another impl is reused."""
    jax.clear_caches()
    with D.default_impl(request.param):
        yield request.param
    jax.clear_caches()


@pytest.fixture(scope="module")
def filled():
    """Two requests of 300 and 130 tokens (one prefill step each), a third
    admitted with no tokens (no blocks)."""
    rng = np.random.default_rng(0)
    csa_p, hca_p = make_params(rng)
    state = D.init_state(CFG)
    mgr = D.CacheManager(CFG)
    a, b, c = mgr.admit(), mgr.admit(), mgr.admit()
    meta = mgr.prepare_step({a: 300, b: 130, c: 0})
    state = step(state, meta, inputs(rng, meta.num_tokens), csa_p[0], hca_p)
    assert not errs(state)
    return dict(state=state, mgr=mgr, ids=(a, b, c), csa_p=csa_p[0], hca_p=hca_p)


@pytest.fixture(scope="module")
def st():
    """A small state (2 requests of 256 tokens) for calls straight to a handler."""
    return D.init_state(D.CacheConfig.tiny(max_requests=2, max_context=256))
