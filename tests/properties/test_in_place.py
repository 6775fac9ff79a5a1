"""docs/design/in-place.md for a whole model step on every implementation: apply_step,
append on every layer and flush on every compressed layer, jitted with the
state donated, at decode (one token) and prefill sizes. The compiled HLO
aliases every pool and copies none; the buffers stay where they were.

The FFI paths keep every leaf in place. The jnp reference keeps the KV pools
(window, CSA/HCA entries, indexer keys: the large buffers) in place; XLA's CPU
backend still copies the small compressor accumulators around the reset
scatter of apply_step, which this test does not hold against it."""
import jax
import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax.app.workload import layer_params
from support.workload import step_inputs, write_step
from support.inplace import assert_in_place


KV_POOLS = (".swa.kv", ".csa.kv", ".csa.index", ".hca.kv")


@pytest.mark.parametrize("tokens", [1, 70])
def test_whole_step_is_in_place(tokens, impl_under_test):
    cfg = dj.CacheConfig.tiny(max_requests=2, max_context=256)
    params = layer_params(cfg, seed=2)
    manager = dj.CacheManager(cfg)
    a = manager.admit()
    step = jax.jit(lambda s, m, x: write_step(s, m, x, params, "auto"), donate_argnums=0)
    state = dj.init_state(cfg)
    rng = np.random.default_rng(0)
    for _ in range(2):      # the second step reuses the compiled step and buffers
        meta = manager.prepare_step({a: tokens})
        only = (lambda path: path.startswith(KV_POOLS)) if impl_under_test == "reference" else None
        state = assert_in_place(step, state, meta, step_inputs(cfg, meta.num_tokens, rng),
                                only=only)
