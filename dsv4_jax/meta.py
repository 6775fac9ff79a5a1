"""Step metadata: every int32 a step needs, packed in one array.

`CacheManager.prepare_step` builds it on the host; it reaches the device as one
transfer. Fields are static slices of `data`, so a jitted step that takes a
`StepMeta` recompiles only when a padded size changes.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): padded sizes of the metadata."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMeta:
    """Packed int32 step metadata (docs/design/host.md). Sizes are static.

    token_slot  i32[T]      request slot of each token, -1 = padding (ignored)
    token_pos   i32[T]      absolute position of each token in its request
    lengths     i32[R]      tokens of each slot after this step (0 = free)
    new_blocks  i32[NB, 3]  (slot, logical block, physical block), -1 rows = padding
    reset_slots i32[NR]     slots of newly admitted requests, -1 = padding

    Static sizes: num_tokens T, num_requests R (per shard), num_new_blocks NB,
    num_resets NR, each a power of two when `CacheManager` builds it.
    `max_rows_per_slot` (static, 0 = none given) bounds the rows any one slot
    has in the step: a hint for the CUDA writes' choice of kernel (a bound of
    at most 16 walks each request serially, as at decode), never a reason for
    another result; a step that breaks it is written right, only slower.
    verify_begin and verify_commit set it to 1 + drafts. Sharded,
    `data` holds one packed array per shard, shard after shard, and each
    field reads every shard's rows in shard order (token_slot: S * T rows).
    """
    data: jax.Array
    num_tokens: int = dataclasses.field(metadata=dict(static=True))
    num_requests: int = dataclasses.field(metadata=dict(static=True))
    num_new_blocks: int = dataclasses.field(metadata=dict(static=True))
    num_resets: int = dataclasses.field(metadata=dict(static=True))
    max_rows_per_slot: int = dataclasses.field(default=0, metadata=dict(static=True))

    # offsets of each field in `data`; token_slot then token_pos first, as the
    # write ops' handlers read them (token_fields)
    def _span(self, field: str) -> tuple[int, int]:
        sizes = [("token_slot", self.num_tokens), ("token_pos", self.num_tokens),
                 ("lengths", self.num_requests), ("new_blocks", 3 * self.num_new_blocks),
                 ("reset_slots", self.num_resets)]
        start = 0
        for name, n in sizes:
            if name == field:
                return start, n
            start += n
        raise KeyError(field)

    @property
    def packed_size(self) -> int:
        """int32s of one shard's packed metadata."""
        return (2 * self.num_tokens + self.num_requests + 3 * self.num_new_blocks
                + self.num_resets)

    @property
    def num_shards(self) -> int:
        """Shards whose metadata `data` holds (1 unsharded)."""
        return max(1, self.data.shape[0] // max(self.packed_size, 1))

    def _get(self, field):
        """The field; for sharded metadata every shard's rows, shard by shard
        (the layout sharded ops expect for their per-token operands)."""
        start, n = self._span(field)
        if self.num_shards == 1:
            return self.data[start:start + n]
        return self.data.reshape(self.num_shards, self.packed_size)[:, start:start + n].reshape(-1)

    @property
    def token_slot(self):
        """i32[T]: request slot of each token row, -1 = padding."""
        return self._get("token_slot")

    @property
    def token_pos(self):
        """i32[T]: absolute position of each token row in its request."""
        return self._get("token_pos")

    @property
    def token_fields(self):
        """i32[P] (one shard's metadata): `data` whole, the operand the write
        ops (append, flush, write_layer) hand their FFI handlers, which read
        token_slot from its first T int32s and token_pos from the next T (the
        packing order of `_span`). Whole rather than the two fields: a slice
        handed to a custom call is a buffer of its own, which XLA fills with a
        copy before every call (two copy kernels a layer on the GPU)."""
        if self.num_shards != 1:
            raise ValueError(f"meta: token_fields is one shard's metadata, this holds "
                             f"{self.num_shards} shards")
        return self.data

    @property
    def lengths(self):
        """i32[R]: tokens of each slot after this step (0 = free)."""
        return self._get("lengths")

    @property
    def new_blocks(self):
        """i32[NB, 3]: (slot, logical block, physical block) rows, -1 = padding."""
        return self._get("new_blocks").reshape(-1, 3)

    @property
    def reset_slots(self):
        """i32[NR]: slots of newly admitted requests, -1 = padding."""
        return self._get("reset_slots")

    @classmethod
    def build(cls, *, token_slot, token_pos, lengths, new_blocks=None, reset_slots=None,
              device_put: bool = True, max_rows_per_slot: int = 0) -> "StepMeta":
        """Pack host arrays. `new_blocks` may be shaped [NB, 3] or empty; missing
        fields are empty. With `device_put`, the packed array goes to the
        default device in one transfer; else it stays a numpy array.
        `max_rows_per_slot`: see the class."""
        if isinstance(max_rows_per_slot, bool) or not isinstance(max_rows_per_slot,
                                                                  (int, np.integer)) \
                or max_rows_per_slot < 0:
            raise ValueError(f"max_rows_per_slot: expected an int >= 0 (0: no bound), "
                             f"got {max_rows_per_slot!r}")
        token_slot = np.asarray(token_slot, np.int32).reshape(-1)
        token_pos = np.asarray(token_pos, np.int32).reshape(-1)
        if token_slot.shape != token_pos.shape:
            raise ValueError(f"token_pos: expected shape {token_slot.shape} (as token_slot), "
                             f"got {token_pos.shape}")
        lengths = np.asarray(lengths, np.int32).reshape(-1)
        new_blocks = np.zeros((0, 3), np.int32) if new_blocks is None else \
            np.asarray(new_blocks, np.int32).reshape(-1, 3)
        reset_slots = np.zeros((0,), np.int32) if reset_slots is None else \
            np.asarray(reset_slots, np.int32).reshape(-1)
        data = np.concatenate([token_slot, token_pos, lengths, new_blocks.reshape(-1),
                               reset_slots])
        if device_put:
            data = jax.device_put(data)
        return cls(data, len(token_slot), len(lengths), len(new_blocks), len(reset_slots),
                   int(max_rows_per_slot))

    def check(self, config) -> None:
        """Trace-time checks against a config (ValueError naming the field).
        For a sharded config the sizes are per shard and `data` holds one
        packed array per shard, shard after shard."""
        local = config.local()
        expect = self.packed_size * config.num_shards
        if tuple(self.data.shape) != (expect,):
            raise ValueError(f"meta.data: expected shape ({expect},), got {tuple(self.data.shape)}")
        if self.data.dtype != jnp.int32:
            raise ValueError(f"meta.data: expected dtype int32, got {self.data.dtype}")
        if self.num_requests != local.max_requests:
            raise ValueError(f"meta.lengths: expected {local.max_requests} entries "
                             f"(max_requests per shard), got {self.num_requests}")
