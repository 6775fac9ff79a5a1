"""Host-side bookkeeping (docs/design/host.md): request slots, physical blocks, and the
step metadata. Plain Python, no device sync.

A typical step::

    meta = manager.prepare_step({req_a: 37, req_b: 1})   # tokens per request
    state = step_fn(state, meta, ...)                     # jitted, donated

Token rows of the step are laid out request by request in the order of the
mapping (`manager.token_rows(req)` gives each request's slice), padded with -1
slots to a bucket size so the jitted step sees few distinct shapes.

Blocks are reference counted: a block is held by every request whose block
list names it and by every cached prefix (`cache_prefix`) that names it, and
goes back to the free list only when the last holder lets go. A request
admitted on a prefix (`admit(prefix=...)`) shares the prefix's blocks, all of
them full (a prefix is a multiple of 128 tokens), and only ever appends
tokens after them, so no request writes a block another holds
(docs/design/host.md, "Prefix sharing").
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Hashable, Mapping

import numpy as np

from ..config import BLOCK_TOKENS, CacheConfig
from ..meta import StepMeta, bucket
from ..requests.types import check_snapshot


class CacheFullError(RuntimeError):
    """No free request slot, not enough free blocks, or a request past its
    maximum context. The manager's state is unchanged when this is raised."""


@dataclasses.dataclass
class _Request:
    slot: int
    length: int = 0                       # tokens in the cache
    blocks: list = dataclasses.field(default_factory=list)   # physical id per logical block


@dataclasses.dataclass(frozen=True)
class _Prefix:
    tokens: int                           # a positive multiple of 128
    blocks: tuple                         # its physical blocks, all full
    snapshot: object                      # the RequestSnapshot taken at `tokens`


class CacheManager:
    """Admits and releases requests, allocates blocks, builds `StepMeta`.

    Plain Python on the host, no device sync: one per cache (a sharded cache
    uses `dsv4_jax.sharding.ShardedCacheManager`). Request ids are any
    hashable. Each step: `prepare_step({request: new tokens})` gives the
    StepMeta whose token rows the model fills (see "Token rows").

    `shard` only labels error messages (one manager per shard, docs/design/sharding.md)."""

    def __init__(self, config: CacheConfig, *, shard: int | None = None):
        self.config = config
        self.shard = shard
        self._free_slots = collections.deque(range(config.max_requests))
        self._free_blocks = collections.deque(range(config.num_blocks))
        self._refs: dict[int, int] = {}            # holders of each block in use
        self._requests: dict[Hashable, _Request] = {}
        self._prefixes: dict[Hashable, _Prefix] = {}
        self._pending_resets: list[int] = []
        self._ids = itertools.count()
        self._token_rows: dict[Hashable, slice] = {}
        # the last step's (start length, tokens, blocks held before it) per
        # request, until commit_speculative settles it or the next step
        self._last_step: dict[Hashable, tuple[int, int, int]] = {}
        self._speculative = False      # the last step was prepared as a speculative one

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

    def block_row(self, request_id) -> np.ndarray:
        """The request's block-table row: i32[MB], its physical blocks then -1
        (what `restore` writes into its slot)."""
        row = np.full(self.config.max_blocks_per_request, -1, np.int32)
        blocks = self._request(request_id).blocks
        row[:len(blocks)] = blocks
        return row

    def global_slot(self, request_id) -> int:
        """The request's slot (one shard: the same as `slot_of`; sharded, the
        row in the global R axis, see ShardedCacheManager)."""
        return self.slot_of(request_id)

    def global_blocks(self, request_id) -> tuple[int, ...]:
        """The request's physical blocks as ids of the whole cache (one shard:
        `blocks_of`)."""
        return self.blocks_of(request_id)

    def refcount(self, block: int) -> int:
        """Holders of physical block `block`: requests and cached prefixes
        naming it (0 = free)."""
        return self._refs.get(block, 0)

    @property
    def prefixes(self) -> tuple:
        """Keys of the cached prefixes, oldest first."""
        return tuple(self._prefixes)

    def prefix_tokens(self, key) -> int:
        """Tokens of a cached prefix (KeyError if none has that key)."""
        return self._prefix(key).tokens

    def prefix_blocks(self, key) -> tuple[int, ...]:
        """Physical blocks of a cached prefix."""
        return self._prefix(key).blocks

    def prefix_snapshot(self, key):
        """The RequestSnapshot a cached prefix was registered with."""
        return self._prefix(key).snapshot

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

    def _prefix(self, key) -> _Prefix:
        try:
            return self._prefixes[key]
        except KeyError:
            raise KeyError(f"no cached prefix {key!r}{self._where()}") from None

    # ---- admission -----------------------------------------------------------------
    def admit(self, request_id: Hashable | None = None, *, prefix: Hashable | None = None,
              slot: int | None = None) -> Hashable:
        """Take a free slot for a new request; returns its id (a new int if
        `request_id` is None). Its slot is reset by the next step's apply_step.

        prefix  the key of a cached prefix (`cache_prefix`): the request starts
                with the prefix's tokens, its blocks are the prefix's (shared,
                reference counted) and its slot is not reset: the caller
                writes the prefix's snapshot and `block_row(id)` into it with
                `restore` before the next step (`dsv4_jax.admit_on_prefix`
                does both)
        slot    take this slot rather than the next free one (ValueError if it
                is outside [0, R) or held by a request)"""
        entry = None if prefix is None else self._prefix(prefix)
        if entry is not None:
            return self._place(request_id, slot, entry.tokens, list(entry.blocks))
        request_id = self._place(request_id, slot, 0, [])
        slot = self._requests[request_id].slot
        if slot not in self._pending_resets:    # admitted, released, admitted again: one reset
            self._pending_resets.append(slot)
        return request_id

    def admit_restored(self, length: int, request_id: Hashable | None = None, *,
                       slot: int | None = None) -> Hashable:
        """Admit a request that arrives with `length` tokens already computed
        (resumed from host memory, imported from another cache): it gets a
        slot and ceil(length / 128) fresh blocks, and no reset; the caller
        fills the blocks with `write_blocks` and the slot with `restore`
        before the next step (`dsv4_jax.resume` does). CacheFullError, and
        nothing changed, if the slot or the blocks are not there."""
        if not isinstance(length, (int, np.integer)) or isinstance(length, bool) \
                or not 0 <= length <= self.config.max_context:
            raise ValueError(f"length: expected an int in [0, {self.config.max_context}], "
                             f"got {length!r}")
        need = -(-int(length) // BLOCK_TOKENS)
        if need > len(self._free_blocks):
            raise CacheFullError(f"a request of {length} tokens needs {need} blocks{self._where()}, "
                                 f"only {len(self._free_blocks)} of {self.config.num_blocks} "
                                 f"are free")
        self._check_place(request_id, slot)
        blocks = [self._free_blocks.popleft() for _ in range(need)]
        return self._place(request_id, slot, int(length), blocks)

    def _check_place(self, request_id, slot) -> None:
        if request_id is not None and request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already admitted{self._where()}")
        if slot is None:
            if not self._free_slots:
                raise CacheFullError(
                    f"no free request slot{self._where()}: asked for 1, all "
                    f"{self.config.max_requests} slots are in use")
            return
        R = self.config.max_requests
        if not isinstance(slot, (int, np.integer)) or isinstance(slot, bool) or not 0 <= slot < R:
            raise ValueError(f"slot: expected an int in [0, {R}), got {slot!r}")
        if slot not in self._free_slots:
            owner = next(r for r, q in self._requests.items() if q.slot == slot)
            raise ValueError(f"slot: {slot} is occupied by request {owner!r}{self._where()}")

    def _place(self, request_id, slot, length: int, blocks: list) -> Hashable:
        """Admit with the given length and blocks (each block gains a holder)."""
        self._check_place(request_id, slot)
        if request_id is None:
            request_id = next(i for i in self._ids if i not in self._requests)
        if slot is None:
            slot = self._free_slots.popleft()
        else:
            self._free_slots.remove(slot)
            slot = int(slot)
        if length:
            # the slot gets its state from a snapshot, not a reset: a reset
            # still queued for it (an earlier owner admitted and released
            # before any step) would wipe the restored state
            self._pending_resets = [s for s in self._pending_resets if s != slot]
        for b in blocks:
            self._refs[b] = self._refs.get(b, 0) + 1
        self._requests[request_id] = _Request(slot, length, blocks)
        return request_id

    def release(self, request_id) -> None:
        """Return the request's slot and let go of its blocks: a block no
        request or cached prefix holds goes back to the free list, and its
        next owner gets it scrubbed by apply_step (or wholly overwritten by
        write_blocks), so it never reads this request's entries."""
        req = self._request(request_id)
        del self._requests[request_id]
        self._last_step.pop(request_id, None)
        self._let_go(req.blocks)
        self._free_slots.append(req.slot)

    def _let_go(self, blocks) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if not self._refs[b]:
                del self._refs[b]
                self._free_blocks.append(b)

    # ---- prefix cache ------------------------------------------------------------------
    def cache_prefix(self, request_id, snapshot, *, tokens: int | None = None,
                     key: Hashable | None = None) -> Hashable:
        """Keep the first `tokens` tokens of a request (default: all it holds)
        as a prefix later requests can be admitted on; returns its key (a new
        `("prefix", n)` if `key` is None).

        `tokens` must be a positive multiple of 128, at most the request's
        length: the prefix is whole blocks, every one of them full and never
        written again (its entries all closed at the boundary). `snapshot` is
        the request's `RequestSnapshot` taken when it held exactly `tokens`
        tokens (`dsv4_jax.share_prefix` takes it); it is kept with the prefix
        and checked against the config. The prefix holds its blocks until
        `drop_prefix`. ValueError, nothing changed, otherwise."""
        req = self._request(request_id)
        tokens = req.length if tokens is None else tokens
        if not isinstance(tokens, (int, np.integer)) or isinstance(tokens, bool) \
                or tokens <= 0 or tokens % BLOCK_TOKENS:
            raise ValueError(f"tokens: expected a positive multiple of {BLOCK_TOKENS}, "
                             f"got {tokens!r}")
        if tokens > req.length:
            raise ValueError(f"tokens: a prefix of {tokens} tokens is longer than request "
                             f"{request_id!r}, which holds {req.length}{self._where()}")
        check_snapshot(self.config, snapshot)
        if key is None:
            key = next(("prefix", i) for i in itertools.count() if ("prefix", i) not in self._prefixes)
        if key in self._prefixes:
            raise ValueError(f"key: a prefix {key!r} is already cached{self._where()}")
        blocks = tuple(req.blocks[:int(tokens) // BLOCK_TOKENS])
        for b in blocks:
            self._refs[b] += 1
        self._prefixes[key] = _Prefix(int(tokens), blocks, snapshot)
        return key

    def drop_prefix(self, key) -> None:
        """Forget a cached prefix: its blocks lose a holder (requests admitted
        on it keep theirs)."""
        entry = self._prefix(key)
        del self._prefixes[key]
        self._let_go(entry.blocks)

    # ---- steps -----------------------------------------------------------------------
    def prepare_step(self, tokens: Mapping[Hashable, int], *, min_tokens: int = 1,
                     min_new_blocks: int = 1, min_resets: int = 1,
                     device_put: bool = True, speculative: bool = False) -> StepMeta:
        """Metadata of one step that appends `tokens[r]` tokens to each request r.

        Allocates a block whenever a request's new tokens cross into a new
        128-token block. Raises CacheFullError (and changes nothing) if a
        request would pass its maximum context or the free blocks run out.
        Sizes are padded to powers of two, at least the given minimums
        (`pad_sizes` gives minimums that fit every step up to a size, so a
        jitted step compiles once). `speculative=True` prepares a speculative
        step (docs/design/speculative.md): its tokens are the requests' next tokens
        and drafts, and `commit_speculative` then says how many each keeps;
        `commit_speculative` refuses any other step."""
        plan = self.plan_step(tokens)
        return self.commit_step(plan, min_tokens=min_tokens, min_new_blocks=min_new_blocks,
                                min_resets=min_resets, device_put=device_put,
                                speculative=speculative)

    def pad_sizes(self, max_tokens: int, *, max_requests: int | None = None) -> dict:
        """`prepare_step`'s minimums (`min_tokens`, `min_new_blocks`,
        `min_resets`) that every step of at most `max_tokens` tokens over at
        most `max_requests` requests (default: every slot) fits, so such
        steps all have one shape: `prepare_step(tokens,
        **manager.pad_sizes(256))`. New blocks: a request's n tokens open at
        most ceil(n / 128) blocks; resets: one a slot."""
        R = self.config.max_requests
        requests = R if max_requests is None else max_requests
        for name, v in (("max_tokens", max_tokens), ("max_requests", requests)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        rows = min(int(requests), R, int(max_tokens))   # requests with at least one token
        blocks = rows + (int(max_tokens) - rows) // BLOCK_TOKENS
        return dict(min_tokens=bucket(int(max_tokens)), min_new_blocks=bucket(blocks),
                    min_resets=bucket(R))

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
                    min_resets: int = 1, device_put: bool = True,
                    speculative: bool = False) -> StepMeta:
        """Carry out a plan from `plan_step` (made since the last change)."""
        cfg = self.config
        self._speculative = bool(speculative)
        T = bucket(plan.num_tokens, min_tokens)
        token_slot = np.full(T, -1, np.int32)
        token_pos = np.zeros(T, np.int32)
        new_blocks = []
        row = 0
        self._token_rows = {}
        self._last_step = {}
        for rid, n, logicals in plan.rows:
            req = self._requests[rid]
            start = req.length
            self._last_step[rid] = (start, n, len(req.blocks))
            token_slot[row:row + n] = req.slot
            token_pos[row:row + n] = np.arange(start, start + n, dtype=np.int32)
            self._token_rows[rid] = slice(row, row + n)
            row += n
            for logical in logicals:
                physical = self._free_blocks.popleft()
                self._refs[physical] = 1
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


    # ---- speculative steps (docs/design/speculative.md) -----------------------------------------
    def check_speculative(self, accepted: Mapping[Hashable, int]) -> dict:
        """The checks of `commit_speculative`, changing nothing: {request:
        (start length, tokens kept, blocks held before the step)}; ValueError
        otherwise."""
        stepped = any(n for _, n, _ in self._last_step.values())
        if not self._speculative and (accepted or stepped):
            what = ("the last step was not prepared as a speculative one" if stepped else
                    "no step to commit")
            raise ValueError(f"accepted: {what}{self._where()}; commit_speculative follows "
                             f"prepare_step(..., speculative=True), once (nothing changed)")
        missing = [r for r, (_, n, _) in self._last_step.items() if n and r not in accepted]
        if missing:
            raise ValueError(f"accepted: no count for request {missing[0]!r}{self._where()}, "
                             f"which had {self._last_step[missing[0]][1]} token(s) in the "
                             f"last step; every request of the step needs one")
        out = {}
        for rid, a in accepted.items():
            if rid not in self._last_step:
                raise ValueError(f"accepted: request {rid!r} had no tokens in the last "
                                 f"step{self._where()}")
            start, n, held = self._last_step[rid]
            if not isinstance(a, (int, np.integer)) or isinstance(a, bool) or not 0 <= a <= n:
                raise ValueError(f"accepted[{rid!r}]: expected an int in [0, {n}] (the "
                                 f"request's tokens in the last step), got {a!r}")
            out[rid] = (start, int(a), held)
        return out

    def commit_speculative(self, accepted: Mapping[Hashable, int]) -> np.ndarray:
        """After a speculative step (`dsv4_jax.verify_commit`): request r
        keeps the first `accepted[r]` of its tokens of the last step, its
        length becomes its length before the step + accepted[r], and the
        blocks that step handed it that hold no kept token go back to the
        free list (verify_commit drops them from the block table). Every
        request of the last step needs a count in [0, its tokens]; ValueError,
        and nothing changed, otherwise, or when there is no step to commit
        (one call per step, before any other change to its requests).

        Returns `accepted` as verify_commit takes it: i32[R] by slot, 0 for
        the slots without a count."""
        plan = self.check_speculative(accepted)
        out = np.zeros(self.config.max_requests, np.int32)
        for rid, (start, a, held) in plan.items():
            req = self._requests[rid]
            length = start + a
            keep = max(-(-length // BLOCK_TOKENS), held)   # only the step's own blocks go
            self._let_go(req.blocks[keep:])
            del req.blocks[keep:]
            req.length = length
            out[req.slot] = a
        self._last_step = {}
        self._speculative = False
        return out

    def accepted_of(self, accepted) -> dict:
        """{request: kept tokens} of the last step's requests from `accepted`
        by slot as verify_commit takes it (i32[R], e.g. the device's
        `dsv4_jax.accepted_counts`; read to the host here): what
        `commit_speculative` takes. Call it before `commit_speculative`."""
        counts = np.asarray(accepted)
        R = self.config.max_requests
        if counts.shape != (R,) or not np.issubdtype(counts.dtype, np.integer):
            raise ValueError(f"accepted: expected an integer array [{R}] by slot, got "
                             f"{counts.dtype}{list(counts.shape)}")
        return {rid: int(counts[self._requests[rid].slot])
                for rid, (_, n, _) in self._last_step.items() if n}


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """A checked step: per request (id, new tokens, new logical blocks)."""
    rows: list
    num_tokens: int
    num_new_blocks: int
    num_resets: int
