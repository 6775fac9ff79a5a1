"""Host-side bookkeeping (docs/design.md §7): request slots, physical blocks, and the
step metadata. Plain Python, no device sync.

A typical step::

    meta = manager.prepare_step({req_a: 37, req_b: 1})   # tokens per request
    state = step_fn(state, meta, ...)                     # jitted, donated

Token rows of the step are laid out request by request in the order of the
mapping (`manager.token_rows(req)` gives each request's slice), padded with -1
slots to a bucket size so the jitted step sees few distinct shapes.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Hashable, Mapping

import numpy as np

from .config import BLOCK_TOKENS, CacheConfig
from .meta import StepMeta


class CacheFullError(RuntimeError):
    """No free request slot, not enough free blocks, or a request past its
    maximum context. The manager's state is unchanged when this is raised."""


@dataclasses.dataclass
class _Request:
    slot: int
    length: int = 0                       # tokens in the cache
    blocks: list = dataclasses.field(default_factory=list)   # physical id per logical block


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): padded sizes of the metadata."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


class CacheManager:
    """Admits and releases requests, allocates blocks, builds `StepMeta`.

    Plain Python on the host, no device sync: one per cache (a sharded cache
    uses `dsv4_jax.sharding.ShardedCacheManager`). Request ids are any
    hashable. Each step: `prepare_step({request: new tokens})` gives the
    StepMeta whose token rows the model fills (see "Token rows").

    `shard` only labels error messages (one manager per shard, docs/design.md §10)."""

    def __init__(self, config: CacheConfig, *, shard: int | None = None):
        self.config = config
        self.shard = shard
        self._free_slots = collections.deque(range(config.max_requests))
        self._free_blocks = collections.deque(range(config.num_blocks))
        self._requests: dict[Hashable, _Request] = {}
        self._pending_resets: list[int] = []
        self._ids = itertools.count()
        self._token_rows: dict[Hashable, slice] = {}

    # ---- queries ---------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """Request slots not in use."""
        return len(self._free_slots)

    @property
    def free_blocks(self) -> int:
        """Physical blocks not in use."""
        return len(self._free_blocks)

    @property
    def requests(self) -> tuple:
        """Ids of the admitted requests, in order of admission."""
        return tuple(self._requests)

    def slot_of(self, request_id) -> int:
        """The request's slot: its row of the block table, the windows and
        the accumulators (KeyError if not admitted)."""
        return self._request(request_id).slot

    def length_of(self, request_id) -> int:
        """Tokens of the request in the cache, those of the last step included."""
        return self._request(request_id).length

    def blocks_of(self, request_id) -> tuple[int, ...]:
        """The request's physical blocks, one per 128 tokens, in order."""
        return tuple(self._request(request_id).blocks)

    def token_rows(self, request_id) -> slice:
        """Rows of `request_id`'s tokens in the last `prepare_step`: a slice of
        the step's T token rows, empty for 0 tokens; KeyError if the request
        was not in that step's mapping."""
        return self._token_rows[request_id]

    def _where(self) -> str:
        return "" if self.shard is None else f" on shard {self.shard}"

    def _request(self, request_id) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not admitted{self._where()}") from None

    # ---- admission -----------------------------------------------------------------
    def admit(self, request_id: Hashable | None = None) -> Hashable:
        """Take a free slot for a new request; returns its id (a new int if
        `request_id` is None). Its slot is reset by the next step's apply_step."""
        if request_id is None:
            request_id = next(i for i in self._ids if i not in self._requests)
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already admitted{self._where()}")
        if not self._free_slots:
            raise CacheFullError(
                f"no free request slot{self._where()}: asked for 1, all "
                f"{self.config.max_requests} slots are in use")
        slot = self._free_slots.popleft()
        self._requests[request_id] = _Request(slot)
        self._pending_resets.append(slot)
        return request_id

    def release(self, request_id) -> None:
        """Return the request's slot and blocks. A block's next owner gets it
        scrubbed by apply_step, so it never reads this request's entries."""
        req = self._request(request_id)
        del self._requests[request_id]
        self._free_blocks.extend(req.blocks)
        self._free_slots.append(req.slot)

    # ---- steps -----------------------------------------------------------------------
    def prepare_step(self, tokens: Mapping[Hashable, int], *, min_tokens: int = 1,
                     min_new_blocks: int = 1, min_resets: int = 1,
                     device_put: bool = True) -> StepMeta:
        """Metadata of one step that appends `tokens[r]` tokens to each request r.

        Allocates a block whenever a request's new tokens cross into a new
        128-token block. Raises CacheFullError (and changes nothing) if a
        request would pass its maximum context or the free blocks run out.
        Sizes are padded to powers of two, at least the given minimums."""
        plan = self.plan_step(tokens)
        return self.commit_step(plan, min_tokens=min_tokens, min_new_blocks=min_new_blocks,
                                min_resets=min_resets, device_put=device_put)

    def plan_step(self, tokens: Mapping[Hashable, int]) -> "StepPlan":
        """Check a step and size it, changing nothing (CacheFullError, KeyError
        or ValueError if it cannot be done)."""
        cfg = self.config
        rows = []
        blocks_needed = 0
        for rid, n in tokens.items():
            req = self._request(rid)
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
                raise ValueError(f"tokens[{rid!r}]: expected a count >= 0, got {n!r}")
            end = req.length + int(n)
            if end > cfg.max_context:
                raise CacheFullError(
                    f"request {rid!r}{self._where()} asked for {n} more tokens, reaching {end}; "
                    f"its maximum context is {cfg.max_context} tokens "
                    f"({cfg.max_blocks_per_request} blocks of {BLOCK_TOKENS})")
            have = len(req.blocks)
            want = -(-end // BLOCK_TOKENS)
            rows.append((rid, int(n), range(have, max(have, want))))
            blocks_needed += max(0, want - have)
        if blocks_needed > len(self._free_blocks):
            raise CacheFullError(
                f"step needs {blocks_needed} new blocks{self._where()}, only "
                f"{len(self._free_blocks)} of {cfg.num_blocks} are free")
        return StepPlan(rows, sum(r[1] for r in rows), blocks_needed, len(self._pending_resets))

    def commit_step(self, plan: "StepPlan", *, min_tokens: int = 1, min_new_blocks: int = 1,
                    min_resets: int = 1, device_put: bool = True) -> StepMeta:
        """Carry out a plan from `plan_step` (made since the last change)."""
        cfg = self.config
        T = bucket(plan.num_tokens, min_tokens)
        token_slot = np.full(T, -1, np.int32)
        token_pos = np.zeros(T, np.int32)
        new_blocks = []
        row = 0
        self._token_rows = {}
        for rid, n, logicals in plan.rows:
            req = self._requests[rid]
            start = req.length
            token_slot[row:row + n] = req.slot
            token_pos[row:row + n] = np.arange(start, start + n, dtype=np.int32)
            self._token_rows[rid] = slice(row, row + n)
            row += n
            for logical in logicals:
                physical = self._free_blocks.popleft()
                req.blocks.append(physical)
                new_blocks.append((req.slot, logical, physical))
            req.length = start + n
        nb = np.full((bucket(len(new_blocks), min_new_blocks), 3), -1, np.int32)
        if new_blocks:
            nb[:len(new_blocks)] = new_blocks
        resets = np.full(bucket(len(self._pending_resets), min_resets), -1, np.int32)
        resets[:len(self._pending_resets)] = self._pending_resets
        self._pending_resets = []
        lengths = np.zeros(cfg.max_requests, np.int32)
        for req in self._requests.values():
            lengths[req.slot] = req.length
        return StepMeta.build(token_slot=token_slot, token_pos=token_pos, lengths=lengths,
                              new_blocks=nb, reset_slots=resets, device_put=device_put)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A checked step: per request (id, new tokens, new logical blocks)."""
    rows: list
    num_tokens: int
    num_new_blocks: int
    num_resets: int
