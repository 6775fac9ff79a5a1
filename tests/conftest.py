"""Shared test helpers: random data, poisoning, byte-level comparison."""
from __future__ import annotations

import os
import sys

# tests import their helpers (oracle, scenario, inplace, ...) as plain modules
sys.path.insert(0, os.path.dirname(__file__))

# Four CPU devices for the sharding tests; must be set before jax initializes.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# No --xla_allow_excess_precision=false here: the reference rounds to bf16
# on the bits (reference/quant.py to_bf16), so it must hold under XLA's
# default, which lets the GPU compiler drop f32 -> bf16 -> f32 round trips.

import jax
import numpy as np
import pytest

from dsv4_jax import _ffi


def has_cuda() -> bool:
    try:
        return bool(jax.devices("cuda")) and _ffi.has_target("cuda", "dsv4_apply_step")
    except RuntimeError:
        return False


requires_cuda = pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU and _dsv4_cuda")
# marks of a CUDA case: skipped without a GPU, selected by `pytest -m gpu`
CUDA = [requires_cuda, pytest.mark.gpu]
requires_cpu_ffi = pytest.mark.skipif(
    not _ffi.has_target("cpu", "dsv4_apply_step") or jax.default_backend() != "cpu",
    reason="_dsv4_cpu not built, or the default backend is not the CPU")


def available_host_gb() -> float:
    """MemAvailable of the host in GiB (0 where /proc/meminfo is missing)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return 0.0


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
