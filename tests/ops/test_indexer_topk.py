"""indexer_topk (issue 9): every implementation against a float32 numpy
replay of the documented arithmetic order (exact index arrays), against a
float64 numpy oracle of the formula (top-k sets where the scores are well
separated), against each other (identical arrays), and fed to gather_topk."""
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
from support.marks import CUDA, requires_cpu_ffi

CSA_LAYERS = (1, 3)      # tiny preset: SWA, CSA, HCA, CSA
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def make_state(rng, R=4, max_context=1024, blocks=None, num_blocks=None):
    """Tiny state with random MXFP4 keys in every CSA block (scale bytes near
    127, no NaN byte) and the block table `blocks` (slot -> physical ids)."""
    cfg = D.CacheConfig.tiny(max_requests=R, max_context=max_context, num_blocks=num_blocks)
    st = D.init_state(cfg)
    Lc, N = st.csa.index.packed.shape[:2]
    packed = rng.integers(0, 256, (Lc, N, 32, 64), dtype=np.uint8)
    scale = rng.integers(119, 132, (Lc, N, 32, 4), dtype=np.uint8)
    bt = np.full((R, cfg.max_blocks_per_request), -1, np.int32)
    for s, phys in (blocks or {}).items():
        bt[s, :len(phys)] = phys
    st = dataclasses.replace(st, block_table=jnp.asarray(bt))
    return with_index_keys(st, packed, scale)


def with_index_keys(st, packed=None, scale=None):
    """`st` with its CSA indexer keys replaced: packed u8 codes and/or scale
    bytes (numpy u8, viewed as e8m0)."""
    packed = st.csa.index.packed if packed is None else jnp.asarray(packed)
    scale = (st.csa.index.scale if scale is None
             else jnp.asarray(scale.view(ml_dtypes.float8_e8m0fnu)))
    return dataclasses.replace(st, csa=dataclasses.replace(
        st.csa, index=D.IndexerKeys(packed, scale)))


def random_blocks(rng, cfg, slots):
    """Distinct random physical blocks for every logical block of `slots`."""
    MB = cfg.max_blocks_per_request
    perm = rng.permutation(cfg.num_blocks)
    return {s: perm[i * MB:(i + 1) * MB] for i, s in enumerate(slots)}


def with_random_blocks(rng, st, n_slots):
    """`st` whose first `n_slots` slots own distinct random blocks, every
    logical block of each (random_blocks)."""
    bt = np.stack([np.r_[b] for b in random_blocks(rng, st.config, range(n_slots)).values()])
    return dataclasses.replace(st, block_table=jnp.asarray(bt.astype(np.int32)))


def queries(rng, T, qscale=1.0):
    q = (rng.standard_normal((T, 64, 128)) * qscale).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((T, 64)).astype(np.float32)
    return q, w


def host_keys(st, kind_idx, slot, n, with_codes=False):
    """Decoded keys f64[n, 128] of entries 0..n-1 of `slot` (numpy only),
    and whether each entry's block exists; with_codes: also their e2m1 codes
    [n, 128] and scale bytes [n, 4]."""
    packed = np.asarray(st.csa.index.packed)[kind_idx]
    scale = np.asarray(st.csa.index.scale).view(np.uint8)[kind_idx].astype(np.int64)
    bt = np.asarray(st.block_table)[slot]
    N = packed.shape[0]
    i = np.arange(n)
    b = bt[i // 32]
    ok = (b >= 0) & (b < N)
    by = packed[np.where(ok, b, 0), i % 32]                      # [n, 64]
    codes = np.where(ok[:, None], np.stack([by & 15, by >> 4], -1).reshape(n, 128), 0)
    sbytes = np.where(ok[:, None], scale[np.where(ok, b, 0), i % 32], 127)
    keys = np.where(ok[:, None], E2M1[codes] * np.repeat(2.0 ** (sbytes - 127), 32, axis=1), 0.)
    if with_codes:
        return keys, ok, codes, sbytes
    return keys, ok


def visible(p, MB):
    return min((p + 1) // 4, MB * 32)


def replay_f32(keys, q, w):
    """The documented fp32 order, replayed in numpy float32."""
    k = keys.astype(np.float32).reshape(-1, 1, 4, 32)
    qq = np.asarray(q, np.float32).reshape(1, 64, 4, 32)
    prod = k * qq
    blk = prod[..., 0]
    for j in range(1, 32):
        blk = blk + prod[..., j]
    d = ((blk[..., 0] + blk[..., 1]) + blk[..., 2]) + blk[..., 3]
    c = np.asarray(w, np.float32)[None, :] * np.where(d > 0, d, np.float32(0))
    s = c[:, 0]
    for h in range(1, 64):
        s = s + c[:, h]
    return s


def replay_f32_mxfp4(key_codes, key_scale, q, w):
    """The documented q_format "mxfp4" order (dsv4/indexer.h) in numpy
    float32: keys as e2m1 codes [n, 128] and scale bytes [n, 4], q rounded by
    npq's independent MXFP4 quantizer."""
    k2 = (2 * E2M1[key_codes]).astype(np.int64).reshape(-1, 4, 32)
    K = np.exp2(key_scale.astype(np.float64) - 127).astype(np.float32)
    qv, qs = npq.mxfp4_roundtrip(np.asarray(q, np.float32))
    qs = qs.reshape(64, 4, 32)[..., 0]
    q2 = np.rint(2 * qv.reshape(64, 4, 32) / qs[..., None]).astype(np.int64)
    # exact integers (|S| <= 32 * 12 * 12), in float64 for the BLAS
    S = np.einsum("nbj,hbj->nhb", k2.astype(np.float64), q2.astype(np.float64),
                  optimize=True).astype(np.int64)
    u = S.astype(np.float32) * K[:, None, :]
    Q = (qs / 4).astype(np.float32)
    d = u[..., 0] * Q[None, :, 0]
    for b in range(1, 4):
        d = d + u[..., b] * Q[None, :, b]      # u * Q exact at these scales: = the fma
    c = np.asarray(w, np.float32)[None, :] * np.where(d > 0, d, np.float32(0))
    while c.shape[1] > 1:                      # balanced pairwise tree over the heads
        c = c[:, 0::2] + c[:, 1::2]
    return c[:, 0]


def oracle_f64(keys, q, w):
    d = keys @ np.asarray(q, np.float64).T                       # [n, 64]
    return np.maximum(d, 0) @ np.asarray(w, np.float64)


def rank(scores, cand, k):
    """Indices of the k best candidates (descending score, ascending index),
    -1 padded."""
    idx = np.nonzero(cand)[0]
    s = scores[idx]
    order = idx[np.lexsort((idx, -s))][:k]
    return np.r_[order, np.full(k - len(order), -1)].astype(np.int32)


def expected(st, layer, slot, pos, q, w, k, q_format="bf16"):
    """Per token: the replayed-fp32 ranking, and (scores64, cand) for the
    float64 oracle (of the formula with q rounded to MXFP4 for "mxfp4")."""
    cfg = st.config
    MB = cfg.max_blocks_per_request
    kind_idx = cfg.kind_index(layer, "csa")
    rows, info = [], []
    for t in range(len(slot)):
        if not (0 <= slot[t] < cfg.max_requests) or pos[t] < 0:
            rows.append(np.full(k, -1, np.int32))
            info.append(None)
            continue
        n = visible(int(pos[t]), MB)
        keys, ok, codes, sbytes = host_keys(st, kind_idx, slot[t], n, with_codes=True)
        if q_format == "mxfp4":
            qt = npq.mxfp4_roundtrip(np.asarray(q[t], np.float32))[0]
            rows.append(rank(replay_f32_mxfp4(codes, sbytes, q[t], w[t]), ok, k))
        else:
            qt = q[t]
            rows.append(rank(replay_f32(keys, q[t], w[t]), ok, k))
        info.append((oracle_f64(keys, qt, w[t]), ok))
    return np.stack(rows), info


def run(st, layer, slot, pos, q, w, k, impl, return_state=True, q_format="bf16"):
    """q_format=None leaves it to the op's default."""
    fmt = {} if q_format is None else {"q_format": q_format}
    f = jax.jit(lambda st, s, p, q, w: D.indexer_topk(st, layer, s, p, q, w, k, impl=impl,
                                                      return_state=return_state, **fmt))
    return f(st, jnp.asarray(slot, jnp.int32), jnp.asarray(pos, jnp.int32), jnp.asarray(q),
             jnp.asarray(w))


# the CPU target of this op may be missing from an older build of the module
needs_cpu_target = pytest.mark.skipif(not _ffi.has_target("cpu", "dsv4_indexer_topk"),
                                      reason="dsv4_indexer_topk not built for the CPU")
IMPLS = ["reference", pytest.param("cpu", marks=[requires_cpu_ffi, needs_cpu_target]),
         pytest.param("cuda", marks=CUDA)]
Q_FORMATS = ["bf16", "mxfp4"]


def workload(seed, k=40):
    """Several requests, one short (fewer visible entries than k), padding
    and a token at position 0 (nothing visible)."""
    rng = np.random.default_rng(seed)
    st = make_state(rng, R=4, max_context=1024)
    st = with_random_blocks(rng, st, 4)
    slot = np.array([0, 2, -1, 1, 3, 0, 2, 1], np.int32)
    pos = np.array([1023, 700, 5, 90, 0, 511, 130, 3], np.int32)
    q, w = queries(rng, len(slot))
    return st, slot, pos, q, w, k


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
    # block 0 missing; token 6 at the largest position sees the whole table
    assert set(got[3][got[3] >= 0]) == set(range(32)) | set(range(64, 96))
    assert np.all(got[5] == -1)
    assert set(got[6][got[6] >= 0]) <= set(range(128)) and np.all(got[6] >= 0)
    err = np.asarray(st2.errors)
    assert err[EK.BAD_SLOT] == 2 and err[EK.BAD_POSITION] == 1
    assert err[EK.MISSING_BLOCK] == 3
    assert err.sum() == 6


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


@pytest.mark.parametrize("seed", [11, 12])
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


def np_rank_keys(s):
    """uint32 rank keys of float32 scores (NaN as -inf, -0 as +0)."""
    s = np.where(np.isnan(s), np.float32(-np.inf), s).astype(np.float32)
    s = np.where(s == 0, np.float32(0), s).astype(np.float32)
    b = s.view(np.uint32)
    key = np.where(b & 0x80000000, b ^ 0x7FFFFFFF, b)
    return (key ^ 0x80000000).astype(np.uint32)


def test_rank_keys_leave_the_lowest_bins_to_missing_entries():
    """The CUDA select counts key 0 (a missing entry) into top-12-bit bin 0
    without a test and takes that bin as empty: no score's rank key may fall
    below bin 7 (the lowest is -inf's, and NaN ranks as -inf)."""
    rng = np.random.default_rng(11)
    special = np.array([-np.inf, np.nan, -np.nan, np.inf, -np.finfo(np.float32).max,
                        -np.finfo(np.float32).tiny, -0.0, 0.0], np.float32)
    bits = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    s = np.concatenate([special, bits.view(np.float32)])
    keys = np_rank_keys(s)
    assert (keys >> 20).min() == 7
    assert np_rank_keys(np.float32([-np.inf]))[0] >> 20 == 7


def test_reference_scores_bit_exact():
    """The reference's score bits equal the numpy float32 replay of the
    documented order (a different summation order would show here)."""
    from dsv4_jax.reference.indexer import score_entries
    rng = np.random.default_rng(4)
    st = make_state(rng, R=1, max_context=512, blocks={0: [0, 1, 2, 3]})
    keys, _ = host_keys(st, 0, 0, 128)
    q, w = queries(rng, 1, qscale=3.0)
    got = np.asarray(jax.jit(score_entries)(jnp.asarray(keys, jnp.float32),
                                            jnp.asarray(q[0], jnp.float32), jnp.asarray(w[0])))
    want = replay_f32(keys, q[0], w[0])
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # the check is sharp: summing the heads in reverse moves some bits
    k = keys.astype(np.float32).reshape(-1, 1, 4, 32) * np.asarray(q[0], np.float32).reshape(1, 64, 4, 32)
    d = k.sum(-1).sum(-1)
    c = w[0][None] * np.maximum(d, 0)
    assert np.any(c[:, ::-1].cumsum(1)[:, -1].view(np.uint32) != want.view(np.uint32))


def test_reference_scores_bit_exact_mxfp4():
    """q_format "mxfp4": the reference's score bits equal the numpy replay
    (npq's own MXFP4 rounding of q); summing the heads in order instead of
    the pairwise tree moves some bits."""
    from dsv4_jax.reference.indexer import query_mxfp4, score_entries_mxfp4
    rng = np.random.default_rng(14)
    st = make_state(rng, R=1, max_context=512, blocks={0: [0, 1, 2, 3]})
    keys, _, codes, sbytes = host_keys(st, 0, 0, 128, with_codes=True)
    q, w = queries(rng, 1, qscale=3.0)
    packed = np.asarray(st.csa.index.packed)[0][[0, 1, 2, 3]].reshape(128, 64)
    scale = np.asarray(st.csa.index.scale)[0][[0, 1, 2, 3]].reshape(128, 4)

    def f(packed, scale, q, w):
        q2, qf = query_mxfp4(q)
        return score_entries_mxfp4(packed, scale, q2, qf, w)
    got = np.asarray(jax.jit(f)(jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(q[0]),
                                jnp.asarray(w[0])))
    want = replay_f32_mxfp4(codes, sbytes, q[0], w[0])
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # the oracle of the formula agrees to fp32 noise
    qv = npq.mxfp4_roundtrip(np.asarray(q[0], np.float32))[0]
    np.testing.assert_allclose(got, oracle_f64(keys, qv, w[0]), rtol=1e-4,
                               atol=1e-5 * np.abs(got).max())
    # sharpness: a sequential head sum gives other bits somewhere
    k2 = (2 * E2M1[codes]).reshape(-1, 4, 32)
    qs = npq.mxfp4_roundtrip(np.asarray(q[0], np.float32))[1].reshape(64, 4, 32)[..., 0]
    q2 = np.rint(2 * qv.reshape(64, 4, 32) / qs[..., None])
    S = np.einsum("nbj,hbj->nhb", k2, q2).astype(np.float32)
    u = S * np.exp2(sbytes.astype(np.float64) - 127).astype(np.float32)[:, None, :]
    d = u[..., 0] * (qs[:, 0] / 4).astype(np.float32)
    for b in range(1, 4):
        d = d + u[..., b] * (qs[:, b] / 4).astype(np.float32)
    c = w[0][None].astype(np.float32) * np.maximum(d, np.float32(0))
    seq = c[:, 0]
    for h in range(1, 64):
        seq = seq + c[:, h]
    assert np.any(seq.view(np.uint32) != want.view(np.uint32))


def handler_scratch(impl, st, slot, pos, q, w, q_format):
    """The handler's scratch result (rank keys of every entry), poisoned first."""
    from dsv4_jax.ops._dispatch import ffi_call
    from dsv4_jax.ops.indexer import QUERY_SCRATCH_BYTES, Q_FORMATS as ATTR
    T = len(slot)
    E = st.config.max_blocks_per_request * 32
    qbytes = QUERY_SCRATCH_BYTES if q_format == "mxfp4" else 0

    def call(st, s, p, q, w):
        return ffi_call("dsv4_indexer_topk", [jnp.int32(1), s, p, q, w, st.block_table, st.errors,
                                              st.csa.index.packed, st.csa.index.scale],
                        [jax.ShapeDtypeStruct((T, 8), jnp.int32),
                         jax.ShapeDtypeStruct((T, E), jnp.uint32),
                         jax.ShapeDtypeStruct((T, qbytes), jnp.uint8),
                         jax.ShapeDtypeStruct((8,), jnp.int32)], {6: 3},
                        q_format=ATTR[q_format])
    args = jax.device_put((st, jnp.asarray(slot), jnp.asarray(pos), jnp.asarray(q),
                           jnp.asarray(w)), jax.devices(impl)[0])
    return np.asarray(jax.jit(call)(*args)[1])


def replay_rank_keys(st, slot, pos, q, w, q_format):
    """Per token: the replayed rank keys of its visible entries."""
    out = []
    for t in range(len(slot)):
        n = visible(int(pos[t]), st.config.max_blocks_per_request)
        keys, _, codes, sbytes = host_keys(st, 1, slot[t], n, with_codes=True)
        want = (replay_f32_mxfp4(codes, sbytes, q[t], w[t]) if q_format == "mxfp4"
                else replay_f32(keys, q[t], w[t]))
        out.append(np_rank_keys(want))
    return out


@pytest.mark.parametrize("q_format", Q_FORMATS)
@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=[requires_cpu_ffi, needs_cpu_target]),
                                  pytest.param("cuda", marks=CUDA)])
def test_handler_scores_bit_exact(impl, q_format):
    """The handlers' scratch output (rank keys of every visible entry) equals
    the float32 replay bit for bit."""
    rng = np.random.default_rng(6)
    st = make_state(rng, R=2, max_context=512, blocks={0: [2, 0, 3, 1], 1: [4, 5, 6, 7]})
    slot = np.array([0, 1, 0], np.int32)
    pos = np.array([511, 300, 77], np.int32)
    q, w = queries(rng, 3, qscale=3.0)
    scratch = handler_scratch(impl, st, slot, pos, q, w, q_format)
    for t, want in enumerate(replay_rank_keys(st, slot, pos, q, w, q_format)):
        np.testing.assert_array_equal(scratch[t, :len(want)], want)


@pytest.mark.parametrize("q_format", Q_FORMATS)
@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=[requires_cpu_ffi, needs_cpu_target]),
                                  pytest.param("cuda", marks=CUDA)])
def test_handler_scores_bit_exact_on_a_full_grid(impl, q_format):
    """As above on a grid past the small-grid kernel shapes: 32 tokens over
    2048 entries. On CUDA that takes the one-thread "bf16" score kernel
    (T * E above kSplitMaxWork) and the "mxfp4" kernel with one warp a tile
    column (its 256 CTAs in pairs would pass one wave on any GPU of up to 256
    multiprocessors; cuda/indexer_topk/launch_policy.h). Even physical
    blocks hold keys the fast form takes (scale bytes 125..128), the others a
    wider spread (per-block tiles), one in eight bytes 228..240 (past 231:
    subtract, then multiply); one token's query lies outside the fast form's
    guards (a head whose block scales spread by 5)."""
    rng = np.random.default_rng(53)
    st = with_random_blocks(rng, make_state(rng, R=2, max_context=8192), 2)
    scale = rng.integers(119, 132, np.asarray(st.csa.index.scale).shape, dtype=np.uint8)
    scale[:, 0::2] = rng.integers(125, 129, scale[:, 0::2].shape)
    scale[:, 1::8] = rng.integers(228, 241, scale[:, 1::8].shape)
    st = with_index_keys(st, scale=scale)
    T, E = 32, st.config.max_blocks_per_request * 32
    used = scale[1][np.asarray(st.block_table).ravel()].astype(np.int64)   # [blocks, 32, 4]
    fast_tile = key_fast(used).all(-1)
    assert 0 < fast_tile.mean() < 1 and (used > 231).any()
    if impl == "cuda":
        sms = getattr(jax.devices("cuda")[0], "core_count", 0)
        assert T * E > 16384 and T * (E // 256) > sms
    slot = np.arange(T, dtype=np.int32) % 2
    pos = rng.integers(0, 8192, T).astype(np.int32)
    pos[:4] = 8191
    q, w = queries(rng, T)
    q = np.asarray(q, np.float32)
    q[5, 9, 64:96] *= 32.0
    q = q.astype(ml_dtypes.bfloat16)
    scratch = handler_scratch(impl, st, slot, pos, q, w, q_format)
    with np.errstate(over="ignore", invalid="ignore"):
        wants = replay_rank_keys(st, slot, pos, q, w, q_format)
    for t, want in enumerate(wants):
        np.testing.assert_array_equal(scratch[t, :len(want)], want, err_msg=f"token {t}")


def key_fast(sbytes):
    """The key guard of the fast form (dsv4/indexer.h), per entry."""
    m = sbytes.min(-1)
    return (m >= 88) & (m <= 168) & (sbytes.max(-1) - m <= 3)


@pytest.mark.parametrize("impl", ["reference",
                                  pytest.param("cpu", marks=[requires_cpu_ffi, needs_cpu_target]),
                                  pytest.param("cuda", marks=CUDA)])
def test_mxfp4_fast_form_guards(impl):
    """q_format "mxfp4" where the handlers' fast form (one dot product over 128
    channels, dsv4/indexer.h) and the per-block form meet: keys whose scale
    bytes lie within 3 of each other, at and across the guard bounds 88 and
    168, tiles with one entry spread by 4; tokens with a query head spread
    by more than 3, with weights far outside [2^-50, 2^50] once scaled, with
    zero weights; tokens whose head terms span 2^-45..2^45 with mixed signs,
    and whose heads cancel in pairs (partial sums exactly 0 or far below the
    terms: the CUDA fast form's scaled, signed tree must round them as the
    definition does). Every score bit equals the replay of the definition,
    and the indices the replayed ranking."""
    rng = np.random.default_rng(77)
    st = make_state(rng, R=2, max_context=1024, blocks={0: list(range(8)), 1: list(range(8, 16))})
    shape = np.asarray(st.csa.index.scale).shape            # [Lc, N, 32, 4]
    base = rng.integers(100, 150, shape[:3])
    base[:, 1] = 88                                          # at the bounds: fast
    base[:, 2] = 168
    base[:, 3] = rng.choice([87, 88, 168, 169], shape[2])    # across them: mixed
    base[:, 4] = rng.integers(60, 200, shape[2])
    spread = rng.integers(0, 4, shape)
    spread[:, 1:4, :, 0] = 0                                 # the minimum is the base
    spread[:, 5, 7, :3] = [0, 0, 4]                          # one entry of a tile: slow tile
    spread[:, 9, :, 1] = 4 * rng.integers(0, 2, shape[2])    # about half the entries
    scale = (base[..., None] + spread).astype(np.uint8)
    st = with_index_keys(st, scale=scale)
    kf = key_fast(scale[1].astype(np.int64))
    assert kf[[0, 1, 2, 6, 7]].all() and not kf[5].all() and 0 < kf[[3, 4, 9]].mean() < 1

    T = 9
    slot = np.array([0, 1, 0, 1, 0, 1, 0, 1, 1], np.int32)
    pos = np.array([1023, 1023, 900, 1023, 1023, 1023, 555, 1023, 1000], np.int32)
    q, w = queries(rng, T)
    q = np.asarray(q, np.float32)
    w[7] = np.sign(w[7]) * 2.0 ** rng.uniform(-45, 45, 64)     # wide, mixed signs: fast
    q[8, 1::2] = q[8, 0::2]                                  # head pairs with equal A ...
    w[8, 0::2] = np.abs(w[8, 0::2]) * 2.0 ** -44
    w[8, 1::2] = -w[8, 0::2] * (1 + rng.integers(0, 3, 32) * 2.0 ** -23)   # ... and w: 0 or tiny
    q[1, 9, 64:96] *= 32.0                                   # head 9: spread 5, token slow
    w[2, 30] = 2.0 ** 60                                     # |wq| above 2^50: token slow
    w[3, 40] = 1.3 * 2.0 ** -60                              # below 2^-50: token slow
    w[4] *= 2.0 ** 40                                        # large, inside: fast
    w[5, ::3] = 0.0                                          # zeros: fast
    w[6] *= 2.0 ** -40
    q = q.astype(ml_dtypes.bfloat16)
    with np.errstate(over="ignore", invalid="ignore"):       # some scores overflow: -> inf
        wants = replay_rank_keys(st, slot, pos, q, w, "mxfp4")
        want_idx, _ = expected(st, 1, slot, pos, q, w, 64, "mxfp4")
    if impl != "reference":
        scratch = handler_scratch(impl, st, slot, pos, q, w, "mxfp4")
        for t, want in enumerate(wants):
            np.testing.assert_array_equal(scratch[t, :len(want)], want, err_msg=f"token {t}")
    got = np.asarray(run(st, 1, slot, pos, q, w, 64, impl, return_state=False, q_format="mxfp4"))
    np.testing.assert_array_equal(got, want_idx)


def few_distinct_keys(rng, st, n_distinct=6):
    """Every key of the pool replaced by one of `n_distinct` keys: scores
    collapse into a few large tie groups (the k-th score sits inside one)."""
    packed = np.array(st.csa.index.packed)
    scale = np.array(st.csa.index.scale.view(np.uint8))
    pick = rng.integers(0, n_distinct, packed.shape[:3])
    src_p = rng.integers(0, 256, (n_distinct, 64), dtype=np.uint8)
    src_s = rng.integers(123, 130, (n_distinct, 4), dtype=np.uint8)
    packed[...] = src_p[pick]
    scale[...] = src_s[pick]
    return with_index_keys(st, packed, scale)


@pytest.mark.parametrize("q_format", Q_FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
def test_long_context_many_ties(impl, q_format):
    """2048 entries (several score chunks and select passes on CUDA), k = 512
    and 700, scores in six tie groups, in one (every key equal), and random
    keys."""
    rng = np.random.default_rng(21)
    st = make_state(rng, R=2, max_context=8192)
    st = with_random_blocks(rng, st, 2)
    tied = few_distinct_keys(rng, st)
    same = few_distinct_keys(rng, st, n_distinct=1)     # one key everywhere: one big tie
    slot = np.array([0, 1, 0, 1], np.int32)
    pos = np.array([8191, 5000, 3001, 8191], np.int32)
    q, w = queries(rng, 4)
    for state in (tied, same, st):
        for k in (512, 700):
            got = np.asarray(run(state, 1, slot, pos, q, w, k, impl, return_state=False,
                                 q_format=q_format))
            want, _ = expected(state, 1, slot, pos, q, w, k, q_format)
            np.testing.assert_array_equal(got, want, err_msg=f"k={k}")


@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=[requires_cpu_ffi, needs_cpu_target]),
                                  pytest.param("cuda", marks=CUDA)])
def test_long_context_past_register_capacity(impl):
    """Requests with more than 16384 visible entries (the CUDA select keeps up
    to 16384 keys a token in registers and re-reads the scratch row beyond),
    at the boundary (16384, 16385) and with a partial last warp (17500); k =
    512 (one register per thread in the sort), 1500 (the shared-memory sort);
    random keys, six tie groups (the ordered collection of the ties), and one
    key everywhere (more keys in the select's top-bits bin than its shared
    buffer holds: the passes over all the keys)."""
    rng = np.random.default_rng(23)
    st = make_state(rng, R=2, max_context=131072)
    st = with_random_blocks(rng, st, 2)
    slot = np.array([0, 1, 0, 1], np.int32)
    pos = np.array([131071, 69999, 65535, 65539], np.int32)
    q, w = queries(rng, 4)
    for state, ks in ((st, (512, 1500)), (few_distinct_keys(rng, st), (512,)),
                      (few_distinct_keys(rng, st, n_distinct=1), (512,))):
        want_all, _ = expected(state, 1, slot, pos, q, w, max(ks), "mxfp4")
        for k in ks:
            got = np.asarray(run(state, 1, slot, pos, q, w, k, impl, return_state=False,
                                 q_format="mxfp4"))
            np.testing.assert_array_equal(got, want_all[:, :k], err_msg=f"k={k}")


@pytest.mark.parametrize("max_context", [262144, 1048576])
@pytest.mark.parametrize("impl", [pytest.param("cpu", marks=[requires_cpu_ffi, needs_cpu_target]),
                                  pytest.param("cuda", marks=CUDA)])
def test_select_spread_over_a_cluster(impl, max_context):
    """Past 16384 visible entries a token's CUDA select spreads over a
    cluster of CTAs (SelectCtas in cuda/indexer_topk/launch_policy.h: 4 here
    at 65536 entries, 8 at 262144, whose chunks exceed a CTA's registers),
    each counting its chunk of the keys and handing the leader its
    candidates. Every path of it: random keys (small top-bits bins: ranks
    within bins), six tie groups (a bin past the ranking's limit: radix
    passes over the bin's keys, at 1M over all the keys), one key everywhere
    (a bin larger than the buffer: the leader's passes over all the keys; at
    999 entries a bin that fits the gather, and with k = 1500 every
    candidate taken, both sorted);
    k = 512 and 1500 (the shared-memory sort); a token with fewer
    candidates than k (all taken), one with fewer entries than CTAs, a
    padding token, and a missing block (counted once a token that needs
    it, by the score kernel in "mxfp4" and by the select's leader in
    "bf16", whose indices this test does not replay: too large a replay)."""
    if impl == "cpu" and max_context > 262144:
        pytest.skip("the CPU handler at 1M context: minutes")
    rng = np.random.default_rng(29)
    st = make_state(rng, R=2, max_context=max_context)
    MB = st.config.max_blocks_per_request
    bt = np.stack([np.r_[b] for b in random_blocks(rng, st.config, range(2)).values()])
    bt[1, MB // 2 + 1] = -1                    # slot 1: a missing block past its middle
    st = dataclasses.replace(st, block_table=jnp.asarray(bt.astype(np.int32)))
    slot = np.array([0, 1, 0, -1, 1, 0], np.int32)
    pos = np.array([max_context - 1, max_context - 1, 9, 100, max_context // 2 + 200, 3999],
                   np.int32)
    missing = sum(1 for s, p in zip(slot, pos)
                  if s == 1 and visible(int(p), MB) > (MB // 2 + 1) * 32)
    q, w = queries(rng, len(slot))
    for state, ks in ((st, (512, 1500)), (few_distinct_keys(rng, st), (512,)),
                      (few_distinct_keys(rng, st, n_distinct=1), (512, 1500))):
        want_all, _ = expected(state, 1, slot, pos, q, w, max(ks), "mxfp4")
        for k in ks:
            got, st2 = run(state, 1, slot, pos, q, w, k, impl, q_format="mxfp4")
            np.testing.assert_array_equal(np.asarray(got), want_all[:, :k], err_msg=f"k={k}")
            err = np.asarray(st2.errors)
            assert err[EK.MISSING_BLOCK] == missing == 2 and err.sum() == missing
    _, st2 = run(st, 1, slot, pos, q, w, 512, impl, q_format="bf16")
    err = np.asarray(st2.errors)
    assert err[EK.MISSING_BLOCK] == missing and err.sum() == missing


@pytest.mark.parametrize("q_format", Q_FORMATS)
@pytest.mark.parametrize("impl", IMPLS)
def test_large_key_scales(impl, q_format):
    """Key scale bytes 228..240 (values up to 2^113): on CUDA, tiles with a
    byte above 231 take the subtract-then-multiply path, the others the fma
    path; both give the documented bits (no product overflows here)."""
    rng = np.random.default_rng(41)
    st = make_state(rng, R=2, max_context=2048, blocks={0: list(range(8, 16)),
                                                        1: list(range(16))})
    scale = rng.integers(228, 241, np.asarray(st.csa.index.scale).shape, dtype=np.uint8)
    scale[:, :8] = rng.integers(228, 232, scale[:, :8].shape)    # blocks 0..7: fast tiles only
    st = with_index_keys(st, scale=scale)
    slot = np.array([0, 1, 1], np.int32)
    pos = np.array([1023, 2047, 700], np.int32)
    q, w = queries(rng, 3)
    got = np.asarray(run(st, 1, slot, pos, q, w, 100, impl, return_state=False,
                         q_format=q_format))
    want, _ = expected(st, 1, slot, pos, q, w, 100, q_format)
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [31])
def test_cuda_equals_reference_on_cpu(seed):
    """On a GPU machine: the CUDA handler against the reference run on the
    host CPU device (the CPU handler equals that reference in the CPU tests;
    under jit with a GPU backend the "cpu" impl is refused)."""
    if not (has_cuda_target() and jax.default_backend() == "gpu"):
        pytest.skip("needs a CUDA GPU and dsv4_indexer_topk built for it")
    st, slot, pos, q, w, _ = workload(seed)
    cpu = jax.devices("cpu")[0]
    host = jax.device_put((st, slot, pos, q, w), cpu)
    for k in (1, 16, 300):
        for fmt in Q_FORMATS:
            got = np.asarray(run(st, 3, slot, pos, q, w, k, "cuda", return_state=False,
                                 q_format=fmt))
            with jax.default_device(cpu):
                ref = np.asarray(run(*host[:1], 3, *host[1:], k, "reference",
                                     return_state=False, q_format=fmt))
            np.testing.assert_array_equal(got, ref, err_msg=f"reference k={k} {fmt}")


def has_cuda_target():
    try:
        return bool(jax.devices("cuda")) and _ffi.has_target("cuda", "dsv4_indexer_topk")
    except RuntimeError:
        return False


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
def test_many_taken_keys_a_warp(impl, q_format):
    """k = 3000 and 4096 (the CUDA handler's largest k) over 3100 to 4096
    entries: most keys are taken, about 100 a warp of the CUDA select, where
    the usual case takes one or two a round; with k = 4096 every candidate
    is taken and the shorter tokens' rows end in -1. Random keys, and one
    key everywhere: a single tie of 3100 to 4096 keys, more than the CUDA
    select ranks within a bin, so its radix passes and its bitonic sort in
    shared memory order them (k = 4096: the sort of every candidate)."""
    rng = np.random.default_rng(47)
    st = make_state(rng, R=2, max_context=16384)
    st = with_random_blocks(rng, st, 2)
    slot = np.array([0, 1, 0], np.int32)
    pos = np.array([16000, 12399, 16383], np.int32)          # 4000, 3100, 4096 entries
    q, w = queries(rng, 3)
    for state in (st, few_distinct_keys(rng, st, n_distinct=1)):
        want_all, _ = expected(state, 1, slot, pos, q, w, 4096, q_format)
        for k in (3000, 4096):
            got = np.asarray(run(state, 1, slot, pos, q, w, k, impl, return_state=False,
                                 q_format=q_format))
            np.testing.assert_array_equal(got, want_all[:, :k], err_msg=f"k={k}")
        assert (want_all[1] >= 0).sum() == 3100 and np.all(want_all[2] >= 0)


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
