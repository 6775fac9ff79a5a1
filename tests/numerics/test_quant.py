"""Bit-level storage formats (docs/design/formats.md): the jnp quantizers against ml_dtypes
and the numpy oracle, and hand-checked edge cases."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4_jax.reference import quant as Q
from support.oracle import bits, decode_kv, decode_mxfp4, encode_kv, encode_mxfp4

E4M3 = ml_dtypes.float8_e4m3fn
jit = jax.jit


def _e4m3_candidates():
    grid = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid)])
    mid = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
    rng = np.random.default_rng(0)
    return np.concatenate([
        grid, mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf)),
        rng.uniform(-460, 460, 50000).astype(np.float32),
        (rng.standard_normal(50000) * np.exp2(rng.integers(-14, 4, 50000))).astype(np.float32),
        np.float32([449, 464, 480, 1e30, -449, -1e30, 2.0 ** -10, 2.0 ** -11 * 3, -0.0])])


def test_e4m3_rounding_matches_ml_dtypes():
    v = _e4m3_candidates()
    want = bits(np.clip(v, -448, 448).astype(E4M3))
    got = np.asarray(jit(Q.e4m3_codes)(v))
    np.testing.assert_array_equal(got, want)


def test_e4m3_edges():
    v = np.float32([448, 500, -1e30, -0.0, 0.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 464])
    got = np.asarray(jit(Q.e4m3_codes)(v))
    # saturation to 0x7E, sign of zero kept, smallest subnormal, ties to even
    # (2^-10 is half of the smallest subnormal -> 0; 3*2^-10 = 1.5 steps -> 2 steps)
    assert got.tolist() == [0x7E, 0x7E, 0xFE, 0x80, 0x00, 0x01, 0x00, 0x02, 0x7E]


def test_pow2_ceil_exponent_against_frexp():
    rng = np.random.default_rng(1)
    r = np.concatenate([np.exp2(rng.integers(-126, 127, 2000)).astype(np.float32),
                        (rng.uniform(0.5, 1, 5000) * np.exp2(rng.integers(-120, 120, 5000))
                         ).astype(np.float32)])
    r = np.concatenate([r, np.nextafter(r, np.float32(np.inf))])
    got = np.asarray(jit(Q.pow2_ceil_exponent)(r))
    mant, exp = np.frexp(r.astype(np.float64))
    want = np.where(mant == 0.5, exp - 1, exp) + 127
    np.testing.assert_array_equal(got, want)


def _random_entries(rng, n):
    """bf16 [n, 512] with per-tile magnitudes from 2^-20 (below the 1e-4
    floor) to 2^8, and a few hand-made tiles."""
    x = rng.standard_normal((n, 512)) * np.exp2(rng.integers(-20, 9, (n, 8)))[:, np.repeat(
        np.arange(8), 64)]
    x = x.astype(np.float32).astype(ml_dtypes.bfloat16)
    x[0, :64] = 0                                    # all-zero tile
    for k, row in zip((-3, 0, 5), (1, 2, 3)):       # amax exactly 448 * 2^k
        x[row, 10] = 448 * 2.0 ** k
        x[row, :10] = 0.5 * 448 * 2.0 ** k
    nxt = np.nextafter(np.float32(448), np.float32(1e9))
    x[4, 70] = np.float32(ml_dtypes.bfloat16(448 * 1.01))   # just above 448 * 2^0
    del nxt
    x[5, 130] = -(448 * 2.0 ** 3)                    # negative amax
    x[6, :448] = 0                                   # all-zero nope (fp8_token)
    return x


@pytest.mark.parametrize("fmt", ["ds_fp8", "fp8_token", "bf16"])
def test_kv_formats_match_oracle(fmt):
    rng = np.random.default_rng(2)
    x = _random_entries(rng, 300)
    got = jit(lambda a: Q.quantize_kv(a, fmt))(jnp.asarray(x))
    want = encode_kv(x, fmt)
    np.testing.assert_array_equal(bits(np.asarray(got.nope)), want["nope"])
    np.testing.assert_array_equal(bits(np.asarray(got.rope)), want["rope"])
    if fmt == "bf16":
        assert got.scale is None
    else:
        np.testing.assert_array_equal(bits(np.asarray(got.scale)), want["scale"])
    back = jit(lambda e: Q.dequantize_kv(e, fmt))(got)
    np.testing.assert_array_equal(bits(np.asarray(back)), bits(decode_kv(want, fmt)))
    if fmt == "bf16":
        np.testing.assert_array_equal(bits(np.asarray(back)), bits(x))


def test_ds_fp8_hand_checked_scales():
    rng = np.random.default_rng(3)
    x = _random_entries(rng, 8)
    q = jit(lambda a: Q.quantize_kv(a, "ds_fp8"))(jnp.asarray(x))
    scale = bits(np.asarray(q.scale)).astype(int)
    nope = bits(np.asarray(q.nope))
    floor_byte = 127 - 22          # 1e-4 / 448 = 2.2e-7 -> 2^-22
    assert scale[0, 0] == floor_byte and not nope[0, :64].any()
    for k, row in zip((-3, 0, 5), (1, 2, 3)):
        assert scale[row, 0] == 127 + k              # amax = 448 * 2^k -> s = 2^k exactly
        assert nope[row, 10] == 0x7E                 # the max maps to 448 exactly
        assert nope[row, 0] == 0x76                  # 224 = 1.75 * 2^7
    assert scale[4, 1] == 128                        # amax just above 448 -> s = 2
    assert scale[5, 2] == 130 and nope[5, 130] == 0xFE
    # dequantized ds_fp8 equals the quantize-dequantize value exactly
    back = np.asarray(Q.dequantize_kv(q, "ds_fp8")).astype(np.float64)
    s = np.exp2(scale - 127.0)
    codes = nope.view(E4M3).astype(np.float64).reshape(8, 7, 64)
    np.testing.assert_array_equal(back[:, :448], (codes * s[..., None]).reshape(8, 448))


def test_fp8_token_zero_entry_has_finite_scale():
    x = np.zeros((2, 512), ml_dtypes.bfloat16)
    x[1, 448:] = 1.5
    q = Q.quantize_kv(jnp.asarray(x), "fp8_token")
    s = np.asarray(q.scale)
    assert np.all(s == np.float32(1e-4) / np.float32(448))
    assert not bits(np.asarray(q.nope)).any()
    back = np.asarray(Q.dequantize_kv(q, "fp8_token")).astype(np.float32)
    assert np.all(back[:, :448] == 0) and np.all(back[1, 448:] == 1.5)


def test_e2m1_ties_and_edges():
    v = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -2.5, -5, -0.0, 0.0,
                    0.2500001, 7, -100, 6, -6, 0.5, 3, 4])
    got = np.asarray(jit(Q.e2m1_codes)(v)).tolist()
    assert got == [0, 2, 2, 4, 4, 6, 6, 8, 12, 14, 8, 0, 1, 7, 15, 7, 15, 1, 5, 6]
    want = bits(np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn)).tolist()
    assert got == want


def test_e2m1_dense_against_ml_dtypes():
    rng = np.random.default_rng(4)
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
    mids = (grid[:-1] + grid[1:]) / 2
    v = np.concatenate([grid, mids, np.nextafter(mids, 9), np.nextafter(mids, -9),
                        rng.uniform(-8, 8, 20000).astype(np.float32)])
    v = np.concatenate([v, -v]).astype(np.float32)
    got = np.asarray(jit(Q.e2m1_codes)(v))
    np.testing.assert_array_equal(got, bits(np.clip(v, -6, 6).astype(ml_dtypes.float4_e2m1fn)))


def test_mxfp4_matches_oracle():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((200, 128)) * np.exp2(rng.integers(-30, 30, (200, 4)))[:, np.repeat(
        np.arange(4), 32)]
    x = x.astype(np.float32).astype(ml_dtypes.bfloat16)
    x[0] = 0                                            # floor: scale byte 1, codes 0
    x[1, :32] = 6.0                                     # amax 6 -> s = 1 exactly
    x[1, 32:64] = -0.0
    x[2, :] = ml_dtypes.bfloat16(1e38)                  # huge: the byte stays < 0xFF
    packed, scale = jit(Q.quantize_mxfp4)(jnp.asarray(x))
    want = encode_mxfp4(x)
    np.testing.assert_array_equal(np.asarray(packed), want["packed"])
    np.testing.assert_array_equal(bits(np.asarray(scale)), want["scale"])
    sb = bits(np.asarray(scale))
    assert sb[0].tolist() == [1, 1, 1, 1] and sb[1, 0] == 127 and sb.max() < 0xFF
    p = np.asarray(packed)
    assert np.all(p[1, :16] == 0x77)                    # 6.0 = code 7, two per byte
    assert np.all(p[1, 16:32] == 0x88)                  # -0.0 keeps its sign
    back = np.asarray(jit(Q.dequantize_mxfp4)(packed, scale))
    np.testing.assert_array_equal(back, decode_mxfp4(want).astype(np.float32))


def test_mxfp4_nibble_order():
    x = np.zeros((1, 128), ml_dtypes.bfloat16)
    x[0, 0], x[0, 1], x[0, 31] = 6.0, 0.5, -1.0       # block scale 1
    packed, scale = Q.quantize_mxfp4(jnp.asarray(x))
    p = np.asarray(packed)[0]
    assert p[0] == 0x17                                 # element 0 low nibble, element 1 high
    assert p[15] == 0xA0                                # element 31 = -1.0 -> code 0xA, high nibble


try:
    from hypothesis import given, settings, strategies as st
    from hypothesis.extra import numpy as hnp
except ImportError:     # pragma: no cover
    given = None

if given is not None:
    _finite_bf16 = st.floats(allow_nan=False, allow_infinity=False, width=32)

    @settings(max_examples=40, deadline=None)
    @given(hnp.arrays(np.float32, (4, 512), elements=_finite_bf16),
           st.sampled_from(["ds_fp8", "fp8_token"]))
    def test_kv_quantizers_any_finite_input(x, fmt):
        """Arbitrary finite bf16 entries (huge, tiny, subnormal, signed zeros)."""
        x = x.astype(ml_dtypes.bfloat16)
        x = np.where(np.isfinite(x.astype(np.float32)), x, ml_dtypes.bfloat16(0))
        got = _quantize_jit(fmt)(jnp.asarray(x))
        want = encode_kv(x, fmt)
        np.testing.assert_array_equal(bits(np.asarray(got.nope)), want["nope"])
        np.testing.assert_array_equal(bits(np.asarray(got.scale)), want["scale"])

    @settings(max_examples=40, deadline=None)
    @given(hnp.arrays(np.float32, (4, 128), elements=_finite_bf16))
    def test_mxfp4_any_finite_input(x):
        x = x.astype(ml_dtypes.bfloat16)
        x = np.where(np.isfinite(x.astype(np.float32)), x, ml_dtypes.bfloat16(0))
        packed, scale = _mxfp4_jit(jnp.asarray(x))
        want = encode_mxfp4(x)
        np.testing.assert_array_equal(np.asarray(packed), want["packed"])
        np.testing.assert_array_equal(bits(np.asarray(scale)), want["scale"])


_JITS = {}


def _quantize_jit(fmt):
    if fmt not in _JITS:
        _JITS[fmt] = jit(lambda a: Q.quantize_kv(a, fmt))
    return _JITS[fmt]


_mxfp4_jit = jit(Q.quantize_mxfp4)


def test_subnormal_inputs_are_not_flushed_to_zero():
    """XLA on the CPU treats subnormal float inputs as zero; the quantizers
    must not (C++/CUDA and docs/design/formats.md keep them). With MXFP4's amax floor of
    6 * 2^-126 the scale is 2^-126, so a bf16 subnormal of 0.9 * 2^-126 is
    code 1.0, not 0. Found by hypothesis in a CI run."""
    rng = np.random.default_rng(11)
    tiny = np.float32(2.0 ** -126)
    x = rng.uniform(0.05, 0.99, (8, 128)).astype(np.float32) * tiny
    x *= rng.choice([-1, 1], x.shape)
    x[0] = 0.92 * tiny                        # the case hypothesis found
    x = x.astype(ml_dtypes.bfloat16)
    assert np.all(np.abs(x.astype(np.float32)) < tiny)      # really subnormal
    packed, scale = _mxfp4_jit(jnp.asarray(x))
    want = encode_mxfp4(x)
    np.testing.assert_array_equal(np.asarray(packed), want["packed"])
    np.testing.assert_array_equal(bits(np.asarray(scale)), bits(want["scale"]))
    assert np.any(np.asarray(packed) & 0x7)   # non-zero codes exist
    for fmt in ("ds_fp8", "fp8_token"):        # e4m3 codes of such values are +-0
        entry = np.zeros((8, 512), ml_dtypes.bfloat16)
        entry[:, :128] = x
        got = _quantize_jit(fmt)(jnp.asarray(entry))
        ref = encode_kv(entry, fmt)
        np.testing.assert_array_equal(bits(np.asarray(got.nope)), bits(ref["nope"]))


def test_times_pow2_is_the_rounded_product_before_an_add():
    """quant.times_pow2 against numpy's float32 product (which is never
    fused into the add after it): normal products, products that overflow
    alone (+-inf, then added to +-inf, finite and NaN values), zero, Inf and
    NaN x. Compiled at XLA's default optimization level, not the suite's 0:
    there XLA on the CPU makes x * f + d one FMA, which gives -inf, not NaN,
    for a finite x whose product overflows to +inf beside d = -inf."""
    rng = np.random.default_rng(5)
    n = 4096
    x = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-60, 128, n)).astype(np.float32)
    x *= rng.choice([-1, 1], n).astype(np.float32)
    x[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 2.0 ** 127, -(2.0 ** 127), 1.5]
    e = rng.integers(-60, 128, n)
    f = np.exp2(e.astype(np.float64)).astype(np.float32)          # normal powers of two
    d = rng.choice([0.0, 1.0, -np.inf, np.inf, np.nan, 3e38], n).astype(np.float32)
    keep = np.abs(x.astype(np.float64) * f) >= 2.0 ** -126      # no subnormal result
    keep |= ~np.isfinite(x) | (x == 0)
    with np.errstate(over="ignore", invalid="ignore"):
        want = x * f + d
        overflow = np.isfinite(x) & np.isinf(x * f) & keep
    step = jax.jit(lambda x, f, d: Q.times_pow2(x, f) + d).lower(x, f, d)
    got = np.asarray(step.compile(compiler_options={"xla_backend_optimization_level": 2})(x, f, d))
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(bits(got[keep & ~nan]), bits(want[keep & ~nan]))
    assert overflow.sum() > 100 and nan[overflow & np.isinf(d)].any()
