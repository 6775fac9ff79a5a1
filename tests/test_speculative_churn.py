"""Speculative steps under a long random run (docs/design/speculative.md): requests
admitted (fresh or on a cached prefix), released, prefilled and verified
with 0 .. K drafts each step, keeping random counts. After every operation
both managers pass the block and slot audit, hold the same lengths, blocks
counts and free lists' sizes, and every request's block-table row on the
device is its manager's; every few steps, and at the end, every byte each
request holds equals a twin cache fed only the kept tokens."""
import collections

import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax.config import BLOCK_TOKENS
from support.audit import audit
from support.marks import requires_cpu_ffi
from support.speculative import SpecDriver, assert_same_cache, table_row
from support.streams import Driver, stream

K = 3            # drafts a request at most (one compiled verify a shape)
STREAMS = 6      # requests read their tokens from these, by admission order


def check(x, y, ids):
    """The audits of one operation; ids maps x's requests to y's."""
    for d in (x, y):
        audit(d.manager, d.cfg)
    assert x.manager.free_blocks == y.manager.free_blocks
    assert x.manager.free_slots == y.manager.free_slots
    for rx, ry in ids.items():
        assert x.manager.length_of(rx) == y.manager.length_of(ry)
        assert len(x.manager.blocks_of(rx)) == len(y.manager.blocks_of(ry))
        # a slot admitted since the last step still holds its last owner's row
        # until that step's apply_step resets it
        if x.manager.slot_of(rx) not in x.manager._pending_resets:
            table_row(x, rx)
            table_row(y, ry)


def run(ops, seed, compare_every):
    cfg = dj.CacheConfig.tiny(max_requests=5, max_context=1024, num_blocks=24)
    streams = {i: stream(cfg, cfg.max_context, seed=100 + i) for i in range(STREAMS)}
    pads = dict(min_new_blocks=8, min_resets=4)
    x = SpecDriver(cfg, dj.CacheManager(cfg), dj.init_state(cfg), streams, impl="cpu",
                   min_tokens=32, pads=pads, drafts=K)
    y = Driver(cfg, dj.CacheManager(cfg), dj.init_state(cfg), streams, impl="cpu",
               min_tokens=32, pads=pads)
    rng = np.random.default_rng(seed)
    ids = {}                                  # request in x -> request in y
    prefixes = {}                             # prefix key in x -> key in y
    counts = collections.Counter()
    admitted = 0
    for i in range(ops):
        op = rng.choice(["admit", "release", "prefill", "share", "prefix", "drop"] + ["verify"] * 6)
        mx = x.manager
        if op == "admit" and mx.free_slots:
            name = admitted % STREAMS
            ids[x.admit(name)] = y.admit(name)
            admitted += 1
        elif op == "release" and ids:
            rx = list(ids)[rng.integers(len(ids))]
            x.manager.release(rx)
            y.manager.release(ids.pop(rx))
        elif op == "prefill" and ids:
            # up to the next block boundary (where a prefix can be cached) or a chunk
            tokens = {}
            for rx in ids:
                room = cfg.max_context - mx.length_of(rx)
                to_edge = -mx.length_of(rx) % BLOCK_TOKENS or BLOCK_TOKENS
                n = int(min(room, to_edge if rng.random() < 0.5 else rng.integers(1, 40)))
                if n and rng.random() < 0.7:
                    tokens[rx] = n
            try:
                mx.plan_step(tokens)
            except dj.CacheFullError:
                counts["full"] += 1
                continue
            x.step(tokens)
            y.step({ids[r]: n for r, n in tokens.items()})
        elif op == "share" and ids:
            rx = list(ids)[rng.integers(len(ids))]
            n = -mx.length_of(rx) % BLOCK_TOKENS or (0 if mx.length_of(rx) else BLOCK_TOKENS)
            if n:                              # first up to the next block boundary
                try:
                    mx.plan_step({rx: n})
                except dj.CacheFullError:
                    counts["full"] += 1
                    continue
                x.step({rx: n})
                y.step({ids[rx]: n})
            kx = dj.share_prefix(x.state, mx, rx)
            prefixes[kx] = dj.share_prefix(y.state, y.manager, ids[rx])
        elif op == "prefix" and prefixes and mx.free_slots:
            kx = list(prefixes)[rng.integers(len(prefixes))]
            x.state, rx = dj.admit_on_prefix(x.state, mx, kx)
            y.state, ry = dj.admit_on_prefix(y.state, y.manager, prefixes[kx])
            x.source[rx] = y.source[ry] = admitted % STREAMS
            admitted += 1
            ids[rx] = ry
        elif op == "drop" and prefixes:
            kx = list(prefixes)[rng.integers(len(prefixes))]
            mx.drop_prefix(kx)
            y.manager.drop_prefix(prefixes.pop(kx))
        elif op == "verify" and ids:
            drafts, accepted = {}, {}
            for rx in ids:
                room = cfg.max_context - mx.length_of(rx)
                k = int(rng.integers(0, K + 1))
                if room < 1 + k or rng.random() < 0.15:
                    continue
                drafts[rx] = k
                # mostly some drafts pass; now and then none, or even the first token not kept
                accepted[rx] = int(rng.choice([0, 1, 1 + k, int(rng.integers(1, 2 + k))]))
            try:
                mx.plan_step({r: 1 + k for r, k in drafts.items()})
            except dj.CacheFullError:
                counts["full"] += 1
                continue
            x.spec_step(drafts, accepted)
            y.step({ids[r]: a for r, a in accepted.items()})
            counts["kept"] += sum(accepted.values())
            counts["verified"] += sum(1 + k for k in drafts.values())
        else:
            continue
        counts[op] += 1
        check(x, y, ids)
        if counts["verify"] and counts["verify"] % compare_every == 0 and op == "verify":
            assert_same_cache(x, y, list(ids.items()), f"op {i}: ")
    assert_same_cache(x, y, list(ids.items()), "end: ")
    dj.check_errors(x.state)
    return counts


@requires_cpu_ffi
@pytest.mark.parametrize("ops", [1000, pytest.param(4000, marks=pytest.mark.slow(
    reason="4,000 operations, some 20 s on 2 cores; the first 1,000 of them stay"))])
def test_random_speculative_run_matches_its_twin_and_keeps_every_block(ops):
    """1,000 or 4,000 operations (about half of them steps on each cache)."""
    counts = run(ops, seed=1, compare_every=25)
    assert min(counts[k] for k in ("admit", "release", "prefill", "share", "prefix", "drop",
                                   "verify")) >= ops // 200, counts
    assert 0 < counts["kept"] < counts["verified"], counts
