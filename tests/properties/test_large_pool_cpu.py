"""docs/design/bad-input.md: offsets are 64-bit. An HCA pool whose fp8 leaf is larger than
2^31 bytes: flush writes its last block and gather_all reads it back, equal to
the same entry written into a 2-block pool. Needs ~6 GB of free memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import _ffi
from dsv4_jax.errors import NUM_ERROR_KINDS
from dsv4_jax.ops.dispatch import ffi_call, ffi_in_place
from dsv4_jax.state import E8M0, FP8
from support.marks import available_host_gb


pytestmark = [pytest.mark.skipif(not _ffi.has_target("cpu", "dsv4_flush_hca"),
                                 reason="CPU FFI module not built"),
              pytest.mark.skipif(available_host_gb() < 8, reason="needs ~6 GB free memory")]


def flush_then_gather(num_blocks):
    rng = np.random.default_rng(3)
    kv = jnp.asarray(rng.standard_normal((128, 512)).astype(np.float32))
    score = jnp.asarray(rng.standard_normal((128, 512)).astype(np.float32))
    ape = jnp.asarray(rng.normal(0, 0.5, (128, 512)).astype(np.float32))
    norm, inv_freq = jnp.ones(512, jnp.float32), jnp.full(32, 0.01, jnp.float32)
    block_table = jnp.array([[num_blocks - 1, -1]], jnp.int32)
    slots, pos = jnp.zeros(128, jnp.int32), jnp.arange(128, dtype=jnp.int32)
    comp = jnp.broadcast_to(jnp.array([-jnp.inf, 0, 0], jnp.float32)[:, None], (1, 1, 1, 3, 512))
    errors = jnp.zeros(NUM_ERROR_KINDS, jnp.int32)
    attrs = dict(kv_format=0, max_context=256)

    @jax.jit
    def make():
        return (jnp.zeros((1, num_blocks, 1, 448), FP8), jnp.zeros((1, num_blocks, 1, 64), jnp.bfloat16),
                jnp.ones((1, num_blocks, 1, 7), E8M0))

    @jax.jit
    def flush(comp, errors, nope, rope, scale):
        return ffi_in_place("dsv4_flush_hca", [jnp.int32(0), jnp.concatenate([slots, pos]), kv, score,
                                               ape, norm, inv_freq, block_table],
                            [comp, errors, nope, rope, scale],
                            max_rows_per_slot=0, **attrs)

    flush = jax.jit(flush.__wrapped__, donate_argnums=(0, 1, 2, 3, 4))
    comp, errors, nope, rope, scale = flush(comp, errors, *make())
    assert int(errors.sum()) == 0
    out, count, errors = ffi_call(
        "dsv4_gather_all", [jnp.int32(0), jnp.array([0], jnp.int32), jnp.array([128], jnp.int32),
                            block_table, errors, nope, rope, scale],
        [jax.ShapeDtypeStruct((1, 1, 512), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.int32),
         jax.ShapeDtypeStruct((NUM_ERROR_KINDS,), jnp.int32)], {4: 2}, **attrs)
    assert int(count[0]) == 1 and int(errors.sum()) == 0
    row = np.asarray(out.astype(jnp.float32))[0, 0]
    # the bytes at the far end of the big leaf, read on the host
    tail = np.asarray(nope[0, num_blocks - 1, 0]).view(np.uint8)
    return row, tail


@pytest.mark.slow(reason="a pool beyond 2 GiB needs about 6 GB of memory")
def test_pool_beyond_2_gib():
    big_n = 2 ** 31 // 448 + 2           # the last entry starts past byte 2^31
    assert (big_n - 1) * 448 > 2 ** 31
    small_row, small_tail = flush_then_gather(2)
    big_row, big_tail = flush_then_gather(big_n)
    assert np.abs(small_row).sum() > 0
    np.testing.assert_array_equal(big_row, small_row)
    np.testing.assert_array_equal(big_tail, small_tail)
