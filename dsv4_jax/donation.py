"""Donation of the cache state: the ops update the pools in place only when
the jitted step donates the state (`jax.jit(step, donate_argnames="state")`).
Without it XLA copies every pool an op writes, on every call: hundreds of
times slower at serving sizes, with the same results.

Inside a trace an op cannot see whether its caller donates: `jax.jit` keeps
that to itself until it lowers. So the ops warn only where they can tell
(a call outside any jit, which always copies), and `check_donated` asks the
lowering of a jitted step itself.
"""
from __future__ import annotations

import warnings

import jax


class NotDonatedWarning(UserWarning):
    """An op ran where it copies the pools it updates instead of writing them
    in place."""


_warned = False


def warn_if_eager(state, op: str) -> None:
    """Warn once per process when `op` runs on concrete arrays, outside any
    `jax.jit`: each such call copies every pool it writes."""
    global _warned
    if _warned or isinstance(state.errors, jax.core.Tracer):
        return
    _warned = True
    warnings.warn(
        f"dsv4_jax.{op} ran outside jax.jit, so it copied every pool it updates; "
        "run the step under jax.jit with the state donated "
        "(jax.jit(step, donate_argnames='state')); dsv4_jax.check_donated(step, ...) checks "
        "a jitted step", NotDonatedWarning, stacklevel=3)


def check_donated(jitted, *args, **kwargs) -> None:
    """Raise ValueError unless `jitted` (a `jax.jit` function) donates every
    `CacheState` among `args` / `kwargs`. It lowers the function for these
    arguments (a trace, no compilation, nothing runs); call it once, e.g.
    before a serving loop or in a test."""
    from .state import CacheState
    is_state = lambda x: isinstance(x, CacheState)
    lowered = jitted.lower(*args, **kwargs)
    states = [s for s in jax.tree_util.tree_leaves(lowered.args_info, is_leaf=is_state)
              if is_state(s)]
    if not states:
        raise ValueError("check_donated: no CacheState among the arguments")
    for i, s in enumerate(states):
        kept = [jax.tree_util.keystr(path) for path, info in
                jax.tree_util.tree_leaves_with_path(s) if not info.donated]
        if kept:
            raise ValueError(
                f"check_donated: cache state {i} is not donated ({len(kept)} of its arrays, "
                f"e.g. state{kept[0]}): every op that writes it copies the whole pool; jit the "
                "step with donate_argnames=('state',) or donate_argnums")
