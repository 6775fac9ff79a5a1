// Scoring of the lightning indexer (docs/design/formats.md; rules in
// dsv4_jax/ops/indexer.py), shared by the CPU handler and the CUDA kernel.
// The arithmetic order is part of the contract: all three implementations
// produce the same fp32 score bits, so they rank entries identically.
//
//   k[c]   = e2m1(code c) * 2^(scale byte - 127)              (exact)
//   blk[b] = k[32b] q[h,32b] + k[32b+1] q[h,32b+1] + ... + k[32b+31] q[h,32b+31]
//            summed left to right (every product is exact)
//   d      = ((blk[0] + blk[1]) + blk[2]) + blk[3]
//   c[h]   = w[h] * (d > 0 ? d : 0)
//   score  = c[0] + c[1] + ... + c[63], left to right
//
// Ranking key: a uint32 that orders like the score, with NaN as -inf and -0
// as +0; 0 is below every score and marks a non-candidate.
#pragma once

#include <cmath>
#include <cstdint>

#include "dsv4/layout.h"
#include "dsv4/numerics.h"

namespace dsv4 {

constexpr int kIndexHeads = 64;
constexpr int kMxfp4Block = 32;

// One MXFP4 key (64 packed bytes, element 2j in the low nibble; 4 scale
// bytes) -> 128 fp32 values.
// An e2m1 code (low 4 bits) as fp32, from bits alone (no table, so a GPU
// thread keeps it in registers): magnitude code m = 2e + f is f * 0.5 for
// e = 0, else 2^(e-1) * (1 + f / 2); the sign is bit 3. Equals
// num::E2m1ToF32, -0 for code 8 included.
DSV4_HD float E2m1Value(uint32_t c) {
  uint32_t e = (c >> 1) & 3u, f = c & 1u;
  uint32_t mag = e ? (((e + 126u) << 23) | (f << 22)) : (f ? 0x3f000000u : 0u);
  return num::BitsFloat(mag | ((c & 8u) << 28));
}

DSV4_HD void DecodeIndexKey(const uint8_t* packed, const uint8_t* scales, float* k) {
  for (int b = 0; b < kIndexScales; ++b) {
    float s = num::E8m0ToF32(scales[b]);
    for (int j = 0; j < kMxfp4Block / 2; ++j) {
      uint8_t byte = packed[16 * b + j];
      k[32 * b + 2 * j] = E2m1Value(byte & 15u) * s;
      k[32 * b + 2 * j + 1] = E2m1Value(byte >> 4) * s;
    }
  }
}

// The head term w * relu(d) from the four block sums of one head.
DSV4_HD float IndexHeadTerm(float b0, float b1, float b2, float b3, float w) {
  float d = ((b0 + b1) + b2) + b3;
  return w * (d > 0.f ? d : 0.f);
}

// The score of one key k[128] for a query q[64 * 128] (fp32 values of bf16)
// with head weights w[64].
DSV4_HD float IndexScore(const float* k, const float* q, const float* w) {
  float score = 0.f;
  for (int h = 0; h < kIndexHeads; ++h) {
    float blk[kIndexScales];
    for (int b = 0; b < kIndexScales; ++b) {
      const float* kb = k + kMxfp4Block * b;
      const float* qb = q + h * kIndexDim + kMxfp4Block * b;
      float a = kb[0] * qb[0];
      for (int j = 1; j < kMxfp4Block; ++j) a = a + kb[j] * qb[j];
      blk[b] = a;
    }
    float c = IndexHeadTerm(blk[0], blk[1], blk[2], blk[3], w[h]);
    score = h == 0 ? c : score + c;
  }
  return score;
}

DSV4_HD uint32_t IndexRankKey(float s) {
  if (num::IsNan(s)) s = num::NegInf();
  if (s == 0.f) s = 0.f;
  uint32_t u = num::FloatBits(s);
  uint32_t key = (u & 0x80000000u) ? (u ^ 0x7fffffffu) : u;  // signed order
  return key ^ 0x80000000u;                                   // to unsigned order
}

// ---- q_format "mxfp4": the query rounded to MXFP4 like the keys -------------
// Each (head, 32-channel block) of q is quantized as a key block is
// (num::QuantizeMxfp4Block). Codes are kept as int8 holding twice the e2m1
// value (0, +-1, +-2, +-3, +-4, +-6, +-8, +-12), so a block's dot product is
// an exact integer:
//   S[b]  = sum_j q2[h, 32b+j] * k2[32b+j]          (|S| <= 32 * 144: exact in
//                                                    any order, int32 or fp32)
//   u[b]  = fl(S[b] * K[b]),   K[b] = 2^(key scale byte - 127)
//   d     = fl(u[0] * Q[0]);  d = fl(d + fl(u[b] * Q[b])), b = 1, 2, 3
//           Q[b] = 2^(query scale byte - 129) (the 1/4 of the two doublings)
//   c[h]  = w[h] * (d > 0 ? d : 0)
//   score = pairwise sum of c[0..63]: level 1 adds (c0 + c1), (c2 + c3), ...,
//           each next level adds neighbouring results (a balanced tree in
//           head order, the order a GPU warp reduces in)
// u[b] * Q[b] is exact unless it leaves the normal fp32 range. Where it
// overflows it is +-inf before it is added (an fma would keep it finite, and
// d + inf, inf - inf give other bits), so no implementation may fuse the two.
// qscratch bytes per token, the CPU handler's layout (the CUDA handler keeps
// the rounded query in each CTA's shared memory instead):
//   [0, 8192)        int8 codes q2[64][128]
//   [8192, 9216)     f32 factors Q[4][64]
//   [9216, 17408)    int8 codes shifted for the fast form (below)
//   [17408, 17664)   f32 wq[64] of the fast form (NaN: the head is outside its guards)
constexpr int kQueryCodeBytes = kIndexHeads * kIndexDim;
constexpr int kQueryFactorOffset = kQueryCodeBytes;
constexpr int kQueryShiftedOffset = kQueryFactorOffset + 4 * kIndexHeads * kIndexScales;
constexpr int kQueryWqOffset = kQueryShiftedOffset + kQueryCodeBytes;
constexpr int kQueryScratchBytes = kQueryWqOffset + 4 * kIndexHeads;

enum IndexQueryFormat : int64_t { kQueryBf16 = 0, kQueryMxfp4 = 1 };

// Twice the e2m1 value of a code (low 4 bits), as an integer.
// Magnitude code m: m for m < 4, else (2 or 3) * 2^(m/2 - 1): 4 6 8 12 (no
// table, so a GPU thread keeps it in registers).
DSV4_HD int E2m1Twice(uint32_t c) {
  const int m = static_cast<int>(c & 7u);
  const int v = m < 4 ? m : (2 + (m & 1)) << ((m >> 1) - 1);
  return (c & 8u) ? -v : v;
}

// Q = 2^(eq - 129) for a query scale byte eq in [1, 254] (2^-128 and 2^-127
// are subnormal; exact bits either way).
DSV4_HD float IndexQueryFactor(uint32_t eq) {
  return num::BitsFloat(eq >= 3 ? (eq - 2u) << 23 : 0x00800000u >> (3u - eq));
}

// Twice the e2m1 value of F32ToE2m1(Clamp(y, 6)) as an int in [-12, 12]
// (NaN -> 0), from the rounded magnitude of num::E2m1Magic without forming
// the code: the query operand of the integer dot products.
DSV4_HD int E2m1TwiceRounded(float y) {
  const float a0 = num::AbsF(y);
  const float a = a0 > num::kE2m1Max ? num::kE2m1Max : a0;
  const float m = num::E2m1Magic(a);
  const float r = num::BitsFloat(num::FloatBits((a + m) - m) | (num::FloatBits(y) & 0x80000000u));
  // the ulp of 1.5 * 2^22 is 1/2: the low bits of the sum count r in halves
  const int v = static_cast<int>(num::FloatBits(r + 6291456.f)) - 0x4AC00000;
  return num::IsNan(y) ? 0 : v;
}

// One (head, block) of the query, its 32 bf16 values widened to fp32 ->
// 32 int8 codes (q2), rounded as a key block is (num::QuantizeMxfp4Block);
// returns its scale byte eq (Q = IndexQueryFactor(eq)).
DSV4_HD uint8_t QuantizeIndexQueryBlock(const float* x, int8_t* q2) {
  const uint8_t eq = num::Mxfp4BlockScale(x, kMxfp4Block);
  const float inv = num::E8m0Inverse(eq);
  for (int j = 0; j < kMxfp4Block; ++j) q2[j] = static_cast<int8_t>(E2m1TwiceRounded(x[j] * inv));
  return eq;
}

// The balanced pairwise sum of 64 values in order (overwrites v).
DSV4_HD float PairwiseSum64(float* v) {
  for (int n = kIndexHeads; n > 1; n /= 2)
    for (int i = 0; i < n / 2; ++i) v[i] = v[2 * i] + v[2 * i + 1];
  return v[0];
}

// The score of one MXFP4 key (64 packed bytes, 4 scale bytes) for a query
// given as q2[64 * 128] and Q[4 * 64] (index b * 64 + h), weights w[64].
DSV4_HD float IndexScoreMxfp4(const uint8_t* packed, const uint8_t* scales, const int8_t* q2,
                              const float* qf, const float* w) {
  int k2[kIndexDim];
  for (int j = 0; j < kIndexDim / 2; ++j) {
    k2[2 * j] = E2m1Twice(packed[j] & 15u);
    k2[2 * j + 1] = E2m1Twice(packed[j] >> 4);
  }
  float c[kIndexHeads];
  for (int h = 0; h < kIndexHeads; ++h) {
    float d = 0.f;
    for (int b = 0; b < kIndexScales; ++b) {
      int s = 0;
      for (int j = 0; j < kMxfp4Block; ++j)
        s += q2[h * kIndexDim + kMxfp4Block * b + j] * k2[kMxfp4Block * b + j];
      const float u = static_cast<float>(s) * num::E8m0ToF32(scales[b]);
      const float qb = qf[b * kIndexHeads + h];
      d = b == 0 ? u * qb : d + u * qb;   // the product rounded first (no contraction)
    }
    c[h] = w[h] * (d > 0.f ? d : 0.f);
  }
  return PairwiseSum64(c);
}

// ---- The fast form of the mxfp4 score: the same bits, with one integer dot
// product per head instead of four block sums ----------------------------------
// Let a head's query scale bytes be eq[b] = mq + sq[b] and a key's be
// ek[b] = mk + sk[b]. Every term of d is S[b] * 2^(ek[b] + eq[b] - 256), an
// integer multiple of 2^(mk + mq - 256); when every sq, sk <= 3 the partial
// sums stay below 2^24 such units (4 * 4608 * 2^6 < 2^21), so the chain of
// u, products and adds above rounds nowhere and
//   d = A * 2^(mk + mq - 256),   A = sum_c (q2[c] << sq[c/32]) * (k2[c] << sk[c/32])
// one exact int8 dot product over 128 channels (shifted codes stay within
// +-96). With wq = w * 2^(mq - 128) and Kf = 2^(mk - 128),
//   c[h]  = fl(w * relu(d)) = Kf * fl(wq * relu(A))
//   score = Kf * pairwise_sum(fl(wq[h] * relu(A[h])))
// because a power-of-two factor commutes with every rounding while nothing
// leaves the normal range. The guards make sure of that:
//   key   mk in [88, 168], every sk <= 3                    (Kf in [2^-40, 2^40])
//   query mq in [20, 190], every sq <= 3, wq = 0 or |wq| in [2^-50, 2^50]
// so mk + mq - 256 >= -148 (the units are fp32 numbers), |fl(wq relu A)| lies
// in [2^-50, 2^71] on a grid of 2^-73, every partial head sum below 2^77, and
// times Kf within [2^-113, 2^117]. Outside the guards the per-block form runs.
constexpr uint32_t kFastKeyMin = 88, kFastKeyMax = 168;
constexpr uint32_t kFastQueryMin = 20, kFastQueryMax = 190;

// A key's scale word (byte b = ek[b]): the shifts sk (byte b) and Kf; false
// outside the guards.
DSV4_HD bool IndexKeyFast(uint32_t scales, uint32_t* shifts, float* kf) {
  uint32_t m = 255;
  for (int b = 0; b < kIndexScales; ++b) {
    const uint32_t e = (scales >> (8 * b)) & 255u;
    m = e < m ? e : m;
  }
  const uint32_t d = scales - m * 0x01010101u;   // no borrow: every byte >= m
  *shifts = d;
  *kf = num::BitsFloat((m - 1u) << 23);          // 2^(m - 128), m >= 1 below
  return m >= kFastKeyMin && m <= kFastKeyMax && (d & 0xFCFCFCFCu) == 0;
}

// wq of one head from the smallest and largest of its query scale bytes and
// its weight; NaN outside the guards (a non-finite w included).
DSV4_HD float IndexQueryFastWeight(uint32_t mq, uint32_t maxq, float w) {
  const float nan = num::BitsFloat(0x7fc00000u);
  if (mq < kFastQueryMin || maxq > kFastQueryMax || maxq - mq > 3) return nan;
  const float wq = w * num::BitsFloat((mq - 1u) << 23);   // 2^(mq - 128): exact
  const float a = num::AbsF(wq);
  const bool ok = wq == 0.f || (a >= num::BitsFloat(0x26800000u) && a <= num::BitsFloat(0x58800000u));
  return ok ? wq : nan;                                    // [2^-50, 2^50]
}

// The fast head term fl(wq * relu(A)).
DSV4_HD float IndexHeadTermFast(int32_t acc, float wq) {
  return wq * static_cast<float>(acc > 0 ? acc : 0);
}

// The score of one MXFP4 key in the fast form: q2s[64 * 128] the query codes
// shifted by sq, wq[64] (all finite), the key's shifts and Kf from IndexKeyFast.
DSV4_HD float IndexScoreMxfp4Fast(const uint8_t* packed, uint32_t shifts, float kf,
                                  const int8_t* q2s, const float* wq) {
  int k2[kIndexDim];
  for (int j = 0; j < kIndexDim / 2; ++j) {
    const int sk = static_cast<int>((shifts >> (8 * (2 * j / kMxfp4Block))) & 255u);
    k2[2 * j] = E2m1Twice(packed[j] & 15u) * (1 << sk);
    k2[2 * j + 1] = E2m1Twice(packed[j] >> 4) * (1 << sk);
  }
  float c[kIndexHeads];
  for (int h = 0; h < kIndexHeads; ++h) {
    int32_t acc = 0;
    for (int j = 0; j < kIndexDim; ++j) acc += q2s[h * kIndexDim + j] * k2[j];
    c[h] = IndexHeadTermFast(acc, wq[h]);
  }
  return kf * PairwiseSum64(c);
}

// Whether a query position of gather_topk or indexer_topk is good: 0 <= p <
// max_context, the reach MB * 128 of a block table of MB columns (the rule of
// append and flush). Such a query sees at most MB * 32 entries.
DSV4_HD bool QueryPositionOk(int64_t p, int64_t mb) { return p >= 0 && p < mb * kBlockTokens; }

// Entries a query at position p >= 0 may see: (p + 1) / 4, capped at `limit`.
DSV4_HD int64_t IndexVisible(int64_t p, int64_t limit) {
  int64_t n = (p + 1) / kCsaRatio;
  return n < limit ? n : limit;
}

}  // namespace dsv4
