"""Independent numpy helpers for the FFI tests: quantizers written from
docs/design/formats.md with ml_dtypes casts, and float64 versions of the
epilogue of docs/design/semantics.md. Nothing here
calls the code under test."""
import ml_dtypes
import numpy as np

F32, U8 = np.float32, np.uint8
E4M3, E2M1, BF16 = ml_dtypes.float8_e4m3fn, ml_dtypes.float4_e2m1fn, ml_dtypes.bfloat16


def bf16(x):
    """fp32 -> bf16 (RNE) -> fp32 values."""
    return np.asarray(x, F32).astype(BF16).astype(F32)


def pow2ceil(r):
    """Smallest power of two >= r (r > 2^-127, finite), float64."""
    m, e = np.frexp(np.asarray(r, np.float64))
    return np.where(m == 0.5, 2.0 ** (e - 1), 2.0 ** e)


def ds_fp8_roundtrip(x):
    """[..., 448] bf16-valued -> the dequantized values of ds_fp8 tiles, plus
    the scale of each element's tile."""
    x = np.asarray(x, F32)
    t = x.reshape(*x.shape[:-1], 7, 64)
    amax = np.maximum(np.abs(t).max(-1, keepdims=True), F32(1e-4)).astype(F32)
    s = pow2ceil((amax / F32(448)).astype(F32)).astype(F32)
    q = np.clip(t / s, F32(-448), F32(448)).astype(F32).astype(E4M3).astype(F32)
    return (q * s).reshape(x.shape), np.broadcast_to(s, t.shape).reshape(x.shape)


def fp8_token_roundtrip(x):
    x = np.asarray(x, F32)
    amax = np.maximum(np.abs(x).max(-1, keepdims=True), F32(1e-4)).astype(F32)
    s = (amax / F32(448)).astype(F32)
    q = np.clip(x / s, F32(-448), F32(448)).astype(F32).astype(E4M3).astype(F32)
    return bf16(q * s), np.broadcast_to(s, x.shape)


def entry_roundtrip(row, fmt):
    """[..., 512] bf16-valued -> what a gather returns after storing it."""
    row = np.asarray(row, F32)
    out = row.copy()
    if fmt == "ds_fp8":
        out[..., :448] = ds_fp8_roundtrip(row[..., :448])[0]
    elif fmt == "fp8_token":
        out[..., :448] = fp8_token_roundtrip(row[..., :448])[0]
    return out


def epilogue64(pooled, norm, inv_freq, pos, rope_dim=64):
    """docs/design/semantics.md epilogue with float64 arithmetic between the bf16 roundings."""
    x = bf16(pooled).astype(np.float64)
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * norm.astype(np.float64)
    x = bf16(x).astype(np.float64)
    ang = (np.asarray(pos, F32)[..., None] * inv_freq.astype(F32)).astype(F32).astype(np.float64)
    r = x[..., -rope_dim:]
    x0, x1 = r[..., 0::2].copy(), r[..., 1::2].copy()
    r[..., 0::2] = x0 * np.cos(ang) - x1 * np.sin(ang)
    r[..., 1::2] = x0 * np.sin(ang) + x1 * np.cos(ang)
    return bf16(x)


def sylvester(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def index_key64(pooled, norm, inv_freq, pos):
    x = epilogue64(pooled, norm, inv_freq, pos).astype(np.float64)
    return bf16(x @ sylvester(128).T * 128 ** -0.5)


def mxfp4_roundtrip(x):
    x = np.asarray(x, F32)
    b = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), F32(6 * 2.0 ** -126)).astype(F32)
    s = pow2ceil((amax / F32(6)).astype(F32)).astype(F32)
    q = np.clip(b / s, F32(-6), F32(6)).astype(F32).astype(E2M1).astype(F32)
    return (q * s).reshape(x.shape), np.broadcast_to(s, b.shape).reshape(x.shape)


def unpack_mxfp4(packed, scale):
    """u8[..., 64] + e8m0[..., 4] -> f32[..., 128]."""
    packed = np.asarray(packed)
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], 128)
    vals = codes.astype(U8).view(E2M1).astype(F32)
    s = np.asarray(scale).astype(F32)
    return vals * np.repeat(s, 32, axis=-1)


def assert_within_one_code(got, want, scale, rel=2.0 ** -3, sub=2.0 ** -9, min_exact=0.97):
    """got: the stored-and-read values; want: the oracle's own quantize-
    dequantize of its float64 result; scale: the quantization scale of each
    element. Every value lies within one code step of the oracle's (a value
    on a rounding boundary may round the other way after a different fp32
    order) and nearly all agree exactly."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    step = np.maximum(np.abs(want) * rel, np.asarray(scale, np.float64) * sub) * 1.01
    bad = np.abs(got - want) > step
    assert not bad.any(), (np.argwhere(bad)[:5], got[bad][:5], want[bad][:5])
    exact = float(np.mean(got == want))
    assert exact >= min_exact, exact
    return exact
