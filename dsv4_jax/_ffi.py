"""Loads the compiled FFI modules and registers their targets with XLA.

`_dsv4_cpu` is always built; `_dsv4_cuda` only where a CUDA compiler was found.
The package imports without either (then every op runs its jnp reference).
`_dsv4_testing_cpu` / `_dsv4_testing_cuda` hold the test-only targets (the
numerics probes, `dsv4_noop`); only a build with
`-C cmake.define.DSV4_BUILD_TESTING=ON` has them, and they load when present.
"""
from __future__ import annotations

import importlib
import os
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
_operands: dict[str, list] = {}         # target -> [(role, name)], as its handlers bind them


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
        if hasattr(module, "operands"):
            _operands.update(module.operands())
        try:
            testing = importlib.import_module(f"dsv4_jax.{testing_name}")
        except ImportError:        # the default build has no test-only targets
            continue
        _registered[key] |= _register(testing, platform)
        if hasattr(testing, "operands"):
            _operands.update(testing.operands())
        _testing[key] = testing


def has_target(platform: str, name: str) -> bool:
    """Whether FFI target `name` was registered for `platform` ("cpu"/"cuda")."""
    return name in _registered.get(platform.lower(), ())


def operands(target: str) -> list[tuple[str, str]]:
    """FFI target `target`'s operands as its handlers bind them: (role, name)
    in order, role "attr", "arg", "args" (the remaining arguments), "ret" or
    "rets" (the remaining results); ffi/include/dsv4/operands.h."""
    if target not in _operands:
        raise KeyError(f"{target}: no operand list (the CPU module is not loaded: "
                       f"{module_status().get('cpu', 'not built')})")
    return [tuple(o) for o in _operands[target]]


def testing_module(platform: str):
    """The loaded test-only module of `platform` ("cpu"/"cuda"), or None."""
    return _testing.get(platform.lower())


def module_status() -> dict[str, str]:
    """Per platform: "loaded (k targets)" or why the module did not load."""
    status = {p: f"loaded ({len(n)} targets{', testing module' if p in _testing else ''})"
              for p, n in _registered.items()}
    status.update({p: f"not loaded: {e}" for p, e in _load_errors.items()})
    return status


def source_checkout() -> str | None:
    """The source checkout this package was imported from (the folder with
    CMakeLists.txt above dsv4_jax/), or None for an installed package."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return root if os.path.exists(os.path.join(root, "CMakeLists.txt")) else None


def missing_module_reason(platform: str) -> str:
    """One line: why the FFI module of `platform` ("cpu" / "cuda") is not
    loaded, and how to get it."""
    module = f"dsv4_jax.{_MODULES['CUDA' if platform == 'cuda' else platform][0]}"
    if platform == "cuda" and "cpu" in _registered:
        return (f"{module} was not built with this package (no CUDA compiler found, or "
                f"DSV4_BUILD_CUDA=OFF; `pip install -v` shows what CMake did)")
    checkout = source_checkout()
    if checkout is not None:
        # Python imports the package from the checkout (the current directory
        # comes first on sys.path), not from where pip installed it.
        return (f"{module} is not built in {os.path.join(checkout, 'dsv4_jax')}, the source "
                f"checkout Python imports dsv4_jax from; build it in place with "
                f"`pip install -e .` in {checkout}, or run from another directory")
    error = _load_errors.get(platform, "not built")
    return f"{module} did not load ({error}); reinstall with `pip install -v .` to see the build"


try:
    _register_all()
except Exception as e:  # a broken build must not make the package unimportable
    warnings.warn(f"dsv4_jax: FFI registration failed, using the jnp reference: {e}")
