"""apply_step: reference vs CPU FFI, in place, bad input
(docs/design/operations.md, docs/design/host.md, docs/design/in-place.md,
docs/design/bad-input.md)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4_jax import CacheConfig, CacheState, StepMeta, apply_step, init_state
from dsv4_jax import config as C
from dsv4_jax.errors import ErrorKind
from support.inplace import assert_in_place
from support.marks import CUDA, requires_cpu_ffi
from support.trees import assert_trees_bytes_equal, poison

IMPLS_FFI = [pytest.param("cpu", marks=requires_cpu_ffi), pytest.param("cuda", marks=CUDA)]


def random_meta(cfg, rng, nb=12, nr=4, bad_fraction=0.0):
    """New-block rows and resets with -1 padding, duplicates of one cell and,
    optionally, out-of-range values."""
    R, MB, N = cfg.max_requests, cfg.max_blocks_per_request, cfg.num_blocks
    rows = np.stack([rng.integers(0, R, nb), rng.integers(0, MB, nb), rng.integers(0, N, nb)], 1)
    rows[rng.random(nb) < 0.25] = -1                 # padding rows
    rows[-1, :2] = rows[0, :2]                       # same cell twice: the later row wins
    resets = rng.integers(0, R, nr)
    resets[rng.random(nr) < 0.3] = -1
    if bad_fraction:
        bad = rng.random(nb) < bad_fraction
        col = rng.integers(0, 3, nb)
        big = np.array([R, MB, N])
        rows[bad, col[bad]] = np.where(rng.random(bad.sum()) < 0.5, big[col[bad]] + 3, -7)
        resets[rng.random(nr) < bad_fraction] = R + 1
    return StepMeta.build(token_slot=[-1], token_pos=[0], lengths=np.zeros(R, np.int32),
                          new_blocks=rows, reset_slots=resets)


def numpy_apply_step(state, meta):
    """Independent host-side model of the semantics (sequential loops)."""
    cfg = state.config
    R, MB, N = cfg.max_requests, cfg.max_blocks_per_request, cfg.num_blocks
    out = jax.tree_util.tree_map(lambda x: np.array(x), state)
    err = out.errors
    for s in np.asarray(meta.reset_slots):
        if s == -1:
            continue
        if not 0 <= s < R:
            err[ErrorKind.BAD_SLOT] += 1
            continue
        out.block_table[s] = -1
        out.swa.pos[:, s] = -1
        for comp in (out.csa.comp, out.csa.icomp, out.hca.comp):
            comp[:, s, :, 0] = -np.inf
            comp[:, s, :, 1:] = 0
    for s, lg, ph in np.asarray(meta.new_blocks):
        if s == -1:
            continue
        if not 0 <= s < R:
            err[ErrorKind.BAD_SLOT] += 1
        elif not (0 <= lg < MB and 0 <= ph < N):
            err[ErrorKind.BAD_BLOCK_ASSIGNMENT] += 1
        else:
            out.block_table[s, lg] = ph
            for pool in jax.tree_util.tree_leaves((out.csa.kv, out.csa.index, out.hca.kv)):
                blank = 0x7F if pool.dtype == jnp.float8_e8m0fnu else 0
                pool.view(np.uint8)[:, ph] = blank
    return out


def garbage_state(cfg, seed):
    """A state whose every byte is random, except the accumulators' max rows
    stay finite-or-empty like real ones."""
    return poison(init_state(cfg), seed)


@pytest.mark.parametrize("kv_format", C.KV_FORMATS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_matches_numpy_model(kv_format, seed):
    cfg = CacheConfig.tiny(kv_format=kv_format)
    rng = np.random.default_rng(seed)
    st = garbage_state(cfg, seed)
    meta = random_meta(cfg, rng, bad_fraction=0.2 if seed else 0.0)
    got = apply_step(st, meta, impl="reference")
    assert_trees_bytes_equal(got, numpy_apply_step(st, meta))


# the reference as the handlers' oracle, one program a shape (eagerly each of
# its ops compiles alone; test_reference_matches_numpy_model runs it so)
_reference_step = jax.jit(lambda state, meta: apply_step(state, meta, impl="reference"))


@pytest.mark.parametrize("impl", IMPLS_FFI)
@pytest.mark.parametrize("kv_format", C.KV_FORMATS)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_ffi_matches_reference(impl, kv_format, seed):
    cfg = CacheConfig.tiny(kv_format=kv_format)
    rng = np.random.default_rng(100 + seed)
    st = garbage_state(cfg, seed)
    meta = random_meta(cfg, rng, nb=int(rng.integers(1, 40)), nr=int(rng.integers(1, 6)),
                       bad_fraction=0.15 * (seed % 2))
    want = _reference_step(st, meta)
    got = apply_step(st, meta, impl=impl)
    assert_trees_bytes_equal(got, want, f"{impl} vs reference: ")
    if seed % 2 == 0:
        assert np.all(np.asarray(got.errors) == np.asarray(st.errors))


@pytest.mark.parametrize("impl", ["reference", pytest.param("cpu", marks=requires_cpu_ffi),
                                  pytest.param("cuda", marks=CUDA)])
def test_jitted_step_is_in_place(impl):
    cfg = CacheConfig.tiny()
    rng = np.random.default_rng(7)
    step = jax.jit(lambda state, meta: apply_step(state, meta, impl=impl),
                   donate_argnames=("state",))
    state = init_state(cfg)
    for i in range(3):   # pointers stay put over several steps
        meta = random_meta(cfg, rng)
        expect = numpy_apply_step(state, meta)
        state = assert_in_place(step, state, meta)
        assert_trees_bytes_equal(state, expect)


def test_trace_time_errors_name_the_argument_before_donation():
    cfg = CacheConfig.tiny()
    state = init_state(cfg)
    step = jax.jit(apply_step, donate_argnames=("state",))
    meta = StepMeta.build(token_slot=[0], token_pos=[0], lengths=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="meta.lengths: expected 4"):
        step(state, meta)
    assert not state.block_table.is_deleted()      # nothing was consumed
    bad = CacheState(state.block_table.astype(jnp.int16), state.swa, state.csa, state.hca,
                     state.errors, cfg)
    with pytest.raises(ValueError, match=r"state.block_table: expected int32\[4, 4\], got int16\[4, 4\]"):
        step(bad, StepMeta.build(token_slot=[0], token_pos=[0], lengths=np.zeros(4, np.int32)))
    with pytest.raises(ValueError, match="meta: expected a StepMeta"):
        apply_step(state, {"new_blocks": 1})
    with pytest.raises(ValueError, match="impl: expected one of"):
        apply_step(state, StepMeta.build(token_slot=[0], token_pos=[0],
                                         lengths=np.zeros(4, np.int32)), impl="tpu")
    assert not state.block_table.is_deleted()


def test_in_place_check_catches_a_step_without_donation():
    cfg = CacheConfig.tiny()
    meta = random_meta(cfg, np.random.default_rng(3))
    step = jax.jit(lambda state, meta: apply_step(state, meta, impl="reference"))
    with pytest.raises(AssertionError, match="not aliased"):
        assert_in_place(step, init_state(cfg), meta)
