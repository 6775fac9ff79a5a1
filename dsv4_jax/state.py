"""The cache state: pytrees of device arrays, laid out as in docs/design/state.md.

Arrays are data fields; the `CacheConfig` is a static field. Pools are stacked
per layer kind (leading axis = index of the layer among layers of its kind) so
one buffer serves every layer of that kind.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import config as C
from .config import CacheConfig
from .error_detail import errors_row

FP8 = jnp.float8_e4m3fn
E8M0 = jnp.float8_e8m0fnu


def pytree_dataclass(cls=None, *, static=()):
    """Frozen dataclass registered as a pytree; `static` names meta fields."""
    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        return jax.tree_util.register_dataclass(
            cls, data_fields=[n for n in names if n not in static],
            meta_fields=[n for n in names if n in static])
    return wrap if cls is None else wrap(cls)


@pytree_dataclass
class KVEntries:
    """Entries of width 512 in one of the three KV formats (docs/design/formats.md).

    ds_fp8:    nope f8e4m3[..., 448], rope bf16[..., 64], scale e8m0[..., 7]
    fp8_token: nope f8e4m3[..., 448], rope bf16[..., 64], scale f32[..., 1]
    bf16:      nope bf16[..., 448],   rope bf16[..., 64], scale None

    An entry is 448 "nope" channels and the 64 RoPE channels that follow them.
    ds_fp8 (DeepSeek-V4's own format) scales each 64-channel tile of nope by a
    power of two (UE8M0), fp8_token scales the row by one f32. The leading
    dims `...` are those of the pool that holds them.
    """
    nope: jax.Array
    rope: jax.Array
    scale: Optional[jax.Array]


@pytree_dataclass
class IndexerKeys:
    """MXFP4 indexer keys: 128 e2m1 codes packed two per byte + 4 UE8M0 scales.

    packed  u8[..., 64]   channel 2j in the low nibble of byte j, 2j + 1 in the high
    scale   e8m0[..., 4]  one power-of-two scale per 32 channels
    """
    packed: jax.Array
    scale: jax.Array


@pytree_dataclass
class WindowState:
    """The sliding windows of every layer: the last 128 positions of each request.

    kv   KVEntries [L, R, 128, ...]  entry of ring slot pos % 128
    pos  i32[L, R, 128]              position held in each ring slot, -1 = empty
    """
    kv: KVEntries
    pos: jax.Array


@pytree_dataclass
class CSAState:
    """The CSA layers' pools, stacked over the Lc CSA layers in model order.

    kv     KVEntries [Lc, N, 32, ...]    paged entries: entry i of a request is
                                         row i % 32 of block block_table[slot, i // 32]
    index  IndexerKeys [Lc, N, 32, ...]  the indexer key of each entry, same layout
    comp   f32[Lc, R, 2, 3, 512]         per request the online-softmax accumulators
                                         of the current and the next entry, each
                                         (max, sum, weighted kv) per channel
    icomp  f32[Lc, R, 2, 3, 128]         the same for the indexer compressor
    """
    kv: KVEntries
    index: IndexerKeys
    comp: jax.Array
    icomp: jax.Array


@pytree_dataclass
class HCAState:
    """The HCA layers' pools, stacked over the Lh HCA layers in model order.

    kv    KVEntries [Lh, N, 1, ...]  paged entries: entry i of a request is the
                                     row of block block_table[slot, i]
    comp  f32[Lh, R, 1, 3, 512]      per request the accumulator of the open entry
    """
    kv: KVEntries
    comp: jax.Array


@pytree_dataclass(static=("config",))
class CacheState:
    """The whole cache: a pytree of device arrays plus its static config.

    block_table  i32[R, MB]       physical block of each 128-token block of a
                                  request, -1 = none
    swa          WindowState      every layer's sliding window
    csa          CSAState         CSA pools, indexer keys, accumulators
    hca          HCAState         HCA pools and accumulators
    errors       i32[9]           count of dropped input per ErrorKind
                                  (sharded: i32[S * 9], one row per shard;
                                  with config.error_detail each row also
                                  holds the op, layer, slot and position
                                  of every kind's first count: i32[54] a
                                  shard, dsv4_jax/error_detail.py)
    config       CacheConfig      static (pytree metadata)

    Make it with `init_state`; pass it to every op and take back the state
    the op returns. Sharded, R and N are the global sizes and each shard
    holds its slice of those axes.
    """
    block_table: jax.Array
    swa: WindowState
    csa: CSAState
    hca: HCAState
    errors: jax.Array
    config: CacheConfig


# Accumulator rows along the axis of length 3.
ACC_MAX, ACC_SUM, ACC_KV = 0, 1, 2


def kv_entry_shapes(kv_format: str, lead: tuple[int, ...]) -> KVEntries:
    """`jax.ShapeDtypeStruct`s of `KVEntries` with leading dims `lead`."""
    S = jax.ShapeDtypeStruct
    if kv_format == "ds_fp8":
        return KVEntries(S(lead + (C.NOPE_DIM,), FP8), S(lead + (C.ROPE_DIM,), jnp.bfloat16),
                         S(lead + (C.NOPE_TILES,), E8M0))
    if kv_format == "fp8_token":
        return KVEntries(S(lead + (C.NOPE_DIM,), FP8), S(lead + (C.ROPE_DIM,), jnp.bfloat16),
                         S(lead + (1,), jnp.float32))
    if kv_format == "bf16":
        return KVEntries(S(lead + (C.NOPE_DIM,), jnp.bfloat16),
                         S(lead + (C.ROPE_DIM,), jnp.bfloat16), None)
    raise ValueError(f"kv_format: expected one of {C.KV_FORMATS}, got {kv_format!r}")


def index_key_shapes(lead: tuple[int, ...]) -> IndexerKeys:
    S = jax.ShapeDtypeStruct
    return IndexerKeys(S(lead + (C.INDEX_PACKED,), jnp.uint8), S(lead + (C.INDEX_SCALES,), E8M0))


def state_shapes(config: CacheConfig) -> CacheState:
    """The state as a pytree of `jax.ShapeDtypeStruct` (no allocation)."""
    S = jax.ShapeDtypeStruct
    R, N, MB = config.max_requests, config.num_blocks, config.max_blocks_per_request
    L, Lc, Lh = config.num_layers, config.num_csa, config.num_hca
    f32, i32 = jnp.float32, jnp.int32
    per_block_csa = CacheConfig.entries_per_block(C.CSA)
    per_block_hca = CacheConfig.entries_per_block(C.HCA)
    return CacheState(
        block_table=S((R, MB), i32),
        swa=WindowState(kv_entry_shapes(config.kv_format, (L, R, C.WINDOW)),
                        S((L, R, C.WINDOW), i32)),
        csa=CSAState(kv_entry_shapes(config.kv_format, (Lc, N, per_block_csa)),
                     index_key_shapes((Lc, N, per_block_csa)),
                     S((Lc, R, 2, 3, C.HEAD_DIM), f32),
                     S((Lc, R, 2, 3, C.INDEX_DIM), f32)),
        hca=HCAState(kv_entry_shapes(config.kv_format, (Lh, N, per_block_hca)),
                     S((Lh, R, 1, 3, C.HEAD_DIM), f32)),
        errors=S((config.num_shards * errors_row(config),), i32),   # one row a shard
        config=config)


def empty_accumulator(shape, dtype=jnp.float32) -> jax.Array:
    """Online-softmax accumulators set to empty: (max, sum, kv) = (-inf, 0, 0).
    `shape` ends in (..., 3, width)."""
    row = jnp.array([-jnp.inf, 0.0, 0.0], dtype).reshape(3, 1)
    return jnp.broadcast_to(row, shape).astype(dtype)


def init_state(config: CacheConfig, sharding=None) -> CacheState:
    """A fresh cache: block table and window positions -1, accumulators empty,
    pools zero (scales 1.0, byte 0x7F: the same "blank entry" `apply_step`
    scrubs recycled blocks to). `sharding`, if given, is a pytree of shardings matching the
    state (see `dsv4_jax.sharding`) and every leaf is created already placed;
    without it every leaf is committed to the default device, where the
    request moves leave a state, so a jitted step compiles once for both."""
    shapes = state_shapes(config)

    def make(path, sds):
        name = jax.tree_util.keystr(path)
        if name.endswith(("block_table", ".pos")):
            return jnp.full(sds.shape, -1, sds.dtype)
        if name.endswith(("comp", "icomp")):
            return empty_accumulator(sds.shape, sds.dtype)
        if sds.dtype == E8M0:   # e8m0 has no zero (0.0 casts to NaN = 0xFF): use 1.0
            return jnp.ones(sds.shape, sds.dtype)
        return jnp.zeros(sds.shape, sds.dtype)

    def build():
        return jax.tree_util.tree_map_with_path(make, shapes)

    if sharding is None:
        # committed to the default device, as every move (`restore`, `resume`,
        # ...) leaves the state: a jitted step keys its cache on whether its
        # arguments are committed, so an uncommitted fresh state would make
        # the step compile again after the first move
        sharding = jax.sharding.SingleDeviceSharding(default_device())
    return jax.jit(build, out_shardings=sharding)()


def default_device():
    """The device jax puts new arrays on: `jax.default_device` if one is set
    (a device or a platform name), else the first local device."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.local_devices()[0]
    if isinstance(device, str):
        return jax.local_devices(backend=device)[0]
    return device


def check_tree(name: str, tree, want, layout: str = "") -> None:
    """ValueError naming the first leaf of `tree` that is no array or whose
    shape or dtype is not that of `want` (a pytree of ShapeDtypeStruct), or
    saying how many arrays were expected (`layout` says what implies that
    count). Run when a call is traced, before anything is donated."""
    got_leaves = jax.tree_util.tree_leaves_with_path(tree)
    want_leaves = jax.tree_util.tree_leaves(want)
    if len(got_leaves) != len(want_leaves):
        raise ValueError(f"{name}: expected {len(want_leaves)} arrays{layout}, "
                         f"got {len(got_leaves)}")
    for (path, x), w in zip(got_leaves, want_leaves):
        where, expected = name + jax.tree_util.keystr(path), f"{np.dtype(w.dtype)}{list(w.shape)}"
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{where}: expected an array {expected}, got {type(x).__name__}")
        if tuple(x.shape) != tuple(w.shape) or np.dtype(x.dtype) != np.dtype(w.dtype):
            raise ValueError(f"{where}: expected {expected}, got "
                             f"{np.dtype(x.dtype)}{list(x.shape)}")


def check_state(state) -> None:
    """ValueError unless `state` is a CacheState laid out as its config
    implies (every op checks it when traced)."""
    if not isinstance(state, CacheState):
        raise ValueError(f"state: expected a CacheState, got {type(state).__name__}")
    check_tree("state", state, state_shapes(state.config),
               f" for kv_format {state.config.kv_format!r}")


def tree_bytes(tree) -> int:
    """Total bytes of the array (or ShapeDtypeStruct) leaves of a pytree."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree))
