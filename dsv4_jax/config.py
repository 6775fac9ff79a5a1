"""Static cache configuration: the DSV4 geometry and the sizes of one cache.

A `CacheConfig` is hashable and immutable, so it can be a static field of the
state pytree and a static argument of `jax.jit`.
"""
from __future__ import annotations

import dataclasses
import math

# --- DSV4 attention geometry (docs/design/overview.md); identical for V4-Flash and V4-Pro ---
HEAD_DIM = 512          # entry width d
ROPE_DIM = 64           # trailing RoPE channels of an entry
NOPE_DIM = HEAD_DIM - ROPE_DIM   # 448 channels stored as fp8
NOPE_TILE = 64          # ds_fp8: one UE8M0 scale per 64 channels
NOPE_TILES = NOPE_DIM // NOPE_TILE   # 7
WINDOW = 128            # sliding-window length, every layer
CSA_RATIO = 4           # m: tokens pooled per CSA entry (with overlap)
HCA_RATIO = 128         # m': tokens pooled per HCA entry (no overlap)
BLOCK_TOKENS = 128      # original tokens per paged block, every compressed layer
INDEX_DIM = 128         # indexer key width
INDEX_HEADS = 64
MXFP4_BLOCK = 32        # indexer keys: one UE8M0 scale per 32 values
INDEX_SCALES = INDEX_DIM // MXFP4_BLOCK  # 4
INDEX_PACKED = INDEX_DIM // 2            # 64 bytes, two e2m1 codes per byte
NORM_EPS = 1e-6
# Scratch bytes a prefill chunk row of `attention` takes on the GPU (the
# row encoded once as append stores it, and a finite flag).
ATTN_CHUNK_SCRATCH_ROW = 2064

# Compressor RoPE of the official model.
ROPE_THETA = 160000.0
ROPE_YARN_FACTOR = 16.0
ROPE_ORIGINAL_LENGTH = 65536
ROPE_BETA_FAST = 32.0
ROPE_BETA_SLOW = 1.0

KV_FORMATS = ("ds_fp8", "fp8_token", "bf16")

# Positions, slots and block ids travel as int32 (StepMeta, the block table).
INT32_MAX = 2 ** 31 - 1
# Most tokens of one request: whole blocks, and the context itself (an
# exclusive bound the ops compare int32 positions with) an int32.
MAX_CONTEXT = INT32_MAX // BLOCK_TOKENS * BLOCK_TOKENS

SWA, CSA, HCA = "swa", "csa", "hca"
_KIND_OF_RATIO = {0: SWA, CSA_RATIO: CSA, HCA_RATIO: HCA}

FLASH_RATIOS = (0, 0, 4) + (128, 4) * 20
PRO_RATIOS = (128, 128) + (4, 128) * 29 + (4,)
TINY_RATIOS = (0, 4, 128, 4)


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Sizes of one cache. Use `flash()`, `pro()` or `tiny()` rather than the
    constructor unless you need a custom layer pattern.

    compress_ratios         per layer 0 (SWA only), 4 (CSA) or 128 (HCA)
    max_requests            R, request slots
    num_blocks              N, physical blocks of 128 tokens shared by all requests
    max_blocks_per_request  MB, columns of the block table (max context / 128)
    kv_format               "ds_fp8" (default), "fp8_token" or "bf16" (see KVEntries)
    index_topk              the model's top-k of CSA entries per query
    model                   a label: "flash", "pro", "tiny" or "custom"
    num_shards, shard_axis  set by `dsv4_jax.sharding.shard_config`; R and N
                            are then global, split evenly over the shards
    error_detail            also record, per error kind, the op and layer that
                            counted it first and the slot and position of
                            the row it dropped (`state.errors` six times as
                            long; `check_errors` shows it): cheap, opt-in

    Frozen and hashable, so it can be a static argument of `jax.jit`; it is
    the static part of `CacheState`.
    """

    compress_ratios: tuple[int, ...]
    max_requests: int
    num_blocks: int
    max_blocks_per_request: int
    kv_format: str = "ds_fp8"
    index_topk: int = 512
    model: str = "custom"
    num_shards: int = 1
    shard_axis: str | None = None
    error_detail: bool = False

    def __post_init__(self):
        ratios = tuple(self.compress_ratios)
        object.__setattr__(self, "compress_ratios", ratios)
        if not ratios:
            raise ValueError("compress_ratios must name at least one layer")
        bad = [r for r in ratios if r not in _KIND_OF_RATIO]
        if bad:
            raise ValueError(
                f"compress_ratios: expected each of 0, {CSA_RATIO} or {HCA_RATIO}, got {bad[0]!r}")
        _positive("max_requests", self.max_requests)
        _positive("num_blocks", self.num_blocks)
        if self.num_blocks > INT32_MAX:
            raise ValueError(f"num_blocks: block ids are int32, expected at most {INT32_MAX:,}, "
                             f"got {self.num_blocks:,}")
        _positive("max_blocks_per_request", self.max_blocks_per_request)
        _positive("index_topk", self.index_topk)
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format: expected one of {KV_FORMATS}, got {self.kv_format!r}")
        _positive("num_shards", self.num_shards)
        if self.num_shards > 1:
            if not self.shard_axis:
                raise ValueError("shard_axis: a config with num_shards > 1 needs the mesh axis name")
            for name in ("max_requests", "num_blocks"):
                if getattr(self, name) % self.num_shards:
                    raise ValueError(f"{name}: expected a multiple of num_shards "
                                     f"({self.num_shards}), got {getattr(self, name)}")

    # ---- presets -------------------------------------------------------------
    @classmethod
    def _preset(cls, model, ratios, topk, max_requests, max_context, num_blocks, kv_format):
        _positive("max_context", max_context)
        if max_context > MAX_CONTEXT:
            raise ValueError(f"max_context: positions are int32, expected at most "
                             f"{MAX_CONTEXT:,} tokens, got {max_context:,}")
        mb = blocks_for_tokens(max_context)
        if num_blocks is None:
            num_blocks = max_requests * mb
        return cls(ratios, max_requests, num_blocks, mb, kv_format, topk, model)

    @classmethod
    def flash(cls, max_requests: int = 8, max_context: int = 65536,
              num_blocks: int | None = None, kv_format: str = "ds_fp8") -> "CacheConfig":
        """DeepSeek-V4-Flash: 43 layers, top-k 512. `num_blocks` defaults to
        enough blocks for every request to reach `max_context`."""
        return cls._preset("flash", FLASH_RATIOS, 512, max_requests, max_context,
                           num_blocks, kv_format)

    @classmethod
    def pro(cls, max_requests: int = 8, max_context: int = 65536,
            num_blocks: int | None = None, kv_format: str = "ds_fp8") -> "CacheConfig":
        """DeepSeek-V4-Pro: 61 layers, top-k 1024."""
        return cls._preset("pro", PRO_RATIOS, 1024, max_requests, max_context,
                           num_blocks, kv_format)

    @classmethod
    def tiny(cls, max_requests: int = 4, max_context: int = 512,
             num_blocks: int | None = None, kv_format: str = "ds_fp8") -> "CacheConfig":
        """Four layers (SWA, CSA, HCA, CSA) at the real entry width, for tests."""
        return cls._preset("tiny", TINY_RATIOS, 16, max_requests, max_context,
                           num_blocks, kv_format)

    # ---- derived -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """L, layers of the model (every one has a sliding window)."""
        return len(self.compress_ratios)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Per global layer: "swa", "csa" or "hca"."""
        return tuple(_KIND_OF_RATIO[r] for r in self.compress_ratios)

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Global indices of the layers of one kind, in order."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == kind)

    @property
    def num_csa(self) -> int:
        """Lc, CSA layers: the leading axis of the CSA pools."""
        return len(self.layers_of(CSA))

    @property
    def num_hca(self) -> int:
        """Lh, HCA layers: the leading axis of the HCA pools."""
        return len(self.layers_of(HCA))

    def kind_index_table(self, kind: str) -> tuple[int, ...]:
        """Per global layer: its index among layers of `kind`, or -1. Used to map
        a traced layer index to a row of the per-kind pools."""
        table = [-1] * self.num_layers
        for j, layer in enumerate(self.layers_of(kind)):
            table[layer] = j
        return tuple(table)

    def kind_index(self, layer: int, kind: str | None = None) -> int:
        """Index of a (Python int) global layer among the layers of its kind;
        ValueError if out of range or, when `kind` is given, of another kind."""
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(
                f"layer: expected an int in [0, {self.num_layers}), got {layer!r}")
        actual = self.layer_kinds[layer]
        if kind is not None and actual != kind:
            raise ValueError(f"layer: expected a {kind.upper()} layer, got layer {layer} "
                             f"which is {actual.upper()} in model {self.model!r}")
        return self.kind_index_table(actual)[layer]

    @property
    def max_context(self) -> int:
        """Most tokens one request can hold: MB * 128."""
        return self.max_blocks_per_request * BLOCK_TOKENS

    def blocks_for_context(self, tokens: int) -> int:
        """Physical blocks a request of `tokens` tokens occupies."""
        return blocks_for_tokens(tokens)

    @staticmethod
    def entries_per_block(kind: str) -> int:
        """Compressed entries one 128-token block holds in a layer of `kind`."""
        return {CSA: BLOCK_TOKENS // CSA_RATIO, HCA: BLOCK_TOKENS // HCA_RATIO}[kind]

    @property
    def sharded(self) -> bool:
        """Whether the R and N axes are split over several shards."""
        return self.num_shards > 1

    def local(self) -> "CacheConfig":
        """The config one shard sees: R and N divided by the number of shards
        (block ids and slots are shard-local)."""
        if not self.sharded:
            return self
        return dataclasses.replace(self, max_requests=self.max_requests // self.num_shards,
                                   num_blocks=self.num_blocks // self.num_shards,
                                   num_shards=1, shard_axis=None)

    def replace(self, **changes) -> "CacheConfig":
        """A copy with the given fields changed (checked like the constructor)."""
        return dataclasses.replace(self, **changes)


def blocks_for_tokens(tokens: int) -> int:
    """Physical blocks a request of `tokens` tokens occupies."""
    return math.ceil(tokens / BLOCK_TOKENS)


# The presets by name, as the command line and the benchmarks take them (--model).
PRESETS = {"tiny": CacheConfig.tiny, "flash": CacheConfig.flash, "pro": CacheConfig.pro}

# Attribute value of kv_format passed to the FFI handlers (ffi/include/dsv4/layout.h).
KV_FORMAT_CODE = {"ds_fp8": 0, "fp8_token": 1, "bf16": 2}
