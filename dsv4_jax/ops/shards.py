"""An op on a sharded state: the op itself run on every shard, its operands
passed by name, so no op unpacks a shard body's arguments by position."""
from __future__ import annotations

from typing import Callable, Mapping

from ..sharded_state import run_sharded
from ._layer import pick_layer, traced_layer

_NO_LAYER = object()


def per_shard(op: Callable, state, out_specs, *, layer=_NO_LAYER, rows: Mapping | None = None,
              whole: Mapping | None = None, **static):
    """`op(local_state[, layer], **rows, **whole, **static)` on every shard
    (`run_sharded`): `rows` split along their first axis shard by shard,
    `whole` the same on every shard, `static` Python values passed as they
    are. An operand given as None is passed as None and not sent to the
    shards; a traced `layer` is carried in as an operand, a Python int stays
    static. `out_specs` as run_sharded takes it."""
    rows, whole = dict(rows or {}), dict(whole or {})
    split = {k: v for k, v in rows.items() if v is not None}
    same = {k: v for k, v in whole.items() if v is not None}
    absent = {k: None for k, v in {**rows, **whole}.items() if v is None}
    carried = [] if layer is _NO_LAYER else traced_layer(layer)
    names = [*split, *same]

    def body(st, *args):
        kw = {**absent, **dict(zip(names, args)), **static}
        if layer is _NO_LAYER:
            return op(st, **kw)
        return op(st, pick_layer(layer, list(args[len(names):])), **kw)
    return run_sharded(body, state, list(split.values()), [*same.values(), *carried], out_specs)
