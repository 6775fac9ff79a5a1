"""Storage formats of docs/design/formats.md in pure jnp, bit for bit.

Every rounding here is written with integer arithmetic on float32 bit
patterns (or exact comparisons), never with log2 or a backend's float8
conversion, so the C++ and CUDA kernels can reproduce each byte:

* power-of-two scales (UE8M0): for a positive normal float32 `r` with biased
  exponent `e` and mantissa bits `f`, the smallest power of two >= r is
  2^(e-127) when f == 0 and 2^(e-126) otherwise; its UE8M0 byte is that
  biased exponent.
* e4m3 (float8_e4m3fn), round to nearest even: normal range (|v| >= 2^-6)
  drops the low 20 mantissa bits with the usual `+ 0x7FFFF + lsb` carry
  trick and re-biases the exponent (127 -> 7); below 2^-6 the code is
  round_half_even(|v| * 2^9) (the subnormal step is 2^-9). Inputs are clamped
  to +-448 first, so the result never reaches the NaN code 0x7F. The sign bit
  is copied, so -0.0 gives 0x80.
* e2m1 (MXFP4 element): magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} are codes 0-7;
  a value half way between two magnitudes goes to the even code; the sign
  bit of the input becomes bit 3 (so -0.0 and negatives that round to
  magnitude 0 give 0x8: docs/design/formats.md, the sign of a zero code).

Formats (x is the bf16 entry, upcast exactly to f32):

ds_fp8     nope: 7 tiles of 64; amax = max(max|x|, 1e-4); r = amax / 448 (f32
           division); s = pow2ceil(r) stored as UE8M0; codes e4m3(clamp(x / s)).
           rope: the 64 trailing channels stay bf16.
fp8_token  one f32 scale over the 448 nope channels: s = amax / 448 with the
           same floor amax = max(max|x|, 1e-4), so an all-zero entry stores
           s = 1e-4/448 and zero codes instead of dividing by zero; codes
           e4m3(clamp(x / s, +-448)) with an IEEE division.
bf16       nope stored as bf16 (no scale).

Dequantization to bf16: ds_fp8 q * s is exact; fp8_token computes q * s in
f32 and rounds once to bf16.

MXFP4 indexer keys: 4 blocks of 32; amax = max(max|x|, 6 * 2^-126); r = amax/6;
s = pow2ceil(r) (a byte in [1, 254], never 0xFF); codes e2m1(clamp(x / s, +-6));
two codes per byte, element 2j in the low nibble.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import config as C
from ..state import E8M0, FP8, KVEntries

_U32 = jnp.uint32
FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
E2M1_MAX = 6.0
MXFP4_AMAX_FLOOR = float(np.float32(6.0 * 2.0 ** -126))


def ieee_div(a, b):
    """a / b rounded once, as IEEE division. XLA's algebraic simplifier turns a
    division by a broadcast or a constant into a multiplication by the
    reciprocal (two roundings); an optimization barrier on the broadcast
    divisor keeps the true division, which the C++/CUDA kernels reproduce."""
    a = jnp.asarray(a, jnp.float32)
    b = jnp.broadcast_to(jnp.asarray(b, jnp.float32), jnp.broadcast_shapes(a.shape, jnp.shape(b)))
    return a / jax.lax.optimization_barrier(b)


def _bits(x):
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), _U32)


def pow2_ceil_exponent(r):
    """Biased exponent (the UE8M0 byte, as int32) of the smallest power of two
    >= r, for positive normal float32 r."""
    b = _bits(r)
    e = (b >> 23).astype(jnp.int32)
    return e + ((b & 0x7FFFFF) != 0).astype(jnp.int32)


def to_bf16(x):
    """f32 -> bf16, round to nearest even, done on the bits. A plain astype
    round trip f32 -> bf16 -> f32 may be skipped by XLA where it allows excess
    precision (its GPU default); a bitcast cannot be, so the official bf16
    rounding points hold on every backend and flag setting."""
    b = _bits(x)
    r = (b + jnp.uint32(0x7FFF) + ((b >> 16) & 1)) >> 16
    r = jnp.where(jnp.isnan(x), (b >> 16) | 0x40, r)          # NaN stays a quiet NaN
    return jax.lax.bitcast_convert_type(r.astype(jnp.uint16), jnp.bfloat16)


def divide_by_pow2(x, e):
    """x / 2^(e-127) for f32 x and int32 biased exponents e (broadcast), exact,
    by exponent arithmetic on the bits. XLA on the CPU treats subnormal inputs
    of float ops as zero; the C++/CUDA code and docs/design/formats.md do not, and MXFP4's
    amax floor (6 * 2^-126) makes scales small enough for that to matter.
    A quotient below 2^-126 becomes a signed zero: it rounds to code 0 in both
    e4m3 (smallest step 2^-9) and e2m1."""
    b = _bits(x)
    sign = b & jnp.uint32(0x80000000)
    exp = ((b >> 23) & 0xFF).astype(jnp.int32)
    mant = b & jnp.uint32(0x7FFFFF)
    shift = e - 127
    # normal x: subtract the scale's exponent
    new_exp = exp - shift
    normal = jnp.where(new_exp >= 1, sign | (new_exp.astype(_U32) << 23) | mant, sign)
    # subnormal x = mant * 2^-149: float(mant) (exact) times 2^(-149 - shift)
    p = -149 - shift + 127
    pow2 = jax.lax.bitcast_convert_type(jnp.clip(p, 1, 254).astype(_U32) << 23, jnp.float32)
    tiny = mant.astype(jnp.float32) * pow2
    tiny = jnp.where(p >= 1, _bits(tiny), jnp.uint32(0)) | sign
    out = jnp.where(exp == 0, tiny, jnp.where(exp == 255, b, normal))
    return jax.lax.bitcast_convert_type(out, jnp.float32)


def times_pow2(x, f):
    """fl(x * f) for f32 x and a power of two f, by exponent arithmetic on
    the bits (divide_by_pow2) where x, f and the result are normal or the
    result overflows, so XLA cannot fuse the product into a following add as
    an FMA (it does on the CPU, and an FMA keeps a product that overflows
    alone finite). Zero, subnormal, Inf and NaN x, subnormal f and results
    below 2^-126 take the float multiply, whose FMA could differ only in a
    subnormal's rounding."""
    exp = ((_bits(x) >> 23) & 0xFF).astype(jnp.int32)
    f_exp = ((_bits(f) >> 23) & 0xFF).astype(jnp.int32)
    new_exp = exp + f_exp - 127
    inf = jnp.copysign(jnp.float32(jnp.inf), x)
    exact = jnp.where(new_exp >= 255, inf, divide_by_pow2(x, 254 - f_exp))  # / 2^(127 - f_exp)
    by_bits = (exp >= 1) & (exp <= 254) & (f_exp >= 1) & (new_exp >= 1)
    return jnp.where(by_bits, exact, x * f)


def e8m0_from_bytes(b):
    return jax.lax.bitcast_convert_type(b.astype(jnp.uint8), E8M0)


def e8m0_to_f32(s):
    """UE8M0 scale -> f32 via its byte (0 -> 2^-127, 0xFF -> NaN)."""
    b = jax.lax.bitcast_convert_type(s, jnp.uint8).astype(_U32)
    v = jax.lax.bitcast_convert_type(b << 23, jnp.float32)
    v = jnp.where(b == 0, jnp.float32(2.0 ** -127), v)
    return jnp.where(b == 255, jnp.float32(jnp.nan), v)


def e4m3_codes(v):
    """float32 -> float8_e4m3fn bit pattern (uint8), round to nearest even,
    saturating at +-448."""
    v = jnp.clip(v.astype(jnp.float32), -FP8_MAX, FP8_MAX)
    b = _bits(v)
    sign = ((b >> 31) << 7).astype(jnp.uint8)
    a = b & 0x7FFFFFFF
    lsb = (a >> 20) & 1
    normal = ((a + 0x7FFFF + lsb) >> 20) - jnp.uint32(120 << 3)
    sub = jnp.round(jnp.abs(v) * jnp.float32(512.0)).astype(_U32)   # half to even
    mag = jnp.where((a >> 23) >= 121, normal, sub)
    return sign | mag.astype(jnp.uint8)


def e4m3_from_codes(codes):
    return jax.lax.bitcast_convert_type(codes.astype(jnp.uint8), FP8)


def e2m1_codes(v):
    """float32 (already divided by its scale) -> e2m1 code in the low 4 bits of
    a uint8: clamp to +-6, nearest magnitude, ties to the even code."""
    a = jnp.minimum(jnp.abs(v.astype(jnp.float32)), E2M1_MAX)
    # Between two neighbours the tie goes up when the upper code is even.
    code = ((a > 0.25).astype(jnp.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
            + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    sign = ((_bits(v) >> 31) << 3).astype(jnp.uint8)
    return sign | code.astype(jnp.uint8)


_E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6],
                        np.float32)


def e2m1_values(codes):
    return jnp.asarray(_E2M1_VALUES)[codes.astype(jnp.int32) & 15]


def e2m1_twice(codes):
    """Twice the e2m1 value of each code, as int8 (exact integers)."""
    return jnp.asarray((2 * _E2M1_VALUES).astype(np.int8))[codes.astype(jnp.int32) & 15]


# ---- KV entries ----------------------------------------------------------------------------
def quantize_kv(x, kv_format: str) -> KVEntries:
    """bf16 [..., 512] entries -> KVEntries in `kv_format` (leading dims kept)."""
    x = x.astype(jnp.bfloat16)
    nope, rope = x[..., :C.NOPE_DIM], x[..., C.NOPE_DIM:]
    if kv_format == "bf16":
        return KVEntries(nope, rope, None)
    xf = nope.astype(jnp.float32)
    if kv_format == "ds_fp8":
        tiles = xf.reshape(xf.shape[:-1] + (C.NOPE_TILES, C.NOPE_TILE))
        amax = jnp.maximum(jnp.max(jnp.abs(tiles), axis=-1), jnp.float32(FP8_AMAX_FLOOR))
        e = pow2_ceil_exponent(ieee_div(amax, FP8_MAX))
        codes = e4m3_codes(divide_by_pow2(tiles, e[..., None])).reshape(xf.shape)
        return KVEntries(e4m3_from_codes(codes), rope, e8m0_from_bytes(e))
    if kv_format == "fp8_token":
        amax = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True),
                           jnp.float32(FP8_AMAX_FLOOR))
        s = ieee_div(amax, FP8_MAX)
        return KVEntries(e4m3_from_codes(e4m3_codes(ieee_div(xf, s))), rope, s)
    raise ValueError(f"kv_format: unknown {kv_format!r}")


def dequantize_kv(entries: KVEntries, kv_format: str):
    """KVEntries -> bf16 [..., 512]."""
    if kv_format == "bf16":
        nope = entries.nope.astype(jnp.bfloat16)
    elif kv_format == "ds_fp8":
        q = entries.nope.astype(jnp.float32)
        q = q.reshape(q.shape[:-1] + (C.NOPE_TILES, C.NOPE_TILE))
        nope = (q * e8m0_to_f32(entries.scale)[..., None]).reshape(
            entries.nope.shape).astype(jnp.bfloat16)
    elif kv_format == "fp8_token":
        nope = (entries.nope.astype(jnp.float32) * entries.scale).astype(jnp.bfloat16)
    else:
        raise ValueError(f"kv_format: unknown {kv_format!r}")
    return jnp.concatenate([nope, entries.rope.astype(jnp.bfloat16)], axis=-1)


# ---- MXFP4 indexer keys ------------------------------------------------------------------------
def mxfp4_codes(x):
    """bf16 [..., 128] -> (e2m1 codes u8[..., 128], one per byte; biased scale
    exponents i32[..., 4], the e8m0 bytes)."""
    xf = x.astype(jnp.bfloat16).astype(jnp.float32)
    blocks = xf.reshape(xf.shape[:-1] + (C.INDEX_SCALES, C.MXFP4_BLOCK))
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1), jnp.float32(MXFP4_AMAX_FLOOR))
    e = pow2_ceil_exponent(ieee_div(amax, E2M1_MAX))
    codes = e2m1_codes(divide_by_pow2(blocks, e[..., None])).reshape(xf.shape)
    return codes, e


def quantize_mxfp4(x):
    """bf16 [..., 128] keys -> (packed u8[..., 64], scale e8m0[..., 4])."""
    codes, e = mxfp4_codes(x)
    pairs = codes.reshape(codes.shape[:-1] + (C.INDEX_PACKED, 2))
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.astype(jnp.uint8), e8m0_from_bytes(e)


def unpack_mxfp4(packed):
    """packed u8[..., 64] -> e2m1 codes u8[..., 128] (element 2j in the low nibble)."""
    return jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(
        packed.shape[:-1] + (C.INDEX_DIM,))


def dequantize_mxfp4(packed, scale):
    """(packed u8[..., 64], scale e8m0[..., 4]) -> f32 [..., 128] (exact)."""
    v = e2m1_values(unpack_mxfp4(packed)).reshape(packed.shape[:-1] + (C.INDEX_SCALES, C.MXFP4_BLOCK))
    return (v * e8m0_to_f32(scale)[..., None]).reshape(packed.shape[:-1] + (C.INDEX_DIM,))
