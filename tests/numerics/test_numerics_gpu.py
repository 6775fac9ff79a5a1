"""The shared numerics header gives the same bits on the GPU as on the CPU
(docs/design/layout.md: one header so CPU and GPU compute alike). Functions built from
bit operations and IEEE +, -, *, /, sqrt must agree exactly; those that call
expf / sinf / cosf (online softmax, RoPE) may differ by an fp32 ulp, and a
stored bf16 value by one code where it sits on a rounding boundary."""
import numpy as np
import pytest

from dsv4_jax import _ffi

pytestmark = pytest.mark.gpu

cpu = pytest.importorskip("dsv4_jax._dsv4_testing_cpu",
                          reason=f"test-only module not built ({_ffi.TESTING_BUILD})").numerics


@pytest.fixture(scope="module")
def gpu():
    try:
        from dsv4_jax import _dsv4_testing_cuda
    except ImportError as e:
        pytest.skip(f"_dsv4_testing_cuda not built ({_ffi.TESTING_BUILD}, nvcc found): {e}")
    try:
        _dsv4_testing_cuda.numerics.bf16_bits(np.zeros(1, np.float32), np.zeros(1, np.uint16))
    except RuntimeError as e:
        pytest.skip(f"no usable GPU: {e}")
    return _dsv4_testing_cuda.numerics


rng = np.random.default_rng(11)
F32, U8 = np.float32, np.uint8


def wide_f32(n):
    """Random bit patterns (every exponent, NaN and inf included) plus normals."""
    bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(F32)
    return np.concatenate([bits, (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(F32),
                           np.array([0, -0.0, np.inf, -np.inf, np.nan, 448, 464, 6, 5, 2 ** -127], F32)])


def both(fn_name, gpu, *args, outs):
    res = []
    for mod in (cpu, gpu):
        o = [np.zeros(shape, dt) for shape, dt in outs]
        getattr(mod, fn_name)(*args, *o)
        res.append(o)
    return res


@pytest.mark.parametrize("name, in_dtype, out_dtype", [
    ("bf16_bits", F32, np.uint16), ("e4m3_encode", F32, U8), ("e8m0_pow2ceil", F32, U8),
    ("e2m1_encode", F32, U8), ("e4m3_decode", U8, F32), ("e8m0_decode", U8, F32),
    ("e2m1_decode", U8, F32), ("index_query_operand", F32, np.int8)])
def test_scalar_conversions_bit_exact(gpu, name, in_dtype, out_dtype):
    x = wide_f32(50000) if in_dtype == F32 else np.arange(256, dtype=U8)
    (c,), (g,) = both(name, gpu, x, outs=[(x.shape, out_dtype)])
    np.testing.assert_array_equal(c.view(np.uint8), g.view(np.uint8))


def test_e4m3_pair_instruction_matches_portable_encode_on_every_float(gpu):
    """The kernels encode fp8 codes a pair at a time (one cvt instruction on
    sm_89+); every non-NaN fp32 pattern must give F32ToE4m3's code."""
    mismatches, first = gpu.e4m3_pair_sweep()
    assert (mismatches, first) == (0, 0xFFFFFFFF), \
        f"{mismatches} patterns differ, the first {first:#010x}"


def bf16_rows(n, width):
    x = rng.standard_normal((n, width)) * 2.0 ** rng.integers(-40, 20, (n, 1))
    return x.astype(F32).view(np.uint32).__and__(0xFFFF0000).view(F32)


@pytest.mark.parametrize("name, width, scale_dtype", [
    ("ds_fp8_tiles", 64, U8), ("fp8_token", 448, F32), ("mxfp4_blocks", 32, U8)])
def test_block_quantizers_bit_exact(gpu, name, width, scale_dtype):
    x = bf16_rows(2000, width)
    x[0] = 0
    x[1, 3] = np.nan
    x[2, 5] = np.inf
    (cc, cs), (gc, gs) = both(name, gpu, x, outs=[(x.shape, U8), (len(x), scale_dtype)])
    if name == "fp8_token":
        # NaN input: the device's IEEE division returns the canonical +NaN
        # where the host keeps the sign. Both are e4m3 NaN (0x7f / 0xff), and
        # the ops drop NaN tokens before quantizing (NONFINITE), so only the
        # NaN-ness must agree there.
        nan = (cc & 0x7F) == 0x7F
        np.testing.assert_array_equal(nan, (gc & 0x7F) == 0x7F)
        cc, gc = np.where(nan, 0x7F, cc), np.where(nan, 0x7F, gc)
    np.testing.assert_array_equal(cc, gc)
    np.testing.assert_array_equal(cs.view(np.uint8), gs.view(np.uint8))


def test_index_keys_bit_exact(gpu):
    x = bf16_rows(500, 128)
    (cp, cs), (gp, gs) = both("index_keys", gpu, x, outs=[((500, 64), U8), ((500, 4), U8)])
    np.testing.assert_array_equal(cp, gp)
    np.testing.assert_array_equal(cs, gs)


def test_rmsnorm_and_hadamard_bit_exact(gpu):
    x = bf16_rows(300, 512)
    w = rng.uniform(0.5, 1.5, 512).astype(F32)
    (c,), (g,) = both("rmsnorm", gpu, x, w, outs=[(x.shape, F32)])
    np.testing.assert_array_equal(c.view(np.uint32), g.view(np.uint32))
    x = bf16_rows(300, 128)
    (c,), (g,) = both("hadamard128", gpu, x, outs=[(x.shape, F32)])
    np.testing.assert_array_equal(c.view(np.uint32), g.view(np.uint32))


def ulps(a, b):
    a, b = a.view(np.int32).astype(np.int64), b.view(np.int32).astype(np.int64)
    return np.abs(a - b)


def test_softmax_merge_within_an_ulp(gpu):
    n = 20000
    a = np.stack([rng.normal(0, 5, n), rng.uniform(1, 8, n), rng.normal(0, 1, n)], 1).astype(F32)
    b = np.stack([rng.normal(0, 5, n), rng.uniform(1, 8, n), rng.normal(0, 1, n)], 1).astype(F32)
    a[:10] = [-np.inf, 0, 0]
    b[5:15] = [-np.inf, 0, 0]
    (c,), (g,) = both("softmax_merge", gpu, a, b, outs=[(a.shape, F32)])
    assert not np.isnan(g).any()
    np.testing.assert_array_equal(c[:, 0], g[:, 0])           # the max is exact
    assert ulps(c[:, 1], g[:, 1]).max() <= 4                  # positive sums: no cancellation
    # kv may cancel to near zero: compare against the size of its terms
    assert (np.abs(c[:, 2] - g[:, 2]) <= 1e-6 * (np.abs(a[:, 2]) + np.abs(b[:, 2]))).all()
    print("softmax: bit-equal fraction", np.mean(c == g))


def test_rope_and_epilogue_close(gpu):
    n = 2000
    inv_freq = (1.0 / 160000.0 ** (np.arange(32) / 32)).astype(F32)
    pos = rng.integers(0, 1 << 20, n).astype(np.int64)
    x = bf16_rows(n, 64)
    (c,), (g,) = both("rope", gpu, x, pos, inv_freq, outs=[(x.shape, F32)])
    scale = np.abs(x).max(1, keepdims=True)
    assert (np.abs(c - g) <= 1e-6 * scale).all()
    pooled = (rng.standard_normal((n, 512))).astype(F32)
    norm = rng.uniform(0.5, 1.5, 512).astype(F32)
    pos4 = (np.arange(n) * 4).astype(np.int64)
    out_c, out_g = np.zeros_like(pooled), np.zeros_like(pooled)
    cpu.epilogue(pooled, norm, inv_freq, pos4, out_c, False)
    gpu.epilogue(pooled, norm, inv_freq, pos4, out_g, False)
    np.testing.assert_array_equal(out_c[:, :448], out_g[:, :448])   # no transcendental there
    diff = ulps(out_c[:, 448:], out_g[:, 448:]) >> 16                # bf16 codes
    assert diff.max() <= 1 and np.mean(diff == 0) > 0.99
