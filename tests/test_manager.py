"""CacheManager: slots, blocks, metadata, failures leave state unchanged (docs/design/host.md)."""
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
    # one reset of every admitted slot (slot 1, admitted twice, once), in
    # admission order, then padding: at most R resets a step (pad_sizes)
    assert list(np.asarray(meta.reset_slots)) == [0, 1, 2, -1]


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


# ---- speculative steps (docs/design/speculative.md) ----------------------------------------------
def test_commit_speculative_keeps_the_counts_and_gives_back_the_steps_empty_blocks():
    cfg = CacheConfig.tiny(max_requests=3, max_context=512, num_blocks=8)
    m = CacheManager(cfg)
    a, b, c = m.admit(), m.admit(), m.admit()
    m.prepare_step({a: 126, b: 10, c: 128})
    m.prepare_step({a: 5, b: 5, c: 4}, speculative=True)   # a: 126..130 (a new block), c: 128..131 (one too)
    assert [len(m.blocks_of(r)) for r in (a, b, c)] == [2, 1, 2]
    free, new_c = m.free_blocks, m.blocks_of(c)[1]
    out = m.commit_speculative({a: 3, b: 5, c: 0})
    assert [m.length_of(r) for r in (a, b, c)] == [129, 15, 128]
    assert [len(m.blocks_of(r)) for r in (a, b, c)] == [2, 1, 1]   # a keeps 128, c's goes
    assert m.free_blocks == free + 1 and m.refcount(new_c) == 0
    assert out.dtype == np.int32 and out.tolist() == [3, 5, 0]
    with pytest.raises(ValueError, match="no step to commit"):
        m.commit_speculative({a: 1})           # one commit a step
    m.prepare_step({a: 2}, speculative=True)    # a request without tokens needs no count
    m.commit_speculative({a: 2})
    assert m.length_of(a) == 131


@pytest.mark.parametrize("accepted, match", [
    ({"a": 3}, "no count for request 'b'"),
    ({"a": 3, "b": 5}, r"accepted\['b'\]: expected an int in \[0, 4\]"),
    ({"a": -1, "b": 0}, r"accepted\['a'\]: expected an int in \[0, 4\]"),
    ({"a": 1, "b": 1, "c": 0}, "request 'c' had no tokens in the last step"),
    ({"a": 1.0, "b": 1}, r"accepted\['a'\]"),
])
def test_commit_speculative_refuses_bad_counts_and_changes_nothing(accepted, match):
    cfg = CacheConfig.tiny(max_requests=3, max_context=512, num_blocks=8)
    m = CacheManager(cfg)
    for r in "abc":
        m.admit(r)
    m.prepare_step({"a": 126, "b": 1})
    m.prepare_step({"a": 4, "b": 4}, speculative=True)
    before = snapshot(m)
    with pytest.raises(ValueError, match=match):
        m.commit_speculative(accepted)
    assert snapshot(m) == before
    m.commit_speculative({"a": 4, "b": 4})      # the step can still be committed


def test_commit_speculative_refuses_a_step_not_prepared_as_speculative():
    """After an ordinary prepare_step({a: 5}) the device holds 5 tokens of a:
    a commit that kept 1 would leave the host's length behind the cache."""
    cfg = CacheConfig.tiny(max_requests=2, max_context=512, num_blocks=8)
    m = CacheManager(cfg)
    a, b = m.admit("a"), m.admit("b")
    m.prepare_step({a: 5, b: 130})
    before = snapshot(m)
    for accepted in ({a: 1, b: 1}, {}):
        with pytest.raises(ValueError, match="the last step was not prepared as a speculative "
                                             r"one; commit_speculative follows prepare_step\("
                                             r"\.\.\., speculative=True\)"):
            m.commit_speculative(accepted)
        assert snapshot(m) == before
    assert m.length_of(a) == 5 and m.length_of(b) == 130
    m.prepare_step({a: 3}, speculative=True)
    m.prepare_step({a: 1})                     # a later ordinary step ends the speculative one
    with pytest.raises(ValueError, match="not prepared as a speculative one"):
        m.commit_speculative({a: 1})
    m.prepare_step({a: 3, b: 2}, speculative=True)
    assert m.commit_speculative({a: 1, b: 2}).tolist() == [1, 2]
    assert (m.length_of(a), m.length_of(b)) == (5 + 3 + 1 + 1, 130 + 2)


@pytest.mark.parametrize("max_tokens", [1, 7, 64, 300])
def test_pad_sizes_fit_every_step_up_to_its_size(max_tokens):
    """Random steps of at most max_tokens tokens over random requests (admitted,
    released, a slot reused), each against its own layout: every StepMeta
    has the sizes pad_sizes names, none larger."""
    cfg = CacheConfig.tiny(max_requests=4, max_context=4096, num_blocks=256)
    rng = np.random.default_rng(max_tokens)
    m = CacheManager(cfg)
    pads = m.pad_sizes(max_tokens)
    sizes = set()
    for _ in range(60):
        while m.free_slots and rng.random() < 0.5:
            m.admit()
        if m.requests and rng.random() < 0.15:
            m.release(m.requests[int(rng.integers(len(m.requests)))])
        live = [r for r in m.requests if m.length_of(r) < 3500]
        if not live:
            continue
        budget = int(rng.integers(1, max_tokens + 1))
        cut = np.sort(rng.integers(0, budget + 1, len(live) - 1))
        take = np.diff(np.concatenate([[0], cut, [budget]]))
        tokens = {r: int(n) for r, n in zip(live, take)}
        plan = m.plan_step(tokens)
        meta = m.prepare_step(tokens, **pads)
        # what this step needs, from its own plan
        assert plan.num_tokens <= pads["min_tokens"] and plan.num_new_blocks <= pads["min_new_blocks"]
        sizes.add((meta.num_tokens, meta.num_new_blocks, meta.num_resets))
    assert sizes == {(pads["min_tokens"], pads["min_new_blocks"], pads["min_resets"])}
    with pytest.raises(ValueError, match="max_tokens: expected an int >= 1"):
        m.pad_sizes(0)


def test_a_released_request_needs_no_count():
    cfg = CacheConfig.tiny(max_requests=2, max_context=512, num_blocks=8)
    m = CacheManager(cfg)
    a, b = m.admit(), m.admit()
    m.prepare_step({a: 127, b: 3}, speculative=True)
    m.release(b)
    m.commit_speculative({a: 100})
    assert m.length_of(a) == 100 and m.free_blocks == cfg.num_blocks - 1


def test_sharded_manager_commits_every_shard_or_none():
    from dsv4_jax.sharding import ShardedCacheManager
    cfg = CacheConfig.tiny(max_requests=4, max_context=512, num_blocks=16).replace(num_shards=2,
                                                                                shard_axis="d")
    m = ShardedCacheManager(cfg)
    a, b = m.admit(shard=0), m.admit(shard=1)
    m.prepare_step({a: 127, b: 128})
    m.prepare_step({a: 3, b: 3}, speculative=True)
    with pytest.raises(ValueError, match=r"accepted\[1\]"):
        m.commit_speculative({a: 2, b: 9})
    assert m.length_of(a) == 130                 # shard 0 unchanged too
    out = m.commit_speculative({a: 2, b: 0})
    assert [m.length_of(a), m.length_of(b)] == [129, 128]
    assert len(m.blocks_of(b)) == 1 and out.tolist() == [2, 0, 0, 0]


def test_process_manager_commits_its_own_shards():
    import jax
    from dsv4_jax.multiprocess import ProcessCacheManager
    from dsv4_jax.sharding import shard_config
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("data",))
    cfg = shard_config(CacheConfig.tiny(max_requests=4, max_context=512, num_blocks=16), mesh,
                       "data")
    m = ProcessCacheManager(cfg, mesh)
    a, b = m.admit(shard=0), m.admit(shard=1)
    m.prepare_step({a: 127, b: 10}, sizes=(256, 2, 2))
    m.prepare_step({a: 3, b: 3}, sizes=(8, 2, 2), speculative=True)
    with pytest.raises(KeyError):
        m.commit_speculative({a: 1, b: 1, "elsewhere": 1})
    assert m.length_of(a) == 130
    # accepted_of reads the counts by local slot, shard after shard, as the device has them
    by_slot = np.zeros(4, np.int32)
    by_slot[m.global_slot(a)], by_slot[m.global_slot(b)] = 1, 3
    assert m.accepted_of(by_slot) == {a: 1, b: 3}
    assert m.accepted_of(m.put_rows(by_slot)) == {a: 1, b: 3}      # split by shard
    with pytest.raises(ValueError, match="accepted"):
        m.accepted_of(by_slot[:3])
    out = m.commit_speculative({a: 1, b: 3})
    assert [m.length_of(a), m.length_of(b)] == [128, 13] and out.tolist() == [1, 0, 3, 0]
    assert len(m.managers[0].blocks_of(a)) == 1
