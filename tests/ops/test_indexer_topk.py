"""indexer_topk's results and rules: every implementation against a float32
numpy replay of the documented arithmetic order (exact index arrays), against
a float64 numpy oracle of the formula (top-k sets where the scores are well
separated) and against each other (identical arrays); ties, bad rows and
their error counts, trace-time checks, sharding, and its indices fed to
gather_topk."""
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax import _ffi
from dsv4_jax.errors import ErrorKind as EK

from support import npq
from support.indexer import (CSA_LAYERS, IMPLS, Q_FORMATS, expected, make_state,
                             needs_cpu_target, queries, run, with_index_keys, workload)
from support.marks import requires_cpu_ffi


@pytest.mark.parametrize("q_format", Q_FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_fp32_replay_and_f64_oracle(impl, seed, q_format):
    st, slot, pos, q, w, k = workload(seed)
    for layer in CSA_LAYERS:
        got, st2 = run(st, layer, slot, pos, q, w, k, impl, q_format=q_format)
        got = np.asarray(got)
        want, info = expected(st, layer, slot, pos, q, w, k, q_format)
        np.testing.assert_array_equal(got, want)
        assert not np.any(np.asarray(st2.errors))
        # the float64 formula: same top-k set wherever the k-th and (k+1)-th
        # scores are apart by more than fp32 noise
        for t, inf in enumerate(info):
            if inf is None:
                assert np.all(got[t] == -1)
                continue
            s64, ok = inf
            c = np.nonzero(ok)[0]
            if len(c) <= k:
                assert set(got[t][got[t] >= 0]) == set(c)
                assert np.all(got[t][len(c):] == -1)
                continue
            srt = np.sort(s64[c])[::-1]
            tol = 1e-4 * np.abs(s64[c]).max()
            if srt[k - 1] - srt[k] > tol:
                assert set(got[t]) == set(c[np.argsort(-s64[c], kind="stable")[:k]])
            # chosen scores are non-increasing in the oracle up to fp32 noise
            assert np.all(np.diff(s64[got[t]]) <= tol)


def test_oracle_check_is_sharp():
    """The float64 comparison above can fail: a wrong selection differs."""
    st, slot, pos, q, w, k = workload(0)
    _, info = expected(st, 1, slot, pos, q, w, k)
    s64, ok = info[0]
    c = np.nonzero(ok)[0]
    best = set(c[np.argsort(-s64[c])[:k]])
    worst = set(c[np.argsort(s64[c])[:k]])
    assert best != worst


@pytest.mark.parametrize("q_format", Q_FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
def test_exact_ties_lower_index_first(impl, q_format):
    rng = np.random.default_rng(5)
    st = make_state(rng, R=2, max_context=512, blocks={0: [3, 1, 0, 2], 1: [5, 4, 7, 6]})
    packed = np.array(st.csa.index.packed)
    scale = np.array(st.csa.index.scale.view(np.uint8))
    # layer kind 0, slot 0: entries 7, 40, 41, 100 copy entry 2's key (equal
    # scores); entries 60..69 are all-zero keys (score 0, ten-way tie)
    bt = np.asarray(st.block_table)[0]

    def cell(i):
        return bt[i // 32], i % 32
    src = cell(2)
    for i in (7, 40, 41, 100):
        packed[0][cell(i)] = packed[0][src]
        scale[0][cell(i)] = scale[0][src]
    for i in range(60, 70):
        packed[0][cell(i)] = 0
    st = with_index_keys(st, packed, scale)
    q, w = queries(rng, 3)
    w[2] = -np.abs(w[2])           # token 2: all weights negative: zero keys rank high
    slot = np.array([0, 0, 0], np.int32)
    pos = np.array([511, 511, 511], np.int32)
    k = 128
    got = np.asarray(run(st, 1, slot, pos, q, w, k, impl, return_state=False, q_format=q_format))
    want, _ = expected(st, 1, slot, pos, q, w, k, q_format)
    np.testing.assert_array_equal(got, want)
    for t in range(3):
        row = list(got[t])
        dup = [row.index(i) for i in (2, 7, 40, 41, 100)]
        assert dup == sorted(dup) and dup[-1] - dup[0] == 4      # adjacent, by index
    zeros = [list(got[2]).index(i) for i in range(60, 70)]
    assert zeros == sorted(zeros) and zeros[-1] - zeros[0] == 9


@pytest.mark.parametrize("q_format", Q_FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
def test_bad_rows_and_errors(impl, q_format):
    rng = np.random.default_rng(9)
    # slot 1 lacks logical block 1; slot 2 has no blocks at all
    st = make_state(rng, R=4, max_context=512, blocks={0: [0, 1, 2, 3], 1: [4, -1, 6, 99],
                                                        3: [8, 9, 10, 11]})
    slot = np.array([-1, 7, 0, 1, 1, 2, 3, -5], np.int32)
    pos = np.array([100, 100, -3, 511, 40, 3, 2 ** 31 - 1, 0], np.int32)
    q, w = queries(rng, len(slot))
    k = 64
    got, st2 = run(st, 3, slot, pos, q, w, k, impl, q_format=q_format)
    got = np.asarray(got)
    want, _ = expected(st, 3, slot, pos, q, w, k, q_format)
    np.testing.assert_array_equal(got, want)
    assert np.all(got[[0, 1, 2, 7]] == -1)
    # token 3 (pos 511): blocks 1 (-1) and 3 (99 >= N=16) missing; token 4
    # (pos 40, 10 entries): only block 0 needed; token 5 (pos 3, 1 entry):
    # block 0 missing; token 6 at 2^31 - 1 >= max_context: BAD_POSITION
    assert set(got[3][got[3] >= 0]) == set(range(32)) | set(range(64, 96))
    assert np.all(got[5] == -1) and np.all(got[6] == -1)
    err = np.asarray(st2.errors)
    assert err[EK.BAD_SLOT] == 2 and err[EK.BAD_POSITION] == 2
    assert err[EK.MISSING_BLOCK] == 3
    assert err.sum() == 7


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_traced_layer(impl):
    rng = np.random.default_rng(2)
    st = make_state(rng, blocks={0: [0, 1]})
    q, w = queries(rng, 2)
    f = jax.jit(lambda st, lay: D.indexer_topk(st, lay, jnp.array([0, 0], jnp.int32),
                                               jnp.array([100, 200], jnp.int32), jnp.asarray(q),
                                               jnp.asarray(w), 8, impl=impl, return_state=True))
    got, st2 = f(st, jnp.int32(2))          # layer 2 is HCA
    assert np.all(np.asarray(got) == -1)
    err = np.asarray(st2.errors)
    assert err[EK.BAD_LAYER] == 1 and err.sum() == 1
    got, st2 = f(st, jnp.int32(3))          # the default q_format
    want, _ = expected(st, 3, [0, 0], [100, 200], q, w, 8, "mxfp4")
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("impl", IMPLS)
def test_feeds_gather_topk(impl):
    st, slot, pos, q, w, k = workload(3, k=16)
    layer = 3
    idx, st2 = run(st, layer, slot, pos, q, w, k, impl)
    kv, valid, st3 = D.gather_topk(st2, layer, jnp.asarray(slot), jnp.asarray(pos), idx,
                                   return_state=True)
    np.testing.assert_array_equal(np.asarray(valid), np.asarray(idx) >= 0)
    assert not np.any(np.asarray(st3.errors))
    assert np.asarray(valid).sum() > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_default_q_format_is_the_official_fp4_simulation(impl):
    """Without q_format the op rounds q to MXFP4 (DeepSeek-V4's inference
    code runs fp4_act_quant(q, 32, inplace=True) before scoring): the same
    indices as q_format="mxfp4", and not those of "bf16" on this workload
    (so the comparison can tell the two apart)."""
    st, slot, pos, q, w, k = workload(4)
    got = np.asarray(run(st, 1, slot, pos, q, w, k, impl, return_state=False, q_format=None))
    want, _ = expected(st, 1, slot, pos, q, w, k, "mxfp4")
    np.testing.assert_array_equal(got, want)
    unrounded, _ = expected(st, 1, slot, pos, q, w, k, "bf16")
    assert np.any(got != unrounded)


@pytest.mark.parametrize("impl", IMPLS)
def test_mxfp4_idempotent_on_a_simulated_query(impl):
    """A model that ran the FP4 simulation itself passes q already on the
    MXFP4 grid (as bf16, what fp4_act_quant(..., inplace=True) returns):
    rounding it again changes no value, so the indices equal those of the
    raw q. Blocks whose largest code is 3 or 4 come back with half the
    scale and twice the codes; the scores must not care."""
    st, slot, pos, q, w, k = workload(6)
    simulated, scale = npq.mxfp4_roundtrip(np.asarray(q, np.float32))
    sim_bf16 = simulated.astype(ml_dtypes.bfloat16)
    assert np.array_equal(sim_bf16.astype(np.float32), simulated)     # exact in bf16
    assert not np.array_equal(sim_bf16, q)
    rescaled = npq.mxfp4_roundtrip(simulated)[1] != scale
    assert rescaled.any() and not rescaled.all()      # both kinds of block are here
    raw = np.asarray(run(st, 1, slot, pos, q, w, k, impl, return_state=False, q_format="mxfp4"))
    again = np.asarray(run(st, 1, slot, pos, sim_bf16, w, k, impl, return_state=False,
                           q_format="mxfp4"))
    np.testing.assert_array_equal(again, raw)


def test_trace_time_checks():
    rng = np.random.default_rng(0)
    st = make_state(rng)
    q, w = queries(rng, 2)
    s = jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="k"):
        D.indexer_topk(st, 1, s, s, jnp.asarray(q), jnp.asarray(w), 0)
    with pytest.raises(ValueError, match="q"):
        D.indexer_topk(st, 1, s, s, jnp.asarray(q, jnp.float32), jnp.asarray(w), 4)
    with pytest.raises(ValueError, match="weights"):
        D.indexer_topk(st, 1, s, s, jnp.asarray(q), jnp.asarray(w[:, :32]), 4)
    with pytest.raises(ValueError, match="layer"):
        D.indexer_topk(st, 2, s, s, jnp.asarray(q), jnp.asarray(w), 4)
    with pytest.raises(ValueError, match="q_format"):
        D.indexer_topk(st, 1, s, s, jnp.asarray(q), jnp.asarray(w), 4, q_format="fp8")


@pytest.mark.parametrize("seed", [11, pytest.param(12, marks=pytest.mark.slow(
    reason="a second random draw; seed 11 stays"))])
def test_implementations_identical(seed):
    """Random workload with big k (more than visible for most tokens): every
    available implementation returns the same array."""
    st, slot, pos, q, w, _ = workload(seed)
    impls = ["reference"]
    if _ffi.has_target("cpu", "dsv4_indexer_topk") and jax.default_backend() == "cpu":
        impls.append("cpu")
    try:
        if jax.devices("cuda") and _ffi.has_target("cuda", "dsv4_indexer_topk"):
            impls.append("cuda")
    except RuntimeError:
        pass
    outs = {}
    for impl in impls:
        for k in (1, 200):
            for fmt in Q_FORMATS:
                outs[impl, k, fmt] = np.asarray(run(st, 1, slot, pos, q, w, k, impl,
                                                    return_state=False, q_format=fmt))
    for (impl, k, fmt), v in outs.items():
        np.testing.assert_array_equal(v, outs["reference", k, fmt], err_msg=f"{impl} k={k} {fmt}")


@pytest.mark.parametrize("q_format", Q_FORMATS)
@pytest.mark.parametrize("impl", ["reference", pytest.param("cpu", marks=[requires_cpu_ffi,
                                                                          needs_cpu_target])])
def test_sharded_equals_each_shard_alone(impl, q_format):
    """Under shard_map over 2 CPU devices each shard ranks its own requests'
    keys (shard-local slots and blocks) exactly as an unsharded state of that
    shard does; errors land in the shard's own counters."""
    from jax.sharding import Mesh
    from dsv4_jax.sharding import init_sharded_state, shard_config
    from support.sharding import unshard
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs 2 devices")
    mesh = Mesh(np.array(devices[:2]), ("data",))
    cfg = shard_config(D.CacheConfig.tiny(max_requests=4, max_context=512, num_blocks=8), mesh,
                       "data")
    state = init_sharded_state(cfg, mesh)
    rng = np.random.default_rng(17)
    Lc, N = state.csa.index.packed.shape[:2]
    packed = rng.integers(0, 256, (Lc, N, 32, 64), dtype=np.uint8)
    scale = rng.integers(119, 132, (Lc, N, 32, 4), dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    # per shard (2 slots, 4 blocks each): slot 0 owns local blocks 3,1; slot 1
    # owns 0 and a missing one
    bt = np.full((4, 4), -1, np.int32)
    for k in range(2):
        bt[2 * k, :2] = [3, 1]
        bt[2 * k + 1, :2] = [0, -1]
    put = lambda x, like: jax.device_put(x, like.sharding)
    state = dataclasses.replace(
        state, block_table=put(bt, state.block_table),
        csa=dataclasses.replace(state.csa, index=D.IndexerKeys(
            put(packed, state.csa.index.packed), put(scale, state.csa.index.scale))))
    # 3 tokens per shard, slots local to their shard
    slot = np.array([0, 1, -1, 1, 0, 5], np.int32)
    pos = np.array([255, 200, 0, 100, 130, 7], np.int32)
    q, w = queries(rng, 6)
    k = 24
    with jax.set_mesh(mesh):
        got, st2 = jax.jit(lambda st, s, p, q, w: D.indexer_topk(
            st, 1, s, p, q, w, k, impl=impl, q_format=q_format, return_state=True))(
                state, jnp.asarray(slot), jnp.asarray(pos), jnp.asarray(q), jnp.asarray(w))
    got = np.asarray(got)
    for sh, local in enumerate(unshard(state, cfg)):
        rows = slice(3 * sh, 3 * sh + 3)
        want, _ = expected(local, 1, slot[rows], pos[rows], q[rows], w[rows], k, q_format)
        np.testing.assert_array_equal(got[rows], want, err_msg=f"shard {sh}")
    err = np.asarray(st2.errors).reshape(2, -1)
    # shard 0: token 1 (slot 1, pos 200 -> 50 entries) needs logical block 1: missing
    assert err[0, EK.MISSING_BLOCK] == 1 and err[0].sum() == 1
    # shard 1: token 3 (slot 1, pos 100 -> 25 entries) fine; slot 5 is out of range
    assert err[1, EK.BAD_SLOT] == 1 and err[1].sum() == 1


@pytest.mark.parametrize("q_format", Q_FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
def test_k_above_table_and_no_tokens(impl, q_format):
    """k larger than every possible entry (E = 128): visible ones first, then
    -1; an empty batch gives an empty result and counts only a bad layer."""
    rng = np.random.default_rng(8)
    st = make_state(rng, R=2, max_context=512, blocks={0: [1, 0, 3, 2]})
    q, w = queries(rng, 2)
    slot = np.array([0, 0], np.int32)
    pos = np.array([511, 63], np.int32)
    got = np.asarray(run(st, 1, slot, pos, q, w, 300, impl, return_state=False,
                         q_format=q_format))
    want, _ = expected(st, 1, slot, pos, q, w, 300, q_format)
    np.testing.assert_array_equal(got, want)
    assert (got[0] >= 0).sum() == 128 and (got[1] >= 0).sum() == 16
    f = jax.jit(lambda st, lay: D.indexer_topk(st, lay, jnp.zeros(0, jnp.int32),
                                               jnp.zeros(0, jnp.int32),
                                               jnp.zeros((0, 64, 128), jnp.bfloat16),
                                               jnp.zeros((0, 64), jnp.float32), 4, impl=impl,
                                               q_format=q_format, return_state=True))
    idx, st2 = f(st, jnp.int32(1))
    assert idx.shape == (0, 4) and not np.any(np.asarray(st2.errors))
    idx, st2 = f(st, jnp.int32(0))
    assert np.asarray(st2.errors)[EK.BAD_LAYER] == 1 and np.asarray(st2.errors).sum() == 1
