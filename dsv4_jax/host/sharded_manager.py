"""The host's bookkeeping of a sharded cache (docs/design/sharding.md): one
`CacheManager` per shard, requests admitted on the least-loaded shard, and
step metadata laid out shard by shard. Plain Python, no device work but the
metadata's one transfer; the device side is sharded_state.py, and
`dsv4_jax.sharding` hands both out.
"""
from __future__ import annotations

import itertools
from typing import Hashable, Mapping

import jax
import numpy as np

from .. import config as C
from ..config import CacheConfig
from ..meta import StepMeta
from .manager import CacheFullError, CacheManager


class ShardedCacheManager:
    """One `CacheManager` per shard; admits each request on the least-loaded
    shard and builds step metadata laid out shard by shard.

    `prepare_step` pads every shard's rows to the same T, so per-token
    operands have S * T rows, shard k's at [k * T, (k + 1) * T);
    `token_rows(request)` is a request's slice of them and `slot_of(request)`
    its shard-local slot (what per-request operands such as `slots` hold)."""

    def __init__(self, config: CacheConfig):
        if config.shard_axis is None:   # one shard is a valid mesh too
            raise ValueError("config: expected a config split over a mesh axis by "
                             "dsv4_jax.sharding.shard_config, got an unsharded one")
        self.config = config
        self.shards = [CacheManager(config.local(), shard=k) for k in range(config.num_shards)]
        self._shard_of: dict[Hashable, int] = {}
        self._prefix_shard: dict[Hashable, int] = {}
        self._token_offsets: dict[Hashable, int] = {}
        self._tokens_per_shard = 0

    def admit(self, request_id: Hashable | None = None, shard: int | None = None, *,
              prefix: Hashable | None = None, slot: int | None = None) -> Hashable:
        """Admit on `shard`, or on the shard with the most free slots (then
        blocks). Raises CacheFullError naming the shard(s) that are full.
        `prefix` admits on a cached prefix (on the prefix's shard, whose
        blocks it shares) and `slot` takes a given shard-local slot, as
        `CacheManager.admit` does."""
        request_id = self._new_id(request_id)
        if prefix is not None:
            shard = self.prefix_shard(prefix)
        elif shard is None:
            shard = self._roomiest()
        self.shards[shard].admit(request_id, prefix=prefix, slot=slot)
        self._shard_of[request_id] = shard
        return request_id

    def admit_restored(self, length: int, request_id: Hashable | None = None, *,
                       shard: int | None = None, slot: int | None = None) -> Hashable:
        """`CacheManager.admit_restored` on `shard`, or on the shard with the
        most free slots among those with the blocks for `length` tokens."""
        request_id = self._new_id(request_id)
        if shard is None:
            need = -(-int(length) // C.BLOCK_TOKENS)
            shard = self._roomiest(lambda m: m.free_blocks >= need)
        self.shards[shard].admit_restored(length, request_id, slot=slot)
        self._shard_of[request_id] = shard
        return request_id

    def _new_id(self, request_id):
        if request_id is None:
            request_id = next(i for i in range(len(self._shard_of) + 1)
                              if i not in self._shard_of)
        if request_id in self._shard_of:
            raise ValueError(f"request_id: {request_id!r} is already admitted")
        return request_id

    def _roomiest(self, fits=lambda m: True) -> int:
        open_ = [k for k, m in enumerate(self.shards) if m.free_slots and fits(m)]
        if not open_:
            raise CacheFullError(f"no free request slot on any of the {len(self.shards)} "
                                 f"shards (asked for 1)")
        return max(open_, key=lambda k: (self.shards[k].free_slots,
                                         self.shards[k].free_blocks, -k))

    def release(self, request_id) -> None:
        """Return the request's slot and blocks on its shard."""
        self.shards[self.shard_of(request_id)].release(request_id)
        del self._shard_of[request_id]

    # ---- prefix cache (docs/design/host.md): a prefix lives on its request's shard ----
    def cache_prefix(self, request_id, snapshot, *, tokens: int | None = None,
                     key: Hashable | None = None) -> Hashable:
        """`CacheManager.cache_prefix` on the request's shard; keys are unique
        over the shards."""
        if key is None:
            key = next(("prefix", i) for i in itertools.count()
                       if ("prefix", i) not in self._prefix_shard)
        if key in self._prefix_shard:
            raise ValueError(f"key: a prefix {key!r} is already cached")
        shard = self.shard_of(request_id)
        self.shards[shard].cache_prefix(request_id, snapshot, tokens=tokens, key=key)
        self._prefix_shard[key] = shard
        return key

    def drop_prefix(self, key) -> None:
        """Forget a cached prefix (`CacheManager.drop_prefix`)."""
        self.shards[self.prefix_shard(key)].drop_prefix(key)
        del self._prefix_shard[key]

    def prefix_shard(self, key) -> int:
        """The shard that holds a cached prefix's blocks."""
        try:
            return self._prefix_shard[key]
        except KeyError:
            raise KeyError(f"no cached prefix {key!r}") from None

    def prefix_tokens(self, key) -> int:
        """Tokens of a cached prefix."""
        return self.shards[self.prefix_shard(key)].prefix_tokens(key)

    def prefix_snapshot(self, key):
        """The RequestSnapshot a cached prefix was registered with."""
        return self.shards[self.prefix_shard(key)].prefix_snapshot(key)

    @property
    def prefixes(self) -> tuple:
        """Keys of the cached prefixes on every shard."""
        return tuple(self._prefix_shard)

    @property
    def requests(self) -> tuple:
        """Ids of the admitted requests, in order of admission."""
        return tuple(self._shard_of)

    def length_of(self, request_id) -> int:
        """Tokens of the request in the cache."""
        return self.shards[self.shard_of(request_id)].length_of(request_id)

    def blocks_of(self, request_id) -> tuple[int, ...]:
        """The request's shard-local physical blocks."""
        return self.shards[self.shard_of(request_id)].blocks_of(request_id)

    def block_row(self, request_id) -> np.ndarray:
        """The request's block-table row (shard-local ids, then -1)."""
        return self.shards[self.shard_of(request_id)].block_row(request_id)

    def global_blocks(self, request_id) -> tuple[int, ...]:
        """The request's blocks as ids of the global N axis (shard k's local
        block b is k * N_local + b): what read_blocks / write_blocks take."""
        off = self.shard_of(request_id) * self.config.local().num_blocks
        return tuple(off + b for b in self.blocks_of(request_id))

    def shard_of(self, request_id) -> int:
        """The shard that holds the request (KeyError if not admitted)."""
        try:
            return self._shard_of[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not admitted") from None

    def slot_of(self, request_id) -> int:
        """The request's shard-local slot."""
        return self.shards[self.shard_of(request_id)].slot_of(request_id)

    def global_slot(self, request_id) -> int:
        """Row of the request in the global (sharded) R axis."""
        return self.shard_of(request_id) * self.config.local().max_requests + self.slot_of(request_id)

    def token_rows(self, request_id) -> slice:
        """Rows of the request's tokens in the last step's global token axis."""
        k = self.shard_of(request_id)
        local = self.shards[k].token_rows(request_id)
        off = k * self._tokens_per_shard
        return slice(local.start + off, local.stop + off)

    @property
    def tokens_per_shard(self) -> int:
        """T of the last step: token rows per shard (the global axis has S * T)."""
        return self._tokens_per_shard

    def commit_speculative(self, accepted: Mapping[Hashable, int]) -> np.ndarray:
        """`CacheManager.commit_speculative` on every shard (all checked
        before any changes). Returns the counts as verify_commit takes them:
        i32[S * R_local], shard after shard, by local slot."""
        per_shard = [dict() for _ in self.shards]
        for rid, a in accepted.items():
            per_shard[self.shard_of(rid)][rid] = a
        for m, a in zip(self.shards, per_shard):
            m.check_speculative(a)
        return np.concatenate([m.commit_speculative(a) for m, a in zip(self.shards, per_shard)])

    def accepted_of(self, accepted) -> dict:
        """`CacheManager.accepted_of` over every shard: `accepted` i32[S * R]
        by local slot, shard after shard (what verify_commit takes)."""
        counts = np.asarray(accepted)
        R = self.config.local().max_requests
        if counts.shape != (len(self.shards) * R,):
            raise ValueError(f"accepted: expected an integer array [{len(self.shards) * R}] "
                             f"(shard after shard, by local slot), got "
                             f"{counts.dtype}{list(counts.shape)}")
        out = {}
        for k, m in enumerate(self.shards):
            out.update(m.accepted_of(counts[k * R:(k + 1) * R]))
        return out

    def prepare_step(self, tokens: Mapping[Hashable, int], *, min_tokens: int = 1,
                     device_put: bool = True, speculative: bool = False) -> StepMeta:
        """Per-shard metadata padded to common sizes and concatenated shard by
        shard. All shards are checked before any changes (CacheFullError names
        the shard); a failed step changes nothing. `speculative` as in
        `CacheManager.prepare_step`."""
        per_shard = [dict() for _ in self.shards]
        for rid, n in tokens.items():
            per_shard[self.shard_of(rid)][rid] = n
        plans = [m.plan_step(t) for m, t in zip(self.shards, per_shard)]
        sizes = dict(min_tokens=max([min_tokens] + [p.num_tokens for p in plans]),
                     min_new_blocks=max([1] + [p.num_new_blocks for p in plans]),
                     min_resets=max([1] + [p.num_resets for p in plans]))
        metas = [m.commit_step(p, device_put=False, speculative=speculative, **sizes)
                 for m, p in zip(self.shards, plans)]
        first = metas[0]
        self._tokens_per_shard = first.num_tokens
        data = np.concatenate([np.asarray(m.data) for m in metas])
        if device_put:
            data = jax.device_put(data)
        return StepMeta(data, first.num_tokens, first.num_requests, first.num_new_blocks,
                        first.num_resets)
