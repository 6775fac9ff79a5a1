"""The host-side audit of a CacheManager after any operation: every block
accounted for (free exactly when no request or prefix holds it, its count
the number of its holders), every slot either held or free."""
import collections

from dsv4_jax.config import BLOCK_TOKENS


def audit(m, cfg):
    holders = collections.Counter()
    for r in m.requests:
        blocks = m.blocks_of(r)
        assert len(blocks) == -(-m.length_of(r) // BLOCK_TOKENS)
        assert len(set(blocks)) == len(blocks)
        holders.update(blocks)
    for k in m.prefixes:
        holders.update(m.prefix_blocks(k))
        assert len(m.prefix_blocks(k)) * BLOCK_TOKENS == m.prefix_tokens(k)
    free = list(m._free_blocks)
    assert len(set(free)) == len(free), "a block is twice on the free list"
    assert not set(free) & set(holders), "a held block is on the free list"
    assert set(free) | set(holders) == set(range(cfg.num_blocks)), "a block was lost"
    for b in range(cfg.num_blocks):
        assert m.refcount(b) == holders[b]
    slots = [m.slot_of(r) for r in m.requests] + list(m._free_slots)
    assert sorted(slots) == list(range(cfg.max_requests))
