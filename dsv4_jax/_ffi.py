"""Loads the compiled FFI modules and registers their targets with XLA.

`_dsv4_cpu` is always built; `_dsv4_cuda` only where a CUDA compiler was found.
The package imports without either (then every op runs its jnp reference).
`_dsv4_testing_cpu` / `_dsv4_testing_cuda` hold the test-only targets (the
numerics probes, `dsv4_noop`); only a build with
`-C cmake.define.DSV4_BUILD_TESTING=ON` has them, and they load when present.
"""
from __future__ import annotations

import importlib
import warnings

import jax

# platform name in jax.ffi.register_ffi_target -> (ops module, testing module)
_MODULES = {"cpu": ("_dsv4_cpu", "_dsv4_testing_cpu"),
            "CUDA": ("_dsv4_cuda", "_dsv4_testing_cuda")}
# how to get the testing modules, for skip reasons and messages
TESTING_BUILD = "pip install with -C cmake.define.DSV4_BUILD_TESTING=ON"
_registered: dict[str, set[str]] = {}   # platform ("cpu" | "cuda") -> target names
_testing: dict[str, object] = {}        # platform -> its loaded testing module
_load_errors: dict[str, str] = {}


def _register(module, platform: str) -> set[str]:
    names = set()
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)
        names.add(name)
    return names


def _register_all() -> None:
    for platform, (ops_name, testing_name) in _MODULES.items():
        key = platform.lower()
        try:
            module = importlib.import_module(f"dsv4_jax.{ops_name}")
        except ImportError as e:   # not built here: the reference path serves
            _load_errors[key] = str(e)
            continue
        _registered[key] = _register(module, platform)
        try:
            testing = importlib.import_module(f"dsv4_jax.{testing_name}")
        except ImportError:        # the default build has no test-only targets
            continue
        _registered[key] |= _register(testing, platform)
        _testing[key] = testing


def has_target(platform: str, name: str) -> bool:
    """Whether FFI target `name` was registered for `platform` ("cpu"/"cuda")."""
    return name in _registered.get(platform.lower(), ())


def testing_module(platform: str):
    """The loaded test-only module of `platform` ("cpu"/"cuda"), or None."""
    return _testing.get(platform.lower())


def module_status() -> dict[str, str]:
    """Per platform: "loaded (k targets)" or why the module did not load."""
    status = {p: f"loaded ({len(n)} targets{', testing module' if p in _testing else ''})"
              for p, n in _registered.items()}
    status.update({p: f"not loaded: {e}" for p, e in _load_errors.items()})
    return status


try:
    _register_all()
except Exception as e:  # a broken build must not make the package unimportable
    warnings.warn(f"dsv4_jax: FFI registration failed, using the jnp reference: {e}")
