"""The sharded cache across processes (docs/design/sharding.md, "Across
processes"): under `jax.distributed` each process drives its own devices and
holds the tables of its own shards; the ops and the jitted step are those of
one process.

    from dsv4_jax.multiprocess import ProcessCacheManager
    manager = ProcessCacheManager(cfg, mesh)      # this process's shards

This module hands out the host side, which lives in host/:
process_manager.py  ProcessCacheManager, StepAbandoned, shard_processes
launch.py           run_processes, free_port: start N processes on this machine
"""
from .host.launch import ProcessResult, free_port, run_processes
from .host.process_manager import ProcessCacheManager, StepAbandoned, shard_processes

__all__ = ["ProcessCacheManager", "StepAbandoned", "shard_processes", "run_processes",
           "free_port", "ProcessResult"]
