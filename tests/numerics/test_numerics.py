"""ffi/include/dsv4/numerics.h against independent numpy / ml_dtypes
computations, bit for bit where the header promises bits (docs/design/formats.md)."""
import ml_dtypes
import numpy as np
import pytest

from dsv4_jax import _ffi

num = pytest.importorskip("dsv4_jax._dsv4_testing_cpu",
                          reason=f"test-only module not built ({_ffi.TESTING_BUILD})").numerics

F32, U8 = np.float32, np.uint8
E4M3, E8M0, E2M1, BF16 = (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e8m0fnu,
                          ml_dtypes.float4_e2m1fn, ml_dtypes.bfloat16)
rng = np.random.default_rng(20261122)


def call(fn, x, out_dtype, *extra):
    x = np.ascontiguousarray(x)
    out = np.empty(x.shape, out_dtype)
    fn(x, *extra, out)
    return out


def random_f32(n, lo=-40, hi=40):
    """Random signs, mantissas and exponents 2^lo .. 2^hi."""
    return (rng.choice([-1, 1], n) * rng.uniform(1, 2, n) * 2.0 ** rng.integers(lo, hi, n)).astype(F32)


def bf16_values(x):
    return np.asarray(x, F32).astype(BF16).astype(F32)


def pow2ceil_byte(r):
    """Smallest power of two >= r as an e8m0 byte, from frexp in float64."""
    r = np.asarray(r, np.float64)
    out = np.empty(r.shape, np.int64)
    for i, v in np.ndenumerate(r):
        if np.isnan(v) or v > 2.0 ** 127:
            out[i] = 254
        elif v <= 2.0 ** -127:
            out[i] = 0
        else:
            m, e = np.frexp(v)            # v = m * 2^e, m in [0.5, 1)
            out[i] = (e - 1 if m == 0.5 else e) + 127
    return out.astype(U8)


# ---- scalar formats --------------------------------------------------------------

def test_bf16_rounding_matches_ml_dtypes():
    x = np.concatenate([random_f32(20000, -130, 120), np.array(
        [0.0, -0.0, np.inf, -np.inf, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 3.0e38, 1e-40], F32)])
    got = call(num.bf16_bits, x, np.uint16)
    np.testing.assert_array_equal(got, x.astype(BF16).view(np.uint16))
    nan = call(num.bf16_bits, np.array([np.nan, -np.nan], F32), np.uint16)
    assert np.isnan(nan.view(BF16).astype(F32)).all()


def test_e4m3_decode_all_codes():
    codes = np.arange(256, dtype=U8)
    got = call(num.e4m3_decode, codes, F32)
    want = codes.view(E4M3).astype(F32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


def test_e4m3_encode_matches_ml_dtypes_within_range():
    finite = np.arange(256, dtype=U8).view(E4M3).astype(F32)
    finite = np.unique(finite[np.isfinite(finite)])
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(F32)   # exact ties
    x = np.concatenate([random_f32(20000, -14, 9), finite, mids, -mids,
                        np.nextafter(mids, F32(np.inf)), np.nextafter(mids, F32(-np.inf)),
                        np.array([0.0, -0.0, 2 ** -10, 2 ** -11, -(2 ** -12), 1e-30], F32)])
    x = np.clip(x, -448, 448)
    got = call(num.e4m3_encode, x, U8)
    np.testing.assert_array_equal(got, x.astype(E4M3).view(U8))


def test_e4m3_encode_saturates_and_keeps_nan():
    x = np.array([448.0, 449.0, 464.0, 1e6, np.inf, -500.0, -np.inf, np.nan, -0.0], F32)
    got = call(num.e4m3_encode, x, U8)
    assert list(got[:7]) == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE]
    assert got[7] & 0x7F == 0x7F
    assert got[8] == 0x80


def test_e8m0_pow2ceil_exact():
    pows = (2.0 ** np.arange(-126, 128)).astype(F32)
    x = np.concatenate([np.abs(random_f32(20000, -126, 127)), pows,
                        np.nextafter(pows, F32(np.inf)), np.nextafter(pows, F32(0)),
                        np.array([0.0, 1e-45, 2 ** -127, 3e-39, 3.4e38, np.inf, np.nan], F32)])
    got = call(num.e8m0_pow2ceil, x, U8)
    np.testing.assert_array_equal(got, pow2ceil_byte(x))
    assert (got != 0xFF).all()
    # the decoded scale is >= r and less than 2r (in range)
    s = call(num.e8m0_decode, got, F32).astype(np.float64)
    inside = (x > 2.0 ** -126) & (x <= 2.0 ** 127)
    assert (s[inside] >= x[inside]).all() and (s[inside] < 2 * x[inside].astype(np.float64)).all()


def test_e8m0_decode_matches_ml_dtypes():
    codes = np.arange(255, dtype=U8)
    got = call(num.e8m0_decode, codes, F32)
    np.testing.assert_array_equal(got, codes.view(E8M0).astype(F32))


def test_e2m1_design_table():
    # docs/design/formats.md: ties to the even code
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 6.0, 7.0], F32)
    got = call(num.e2m1_decode, call(num.e2m1_encode, x, U8), F32)
    np.testing.assert_array_equal(got, [0, 1, 1, 2, 2, 4, 4, -0.0, -4, 6, 6])
    assert call(num.e2m1_encode, np.array([-0.0], F32), U8)[0] == 8


def test_e2m1_encode_matches_ml_dtypes():
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], F32)
    mids = (grid[:-1] + grid[1:]) / 2
    x = np.concatenate([rng.uniform(-6, 6, 20000).astype(F32), grid, -grid, mids, -mids,
                        np.nextafter(mids, F32(9)), np.nextafter(mids, F32(-9)),
                        np.array([-0.0, 1e-30, -1e-30], F32)])
    got = call(num.e2m1_encode, x, U8)
    np.testing.assert_array_equal(got, x.astype(E2M1).view(U8))
    codes = np.arange(16, dtype=U8)
    np.testing.assert_array_equal(call(num.e2m1_decode, codes, F32), codes.view(E2M1).astype(F32))


def test_index_query_operand_is_twice_the_e2m1_value():
    # the indexer's q operand: twice the e2m1 value of clamp(y, +-6) as an int
    # (NaN -> 0), checked against ml_dtypes' rounding
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], F32)
    mids = (grid[:-1] + grid[1:]) / 2
    y = np.concatenate([rng.uniform(-7, 7, 50000).astype(F32), grid, -grid, mids, -mids,
                        np.nextafter(mids, F32(9)), np.nextafter(mids, F32(-9)),
                        np.nextafter(grid, F32(9)), np.nextafter(grid, F32(-9)),
                        np.array([-0.0, 1e-30, -1e-30, 2 ** -149, 6.5, -100, 3e38,
                                  np.inf, -np.inf, np.nan], F32)])
    got = call(num.index_query_operand, y, np.int8)
    with np.errstate(invalid="ignore"):
        want = np.clip(y, -6, 6).astype(E2M1).astype(F32) * 2
    want = np.where(np.isnan(y), 0, want).astype(np.int8)
    np.testing.assert_array_equal(got, want)
    assert set(np.unique(got)) == {0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12}


# ---- block quantizers ------------------------------------------------------------

def ref_ds_fp8(x):
    """Independent ds_fp8 tile quantizer: numpy f32 arithmetic + ml_dtypes."""
    amax = np.maximum(np.abs(x).max(axis=1), F32(1e-4)).astype(F32)
    byte = pow2ceil_byte((amax / F32(448)).astype(F32))
    s = (2.0 ** (byte.astype(np.float64) - 127)).astype(F32)
    q = np.clip(x / s[:, None], F32(-448), F32(448)).astype(F32)
    return q.astype(E4M3).view(U8), byte


def tiles_with_edges():
    n = 400
    mags = 2.0 ** rng.integers(-20, 12, n)
    x = bf16_values(rng.standard_normal((n, 64)) * mags[:, None])
    x[0] = 0.0                                          # amax 0 -> floor 1e-4
    x[1] = bf16_values(rng.uniform(-5e-5, 5e-5, 64))    # amax < 1e-4
    for k, row in zip(range(-6, 6), range(2, 14)):      # amax exactly 448 * 2^k
        x[row] = bf16_values(rng.uniform(-224, 224, 64) * 2.0 ** k)
        x[row, 7] = -448 * 2.0 ** k
    x[14, :] = -0.0
    x[15, 3] = 448 * 2.0 ** 10 * (1 + 2 ** -7)          # just above a power of two
    return x.astype(F32)


def test_ds_fp8_tile_bit_exact():
    x = tiles_with_edges()
    codes, scales = np.empty(x.shape, U8), np.empty(x.shape[0], U8)
    num.ds_fp8_tiles(x, codes, scales)
    want_codes, want_scales = ref_ds_fp8(x)
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(codes, want_codes)
    # amax = 448 * 2^k maps to scale 2^k and the code of +-448
    for k, row in zip(range(-6, 6), range(2, 14)):
        assert scales[row] == 127 + k and codes[row, 7] == 0xFE
    assert scales[0] == pow2ceil_byte(np.float32(1e-4) / np.float32(448))
    # dequantized values: exact in bf16 and within half an fp8 step of x
    deq = codes.view(E4M3).astype(np.float64) * 2.0 ** (scales.astype(np.float64) - 127)[:, None]
    assert (bf16_values(deq) == deq).all()
    step = 2.0 ** (scales.astype(np.float64) - 127)[:, None] * np.maximum(
        2.0 ** np.floor(np.log2(np.maximum(np.abs(x) / 2.0 ** (scales.astype(np.float64) - 127)[:, None], 2 ** -6))) / 8, 2 ** -9)
    assert (np.abs(deq - x) <= step / 2 * (1 + 1e-9)).all()


def test_quantizers_never_make_nan_scales():
    x = tiles_with_edges()[:20].copy()
    x[0, 0], x[1, 5], x[2, 9], x[3, 0] = np.nan, np.inf, -np.inf, np.nan
    x[3, 1] = np.inf
    codes, scales = np.empty(x.shape, U8), np.empty(x.shape[0], U8)
    num.ds_fp8_tiles(x, codes, scales)
    assert (scales != 0xFF).all()
    xm = np.ascontiguousarray(x[:, :32])
    c4, s4 = np.empty(xm.shape, U8), np.empty(xm.shape[0], U8)
    num.mxfp4_blocks(xm, c4, s4)
    assert (s4 != 0xFF).all()
    # a NaN is ignored by amax: row 0 keeps the scale of its finite values
    finite = np.ascontiguousarray(np.where(np.isnan(x[:1]), 0, x[:1]))
    c, s = np.empty(finite.shape, U8), np.empty(1, U8)
    num.ds_fp8_tiles(finite, c, s)
    assert s[0] == scales[0]


def test_fp8_token_bit_exact():
    n = 50
    x = bf16_values(rng.standard_normal((n, 448)) * 2.0 ** rng.integers(-12, 10, n)[:, None])
    x[0] = 0.0
    x[1, 100] = 448.0
    codes, scales = np.empty(x.shape, U8), np.empty(n, F32)
    num.fp8_token(x, codes, scales)
    amax = np.maximum(np.abs(x).max(axis=1), F32(1e-4)).astype(F32)
    want_s = (amax / F32(448)).astype(F32)
    np.testing.assert_array_equal(scales, want_s)
    want_c = np.clip(x / want_s[:, None], F32(-448), F32(448)).astype(F32).astype(E4M3).view(U8)
    np.testing.assert_array_equal(codes, want_c)
    assert scales[0] == F32(1e-4) / F32(448) and (codes[0] == 0).all()


def ref_mxfp4(x):
    amax = np.maximum(np.abs(x).max(axis=1), F32(6 * 2.0 ** -126)).astype(F32)
    byte = pow2ceil_byte((amax / F32(6)).astype(F32))
    s = (2.0 ** (byte.astype(np.float64) - 127)).astype(F32)
    q = np.clip(x / s[:, None], F32(-6), F32(6)).astype(F32)
    return q.astype(E2M1).view(U8), byte


def test_mxfp4_bit_exact_and_packing():
    n = 300
    x = bf16_values(rng.standard_normal((n, 32)) * 2.0 ** rng.integers(-30, 20, n)[:, None])
    x[0] = 0.0
    x[1] = bf16_values(rng.uniform(-3, 3, 32))
    x[1, :8] = [6.0, 0.75 * 1, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25]   # ties at scale 1
    x[2] = 1e-39                                                  # below the amax floor
    x[3] = bf16_values(rng.uniform(-3, 3, 32) * 2.0 ** 7)
    x[3, 0] = 6 * 2.0 ** 7                                        # amax exactly 6 * 2^k
    codes, scales = np.empty(x.shape, U8), np.empty(n, U8)
    num.mxfp4_blocks(x, codes, scales)
    wc, ws = ref_mxfp4(x)
    np.testing.assert_array_equal(scales, ws)
    np.testing.assert_array_equal(codes, wc)
    assert scales[1] == 127 and scales[3] == 127 + 7 and scales[0] == 1   # 2^-126
    assert list(codes[1, :8].view(E2M1).astype(F32)) == [6, 1, 1, 2, 2, 4, 4, -0.0]
    # packed keys: element 2j in the low nibble
    keys = np.ascontiguousarray(x[:296].reshape(-1, 128))
    packed, kscales = np.empty((len(keys), 64), U8), np.empty((len(keys), 4), U8)
    num.index_keys(keys, packed, kscales)
    np.testing.assert_array_equal(kscales.reshape(-1), scales[:296])
    unpacked = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(-1, 32)
    np.testing.assert_array_equal(unpacked, codes[:296])


# ---- online softmax ------------------------------------------------------------------

def test_softmax_merge_matches_two_pass():
    n, length = 64, 12
    z = rng.normal(0, 5, (n, length)).astype(F32)
    v = rng.normal(0, 1, (n, length)).astype(F32)
    acc = np.tile(np.array([-np.inf, 0, 0], F32), (n, 1))
    for j in range(length):
        acc = call(num.softmax_merge, acc, F32, np.stack([z[:, j], np.ones(n, F32), v[:, j]], 1))
    # also a split merge: two halves folded separately then merged
    left = np.tile(np.array([-np.inf, 0, 0], F32), (n, 1))
    right = left.copy()
    for j in range(length // 2):
        left = call(num.softmax_merge, left, F32, np.stack([z[:, j], np.ones(n, F32), v[:, j]], 1))
    for j in range(length // 2, length):
        right = call(num.softmax_merge, right, F32, np.stack([z[:, j], np.ones(n, F32), v[:, j]], 1))
    both = call(num.softmax_merge, left, F32, right)
    z64 = z.astype(np.float64)
    w = np.exp(z64 - z64.max(1, keepdims=True))
    want = (w * v).sum(1) / w.sum(1)
    for a in (acc, both):
        got = np.empty(n, F32)
        num.softmax_finalize(np.ascontiguousarray(a), got)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
        np.testing.assert_array_equal(a[:, 0], z.max(1))


def test_softmax_merge_empty_sides():
    empty = np.array([[-np.inf, 0, 0]], F32)
    x = np.array([[1.5, 2.0, -3.0]], F32)
    assert np.array_equal(call(num.softmax_merge, empty, F32, empty), empty)
    np.testing.assert_array_equal(call(num.softmax_merge, empty, F32, x), x)
    np.testing.assert_array_equal(call(num.softmax_merge, x, F32, empty), x)
    out = np.empty(1, F32)
    num.softmax_finalize(empty, out)
    assert out[0] == 0.0


# ---- RMSNorm, RoPE, Hadamard -------------------------------------------------------------

def test_rmsnorm_close_to_float64():
    d = 512
    x = bf16_values(rng.standard_normal((40, d)) * 3)
    w = rng.uniform(0.5, 1.5, d).astype(F32)
    got = call(num.rmsnorm, x, F32, w)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, want, rtol=3e-6, atol=1e-7)


def test_rope_rotates_pairs():
    n = 30
    x = bf16_values(rng.standard_normal((n, 64)))
    pos = rng.integers(0, 1 << 20, n).astype(np.int64)
    inv_freq = (1.0 / 160000.0 ** (np.arange(32) / 32)).astype(F32)
    out = np.empty_like(x)
    num.rope(x, pos, inv_freq, out)
    ang = (pos.astype(F32)[:, None] * inv_freq[None, :]).astype(F32).astype(np.float64)
    x0, x1 = x[:, 0::2].astype(np.float64), x[:, 1::2].astype(np.float64)
    c, s = np.cos(ang), np.sin(ang)
    np.testing.assert_allclose(out[:, 0::2], x0 * c - x1 * s, atol=2e-6)
    np.testing.assert_allclose(out[:, 1::2], x0 * s + x1 * c, atol=2e-6)
    # the norm of each pair is kept
    np.testing.assert_allclose(out[:, 0::2] ** 2 + out[:, 1::2] ** 2, x0 ** 2 + x1 ** 2, rtol=1e-5)


def sylvester(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def test_hadamard_matches_matrix():
    x = bf16_values(rng.standard_normal((50, 128)))
    got = call(num.hadamard128, x, F32)
    want = x.astype(np.float64) @ sylvester(128).T * 128 ** -0.5
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # applied twice it is the identity (H/sqrt(n) is orthogonal and symmetric)
    np.testing.assert_allclose(call(num.hadamard128, got, F32), x, atol=1e-5)


def test_epilogue_order():
    """pooled -> bf16 -> RMSNorm -> bf16 -> RoPE(trailing 64) -> bf16, as
    numpy composing the header's own pieces would."""
    d = 512
    pooled = (rng.standard_normal((6, d)) * 2).astype(F32)
    norm = rng.uniform(0.5, 1.5, d).astype(F32)
    inv_freq = (1.0 / 160000.0 ** (np.arange(32) / 32)).astype(F32)
    pos = np.array([0, 4, 8, 128, 4096, 65532], np.int64)
    got = np.empty_like(pooled)
    num.epilogue(pooled, norm, inv_freq, pos, got, False)
    y = bf16_values(call(num.rmsnorm, bf16_values(pooled), F32, norm))
    rope = np.empty((6, 64), F32)
    num.rope(np.ascontiguousarray(y[:, -64:]), pos, inv_freq, rope)
    y[:, -64:] = bf16_values(rope)
    np.testing.assert_array_equal(got, y)
    assert (bf16_values(got) == got).all()
    # the indexer path adds the Hadamard product, rounded to bf16
    ipooled = np.ascontiguousarray(pooled[:, :128])
    inorm = np.ascontiguousarray(norm[:128])
    igot = np.empty_like(ipooled)
    num.epilogue(ipooled, inorm, inv_freq, pos, igot, True)
    base = np.empty_like(ipooled)
    num.epilogue(ipooled, inorm, inv_freq, pos, base, False)
    np.testing.assert_array_equal(igot, bf16_values(call(num.hadamard128, base, F32)))
