"""Loads the compiled FFI modules and registers their targets with XLA.

`_dsv4_cpu` is always built; `_dsv4_cuda` only where a CUDA compiler was found.
The package imports without either (then every op runs its jnp reference).
"""
from __future__ import annotations

import importlib
import warnings

import jax

# platform name in jax.ffi.register_ffi_target -> module
_MODULES = {"cpu": "_dsv4_cpu", "CUDA": "_dsv4_cuda"}
_registered: dict[str, set[str]] = {}   # platform ("cpu" | "cuda") -> target names
_load_errors: dict[str, str] = {}


def _register_all() -> None:
    for platform, module_name in _MODULES.items():
        try:
            module = importlib.import_module(f"dsv4_jax.{module_name}")
        except ImportError as e:   # not built here: the reference path serves
            _load_errors[platform.lower()] = str(e)
            continue
        names = set()
        for name, capsule in module.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
            names.add(name)
        _registered[platform.lower()] = names


def has_target(platform: str, name: str) -> bool:
    """Whether FFI target `name` was registered for `platform` ("cpu"/"cuda")."""
    return name in _registered.get(platform.lower(), ())


def module_status() -> dict[str, str]:
    """Per platform: "loaded (k targets)" or why the module did not load."""
    status = {p: f"loaded ({len(n)} targets)" for p, n in _registered.items()}
    status.update({p: f"not loaded: {e}" for p, e in _load_errors.items()})
    return status


try:
    _register_all()
except Exception as e:  # a broken build must not make the package unimportable
    warnings.warn(f"dsv4_jax: FFI registration failed, using the jnp reference: {e}")
