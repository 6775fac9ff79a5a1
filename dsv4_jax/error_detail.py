"""Where the first bad input of each kind was counted (docs/design/bad-input.md):
the op and the layer, kept in `state.errors` beside the counters when the
config asks for it (`CacheConfig(error_detail=True)`), shown by
`check_errors`.

The record is written around each op, the same for every implementation:
the op runs on the counters alone, and a kind whose counter it took from
zero to non-zero gets the op's code and layer. The handlers' operands do
not change. Per shard the row is

    counters   i32[K]        as without detail (K = NUM_ERROR_KINDS)
    op         i32[K]        the ErrorOp that first counted the kind, 0 none
    layer      i32[K]        its global layer (-1: an op without one)

so `errors` is i32[S * 3K]. Cheap: a few dozen integers an op.
"""
from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp

from .error_ops import ErrorOp
from .errors import DETAIL_FIELDS, NUM_ERROR_KINDS, errors_row

__all__ = ["ErrorOp", "records_detail", "errors_row", "DETAIL_FIELDS"]


def records_detail(op: ErrorOp, *, layer_arg: bool = True, state_at=None):
    """Decorate a public op so that, on a state with error detail, it runs
    on the counters alone and records itself (and its `layer`, the argument
    after the state) for every kind it counts first. `state_at`: where the
    state is in the op's result (None: the result is the state; an int: an
    index of the result tuple, when it is a tuple that long)."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(state, *args, **kwargs):
            config = getattr(state, "config", None)
            if not getattr(config, "error_detail", False):
                return fn(state, *args, **kwargs)
            S, K = config.num_shards, NUM_ERROR_KINDS
            rows = state.errors.reshape(S, errors_row(config))
            counts, detail = rows[:, :K], rows[:, K:].reshape(S, DETAIL_FIELDS, K)
            inner = dataclasses.replace(state, errors=counts.reshape(S * K),
                                        config=config.replace(error_detail=False))
            out = fn(inner, *args, **kwargs)
            if state_at is None:
                new = out
            elif isinstance(out, tuple) and len(out) > state_at \
                    and hasattr(out[state_at], "errors"):
                new = out[state_at]
            else:                                 # return_state=False: nothing kept
                return out
            new_counts = new.errors.reshape(S, K)
            first = (counts == 0) & (new_counts > 0)
            layer = args[0] if layer_arg and args else kwargs.get("layer", -1)
            layer = jnp.asarray(layer, jnp.int32)
            here = jnp.stack([jnp.full((K,), int(op), jnp.int32),
                              jnp.broadcast_to(layer, (K,))])            # [2, K]
            detail = jnp.where(first[:, None, :], here[None], detail)
            errors = jnp.concatenate([new_counts, detail.reshape(S, DETAIL_FIELDS * K)],
                                     axis=1).reshape(-1)
            new = dataclasses.replace(new, errors=errors, config=config)
            if state_at is None:
                return new
            return out[:state_at] + (new,) + out[state_at + 1:]
        return run
    return wrap

