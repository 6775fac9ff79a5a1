"""Prefix sharing (docs/design/host.md): a request admitted on a cached
prefix of 128*n tokens and continued reads back byte for byte what the same
request prefilled from scratch does (its snapshot, its blocks, every gather and
indexer_topk), in every KV format, sharded and not; the prefix's shared blocks
are never written by the request that shares them."""
import jax
import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax.sharding import ShardedCacheManager, init_sharded_state, shard_config
from support.sharding import data_mesh
from support.streams import Driver, assert_same_request, stream
from support.trees import assert_trees_bytes_equal


def chunks(n, size):
    out = []
    while n > 0:
        out.append(min(size, n))
        n -= out[-1]
    return out


def make_driver(cfg, streams, mesh=None, **kw):
    if mesh is None:
        return Driver(cfg, dj.CacheManager(cfg), dj.init_state(cfg), streams, **kw)
    scfg = shard_config(cfg, mesh, "data")
    return Driver(scfg, ShardedCacheManager(scfg), init_sharded_state(scfg, mesh), streams,
                  mesh=mesh, **kw)


def prefix_then_share(cfg, prefix, tail, mesh=None, chunk=128):
    """Cache X: request A prefills `prefix` tokens of stream "p" and caches
    them; A goes on with its own tokens; B is admitted on the prefix and
    continues with `tail` tokens of the same stream (a prefill chunk, then
    decode steps) beside A. Cache Y: B prefilled from scratch with the same
    chunks. Returns (reads of B in X, in Y, the prefix blocks before and after
    B ran, A's length)."""
    total = prefix + sum(tail)
    streams = {"p": stream(cfg, total, seed=1), "a": stream(cfg, total + 300, seed=2)}
    x = make_driver(cfg, streams, mesh)
    a = x.admit("p")
    for n in chunks(prefix, chunk):
        x.step({a: n})
    with x.ctx():
        key = dj.share_prefix(x.state, x.manager, a)
    blocks_before = read_prefix(x, key)
    x.source[a] = "p"
    with x.ctx():
        x.state, b = dj.admit_on_prefix(x.state, x.manager, key)
    x.source[b] = "p"
    assert x.manager.length_of(b) == prefix
    for n in tail:
        x.step({b: n, a: 3})        # A continues beside B (its own blocks after the prefix)
    blocks_after = read_prefix(x, key)

    y = make_driver(cfg, {"p": streams["p"]}, mesh)
    y.admit("p", "pad")             # B' in another slot than B, other blocks
    y.step({"pad": 5})
    b2 = y.admit("p")
    for n in chunks(prefix, chunk) + tail:
        y.step({b2: n})
    return x.read(b), y.read(b2), blocks_before, blocks_after, x


def read_prefix(driver, key):
    m = driver.manager
    shard = m.prefix_shard(key) if hasattr(m, "prefix_shard") else 0
    off = shard * driver.cfg.local().num_blocks
    ids = [off + b for b in m.shards[shard].prefix_blocks(key)] if hasattr(m, "shards") \
        else list(m.prefix_blocks(key))
    with driver.ctx():
        return jax.tree_util.tree_map(np.asarray, dj.read_blocks(driver.state, ids))


@pytest.mark.parametrize("kv_format", ["ds_fp8", "fp8_token", "bf16"])
@pytest.mark.parametrize("prefix", [128, 384])
def test_prefix_admitted_request_equals_prefill_from_scratch(kv_format, prefix):
    cfg = dj.CacheConfig.tiny(max_requests=4, max_context=768, num_blocks=24,
                              kv_format=kv_format)
    got, want, before, after, x = prefix_then_share(cfg, prefix, [70, 1, 1, 1])
    assert_same_request(got, want)
    assert_trees_bytes_equal(after, before, "prefix blocks ")   # never written by A or B
    dj.check_errors(x.state)


@pytest.mark.slow(reason="sharded prefix sharing; the unsharded runs and sharded moves byte for byte stay")
def test_prefix_sharing_on_a_sharded_state():
    mesh = data_mesh(4)
    cfg = dj.CacheConfig.tiny(max_requests=8, max_context=512, num_blocks=32)
    got, want, before, after, x = prefix_then_share(cfg, 256, [40, 1, 1], mesh=mesh)
    assert_same_request(got, want)
    assert_trees_bytes_equal(after, before, "prefix blocks ")


def test_prefix_blocks_are_held_until_the_last_holder_lets_go():
    cfg = dj.CacheConfig.tiny(max_requests=4, max_context=512, num_blocks=12)
    streams = {"p": stream(cfg, 512, seed=3)}
    x = make_driver(cfg, streams)
    a = x.admit("p")
    x.step({a: 256})
    with x.ctx():
        key = dj.share_prefix(x.state, x.manager, a)
        x.state, b = dj.admit_on_prefix(x.state, x.manager, key)
    x.source[b] = "p"
    shared = x.manager.prefix_blocks(key)
    assert x.manager.blocks_of(b) == shared == x.manager.blocks_of(a)
    assert [x.manager.refcount(k) for k in shared] == [3, 3]
    x.step({b: 1})                                   # B's first own block
    assert x.manager.blocks_of(b)[:2] == shared and x.manager.refcount(x.manager.blocks_of(b)[2]) == 1
    free = x.manager.free_blocks
    x.manager.release(a)
    x.manager.drop_prefix(key)
    assert x.manager.free_blocks == free             # B still holds them
    assert [x.manager.refcount(k) for k in shared] == [1, 1]
    x.manager.release(b)
    assert x.manager.free_blocks == cfg.num_blocks and not x.manager._refs
