"""indexer_topk's scores bit for bit: the reference's and the handlers'
(their scratch of rank keys) against the numpy float32 replay of the
documented order in both q formats, across the fast form's guards and large
key scales, and the CUDA handler against the reference on the host CPU."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4_jax import _ffi

from support import npq
from support.indexer import (E2M1, IMPLS, Q_FORMATS, expected, handler_scratch, host_keys,
                             make_state, needs_cpu_target, np_rank_keys, oracle_f64, queries,
                             replay_f32, replay_f32_mxfp4, run, visible, with_index_keys,
                             with_random_blocks, workload)
from support.marks import CUDA, requires_cpu_ffi


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
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("context, k", [(1024, 512), (4096, 16)])
def test_overflowing_products(impl, q_format, context, k):
    """Key scale bytes 254 on a third of the entries and a large q: block
    products overflow alone (+-inf before they are added, never fused into
    an FMA that keeps them finite), so scores are +inf, -inf or NaN (inf -
    inf, ranked as -inf) beside finite ones. Every entry is taken at 1024
    (E = 256 < k: the order of the -inf and NaN tail counts); at 4096 the
    first 16 of the +inf ties, by index."""
    rng = np.random.default_rng(context + k)
    B = 3
    st = with_random_blocks(rng, make_state(rng, R=B, max_context=context), B)
    scale = np.array(st.csa.index.scale.view(np.uint8))
    scale[rng.random(scale.shape[:3]) < 0.3] = 254
    st = with_index_keys(st, scale=scale)
    q, w = queries(rng, B, qscale=1e4)
    slot, pos = np.arange(B), np.full(B, context - 1)
    with np.errstate(over="ignore", invalid="ignore"):
        want, _ = expected(st, 1, slot, pos, q, w, k, q_format)
    got = np.asarray(run(st, 1, slot, pos, q, w, k, impl, return_state=False, q_format=q_format))
    np.testing.assert_array_equal(got, want)
