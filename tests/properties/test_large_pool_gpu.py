"""docs/design/bad-input.md on the GPU: offsets are 64-bit, a pool larger than 2^31 bytes works.

For each kind of pool (the SWA window ring, the CSA and the HCA block pools) a
one-layer cache whose fp8 leaf is just over 2^31 bytes, with one request placed
at its far end: the last window slot, or the last two blocks (the last one
starts past byte 2^31, the one before it below). One jitted step through the
CUDA handlers (apply_step assigns and scrubs the blocks, append, flush) and
every gather of the layer (window, top-k over every visible entry, all) give
byte for byte what the same step gives on a small pool holding the request at
its near end; every other byte of the big pool stays blank, so no write
wrapped around a 32-bit offset.

One big state at a time, about 3.2 GB of device memory. DSV4_LARGE_IMPL=cpu
runs the same through the CPU handlers (about 3.2 GB of host memory)."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsv4_jax as dj
from dsv4_jax import CacheConfig, init_state
from dsv4_jax import config as C
from dsv4_jax.state import E8M0
from dsv4_jax.app.workload import layer_params
from support.workload import assert_outputs_equal, read_step, step_inputs, write_step
from support.marks import CUDA, available_host_gb, requires_cpu_ffi

IMPL = os.environ.get("DSV4_LARGE_IMPL", "cuda")
pytestmark = CUDA if IMPL == "cuda" else [
    requires_cpu_ffi, pytest.mark.skipif(available_host_gb() < 8, reason="needs ~4 GB free memory")]

GIB2 = 2 ** 31
ENTRY = C.NOPE_DIM                      # bytes of one ds_fp8 entry's fp8 part
T = 2 * C.BLOCK_TOKENS                  # one request's first 256 tokens, two blocks
BY_BLOCK = (".csa.kv.", ".csa.index.", ".hca.kv.")


def _configs(kind):
    """(big, small) configs of one layer of `kind`, and where the request
    sits in each: (slot, its two physical blocks)."""
    ratio = {C.SWA: 0, C.CSA: C.CSA_RATIO, C.HCA: C.HCA_RATIO}[kind]

    def cfg(R, N):
        return CacheConfig((ratio,), max_requests=R, num_blocks=N, max_blocks_per_request=2,
                           kv_format="ds_fp8", index_topk=16)
    if kind == C.SWA:                   # slot R-1's ring starts past 2^31
        R = GIB2 // (C.WINDOW * ENTRY) + 2
        assert (R - 1) * C.WINDOW * ENTRY > GIB2
        return (cfg(R, 2), (R - 1, (0, 1))), (cfg(2, 2), (1, (0, 1)))
    per_block = CacheConfig.entries_per_block(kind) * ENTRY
    N = GIB2 // per_block + 2           # block N-1 starts past 2^31, N-2 below
    assert (N - 1) * per_block > GIB2 > (N - 2) * per_block
    return (cfg(2, N), (0, (N - 1, N - 2))), (cfg(2, 2), (0, (1, 0)))


def _step_and_reads(cfg, slot, blocks):
    """The write step and the reads; returns the state, the reads (states cut
    to their error counters) and the host copy of the request's rows of every
    leaf (its window ring slot, its blocks), with the count of non-blank
    values of each leaf, in total and within those rows."""
    meta = dj.StepMeta.build(token_slot=np.full(T, slot), token_pos=np.arange(T),
                             lengths=np.zeros(cfg.max_requests, np.int32),
                             new_blocks=[[slot, 0, blocks[0]], [slot, 1, blocks[1]]],
                             reset_slots=[slot])
    inputs = step_inputs(cfg, T, np.random.default_rng(4))
    params = layer_params(cfg, seed=6)
    k = C.BLOCK_TOKENS // C.CSA_RATIO * 2          # every CSA entry of the two blocks
    visible = (np.arange(T) + 1) // C.CSA_RATIO
    idx = np.where(np.arange(k)[None] < visible[:, None], np.arange(k)[None], -1)
    q = {"slots": jnp.asarray([slot], jnp.int32), "lengths": jnp.asarray([T], jnp.int32),
         "topk": jnp.asarray(idx, jnp.int32)}
    write = jax.jit(lambda s, m, x, p: write_step(s, m, x, p, IMPL), donate_argnums=0)
    read = jax.jit(lambda s, m, q: {key: (*v[:-1], v[-1].errors)
                                    for key, v in read_step(s, m, q, IMPL).items()})
    state = write(init_state(cfg), meta, inputs, params)
    reads = jax.tree_util.tree_map(np.asarray, read(state, meta, q))
    rows = jax.tree_util.tree_map(np.asarray, _rows(state, jnp.int32(slot),
                                                    jnp.asarray(blocks, jnp.int32)))
    return state, reads, rows


def _blank(x):
    """The leaf's bits as unsigned ints, and its blank value (init_state's)."""
    bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[
        x.dtype.itemsize])
    blank = 0x7F if x.dtype == E8M0 else (0xFFFFFFFF if x.dtype == jnp.int32 else 0)
    return bits, np.asarray(blank, bits.dtype)


@jax.jit
def _rows(state, slot, blocks):
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        name = jax.tree_util.keystr(path)
        if name in (".block_table", ".errors"):
            out[name] = x
            continue
        part = jnp.take(x, blocks if name.startswith(BY_BLOCK) else slot[None], axis=1)
        if name.endswith("comp"):       # accumulators (max, sum, kv): no blank value
            out[name] = (part,)
            continue
        bits, blank = _blank(x)
        part_bits, _ = _blank(part)
        out[name] = (part, jnp.sum(bits != blank), jnp.sum(part_bits != blank))
    return out


@pytest.mark.slow(reason="a pool beyond 2 GiB on the GPU, as its CPU twin")
@pytest.mark.parametrize("kind", [C.SWA, C.CSA, C.HCA])
def test_pool_beyond_2_gib(kind):
    (big_cfg, (big_slot, big_blocks)), (small_cfg, (small_slot, small_blocks)) = _configs(kind)
    big_leaf = max(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(dj.state.state_shapes(big_cfg)))
    assert big_leaf > GIB2
    _, small_reads, small_rows = _step_and_reads(small_cfg, small_slot, small_blocks)
    state, big_reads, big_rows = _step_and_reads(big_cfg, big_slot, big_blocks)
    del state
    stats = jax.devices()[0].memory_stats() or {}
    print(f"{kind}: largest leaf {big_leaf / 2 ** 30:.2f} GiB, device peak "
          f"{stats.get('peak_bytes_in_use', 0) / 2 ** 30:.2f} GiB")
    assert not big_rows[".errors"].any() and not small_rows[".errors"].any()
    assert list(big_rows[".block_table"][big_slot]) == list(big_blocks)
    # the gathers read the far entries exactly as the near ones
    assert_outputs_equal(big_reads, small_reads, f"{kind}: ")
    for key, (kv, count, errors) in big_reads.items():
        assert not errors.any(), key
        assert np.abs(kv.astype(np.float32)).sum() > 0, f"{key} read nothing"
    for name, got in big_rows.items():
        if name in (".block_table", ".errors"):
            continue
        want = small_rows[name]
        np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8),
                                      np.asarray(want[0]).view(np.uint8), err_msg=name)
        if len(got) == 3:               # nothing outside the request's rows was written
            assert int(got[1]) == int(got[2]), f"{name}: {int(got[1]) - int(got[2])} " \
                                               f"values written outside the request's rows"
            assert int(got[1]) == int(want[1]) == int(want[2]), name
