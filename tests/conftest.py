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
import pytest

from support.marks import CUDA, requires_cpu_ffi


@pytest.fixture(params=["reference", pytest.param("cpu", marks=requires_cpu_ffi),
                        pytest.param("cuda", marks=CUDA)])
def impl_under_test(request):
    """Runs a test once per implementation, as what impl="auto" resolves to.
    Jit caches are cleared around it so no trace of another impl is reused."""
    import dsv4_jax
    jax.clear_caches()
    with dsv4_jax.default_impl(request.param):
        yield request.param
    jax.clear_caches()
