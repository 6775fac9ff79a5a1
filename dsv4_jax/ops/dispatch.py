"""Shared plumbing of the ops: choosing an implementation, calling an FFI
target in place, and trace-time argument checks."""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Sequence

import jax
import numpy as np

from .. import _ffi

IMPLS = ("auto", "reference", "cpu", "cuda")

# What impl="auto" means; DSV4_JAX_IMPL=reference forces the jnp path everywhere
# (parity and debugging runs) without touching the model code.
_default_impl = os.environ.get("DSV4_JAX_IMPL", "auto")
if _default_impl not in IMPLS:
    raise ValueError(f"DSV4_JAX_IMPL: expected one of {IMPLS}, got {_default_impl!r}")


@contextlib.contextmanager
def default_impl(impl: str):
    """Within the block, ops called with impl="auto" use `impl` instead.
    It is read when a function is traced: clear jit caches (jax.clear_caches())
    or use fresh functions when switching between already-traced calls.

    `impl` is "auto", "reference" (the jnp oracle), "cpu" or "cuda" (the FFI
    handlers), e.g. `with dsv4_jax.default_impl("reference"): ...`. The
    environment variable DSV4_JAX_IMPL, read at import, sets the same default."""
    global _default_impl
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    saved, _default_impl = _default_impl, impl
    try:
        yield
    finally:
        _default_impl = saved


def auto_means() -> str:
    """What impl="auto" stands for now: "auto", or what `default_impl` /
    DSV4_JAX_IMPL set."""
    return _default_impl


def _platform_of(arrays) -> str:
    """Platform of the first concrete array, else the default backend (under jit
    arrays are tracers and the computation runs on the default backend)."""
    for a in arrays:
        if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
            try:
                return next(iter(a.devices())).platform
            except Exception:
                break
    return jax.default_backend()


def resolve_impl(impl: str, target: str, arrays: Sequence = ()) -> str:
    """"reference", "cpu" or "cuda". "auto" picks the FFI target of the
    arrays' platform when it was built, else the jnp reference."""
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = _default_impl
    if impl == "reference":
        return impl
    platform = _platform_of(arrays)
    platform = {"gpu": "cuda"}.get(platform, platform)
    if impl == "auto":
        return platform if _ffi.has_target(platform, target) else "reference"
    # One target name is registered per platform, so the platform the step
    # runs on decides which handler runs: refuse a mismatch instead.
    if impl != platform:
        raise ValueError(f"impl: {impl!r} needs the computation on {impl}, "
                         f"but it runs on {platform}")
    if not _ffi.has_target(impl, target):
        raise ValueError(f"impl: FFI target {target!r} is not built for {impl!r} "
                         f"({_ffi.module_status().get(impl, 'module not found')})")
    return impl


def ffi_call(target: str, args: Sequence, out_types: Sequence, aliases: dict, **attrs) -> list:
    """Call FFI `target`; `aliases` maps an argument index to the result it is
    updated into in place. Integer attributes are passed as int64.

    Under `jax.vmap` the call runs once per element of the batch, in a loop
    (`_one_call_per_element`): the handlers take one state and one step's
    operands, so a batch is that many calls, each exactly the unbatched op."""
    call = jax.ffi.ffi_call(target, list(out_types), input_output_aliases=aliases)
    kw = {k: np.int64(v) for k, v in attrs.items()}
    mapped = jax.custom_batching.custom_vmap(lambda *a: tuple(call(*a, **kw)))
    mapped.def_vmap(functools.partial(_one_call_per_element, mapped))
    return list(mapped(*args))


def _one_call_per_element(fn, axis_size, in_batched, *args):
    """The batching rule of ffi_call: `fn` once per element, in a loop. Each
    element's operands and results pass an optimization barrier, so the call
    never sees a slice of the batch: XLA's GPU dynamic-slice fusion would
    otherwise hand a handler a slice of the batched output as the result
    of an operand it updates in place, and that result does not start as the
    operand (the handlers write only what changes)."""
    batched = [a for a, b in zip(args, in_batched) if b]

    def one(elements):
        it = iter(elements)
        full = [next(it) if b else a for a, b in zip(args, in_batched)]
        return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(full)))
    outs = jax.lax.map(one, batched)
    return tuple(outs), tuple([True] * len(outs))


def operand_index(target: str, role: str, name: str) -> int:
    """The position of `target`'s operand `name` among its arguments (role
    "arg") or results ("ret"), from the list its handlers bind."""
    kinds = {"arg": ("arg", "args"), "ret": ("ret", "rets")}[role]
    names = [n for r, n in _ffi.operands(target) if r in kinds]
    if name not in names:
        raise KeyError(f"{target}: no {role} named {name!r} (its {role}s: {names})")
    return names.index(name)


def errors_alias(target: str, return_state: bool) -> dict:
    """A read op's aliasing of its `errors_in` argument into its `errors`
    result: only when the op returns the state. Aliasing a buffer the caller
    still holds (the state it did not take back) makes XLA copy it before the
    call."""
    if not return_state:
        return {}
    return {operand_index(target, "arg", "errors_in"): operand_index(target, "ret", "errors")}


def ffi_in_place(target: str, inputs: Sequence, aliased: Sequence, **attrs) -> list:
    """Call FFI `target` on `inputs` (read only) followed by `aliased` (updated
    in place), returning the new values of `aliased`. Buffers keep their native
    shapes: a reshape around the call would force a copy. The aliased operands
    start at the target's first argument named `*_in`."""
    n = len(inputs)
    args = [name for role, name in _ffi.operands(target) if role in ("arg", "args")]
    first = next(i for i, name in enumerate(args) if name.endswith("_in"))
    if n != first:
        raise ValueError(f"{target}: {n} read-only inputs, but its aliased operands start "
                         f"at argument {first} ({args[first]})")
    out_types = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in aliased]
    return ffi_call(target, [*inputs, *aliased], out_types,
                    {n + i: i for i in range(len(aliased))}, **attrs)


def check_array(name: str, x, shape: tuple, dtypes) -> None:
    """ValueError naming `name` unless x has `shape` (None = any size along an
    axis) and one of `dtypes`."""
    dtypes = tuple(np.dtype(d) for d in (dtypes if isinstance(dtypes, (tuple, list)) else (dtypes,)))
    want = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):   # a list, a tuple, a Python int
        raise ValueError(f"{name}: expected a jax or numpy array of shape {want} and dtype "
                         f"{' or '.join(str(d) for d in dtypes)}, got {type(x).__name__}")
    got_shape = tuple(x.shape)
    ok = len(got_shape) == len(shape) and all(e is None or e == g for e, g in zip(shape, got_shape))
    if not ok:
        raise ValueError(f"{name}: expected shape {want}, got {list(got_shape)}")
    if np.dtype(getattr(x, "dtype", None)) not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, "
                         f"got {getattr(x, 'dtype', type(x).__name__)}")
