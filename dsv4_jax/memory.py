"""Exact memory of a cache configuration, from the state layout itself."""
from __future__ import annotations

import dataclasses

from .config import BLOCK_TOKENS, CacheConfig
from .state import state_shapes, tree_bytes

MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes of every part of the state (all exact integers but `per_token`).

    pools:            bytes of each state leaf group, whole cache
    by_kind:          bytes per layer kind (window in "swa": every layer has one)
    window_per_request, compressor_per_request: the per-slot state
    per_block:        compressed pools of one 128-token block, all layers
    per_token:        per_block / 128: compressed bytes per token of context
    total:            every state leaf
    num_shards:       shards the R and N axes are split over; per_shard = total / shards
    """
    config: CacheConfig
    pools: dict
    by_kind: dict
    window_per_request: int
    compressor_per_request: int
    per_block: int
    per_token: float
    total: int
    num_shards: int = 1

    @property
    def per_shard(self) -> int:
        """Bytes of the state on each shard."""
        return self.total // self.num_shards

    def per_request(self, context: int) -> int:
        """Bytes one request of `context` tokens holds: its window, its
        compressor state and the blocks of its context."""
        blocks = -(-context // BLOCK_TOKENS)
        return self.window_per_request + self.compressor_per_request + blocks * self.per_block

    def table(self) -> str:
        """The report as plain-text lines: bytes and MiB per pool, then the
        per-token and per-request figures."""
        rows = [(name, b) for name, b in self.pools.items()] + [("total", self.total)]
        width = max(len(r[0]) for r in rows)
        lines = [f"{'pool':<{width}}  {'bytes':>16}  {'MiB':>12}"]
        lines += [f"{n:<{width}}  {b:>16,}  {b / MIB:>12.2f}" for n, b in rows]
        lines.append(f"per token of context (compressed pools): {self.per_token:,.2f} B")
        lines.append(f"window per request: {self.window_per_request / MIB:.2f} MiB; "
                     f"compressor state per request: {self.compressor_per_request / MIB:.2f} MiB")
        if self.num_shards > 1:
            lines.append(f"per shard ({self.num_shards} shards): {self.per_shard:,} B")
        return "\n".join(lines)


def memory_report(config: CacheConfig, num_shards: int | None = None) -> MemoryReport:
    """Exact bytes per pool, layer kind, request, block and token of context.
    `num_shards` (default: the config's) splits the R and N axes evenly."""
    num_shards = config.num_shards if num_shards is None else num_shards
    if config.max_requests % num_shards or config.num_blocks % num_shards:
        raise ValueError(f"num_shards: {num_shards} must divide max_requests "
                         f"({config.max_requests}) and num_blocks ({config.num_blocks})")
    s = state_shapes(config)
    R, N = config.max_requests, config.num_blocks
    pools = {
        "block_table": tree_bytes(s.block_table),
        "swa.kv": tree_bytes(s.swa.kv), "swa.pos": tree_bytes(s.swa.pos),
        "csa.kv": tree_bytes(s.csa.kv), "csa.index": tree_bytes(s.csa.index),
        "csa.comp": tree_bytes(s.csa.comp), "csa.icomp": tree_bytes(s.csa.icomp),
        "hca.kv": tree_bytes(s.hca.kv), "hca.comp": tree_bytes(s.hca.comp),
        "errors": tree_bytes(s.errors),
    }
    by_kind = {
        "swa": pools["swa.kv"] + pools["swa.pos"],
        "csa": pools["csa.kv"] + pools["csa.index"] + pools["csa.comp"] + pools["csa.icomp"],
        "hca": pools["hca.kv"] + pools["hca.comp"],
    }
    window = (pools["swa.kv"] + pools["swa.pos"]) // R
    compressor = (pools["csa.comp"] + pools["csa.icomp"] + pools["hca.comp"]) // R
    per_block = (pools["csa.kv"] + pools["csa.index"] + pools["hca.kv"]) // N
    return MemoryReport(config, pools, by_kind, window, compressor, per_block,
                        per_block / BLOCK_TOKENS, sum(pools.values()), num_shards)
