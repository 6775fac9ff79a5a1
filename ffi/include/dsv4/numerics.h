// Scalar numerics of the DSV4 cache, shared by the CPU handlers and the CUDA
// kernels (docs/design/semantics.md, docs/design/formats.md). Every function
// is `__host__ __device__` and built
// from integer bit operations or IEEE +, -, *, / only, so that host and device
// produce the same bits. Nothing here may be compiled with fast math; the build
// passes -fno-fast-math -ffp-contract=off (host) and --fmad=false (nvcc), so
// `a * b + c` is two rounded operations everywhere.
//
// Decisions the jnp reference has to match (see also the per-function notes):
//  * fp8_token: scale = max(amax, 1e-4) / 448 in fp32, the same 1e-4 floor as
//    ds_fp8. An all-zero entry therefore gets scale 1e-4f/448 and zero codes.
//  * Online softmax: accumulating one value is the merge with (z, 1, v); the
//    weight of a side is expf(m_side - m_new), or exactly 0 when m_side = -inf.
//    sum = s_a * w_a + s_b * w_b, kv = kv_a * w_a + kv_b * w_b, left to right.
//    The final value is kv / sum (IEEE division).
//  * RMSNorm: the sum of squares runs in 32 strided partial sums (partial j
//    adds channels j, j+32, j+64, ... in order) folded by halving (j += j+16,
//    then j+8, 4, 2, 1): the order of a warp reduction. A jnp `sum` may add in
//    another order; that moves the fp32 result by an ulp at most and flips a
//    bf16/fp8 code only where a value sits on a rounding boundary.
//    y = (x * (1 / sqrtf(ss / d + 1e-6f))) * w.
//  * RoPE: angle = float(pos) * inv_freq[k]; c = cosf(angle), s = sinf(angle);
//    (x0, x1) -> (x0*c - x1*s, x0*s + x1*c). cosf/sinf of glibc, CUDA and XLA
//    are each within ~1 ulp of exact, not bit-identical.
//  * Hadamard: in-place fast Walsh-Hadamard butterflies with strides 1, 2, 4,
//    ..., 64 ((a, b) -> (a + b, a - b)) in fp32, then each output times
//    float(128^-0.5). A matmul with the +-1 matrix adds in another order; as
//    with RMSNorm the difference shows only as a rare one-code flip.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define DSV4_HD __host__ __device__ __forceinline__
#else
#define DSV4_HD inline
#endif

namespace dsv4 {
namespace num {

// ---- bit casts ----------------------------------------------------------------
DSV4_HD uint32_t FloatBits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

DSV4_HD float BitsFloat(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

DSV4_HD bool IsNan(float f) { return (FloatBits(f) & 0x7fffffffu) > 0x7f800000u; }
DSV4_HD bool IsFinite(float f) { return (FloatBits(f) & 0x7f800000u) != 0x7f800000u; }
DSV4_HD bool Bf16IsFinite(uint16_t h) { return (h & 0x7f80u) != 0x7f80u; }
// Whether a row of inputs holds no NaN or Inf (docs/design/bad-input.md: such a token is
// dropped and counted as NONFINITE).
DSV4_HD bool RowIsFinite(const uint16_t* bf16, int64_t n) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok = ok && Bf16IsFinite(bf16[i]);
  return ok;
}
DSV4_HD bool RowIsFinite(const float* f32, int64_t n) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) ok = ok && IsFinite(f32[i]);
  return ok;
}
DSV4_HD float NegInf() { return BitsFloat(0xff800000u); }
DSV4_HD float AbsF(float f) { return BitsFloat(FloatBits(f) & 0x7fffffffu); }
// max that ignores a NaN operand (as fmaxf): a NaN input never becomes amax.
// Selects, not branches: a GPU compiles them without divergence.
DSV4_HD float MaxF(float a, float b) {
  const float m = a > b ? a : b;
  return IsNan(a) ? b : IsNan(b) ? a : m;
}
// clamp to [-lim, lim]; NaN stays NaN.
DSV4_HD float Clamp(float x, float lim) {
  const float hi = x > lim ? lim : x;
  return x < -lim ? -lim : hi;
}
// MaxF(amax, |x|) for a running block amax (a positive number): fmaxf on
// a GPU, one instruction. The same result: no operand is -0, and both ignore
// a NaN |x|.
DSV4_HD float AmaxWith(float amax, float x) {
#ifdef __CUDA_ARCH__
  return fmaxf(amax, fabsf(x));
#else
  return MaxF(amax, AbsF(x));
#endif
}

// ---- bf16 -----------------------------------------------------------------
// fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN of the same sign.
DSV4_HD uint16_t F32ToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

DSV4_HD float Bf16ToF32(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// The fp32 value of fp32 -> bf16 -> fp32.
DSV4_HD float RoundBf16(float f) { return Bf16ToF32(F32ToBf16(f)); }

// ---- e4m3fn (bias 7, max 448, 0x7f / 0xff NaN, no infinity) ----------------
constexpr float kE4m3Max = 448.f;

// fp32 -> e4m3fn, round to nearest even, saturating: |x| > 448 and +-inf give
// +-448 (0x7e / 0xfe); NaN gives 0x7f / 0xff. The sign of zero is kept.
DSV4_HD uint8_t F32ToE4m3(float f) {
  uint32_t u = FloatBits(f);
  uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  if (a > 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);  // > 448 (also inf)
  if (a >= 0x3c800000u) {                                          // >= 2^-6: normal
    uint32_t r = a - (120u << 23);  // exponent bias 127 -> 7
    r = (r + 0x7ffffu + ((r >> 20) & 1u)) >> 20;
    return static_cast<uint8_t>(sign | r);  // a carry into the exponent is right
  }
  // Subnormal target: code = round_even(|x| * 2^9), 0..8 (8 = 2^-6, smallest normal).
  uint32_t e = a >> 23;
  if (e == 0) return sign;  // fp32 subnormal: far below 2^-10
  uint32_t mant = (a & 0x7fffffu) | 0x800000u;  // |x| = mant * 2^(e - 150)
  uint32_t shift = 141u - e;                    // |x| * 2^9 = mant >> shift
  if (shift > 24u) return sign;                 // < 0.5
  uint32_t q = mant >> shift;
  uint32_t rem = mant & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint8_t>(sign | q);
}

// F32ToE4m3 of two values, x0's code in the low byte. Hopper (sm_89+) has
// the conversion as one instruction for a pair, round to nearest even and
// saturating to +-448 like F32ToE4m3; the portable form is what the CPU runs.
// The two agree on every fp32 input but NaN (whose code may lose its sign):
// tests/numerics/test_numerics_gpu.py sweeps all 2^32 patterns on the GPU.
// A NaN's code is a NaN code either way (its sign may differ).
DSV4_HD uint16_t F32PairToE4m3(float x0, float x1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(x1), "f"(x0));
  return r;
#else
  return static_cast<uint16_t>(F32ToE4m3(x0) | (F32ToE4m3(x1) << 8));
#endif
}

DSV4_HD float E4m3ToF32(uint8_t c) {
  uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  uint32_t exp = (c >> 3) & 0xfu, mant = c & 7u;
  if ((c & 0x7fu) == 0x7fu) return BitsFloat(sign | 0x7fc00000u);
  if (exp == 0) {
    float v = static_cast<float>(mant) * BitsFloat(0x3b000000u);  // * 2^-9, exact
    return BitsFloat(FloatBits(v) | sign);
  }
  return BitsFloat(sign | ((exp + 120u) << 23) | (mant << 20));
}

// ---- e8m0 (unsigned; byte b means 2^(b - 127); 0xff is NaN) ---------------
// The smallest power of two >= r as an e8m0 byte, read off the fp32 bits.
// r <= 2^-127 (including 0 and negatives) gives 0x00; r > 2^127, +inf and NaN
// give 0xfe: a scale is never 0xff.
DSV4_HD uint8_t Pow2CeilE8m0(float r) {
  uint32_t u = FloatBits(r);
  if (u & 0x80000000u) return 0;                 // negative or -0
  if (u > 0x7f000000u) return 0xfe;              // > 2^127, inf, NaN
  uint32_t e = u >> 23, mant = u & 0x7fffffu;
  if (e == 0) return mant > 0x400000u ? 1 : 0;  // subnormal: 2^-126 or 2^-127
  uint32_t b = e + (mant != 0 ? 1u : 0u);
  return static_cast<uint8_t>(b > 0xfeu ? 0xfeu : b);
}

// The fp32 value of an e8m0 byte (0xff -> NaN).
DSV4_HD float E8m0ToF32(uint8_t b) {
  if (b == 0xff) return BitsFloat(0x7fc00000u);
  if (b == 0) return BitsFloat(0x00400000u);  // 2^-127, an fp32 subnormal
  return BitsFloat(static_cast<uint32_t>(b) << 23);
}

// 1 / E8m0ToF32(b) = 2^(127 - b), a float for every byte (2^-127 subnormal;
// NaN for 0xff). x * E8m0Inverse(b) == x / E8m0ToF32(b) bit for bit: both
// round the same real number once (denormals kept), and a multiply is
// cheaper than a division.
DSV4_HD float E8m0Inverse(uint8_t b) {
  if (b == 0xff) return BitsFloat(0x7fc00000u);
  if (b == 0xfe) return BitsFloat(0x00400000u);
  return BitsFloat(static_cast<uint32_t>(0xfe - b) << 23);
}

// ---- e2m1 (fp4: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 = codes 0-7, sign bit 3) --
constexpr float kE2m1Max = 6.f;

// Rounding to the format for a in [0, 6] (not NaN), by one fp32 add:
// M = E2m1Magic(a) = 2^(22 + k), k = max(0, floor(log2 a)), has an ulp of
// 2^(k - 1), the format's step in a's binade (0.5 below 2, 1 below 4, 2 from
// 4). So fl(a + M) is a rounded to the format's grid, a tie going to the even
// multiple of the step, which is the even code. fl(a + M) - M is the rounded
// magnitude (exact), bits(a + M) - bits(M) its count of steps, and the code
// that count plus 2k.
DSV4_HD float E2m1Magic(float a) {
  const uint32_t e = FloatBits(a) & 0x7f800000u;
  return BitsFloat((e > 0x3f800000u ? e : 0x3f800000u) + (22u << 23));
}

// Nearest magnitude, a tie going to the even code (the rounding of the format):
// 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
// |x| > 6 and +-inf saturate to 6; the sign bit follows the fp32 sign, so
// -0 and a negative value rounding to magnitude 0 give 0x8 (docs/design/formats.md,
// the sign of a zero code). The format has no NaN: NaN gives 0x8, as
// ml_dtypes does.
// Integer and fp32 operations only, no branches (a GPU warp does not
// diverge); a NaN runs through them harmlessly and is replaced at the end.
DSV4_HD uint8_t F32ToE2m1(float f) {
  const uint32_t sign = (FloatBits(f) & 0x80000000u) ? 8u : 0u;
  const float a0 = AbsF(f);
  const float a = a0 > kE2m1Max ? kE2m1Max : a0;
  const uint32_t m = FloatBits(E2m1Magic(a));
  const uint32_t code = FloatBits(a + BitsFloat(m)) - m + 2u * ((m >> 23) - 149u);
  return static_cast<uint8_t>(IsNan(f) ? 8u : sign | code);
}

DSV4_HD float E2m1ToF32(uint8_t c) {
  // Twice the magnitude of each code, to keep the table integral.
  const uint8_t twice[8] = {0, 1, 2, 3, 4, 6, 8, 12};
  float v = 0.5f * static_cast<float>(twice[c & 7u]);
  return (c & 8u) ? -v : v;
}

// ---- ds_fp8 tile (64 values, one e8m0 scale) --------------------------------
constexpr float kDsFp8AmaxFloor = 1e-4f;

// Quantize `n` fp32 values (the bf16 values of an entry, widened): amax =
// max(|x|, 1e-4) (NaN ignored), s = smallest power of two >= amax / 448,
// code = e4m3(clamp(x / s, +-448)). Returns the scale byte.
DSV4_HD uint8_t QuantizeDsFp8Tile(const float* x, int n, uint8_t* codes) {
  float amax = kDsFp8AmaxFloor;
  for (int i = 0; i < n; ++i) amax = AmaxWith(amax, x[i]);
  uint8_t sb = Pow2CeilE8m0(amax / kE4m3Max);
  float s = E8m0ToF32(sb);
  for (int i = 0; i < n; ++i) codes[i] = F32ToE4m3(Clamp(x[i] / s, kE4m3Max));
  return sb;
}

// code * scale, exact in fp32 (and in bf16, the codes having 3 mantissa bits).
DSV4_HD float DequantDsFp8(uint8_t code, uint8_t scale) {
  return E4m3ToF32(code) * E8m0ToF32(scale);
}

// ---- fp8_token (448 values, one fp32 scale) ---------------------------------
// s = max(amax, 1e-4) / 448 (fp32; NaN ignored in amax), code =
// e4m3(clamp(x / s, +-448)). Returns s. Dequantized value: bf16(code * s).
DSV4_HD float QuantizeFp8Token(const float* x, int n, uint8_t* codes) {
  float amax = kDsFp8AmaxFloor;
  for (int i = 0; i < n; ++i) amax = AmaxWith(amax, x[i]);
  float s = amax / kE4m3Max;
  for (int i = 0; i < n; ++i) codes[i] = F32ToE4m3(Clamp(x[i] / s, kE4m3Max));
  return s;
}

// ---- MXFP4 block (32 values, one e8m0 scale) ---------------------------------
// amax = max(|x|, 6 * 2^-126) (NaN ignored), s = smallest power of two >=
// amax / 6 (never below 2^-126, never 0xff), code = e2m1(clamp(x / s, +-6)).
// The pieces of QuantizeMxfp4Block, for callers that split a block across
// threads (MaxF is associative, so any order of the amax gives the same byte).
DSV4_HD float Mxfp4AmaxFloor() { return 6.f * BitsFloat(0x00800000u); }  // 6 * 2^-126
DSV4_HD uint8_t Mxfp4ScaleByte(float amax) { return Pow2CeilE8m0(amax / kE2m1Max); }
// The code of x in a block of scale byte sb, given inv_scale = E8m0Inverse(sb).
DSV4_HD uint8_t Mxfp4Encode(float x, float inv_scale) {
  return F32ToE2m1(Clamp(x * inv_scale, kE2m1Max));
}

// The scale byte of a block of n values.
DSV4_HD uint8_t Mxfp4BlockScale(const float* x, int n) {
  float amax = Mxfp4AmaxFloor();
  for (int i = 0; i < n; ++i) amax = AmaxWith(amax, x[i]);
  return Mxfp4ScaleByte(amax);
}

// Codes are returned one per byte (low nibble); packing is the caller's.
DSV4_HD uint8_t QuantizeMxfp4Block(const float* x, int n, uint8_t* codes) {
  const uint8_t sb = Mxfp4BlockScale(x, n);
  const float inv = E8m0Inverse(sb);
  for (int i = 0; i < n; ++i) codes[i] = Mxfp4Encode(x[i], inv);
  return sb;
}

// ---- online softmax -----------------------------------------------------------
// Per channel (max, sum, weighted kv); empty = (-inf, 0, 0).
struct SoftmaxAcc {
  float m, s, kv;
};

DSV4_HD SoftmaxAcc EmptyAcc() { return SoftmaxAcc{NegInf(), 0.f, 0.f}; }

DSV4_HD SoftmaxAcc MergeAcc(SoftmaxAcc a, SoftmaxAcc b) {
  float m = a.m > b.m ? a.m : b.m;
  if (m == NegInf()) return a;  // both empty
  float wa = a.m == NegInf() ? 0.f : expf(a.m - m);
  float wb = b.m == NegInf() ? 0.f : expf(b.m - m);
  SoftmaxAcc r;
  r.m = m;
  r.s = a.s * wa + b.s * wb;
  r.kv = a.kv * wa + b.kv * wb;
  return r;
}

// Fold one value v with score z: the merge with (z, 1, v).
DSV4_HD SoftmaxAcc AccumulateAcc(SoftmaxAcc a, float z, float v) {
  return MergeAcc(a, SoftmaxAcc{z, 1.f, v});
}

// The pooled value; an empty accumulator gives 0.
DSV4_HD float FinalizeAcc(SoftmaxAcc a) { return a.s == 0.f ? 0.f : a.kv / a.s; }

// ---- RMSNorm ----------------------------------------------------------------------
constexpr float kNormEps = 1e-6f;
constexpr int kSumLanes = 32;

// Sum of x[c]^2 in the order described at the top (d a multiple of 32).
DSV4_HD float SumSquares(const float* x, int d) {
  float part[kSumLanes];
  for (int j = 0; j < kSumLanes; ++j) part[j] = 0.f;
  for (int c = 0; c < d; ++c) part[c % kSumLanes] = part[c % kSumLanes] + x[c] * x[c];
  for (int off = kSumLanes / 2; off > 0; off /= 2)
    for (int j = 0; j < off; ++j) part[j] = part[j] + part[j + off];
  return part[0];
}

// The factor 1 / sqrt(mean(x^2) + eps) from a sum of squares over d channels.
DSV4_HD float RmsInvFromSumSquares(float ss, int d) {
  return 1.f / sqrtf(ss / static_cast<float>(d) + kNormEps);
}

// y[c] = (x[c] * inv) * w[c], in place allowed.
DSV4_HD void RmsNorm(const float* x, const float* w, int d, float* y) {
  float inv = RmsInvFromSumSquares(SumSquares(x, d), d);
  for (int c = 0; c < d; ++c) y[c] = (x[c] * inv) * w[c];
}

// ---- RoPE (interleaved pairs) ----------------------------------------------------
// Rotates pair k = (x[2k], x[2k+1]) by angle float(pos) * inv_freq[k].
DSV4_HD void RopePair(float x0, float x1, float angle, float* y0, float* y1) {
  float c = cosf(angle), s = sinf(angle);
  *y0 = x0 * c - x1 * s;
  *y1 = x0 * s + x1 * c;
}

DSV4_HD void RopeInterleaved(float* x, int pairs, int64_t pos, const float* inv_freq) {
  float p = static_cast<float>(pos);
  for (int k = 0; k < pairs; ++k) {
    float y0, y1;
    RopePair(x[2 * k], x[2 * k + 1], p * inv_freq[k], &y0, &y1);
    x[2 * k] = y0;
    x[2 * k + 1] = y1;
  }
}

// ---- Hadamard (128-point Sylvester, normalized) ---------------------------------
constexpr int kHadamardN = 128;

DSV4_HD float HadamardScale() { return 0.0883883461356163f; }  // float(128^-0.5)

DSV4_HD void Hadamard128(float* x) {
  for (int h = 1; h < kHadamardN; h *= 2)
    for (int i = 0; i < kHadamardN; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  float sc = HadamardScale();
  for (int i = 0; i < kHadamardN; ++i) x[i] = x[i] * sc;
}

}  // namespace num
}  // namespace dsv4
