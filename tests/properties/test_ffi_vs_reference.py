"""Every op through the FFI (CPU here, CUDA on the GPU machine) against the
jnp reference on the same multi-request, multi-layer workload: pools
byte-identical up to counted one-code flips, accumulators within rtol 1e-6,
gathers byte-identical on identical input (docs/design/testing.md)."""
import jax
import numpy as np
import pytest

from dsv4_jax import CacheConfig, init_state
from dsv4_jax.app.workload import Flips, compare_states, layer_params
from support.workload import (Schedule, assert_outputs_equal, read_step, step_inputs,
                              write_step)
from support.marks import CUDA, requires_cpu_ffi

FFI = [pytest.param("cpu", marks=requires_cpu_ffi), pytest.param("cuda", marks=CUDA)]
MAX_FLIP_FRACTION = 1e-3


@pytest.mark.slow(reason="8 steps of every kv_format; the demo and each op's parity tests stay")
@pytest.mark.parametrize("impl", FFI)
@pytest.mark.parametrize("kv_format", ["ds_fp8", "fp8_token", "bf16"])
def test_ffi_equals_reference_step_by_step(impl, kv_format):
    cfg = CacheConfig.tiny(kv_format=kv_format)
    params = layer_params(cfg, seed=1)
    sched = Schedule(cfg, seed=["ds_fp8", "fp8_token", "bf16"].index(kv_format), decode_after=4,
                     pad_to_capacity=True)
    rng = np.random.default_rng(2)
    write = {i: jax.jit(lambda s, m, x, i=i: write_step(s, m, x, params, i),
                        donate_argnums=0) for i in (impl, "reference")}
    read = {i: jax.jit(lambda s, m, q, i=i: read_step(s, m, q, i)) for i in (impl, "reference")}
    ours, ref = init_state(cfg), init_state(cfg)
    flips = Flips()
    for step in range(8):
        meta = sched.next()
        inputs = step_inputs(cfg, meta.num_tokens, rng)
        ours = write[impl](ours, meta, inputs)
        ref = write["reference"](ref, meta, inputs)
        compare_states(ours, ref, flips, f"step {step} ")
        q = sched.queries(meta)
        assert_outputs_equal(read[impl](ours, meta, q), read["reference"](ours, meta, q),
                             f"step {step} ")
    print(f"{impl} {kv_format}: one-code flips {flips}")
    assert flips.fraction < MAX_FLIP_FRACTION, flips
