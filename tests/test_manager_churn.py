"""CacheManager under a long random churn of admit / share / release / preempt /
resume (issue 40, docs/design.md §7), host side: after every operation every
block is accounted for (free exactly when no request or prefix holds it, its
count the number of holders), a step only allocates free blocks, and a step
writes only blocks its request alone holds."""
import collections

import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax import manager as manager_module
from dsv4_jax.config import BLOCK_TOKENS

SNAP = object()    # the manager keeps a prefix's snapshot opaque: any object will do here


def audit(m: dj.CacheManager, cfg):
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


def test_long_random_churn_keeps_every_block_accounted_for(monkeypatch):
    monkeypatch.setattr(manager_module, "check_snapshot", lambda config, snap: None)
    cfg = dj.CacheConfig.tiny(max_requests=6, max_context=1024, num_blocks=24)
    m = dj.CacheManager(cfg)
    rng = np.random.default_rng(0)
    parked = []                     # (length) of preempted requests
    counts = collections.Counter()
    for i in range(4000):
        op = rng.choice(["admit", "prefix", "share", "release", "preempt", "resume", "drop",
                         "step", "step"])
        try:
            if op == "admit":
                m.admit()
            elif op == "prefix" and m.prefixes:
                m.admit(prefix=m.prefixes[rng.integers(len(m.prefixes))])
            elif op == "share" and m.requests:
                r = m.requests[rng.integers(len(m.requests))]
                if m.length_of(r) >= BLOCK_TOKENS:
                    n = int(rng.integers(1, m.length_of(r) // BLOCK_TOKENS + 1)) * BLOCK_TOKENS
                    m.cache_prefix(r, SNAP, tokens=n)
            elif op == "release" and m.requests:
                m.release(m.requests[rng.integers(len(m.requests))])
            elif op == "preempt" and m.requests:
                r = m.requests[rng.integers(len(m.requests))]
                parked.append(m.length_of(r))
                m.release(r)
            elif op == "resume" and parked:
                m.admit_restored(parked[-1])
                parked.pop()
            elif op == "drop" and m.prefixes:
                m.drop_prefix(m.prefixes[rng.integers(len(m.prefixes))])
            elif op == "step" and m.requests:
                tokens = {r: int(rng.choice([0, 1, 1, 1, 5, 40, 130]))
                          for r in m.requests if rng.random() < 0.8}
                free_before = set(m._free_blocks)
                writes = {}
                for r, n in tokens.items():
                    start = m.length_of(r)
                    writes[r] = (start, n)
                try:
                    meta = m.prepare_step(tokens, device_put=False)
                except dj.CacheFullError:
                    counts["full"] += 1
                    audit(m, cfg)
                    continue
                new = np.asarray(meta.new_blocks)
                new = new[new[:, 0] >= 0]
                assert set(new[:, 2]) <= free_before, "a step handed out a block in use"
                for r, (start, n) in writes.items():
                    if not n:
                        continue
                    blocks = m.blocks_of(r)
                    written = blocks[start // BLOCK_TOKENS:-(-(start + n) // BLOCK_TOKENS)]
                    for b in written:
                        assert m.refcount(b) == 1, f"step {i}: request {r} writes shared block {b}"
            counts[op] += 1
        except dj.CacheFullError:
            counts["full"] += 1
        audit(m, cfg)
    assert min(counts[k] for k in ("admit", "prefix", "share", "release", "preempt", "resume",
                                   "drop", "step")) > 50, counts
    for k in m.prefixes:
        m.drop_prefix(k)
    for r in m.requests:
        m.release(r)
    assert m.free_blocks == cfg.num_blocks and m.free_slots == cfg.max_requests
