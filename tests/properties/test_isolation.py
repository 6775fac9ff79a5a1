"""Tenant isolation (docs/design/host.md): a released request's blocks go to the next
request scrubbed; nothing the previous owner wrote is readable by it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax import config as C
from dsv4_jax.app.workload import layer_params
from support.workload import step_inputs, write_step

pytestmark = pytest.mark.usefixtures("impl_under_test")


def test_next_owner_of_a_block_reads_nothing_of_the_previous_owner():
    cfg = dj.CacheConfig.tiny(max_requests=2, num_blocks=2)   # A takes every block
    params = layer_params(cfg, seed=4)
    rng = np.random.default_rng(4)
    manager = dj.CacheManager(cfg)
    state = dj.init_state(cfg)
    step = jax.jit(lambda s, m, x: write_step(s, m, x, params, "auto"), donate_argnums=0)

    a = manager.admit()
    meta = manager.prepare_step({a: 256})                 # A fills two blocks
    state = step(state, meta, step_inputs(cfg, meta.num_tokens, rng))
    blocks = manager.blocks_of(a)
    pools = (state.csa.kv, state.csa.index, state.hca.kv)
    written = [np.asarray(x)[:, list(blocks)].copy() for x in jax.tree_util.tree_leaves(pools)]
    assert any(np.any(w.view(np.uint8) != 0) for w in written)   # A's entries are there
    manager.release(a)

    b = manager.admit()
    meta = manager.prepare_step({b: 5})                   # B gets A's first block back
    assert manager.blocks_of(b) == blocks[:1]
    state = step(state, meta, step_inputs(cfg, meta.num_tokens, rng))
    block = blocks[0]
    # B's 5 tokens closed CSA entry 0 only: every other row of the block is blank
    for name, leaf in zip(("nope", "rope", "scale", "packed", "iscale"),
                          jax.tree_util.tree_leaves((state.csa.kv, state.csa.index))):
        rows = np.asarray(leaf)[:, block, 1:].view(np.uint8)
        blank = 0x7F if leaf.dtype == jnp.float8_e8m0fnu else 0
        assert np.all(rows == blank), f"csa {name}: stale bytes in block {block}"
    hca = jax.tree_util.tree_leaves(state.hca.kv)
    for leaf in hca:                                      # HCA entry 0 needs 128 tokens of B
        blank = 0x7F if leaf.dtype == jnp.float8_e8m0fnu else 0
        assert np.all(np.asarray(leaf)[:, block].view(np.uint8) == blank)
    # ... and B's gathers see its own entries only
    slot = jnp.array([manager.slot_of(b)], jnp.int32)
    kv, count = dj.gather_all(state, 2, slot, jnp.array([5], jnp.int32), 4, return_state=False)
    assert int(count[0]) == 0 and not np.asarray(kv, np.float32).any()
    idx = jnp.arange(32, dtype=jnp.int32)[None, :]
    kv, valid = dj.gather_topk(state, 1, slot, jnp.array([4], jnp.int32), idx, return_state=False)
    assert np.asarray(valid).sum() == 1 and not np.asarray(kv, np.float32)[0, 1:].any()
    window, pos = dj.gather_window(state, 0, slot, return_state=False)
    assert sorted(np.asarray(pos)[0][np.asarray(pos)[0] >= 0]) == [0, 1, 2, 3, 4]
    assert not np.asarray(window, np.float32)[0][np.asarray(pos)[0] < 0].any()
