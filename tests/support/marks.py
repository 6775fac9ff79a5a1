"""Skip marks of the suite: a case for the CUDA handlers runs only where a GPU
and the CUDA module are there, a case for the CPU handlers only where the CPU
module was built, a large case only where the host has the memory."""
from __future__ import annotations

import jax
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


def cpu_target_built(target: str):
    """Skips a case that calls the CPU handler `target` itself (impl="cpu" or
    a raw FFI call) where the CPU module lacks it."""
    return pytest.mark.skipif(not _ffi.has_target("cpu", target),
                              reason="CPU FFI module not built")


def available_host_gb() -> float:
    """MemAvailable of the host in GiB (0 where /proc/meminfo is missing)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return 0.0


# a case run once per implementation (reference, CPU FFI, CUDA), each as what
# impl="auto" resolves to: conftest's impl_under_test
every_impl = pytest.mark.usefixtures("impl_under_test")
