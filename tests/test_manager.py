"""CacheManager: slots, blocks, metadata, failures leave state unchanged (docs/design.md §7)."""
import copy

import numpy as np
import pytest

from dsv4_jax import CacheConfig, CacheFullError, CacheManager


def snapshot(m: CacheManager):
    return (list(m._free_slots), list(m._free_blocks),
            {k: copy.deepcopy(v) for k, v in m._requests.items()}, list(m._pending_resets))


def test_admit_until_full_then_release_and_reuse():
    cfg = CacheConfig.tiny(max_requests=3)
    m = CacheManager(cfg)
    ids = [m.admit() for _ in range(3)]
    assert sorted(m.slot_of(i) for i in ids) == [0, 1, 2]
    before = snapshot(m)
    with pytest.raises(CacheFullError, match="no free request slot: asked for 1, all 3 slots"):
        m.admit()
    assert snapshot(m) == before
    m.release(ids[1])
    new = m.admit("late")
    assert m.slot_of(new) == 1 and m.free_slots == 0
    meta = m.prepare_step({})
    # resets of every admitted slot, in admission order, then padding
    assert list(np.asarray(meta.reset_slots)[:4]) == [0, 1, 2, 1]


def test_blocks_are_allocated_exactly_at_128_token_boundaries():
    cfg = CacheConfig.tiny(max_requests=2, max_context=512, num_blocks=8)
    m = CacheManager(cfg)
    a = m.admit()
    seen = []
    for n in (127, 1, 1, 126, 1, 1):   # positions 0..126, 127, 128, 129..254, 255, 256
        meta = m.prepare_step({a: n})
        rows = np.asarray(meta.new_blocks)
        seen.append([tuple(r) for r in rows if r[0] != -1])
    assert seen == [[(0, 0, 0)], [], [(0, 1, 1)], [], [], [(0, 2, 2)]]
    assert m.length_of(a) == 257 and m.blocks_of(a) == (0, 1, 2)


def test_prefill_crossing_several_blocks_and_metadata_layout():
    cfg = CacheConfig.tiny(max_requests=4, max_context=512, num_blocks=16)
    m = CacheManager(cfg)
    a, b = m.admit("a"), m.admit("b")
    meta = m.prepare_step({a: 300, b: 5}, device_put=False)
    assert meta.num_tokens == 512                       # 305 padded to a power of two
    slot, pos = np.asarray(meta.token_slot), np.asarray(meta.token_pos)
    ra, rb = m.token_rows(a), m.token_rows(b)
    assert (ra, rb) == (slice(0, 300), slice(300, 305))
    assert np.all(slot[ra] == m.slot_of(a)) and np.array_equal(pos[ra], np.arange(300))
    assert np.all(slot[rb] == m.slot_of(b)) and np.array_equal(pos[rb], np.arange(5))
    assert np.all(slot[305:] == -1)
    rows = [tuple(r) for r in np.asarray(meta.new_blocks) if r[0] != -1]
    assert rows == [(0, 0, 0), (0, 1, 1), (0, 2, 2), (1, 0, 3)]
    assert meta.num_new_blocks == 4
    lengths = np.asarray(meta.lengths)
    assert lengths[m.slot_of(a)] == 300 and lengths[m.slot_of(b)] == 5 and lengths.sum() == 305


def test_padding_buckets_keep_shapes_stable():
    cfg = CacheConfig.tiny(max_requests=4)
    m = CacheManager(cfg)
    ids = [m.admit() for _ in range(3)]
    m.prepare_step({i: 3 for i in ids})
    shapes = {m.prepare_step({i: 1 for i in ids}).data.shape for _ in range(20)}
    assert len(shapes) == 1    # decode steps reuse one compiled shape


def test_full_blocks_and_context_raise_without_changing_anything():
    cfg = CacheConfig.tiny(max_requests=2, max_context=512, num_blocks=5)
    m = CacheManager(cfg)
    a, b = m.admit(), m.admit()
    m.prepare_step({a: 256})                               # 2 blocks
    before = snapshot(m)
    with pytest.raises(CacheFullError, match="needs 5 new blocks, only 3 of 5 are free"):
        m.prepare_step({a: 10, b: 400})
    assert snapshot(m) == before
    with pytest.raises(CacheFullError, match="maximum context is 512 tokens"):
        m.prepare_step({a: 300})
    assert snapshot(m) == before
    with pytest.raises(KeyError, match="not admitted"):
        m.prepare_step({"ghost": 1})
    with pytest.raises(ValueError, match="expected a count >= 0"):
        m.prepare_step({a: -1})
    assert snapshot(m) == before


def test_release_returns_blocks_for_the_next_request():
    cfg = CacheConfig.tiny(max_requests=2, max_context=512, num_blocks=4)
    m = CacheManager(cfg)
    a = m.admit()
    m.prepare_step({a: 512})
    assert m.free_blocks == 0
    m.release(a)
    assert m.free_blocks == 4 and m.free_slots == 2
    b = m.admit()
    meta = m.prepare_step({b: 130})
    rows = [tuple(r) for r in np.asarray(meta.new_blocks) if r[0] != -1]
    assert [r[2] for r in rows] == [0, 1]      # A's blocks, handed to B (scrubbed by apply_step)
    with pytest.raises(KeyError):
        m.release(a)


def test_shard_label_in_messages():
    m = CacheManager(CacheConfig.tiny(max_requests=1), shard=3)
    m.admit()
    with pytest.raises(CacheFullError, match="on shard 3"):
        m.admit()
