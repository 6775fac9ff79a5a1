"""A jitted, donated step compiles once over a serving engine's request
moves (docs/api/state.md `init_state`): a fresh state is committed to the
device where admit_on_prefix, resume and verify_commit leave it, and with
fixed pad sizes (`CacheManager.pad_sizes`) every step has the same shapes.
jax keys its compiled programs on whether each argument is committed, so a
fresh state that was not would compile every step again after the first
move (seen only with JAX_LOG_COMPILES)."""
import jax
import numpy as np

import dsv4_jax as dj
from support.speculative import SpecDriver
from support.streams import stream

CFG = dj.CacheConfig.tiny(max_requests=4, max_context=512, num_blocks=24)


def test_fresh_state_is_committed_like_a_moved_one():
    state = dj.init_state(CFG)
    for x in jax.tree_util.tree_leaves(state):
        assert x.committed
        assert x.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])


def test_step_compiles_once_across_admit_preempt_resume_prefix_and_speculative_moves():
    streams = {k: stream(CFG, 512, seed=s) for k, s in (("a", 1), ("b", 2), ("c", 3))}
    m = dj.CacheManager(CFG)
    pads = {k: v for k, v in m.pad_sizes(64).items() if k != "min_tokens"}
    d = SpecDriver(CFG, m, dj.init_state(CFG), streams, drafts=3, min_tokens=64, pads=pads)
    a, b = d.admit("a"), d.admit("b")
    d.step({a: 60, b: 4})                          # first step: the one compile
    d.step({a: 60, b: 1})
    d.step({a: 8, b: 1})                           # a holds 128: a prefix
    key = dj.share_prefix(d.state, m, a)
    d.state, c = dj.admit_on_prefix(d.state, m, key)
    d.source[c] = "a"
    d.step({a: 1, b: 1, c: 1})
    parked = dj.preempt(d.state, m, b)             # b to host memory
    d.step({a: 1, c: 1})
    d.state, b = dj.resume(d.state, m, parked, "b")
    d.source[b] = "b"
    d.step({a: 1, b: 1, c: 1})
    d.spec_step({a: 3, b: 2}, {a: 2, b: 3})        # the speculative step: its one compile
    d.step({a: 1, b: 1, c: 1})
    d.spec_step({a: 1, c: 3}, {a: 0, c: 4})
    assert d._step._cache_size() == 1
    assert d._spec._cache_size() == 1
    dj.check_errors(d.state)
    np.testing.assert_array_equal(np.asarray(d.state.block_table)[m.slot_of(b)], m.block_row(b))
