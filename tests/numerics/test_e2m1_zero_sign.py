"""The sign of a zero e2m1 code (docs/design/formats.md): the sign bit follows the
input's, so -0 and a negative value that rounds to magnitude 0 give code 8,
+0 and a positive one code 0 (the rounding of ml_dtypes' float4_e2m1fn and
of the e2m1 conversion DeepSeek-V4's fp4_act_quant kernel casts with). Pinned
for the encoders (jnp reference, the shared header on the CPU and on the GPU),
for indexer keys as flush writes them (every implementation: on CUDA the
flush kernel's encoding), and for the scores, which must not depend on it."""
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dsv4_jax as D
from dsv4_jax import _ffi
from dsv4_jax.reference import indexer as RI, quant as Q

from support.marks import every_impl

F32, U8 = np.float32, np.uint8
E2M1, BF16 = ml_dtypes.float4_e2m1fn, ml_dtypes.bfloat16


def _numerics(module):
    try:
        return __import__(f"dsv4_jax.{module}", fromlist=["numerics"]).numerics
    except ImportError:
        return None


cpu_num = _numerics("_dsv4_testing_cpu")
needs_cpu_num = pytest.mark.skipif(cpu_num is None,
                                   reason=f"test-only module not built ({_ffi.TESTING_BUILD})")


# ---- the encoders ---------------------------------------------------------------------
def every_bf16_in_blocks():
    """Every finite bf16 value in MXFP4 blocks of 32 at eleven block scales:
    31 values of magnitude <= the block's anchor 6 * 2^k, then the anchor
    (which sets the scale byte to 127 + k)."""
    v = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).view(BF16).astype(F32)
    v = v[np.isfinite(v)]
    rows = []
    for k in (-126, -100, -50, -20, -5, 0, 5, 20, 50, 100, 125):
        anchor = F32(6.0 * 2.0 ** k)
        mine = v[np.abs(v) <= anchor]
        pad = -len(mine) % 31
        mine = np.concatenate([mine, np.zeros(pad, F32)]).reshape(-1, 31)
        rows.append(np.concatenate([mine, np.full((len(mine), 1), anchor, F32)], axis=1))
    rows = np.concatenate(rows)
    rows = np.concatenate([rows, np.zeros((-len(rows) % 4, 32), F32)])   # whole keys of 4 blocks
    return np.ascontiguousarray(rows)


def ml_dtypes_codes(x):
    """clip(x / s, +-6) cast by ml_dtypes, s = the smallest power of two >=
    amax / 6 (amax floored at 6 * 2^-126), in float64 (x / s exact)."""
    amax = np.maximum(np.abs(x).max(1, keepdims=True), 6.0 * 2.0 ** -126).astype(np.float64)
    s = 2.0 ** np.ceil(np.log2(amax / 6))
    return np.clip(x / s, -6, 6).astype(E2M1).view(U8)


BLOCKS = every_bf16_in_blocks()
WANT = ml_dtypes_codes(BLOCKS)


def test_oracle_keeps_the_sign_of_zero():
    x = np.float64([[-0.0, 0.0, -1e-3, 1e-3, -0.25, 0.25, -0.2501] + [0] * 24 + [6]])
    assert ml_dtypes_codes(x)[0, :7].tolist() == [8, 0, 8, 0, 8, 0, 9]
    assert np.sum((WANT == 8) & (BLOCKS < 0)) > 10000     # many negatives round to -0


def test_reference_encoder_every_bf16():
    codes, _ = jax.jit(Q.mxfp4_codes)(jnp.asarray(BLOCKS.reshape(-1, 128), jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(codes).reshape(BLOCKS.shape), WANT)


@needs_cpu_num
def test_header_encoder_every_bf16():
    codes, scales = np.empty(BLOCKS.shape, U8), np.empty(len(BLOCKS), U8)
    cpu_num.mxfp4_blocks(BLOCKS, codes, scales)
    np.testing.assert_array_equal(codes, WANT)


@pytest.mark.gpu
def test_header_encoder_every_bf16_on_the_gpu():
    gpu = _numerics("_dsv4_testing_cuda")
    if gpu is None:
        pytest.skip(f"_dsv4_testing_cuda not built ({_ffi.TESTING_BUILD}, nvcc found)")
    try:
        codes, scales = np.empty(BLOCKS.shape, U8), np.empty(len(BLOCKS), U8)
        gpu.mxfp4_blocks(BLOCKS, codes, scales)
    except RuntimeError as e:
        pytest.skip(f"no usable GPU: {e}")
    np.testing.assert_array_equal(codes, WANT)
    # the query operand of the mxfp4 score: an integer, so -0 and +0 are both 0
    y = F32([-0.0, 0.0, -0.2, 0.2, -0.25, 0.25])
    out = np.empty(y.shape, np.int8)
    gpu.index_query_operand(y, out)
    assert out.tolist() == [0, 0, 0, 0, 0, 0]


@needs_cpu_num
def test_query_operand_has_no_signed_zero():
    y = F32([-0.0, 0.0, -0.2, 0.2, -0.25, 0.25, -0.26])
    out = np.empty(y.shape, np.int8)
    cpu_num.index_query_operand(y, out)
    assert out.tolist() == [0, 0, 0, 0, 0, 0, -1]
    q = np.zeros((64, 128), F32)
    q[:, 0] = 6.0
    q[:, 1], q[:, 2] = -1e-3, -0.0                        # codes 8, as int8 0
    q2, _ = RI.query_mxfp4(jnp.asarray(q, jnp.bfloat16))
    assert np.all(np.asarray(q2)[:, 1:3] == 0)


# ---- keys as flush writes them --------------------------------------------------------
def crafted_flush_inputs():
    """One CSA entry (window 0 of slot 0) whose indexer key is known exactly.
    Token 0's score is 0 and tokens 1-3 score -1000, so the softmax weights
    are exactly 1 and 0 and the pooled key is token 0's row x. x has the
    squares sum 2 + 4 * 2^-16 (exact in any order), norm 1 and inv_freq 0
    (RoPE the identity), so every implementation's bf16 key is x * B with
    the same B, and the Hadamard output of channel j (bits j0, j1, j2) is
        2B h             for j0 = 0
        +0               for j0 = 1, j2 = 0   (exact cancellation)
        -B/64 h, +B/64 h for j0 = 1, j2 = 1, j1 = 0 / 1
    with h = 128^-0.5: in each block amax 2Bh, and +-B/64 h is far below a
    quarter of its scale."""
    x = np.zeros(128, F32)
    x[[0, 1, 3, 6]] = 1.0, 1.0, 2.0 ** -8, 2.0 ** -8
    x[[2, 7]] = -2.0 ** -8
    T = 4
    rng = np.random.default_rng(3)
    ikv = rng.standard_normal((T, 256)).astype(F32)
    ikv[0, 128:] = x                              # the b half pools into entry 0
    isc = np.zeros((T, 256), F32)
    isc[1:, 128:] = -1000.0
    main = dict(kv=rng.standard_normal((T, 1024)).astype(F32),
                score=rng.standard_normal((T, 1024)).astype(F32))
    idx = D.CompressorParams(jnp.zeros((4, 256), jnp.float32), jnp.ones(128, jnp.float32),
                             jnp.zeros(32, jnp.float32))
    params = D.CompressorParams(jnp.zeros((4, 1024), jnp.float32), jnp.ones(512, jnp.float32),
                                jnp.zeros(32, jnp.float32), idx)
    return ikv, isc, main, params


def expected_key_codes():
    j = np.arange(128)
    b0, b1, b2 = j & 1, (j >> 1) & 1, (j >> 2) & 1
    # 2Bh / s = 5.66 rounds to 6 (code 7): B = bf16(8 * (1 - 1e-6 ...)) = 8,
    # amax = bf16(16 h) = 1.4140625, s = 2^-2
    return np.where(b0 == 0, 7, np.where((b2 == 1) & (b1 == 0), 8, 0)).astype(U8)


@every_impl
def test_flush_writes_the_sign_of_zero():
    cfg = D.CacheConfig.tiny(max_requests=2, max_context=512)
    st = D.init_state(cfg)
    bt = np.full((2, cfg.max_blocks_per_request), -1, np.int32)
    bt[0, 0] = 5
    st = dataclasses.replace(st, block_table=jnp.asarray(bt))
    ikv, isc, main, params = crafted_flush_inputs()
    meta = D.StepMeta.build(token_slot=np.zeros(4, np.int32), token_pos=np.arange(4, dtype=np.int32),
                            lengths=np.zeros(2, np.int32))
    st = jax.jit(lambda st: D.flush(st, 1, meta, jnp.asarray(main["kv"]),
                                    jnp.asarray(main["score"]), params,
                                    index_kv=jnp.asarray(ikv), index_score=jnp.asarray(isc)))(st)
    assert not np.asarray(st.errors).any()
    packed = np.asarray(st.csa.index.packed)[0, 5, 0]
    codes = np.stack([packed & 15, packed >> 4], -1).reshape(128)
    np.testing.assert_array_equal(np.asarray(st.csa.index.scale).view(U8)[0, 5, 0], [125] * 4)
    np.testing.assert_array_equal(codes, expected_key_codes())


# ---- scores ---------------------------------------------------------------------------
@pytest.mark.parametrize("q_format", ["bf16", "mxfp4"])
@every_impl
def test_scores_ignore_the_sign_of_zero(q_format):
    """Entry 2m + 1 is entry 2m with the sign bit of every zero code flipped:
    their scores tie, so each pair comes out adjacent, the lower index first."""
    rng = np.random.default_rng(17)
    cfg = D.CacheConfig.tiny(max_requests=1, max_context=512)
    st = D.init_state(cfg)
    Lc, N = st.csa.index.packed.shape[:2]
    codes = rng.integers(0, 16, (Lc, N, 32, 128)).astype(U8)
    codes[rng.random(codes.shape) < 0.3] &= 8                 # many zero codes of both signs
    zero = (codes & 7) == 0
    codes[:, :, 1::2] = np.where(zero[:, :, 0::2], codes[:, :, 0::2] ^ 8, codes[:, :, 0::2])
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scale = rng.integers(119, 132, (Lc, N, 32, 4)).astype(U8)
    scale[:, :, 1::2] = scale[:, :, 0::2]
    keys = D.IndexerKeys(jnp.asarray(packed), jnp.asarray(scale.view(ml_dtypes.float8_e8m0fnu)))
    bt = jnp.asarray(np.arange(4, dtype=np.int32)[None])
    st = dataclasses.replace(st, block_table=bt, csa=dataclasses.replace(st.csa, index=keys))
    q = rng.standard_normal((2, 64, 128)).astype(BF16)
    w = rng.standard_normal((2, 64)).astype(F32)
    got = np.asarray(D.indexer_topk(st, 3, jnp.zeros(2, jnp.int32), jnp.int32([511, 300]),
                                    jnp.asarray(q), jnp.asarray(w), 128, q_format=q_format, return_state=False))
    for row, n in zip(got, (128, 75)):
        assert sorted(row[:n]) == list(range(n)) and np.all(row[n:] == -1)
        place = np.argsort(row[:n])
        for m in range(0, n - 1, 2):
            assert place[m + 1] == place[m] + 1, (m, row[:n])


# ---- what a comparison of two runs allows ---------------------------------------------
def test_run_comparison_takes_zero_codes_of_either_sign_as_one_value():
    """Two runs round through the same encoders, but their values may differ
    by rounding noise (RoPE's sinf/cosf, reduction orders); a value near zero
    then keeps its magnitude code 0 and may change sign. The demo's check
    (workload.compare_states) counts that as a flip, like a one-step one, and
    fails two steps."""
    from dsv4_jax.app.workload import within_one_step
    a = np.uint8([0, 8, 9, 0, 1, 8, 0x00, 0x80, 0x81, 0x01])
    b = np.uint8([8, 0, 0, 9, 9, 1, 0x80, 0x01, 0x00, 0x81])
    sign = np.array([8] * 6 + [0x80] * 4)
    got = [bool(within_one_step(np.uint8([x]), np.uint8([y]), s)[0]) for x, y, s in zip(a, b, sign)]
    assert got == [True, True, True, True, False, True, True, True, True, False]
