"""The ops an error-detail record names (`CacheConfig(error_detail=True)`,
dsv4_jax/error_detail.py): a module of its own so that the counters
(errors.py) and the records both read it without importing each other."""
from __future__ import annotations

import enum


class ErrorOp(enum.IntEnum):
    """The op recorded with a kind's first count (0: none yet)."""
    APPLY_STEP = 1
    APPEND = 2
    FLUSH = 3
    WRITE_LAYER = 4
    INDEXER_TOPK = 5
    ATTENTION = 6
    GATHER_WINDOW = 7
    GATHER_TOPK = 8
    GATHER_ALL = 9
    VERIFY_COMMIT = 10


# what `check_errors` and the API reference say each op is
_DESCRIPTIONS = {op: f"`dsv4_jax.{op.name.lower()}`" for op in ErrorOp}
