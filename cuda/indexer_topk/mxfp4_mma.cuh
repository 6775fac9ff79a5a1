// MXFP4 tile sums on the int8 tensor cores: key decode, the MMA, the fast and per-block forms.
#pragma once

#include <cstdint>

#include "dsv4/indexer.h"
#include "dsv4/numerics.h"
#include "indexer_topk/mxfp4_head_tree.cuh"


namespace dsv4 {
namespace indexer {
namespace {  // internal linkage: see cuda/indexer_topk/indexer_topk.cu

// Accumulator starts: the integer sum lands in the mantissa of these floats
// (the forms in score_mxfp4.cuh).
constexpr uint32_t kBlockMagicBits = 0x4B400000u;            // 1.5 * 2^23
constexpr float kBlockMagic = 12582912.f;
constexpr uint32_t kFastMagicBits = 0x4B000000u;             // 2^23
constexpr float kFastMagic = 8388608.f;
constexpr uint32_t kFmaScaleMax = 231;

__device__ __forceinline__ uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// Per-block form. Eight e2m1 codes (code k in bits 4k..4k+3) -> eight int8
// holding twice their values, as two words (codes 0-3, codes 4-7).
// Magnitudes by a byte permute of an 8-entry table, negated bytewise
// ((0x80 - m) ^ 0x80 = -m mod 256, no borrow for m <= 0x80), then a permute
// picks by the sign bit.
__device__ __forceinline__ void E2m1x8ToInt8(uint32_t w, uint32_t* lo, uint32_t* hi) {
  const uint32_t sel = w & 0x77777777u;
  const uint32_t pick = ((w >> 1) & 0x44444444u) | 0x32103210u;   // +4: the negated word
  const uint32_t pl = Prmt(0x03020100u, 0x0C080604u, sel);          // 0 1 2 3 | 4 6 8 12
  const uint32_t ph = Prmt(0x03020100u, 0x0C080604u, sel >> 16);
  const uint32_t nl = (0x80808080u - pl) ^ 0x80808080u, nh = (0x80808080u - ph) ^ 0x80808080u;
  *lo = Prmt(pl, nl, pick);
  *hi = Prmt(ph, nh, pick >> 16);
}

// Fast form. Eight e2m1 codes -> eight bytes 128 + twice their value times
// 2^sk, as two words. t0, t1: the magnitude table 0 1 2 3 | 4 6 8 12 shifted
// by sk (at most 96). A byte permute with the code as its selector gives the
// magnitude of a positive code and 0 for a negative one (selector bit 3
// copies the table byte's sign bit, 0); with bit 3 flipped, the reverse.
// 0x80 + positive - negative lies in [32, 224] per byte: nothing carries or
// borrows across bytes.
__device__ __forceinline__ void E2m1x8ToBiased(uint32_t w, uint32_t t0, uint32_t t1,
                                               uint32_t* lo, uint32_t* hi) {
  const uint32_t wn = w ^ 0x88888888u;
  *lo = Prmt(t0, t1, w) + 0x80808080u - Prmt(t0, t1, wn);
  *hi = Prmt(t0, t1, w >> 16) + 0x80808080u - Prmt(t0, t1, wn >> 16);
}

// d = A * B + C, C given as four words (s32, or the bits of a magic start);
// A unsigned (the fast form's biased keys) or signed.
template <bool kUnsignedA>
__device__ __forceinline__ void Mma(uint32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1, const uint32_t (&c)[4]) {
  if (kUnsignedA)
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]),
          "r"(c[2]), "r"(c[3]));
  else
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]),
          "r"(c[2]), "r"(c[3]));
}

// d > 0 ? d : 0 (NaN -> 0) in one instruction. fmaxf may return -0 for
// d = -0; a zero's sign cannot change a sum with a non-zero term, and the
// rank key treats -0 as +0, so the keys equal the definition's.
__device__ __forceinline__ float Relu(float d) { return fmaxf(d, 0.f); }

// Fast form: k-steps 2bp, 2bp + 1 of the lane's key operand of a tile,
// decoded. keys[r]: block c of row g + 8r (word kk: k-step kk); tab[r]: its
// magnitude table. a[t][e]: the A fragment of row half t, k-step 2bp + e.
__device__ __forceinline__ void DecodeFastKeys(const uint4 (&keys)[4], const uint2 (&tab)[4],
                                               int bp, uint32_t (&a)[2][2][4]) {
#pragma unroll
  for (int t = 0; t < 2; ++t) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const uint4& k0 = keys[2 * t];
      const uint4& k1 = keys[2 * t + 1];
      const uint32_t w0 = bp == 0 ? (e == 0 ? k0.x : k0.y) : (e == 0 ? k0.z : k0.w);
      const uint32_t w1 = bp == 0 ? (e == 0 ? k1.x : k1.y) : (e == 0 ? k1.z : k1.w);
      E2m1x8ToBiased(w0, tab[2 * t].x, tab[2 * t].y, &a[t][e][0], &a[t][e][2]);
      E2m1x8ToBiased(w1, tab[2 * t + 1].x, tab[2 * t + 1].y, &a[t][e][1], &a[t][e][3]);
    }
  }
}

// The whole tile's key operand (both k-step pairs bp).
__device__ __forceinline__ void DecodeFastTile(const uint4 (&keys)[4], const uint2 (&tab)[4],
                                               uint32_t (&a)[2][2][2][4]) {
  DecodeFastKeys(keys, tab, 0, a[0]);
  DecodeFastKeys(keys, tab, 1, a[1]);
}

// Fast form, half hf of the lane's heads (n-tiles j0 = 4hf .. 4hf + 3): the
// MMAs of k-step pair bp into acc[row half][n-tile - j0], from the
// accumulator starts start[4j] = (S, S', S, S') of heads 16c + 2j, +1 at bp 0.
template <int kHalf>
__device__ __forceinline__ void FastMmaPair(const uint4* bfrag, const uint4* start, int bp,
                                            const uint32_t (&a)[2][2][4],
                                            uint32_t (&acc)[2][4][4]) {
  constexpr int j0 = 4 * kHalf;
  // eight independent accumulators between an MMA and the next on the same one
  uint4 bq[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) bq[j] = bfrag[((j0 + j) * 2 + bp) * 32];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      if (bp == 0) {
        const uint4 s = start[4 * (j0 + j)];
        const uint32_t c0[4] = {s.x, s.y, s.z, s.w};
        Mma<true>(acc[t][j], a[t][0], bq[j].x, bq[j].y, c0);
      } else {
        Mma<true>(acc[t][j], a[t][0], bq[j].x, bq[j].y, acc[t][j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int t = 0; t < 2; ++t) Mma<true>(acc[t][j], a[t][1], bq[j].z, bq[j].w, acc[t][j]);
}

// Fast form, half hf: levels 1-3 of the head tree for rows g + 8r from the
// MMAs' ends, scaled and signed (TreeSigns, mxfp4_head_tree.cuh); leaf[4j] =
// (s, s', -2^23 s, -2^23 s') of heads 16c + 2j, +1.
template <int kHalf>
__device__ __forceinline__ void FastTileLeaves(const float4* leaf, const TreeSigns& signs,
                                               const uint32_t (&acc)[2][4][4], float (&l3)[4]) {
  constexpr int j0 = 4 * kHalf;
  float p[4][4];   // [row g + 8r][pair]
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 f = leaf[4 * (j0 + j)];
    const float m = signs.l1[j0 + j];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      p[2 * t][j] = fmaf(FastLeaf(acc[t][j][0], f.x, f.z), m, FastLeaf(acc[t][j][1], f.y, f.w));
      p[2 * t + 1][j] = fmaf(FastLeaf(acc[t][j][2], f.x, f.z), m, FastLeaf(acc[t][j][3], f.y, f.w));
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) l3[r] = HalfHeadTree(p[r], signs, kHalf);
}

// Fast form, one half hf of the lane's heads (n-tiles 4hf..4hf+3: heads 16c +
// 8hf .. + 7): levels 1-3 of the head tree for rows g + 8r. Each half decodes
// the keys itself, a k-step pair at a time, so that only half the heads'
// accumulators are live at once (a build with one decode was hardly faster:
// docs/perf/indexer.md, "Ideas tried"). The compiler merges the two identical
// decodes: the sm_90a loop has one decode's 68 PRMT a tile.
template <int kHalf>
__device__ __forceinline__ void FastTileHalf(const uint4* bfrag, const float4* leaf,
                                             const TreeSigns& signs, const uint4* start,
                                             const uint4 (&keys)[4], const uint2 (&tab)[4],
                                             float (&l3)[4]) {
  uint32_t acc[2][4][4];   // [row half][n-tile - j0][fragment]
#pragma unroll
  for (int bp = 0; bp < 2; ++bp) {
    uint32_t a[2][2][4];   // [row half][k-step of the pair][fragment]
    DecodeFastKeys(keys, tab, bp, a);
    FastMmaPair<kHalf>(bfrag, start, bp, a, acc);
  }
  FastTileLeaves<kHalf>(leaf, signs, acc, l3);
}

// FastTileHalf on a tile decoded once (DecodeFastTile) for several queries:
// the decoded operand stays in registers across them.
template <int kHalf>
__device__ __forceinline__ void FastTileHalfDecoded(const uint4* bfrag, const float4* leaf,
                                                    const TreeSigns& signs, const uint4* start,
                                                    const uint32_t (&a)[2][2][2][4],
                                                    float (&l3)[4]) {
  uint32_t acc[2][4][4];
#pragma unroll
  for (int bp = 0; bp < 2; ++bp) FastMmaPair<kHalf>(bfrag, start, bp, a[bp], acc);
  FastTileLeaves<kHalf>(leaf, signs, acc, l3);
}

// Key bytes of one row half for this lane in the per-block form (rows g and
// g + 8 of the half, channels 8c.. of each block) and their scale words.
struct TileKeys {
  uint32_t kg[4], kh[4], sg, sh;
};

// Per-block form: level-1 head sums of rows g and g + 8 of a row half (the
// definition's order). bfrag: the unshifted codes.
template <bool kFmaScale>
__device__ __forceinline__ void BlockTileSums(const uint4* bfrag,
                                              const float2 (*qf_s)[kIndexHeads / 2],
                                              const float2* w_s, const TileKeys& k, int c,
                                              float (&pg)[8], float (&ph)[8]) {
  float acc[8][4];
#pragma unroll
  for (int b = 0; b < kIndexScales; ++b) {
    uint32_t a[4];
    E2m1x8ToInt8(k.kg[b], &a[0], &a[2]);
    E2m1x8ToInt8(k.kh[b], &a[1], &a[3]);
    // scale bytes 1..231: 2^(byte - 127) is the byte as an exponent
    const float Kg = kFmaScale ? __uint_as_float(((k.sg >> (8 * b)) & 255u) << 23)
                               : num::E8m0ToF32(static_cast<uint8_t>(k.sg >> (8 * b)));
    const float Kh = kFmaScale ? __uint_as_float(((k.sh >> (8 * b)) & 255u) << 23)
                               : num::E8m0ToF32(static_cast<uint8_t>(k.sh >> (8 * b)));
    const float MKg = -kBlockMagic * Kg, MKh = -kBlockMagic * Kh;
    const uint32_t start[4] = {kBlockMagicBits, kBlockMagicBits, kBlockMagicBits, kBlockMagicBits};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t d[4];
      const uint4 bq = bfrag[(j * 2 + b / 2) * 32];
      Mma<false>(d, a, b % 2 ? bq.z : bq.x, b % 2 ? bq.w : bq.y, start);
      const float2 Q = qf_s[b][8 * c + j];
      float u[4];
      if (kFmaScale) {
        u[0] = fmaf(__uint_as_float(d[0]), Kg, MKg);
        u[1] = fmaf(__uint_as_float(d[1]), Kg, MKg);
        u[2] = fmaf(__uint_as_float(d[2]), Kh, MKh);
        u[3] = fmaf(__uint_as_float(d[3]), Kh, MKh);
      } else {
        u[0] = (__uint_as_float(d[0]) - kBlockMagic) * Kg;
        u[1] = (__uint_as_float(d[1]) - kBlockMagic) * Kg;
        u[2] = (__uint_as_float(d[2]) - kBlockMagic) * Kh;
        u[3] = (__uint_as_float(d[3]) - kBlockMagic) * Kh;
      }
      if (b == 0) {
        acc[j][0] = u[0] * Q.x;
        acc[j][1] = u[1] * Q.y;
        acc[j][2] = u[2] * Q.x;
        acc[j][3] = u[3] * Q.y;
      } else {
        // the product rounded before the add, as dsv4/indexer.h: an fma
        // would keep a product that overflows alone finite
        acc[j][0] = __fadd_rn(acc[j][0], __fmul_rn(u[0], Q.x));
        acc[j][1] = __fadd_rn(acc[j][1], __fmul_rn(u[1], Q.y));
        acc[j][2] = __fadd_rn(acc[j][2], __fmul_rn(u[2], Q.x));
        acc[j][3] = __fadd_rn(acc[j][3], __fmul_rn(u[3], Q.y));
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 w = w_s[8 * c + j];
    pg[j] = w.x * Relu(acc[j][0]) + w.y * Relu(acc[j][1]);
    ph[j] = w.x * Relu(acc[j][2]) + w.y * Relu(acc[j][3]);
  }
}

// Every scale byte of the word in [1, kFmaScaleMax] (byte - 1 <= max - 1,
// four bytes at once).
__device__ __forceinline__ bool FmaScales(uint32_t s) {
  return __vcmpleu4(__vsub4(s, 0x01010101u), (kFmaScaleMax - 1) * 0x01010101u) == 0xffffffffu;
}

}  // namespace
}  // namespace indexer
}  // namespace dsv4
