"""pytest's set-up of the suite: the helpers' import path, the host devices,
and the fixtures that test files in several folders use."""
from __future__ import annotations

import atexit
import ctypes
import gc
import os
import shutil
import sys
import tempfile

# test files import their helpers as `support.<module>` (tests/support/)
sys.path.insert(0, os.path.dirname(__file__))

# Four CPU devices for the sharding tests; must be set before jax initializes.
# LLVM's optimization level 0 for the CPU code XLA emits: the suite compiles
# hundreds of small programs and runs each briefly, and at level 0 it spends
# about a third less time compiling. One difference: at its default level
# XLA's CPU code fuses a multiply into the add after it (an FMA), at level 0
# it does not, so a reference result that depends on that would pass here
# and differ for a user; the indexer's overflowing products are formed on
# the bits for that reason (reference/quant.py times_pow2, tested at the
# default level in numerics/test_quant.py).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4 "
                                   "--xla_backend_optimization_level=0")
# pytest's defaults run a worker per core (pyproject addopts): on a GPU each
# worker would otherwise reserve most of the device's memory at its first
# array and the second would fail to allocate.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# No --xla_allow_excess_precision=false here: the reference rounds to bf16
# on the bits (reference/quant.py to_bf16), so it must hold under XLA's
# default, which lets the GPU compiler drop f32 -> bf16 -> f32 round trips.

import jax
import numpy as np
import pytest

# The suite compiles the same program again and again: jit caches are
# cleared between files and implementations (below), and tests in several
# files build the same steps. JAX's persistent compilation cache, in a
# folder of this process's own that goes with it, hands each later copy the
# executable compiled the first time (keyed by the program, its options and
# the backend) and saves about a fifth of the run; nothing outlives it, so
# every run compiles everything once, as on a clean clone.
_compile_cache = tempfile.mkdtemp(prefix="dsv4-jax-tests-xla-")
atexit.register(shutil.rmtree, _compile_cache, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _compile_cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

import dsv4_jax as D

from support.harness import make_params
from support.marks import CUDA, requires_cpu_ffi
from support.tiny_step import CFG, errs, inputs, step


IMPL_ORDER = ("auto", "reference", "cpu", "cuda")


def _impl_of(item) -> str:
    """What impl="auto" resolves to while `item` runs: its impl_under_test
    parameter, else the default."""
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("impl_under_test", "auto") if callspec else "auto"


def pytest_collection_modifyitems(items):
    """Each file's tests grouped by the implementation they run under (a
    stable sort, files in their order): the jit caches, which hold traces
    made under one implementation, then serve a whole group, and a
    module-level jitted helper compiles once per implementation, not once
    per test."""
    files = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    items[:] = [item for group in files.values()
                for item in sorted(group, key=lambda i: IMPL_ORDER.index(_impl_of(i)))]


_traced_under = [None, None]       # the impl and the file of the last test
# Compiled programs are kept until the caches are cleared: past this resident
# size they are let go after a test, so a long run stays within ~2 GB.
_RSS_LIMIT = 1.2 * 2 ** 30


try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):    # not glibc: nothing to trim
    _malloc_trim = lambda pad: 0     # noqa: E731


def _rss() -> int:
    """This process's resident bytes now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(autouse=True)
def _jit_caches_follow_the_impl(request):
    """Clears the jit caches when the implementation "auto" stands for
    changes between two tests, so no trace made under another is reused
    (default_impl is read when a function is traced); and when the file
    changes, or the process holds more than _RSS_LIMIT, to let go of
    compiled programs no later test uses."""
    here = (_impl_of(request.node), request.node.path)
    if _traced_under[0] is not None and (here != tuple(_traced_under) or _rss() > _RSS_LIMIT):
        jax.clear_caches()
        gc.collect()
        _malloc_trim(0)             # hand the freed heap back to the system
    _traced_under[:] = here
    yield


@pytest.fixture(params=["reference", pytest.param("cpu", marks=requires_cpu_ffi),
                        pytest.param("cuda", marks=CUDA)])
def impl_under_test(request):
    """Runs a test once per implementation, as what impl="auto" resolves to
    (the jit caches: _jit_caches_follow_the_impl)."""
    with D.default_impl(request.param):
        yield request.param


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
