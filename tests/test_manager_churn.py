"""CacheManager under a long random churn of admit / share / release / preempt /
resume and speculative steps (docs/design/host.md,
docs/design/speculative.md), host side: after every operation every
block is accounted for (free exactly when no request or prefix holds it, its
count the number of holders), a step only allocates free blocks, and a step
writes only blocks its request alone holds."""
import collections

import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax.host import manager as manager_module
from dsv4_jax.config import BLOCK_TOKENS
from support.audit import audit

SNAP = object()    # the manager keeps a prefix's snapshot opaque: any object will do here


def test_long_random_churn_keeps_every_block_accounted_for(monkeypatch):
    monkeypatch.setattr(manager_module, "check_snapshot", lambda config, snap: None)
    cfg = dj.CacheConfig.tiny(max_requests=6, max_context=1024, num_blocks=24)
    m = dj.CacheManager(cfg)
    rng = np.random.default_rng(0)
    parked = []                     # (length) of preempted requests
    counts = collections.Counter()
    for i in range(4000):
        op = rng.choice(["admit", "prefix", "share", "release", "preempt", "resume", "drop",
                         "step", "step", "speculate"])
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
            elif op == "speculate" and m.requests:
                # a step of 1 + k tokens, then a kept count per request: the
                # blocks of the step holding no kept token go back
                drafts = {r: int(rng.integers(0, 8)) for r in m.requests if rng.random() < 0.8}
                m.prepare_step({r: 1 + k for r, k in drafts.items()}, device_put=False,
                               speculative=True)
                before = {r: (m.length_of(r) - 1 - k, len(m.blocks_of(r)))
                          for r, k in drafts.items()}
                kept = {r: int(rng.integers(0, 2 + k)) for r, k in drafts.items()}
                if rng.random() < 0.5 and drafts:       # now and then one request leaves first
                    gone = next(iter(drafts))
                    m.release(gone)
                    del kept[gone], before[gone]
                m.commit_speculative(kept)
                for r, a in kept.items():
                    assert m.length_of(r) == before[r][0] + a
                    assert len(m.blocks_of(r)) <= before[r][1]
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
                                   "drop", "step", "speculate")) > 50, counts
    for k in m.prefixes:
        m.drop_prefix(k)
    for r in m.requests:
        m.release(r)
    assert m.free_blocks == cfg.num_blocks and m.free_slots == cfg.max_requests
