"""The host's bookkeeping of a cache: which request holds which slot and
blocks, and the step metadata built from it (docs/design/host.md).

manager.py          CacheManager: one cache's slots, blocks and lengths
sharded_manager.py  ShardedCacheManager: one CacheManager per shard
process_manager.py  ProcessCacheManager: the shards of this process under
                    jax.distributed
launch.py           start the processes of a multi-process run on this machine

Public names are importable from `dsv4_jax`, `dsv4_jax.sharding` and
`dsv4_jax.multiprocess`.
"""
