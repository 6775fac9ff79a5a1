// CUDA handler of indexer_topk (operands in ffi/indexer_topk.h, rules in
// dsv4_jax/ops/indexer.py, arithmetic order in dsv4/indexer.h).
//
// Two launches on the handler's stream, no host sync, no allocation (the
// per-entry rank keys live in the op's `scratch` result):
//  1. ScoreKernel (or ScoreKernelSplit for small grids, see SplitScores),
//     grid (T, entry chunks): the token's q (as fp32) and weights in shared
//     memory; one thread per visible entry reads its key through the block
//     table (4 x 16-byte loads + the 4 scale bytes), decodes it into 128
//     registers and computes the score in the fixed order (the split kernel:
//     4 lanes per entry, one 32-channel block each); it stores the rank key
//     (0 for an entry of a missing block).
//     With q_format "mxfp4": QuantizeQueryKernel then ScoreKernelMxfp4
//     (integer block sums on the tensor cores; see below).
//  2. SelectKernel, one block per token: an MSB-first radix select (passes
//     of 8 bits from the top bit where the keys differ) finds the k-th
//     largest key; one ordered pass collects the
//     keys above it and the lowest-indexed keys equal to it; a bitonic sort
//     in shared memory orders them (key descending, index ascending).
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "handlers_cuda.h"
#include "indexer_topk.h"
#include "kernels.cuh"

namespace dsv4 {
namespace {

constexpr int kScoreThreads = 256;
constexpr int kSelectThreads = 512;
constexpr int kMaxK = 4096;
constexpr int64_t kPerBlock = kBlockTokens / kCsaRatio;

struct TokenInfo {
  bool ok;       // a good token of a good layer
  int64_t slot;
  int64_t n;     // visible entries
};

__device__ TokenInfo ReadToken(const IndexerTopkArgs& a, int64_t t) {
  TokenInfo ti{false, 0, 0};
  int64_t l = *a.layer, s = a.slot[t], p = a.pos[t];
  if (l < 0 || l >= a.L || s < 0 || s >= a.R || p < 0) return ti;
  ti.ok = true;
  ti.slot = s;
  ti.n = IndexVisible(p, a.E);
  return ti;
}

__global__ void __launch_bounds__(kScoreThreads) ScoreKernel(IndexerTopkArgs a) {
  __shared__ __align__(16) float qs[kIndexHeads * kIndexDim];
  __shared__ float ws[kIndexHeads];
  const int64_t t = blockIdx.x;
  const TokenInfo ti = ReadToken(a, t);
  const int64_t first = static_cast<int64_t>(blockIdx.y) * kScoreThreads;
  if (!ti.ok || first >= ti.n) return;
  // q: 8192 bf16 = 1024 x 16 bytes, four per thread
  const uint4* qg = reinterpret_cast<const uint4*>(a.q + t * kIndexHeads * kIndexDim);
  for (int v = threadIdx.x; v < kIndexHeads * kIndexDim / 8; v += kScoreThreads) {
    uint4 raw = qg[v];
    uint32_t w4[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      qs[8 * v + 2 * e] = num::BitsFloat(w4[e] << 16);
      qs[8 * v + 2 * e + 1] = num::BitsFloat(w4[e] & 0xffff0000u);
    }
  }
  if (threadIdx.x < kIndexHeads) ws[threadIdx.x] = a.weights[t * kIndexHeads + threadIdx.x];
  __syncthreads();

  const int64_t i = first + threadIdx.x;
  if (i >= ti.n) return;
  uint32_t* out = a.scratch + t * a.E + i;
  const int64_t block = a.block_table[ti.slot * a.MB + i / kPerBlock];
  if (block < 0 || block >= a.N) {
    *out = 0;
    return;
  }
  const int64_t row = (static_cast<int64_t>(*a.layer) * a.N + block) * kPerBlock + i % kPerBlock;
  const uint4* pk = reinterpret_cast<const uint4*>(a.packed + row * kIndexPacked);
  uint4 p4[4];
#pragma unroll
  for (int v = 0; v < 4; ++v) p4[v] = pk[v];
  const uint32_t sc = *reinterpret_cast<const uint32_t*>(a.scale + row * kIndexScales);
  float k[kIndexDim];
#pragma unroll
  for (int b = 0; b < kIndexScales; ++b) {
    const float s = num::E8m0ToF32(static_cast<uint8_t>(sc >> (8 * b)));
    const uint32_t w4[4] = {p4[b].x, p4[b].y, p4[b].z, p4[b].w};
#pragma unroll
    for (int c = 0; c < 32; ++c) k[32 * b + c] = E2m1Value(w4[c / 8] >> (4 * (c % 8))) * s;
  }
  float score = 0.f;
#pragma unroll 1
  for (int h = 0; h < kIndexHeads; ++h) {
    const float4* qh = reinterpret_cast<const float4*>(qs + h * kIndexDim);
    float blk[kIndexScales];
#pragma unroll
    for (int b = 0; b < kIndexScales; ++b) {
      float4 v = qh[8 * b];
      const float* kb = k + 32 * b;
      float acc = kb[0] * v.x;
      acc = acc + kb[1] * v.y;
      acc = acc + kb[2] * v.z;
      acc = acc + kb[3] * v.w;
#pragma unroll
      for (int g = 1; g < 8; ++g) {
        v = qh[8 * b + g];
        acc = acc + kb[4 * g] * v.x;
        acc = acc + kb[4 * g + 1] * v.y;
        acc = acc + kb[4 * g + 2] * v.z;
        acc = acc + kb[4 * g + 3] * v.w;
      }
      blk[b] = acc;
    }
    const float c = IndexHeadTerm(blk[0], blk[1], blk[2], blk[3], ws[h]);
    score = h == 0 ? c : score + c;
  }
  *out = IndexRankKey(score);
}

// Same scores, four lanes per entry: lane b of a group of 4 holds the 32
// key values of block b and forms blk[b] for every head; the group swaps the
// four block sums by shuffles and every lane finishes d, the head term and
// the running score identically (lane 0 stores). A quarter of the registers
// and of the serial chain of ScoreKernel per entry. q sits in shared memory
// with 4 floats of padding after each 32-float block, so the four lanes'
// 16-byte reads of one head fall in distinct banks.
constexpr int kGroupEntries = kScoreThreads / 4;
constexpr int kQBlockStride = kMxfp4Block + 4;
constexpr int kQHeadStride = kIndexScales * kQBlockStride;

__global__ void __launch_bounds__(kScoreThreads) ScoreKernelSplit(IndexerTopkArgs a) {
  __shared__ __align__(16) float qs[kIndexHeads * kQHeadStride];
  __shared__ float ws[kIndexHeads];
  const int64_t t = blockIdx.x;
  const TokenInfo ti = ReadToken(a, t);
  const int64_t first = static_cast<int64_t>(blockIdx.y) * kGroupEntries;
  if (!ti.ok || first >= ti.n) return;
  const uint4* qg = reinterpret_cast<const uint4*>(a.q + t * kIndexHeads * kIndexDim);
  for (int v = threadIdx.x; v < kIndexHeads * kIndexDim / 8; v += kScoreThreads) {
    uint4 raw = qg[v];
    uint32_t w4[4] = {raw.x, raw.y, raw.z, raw.w};
    const int c0 = 8 * v;                     // first channel of these 8 (same head, block)
    float* dst = qs + (c0 / kIndexDim) * kQHeadStride + ((c0 % kIndexDim) / kMxfp4Block) * kQBlockStride +
                 c0 % kMxfp4Block;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      dst[2 * e] = num::BitsFloat(w4[e] << 16);
      dst[2 * e + 1] = num::BitsFloat(w4[e] & 0xffff0000u);
    }
  }
  if (threadIdx.x < kIndexHeads) ws[threadIdx.x] = a.weights[t * kIndexHeads + threadIdx.x];
  __syncthreads();

  const int lane = threadIdx.x & 31;
  const int b = threadIdx.x & 3;
  const unsigned group = 0xfu << (lane & ~3);
  const int64_t i = first + (threadIdx.x >> 2);
  if (i >= ti.n) return;                      // whole groups leave together
  uint32_t* out = a.scratch + t * a.E + i;
  const int64_t block = a.block_table[ti.slot * a.MB + i / kPerBlock];
  if (block < 0 || block >= a.N) {
    if (b == 0) *out = 0;
    return;
  }
  const int64_t row = (static_cast<int64_t>(*a.layer) * a.N + block) * kPerBlock + i % kPerBlock;
  const uint4 p4 = reinterpret_cast<const uint4*>(a.packed + row * kIndexPacked)[b];
  const float s = num::E8m0ToF32(a.scale[row * kIndexScales + b]);
  const uint32_t w4[4] = {p4.x, p4.y, p4.z, p4.w};
  float k[kMxfp4Block];
#pragma unroll
  for (int c = 0; c < kMxfp4Block; ++c) k[c] = E2m1Value(w4[c / 8] >> (4 * (c % 8))) * s;
  const float4* qb = reinterpret_cast<const float4*>(qs + b * kQBlockStride);
  float score = 0.f;
#pragma unroll 2
  for (int h = 0; h < kIndexHeads; ++h) {
    const float4* qh = qb + h * (kQHeadStride / 4);
    float4 v = qh[0];
    float acc = k[0] * v.x;
    acc = acc + k[1] * v.y;
    acc = acc + k[2] * v.z;
    acc = acc + k[3] * v.w;
#pragma unroll
    for (int g = 1; g < 8; ++g) {
      v = qh[g];
      acc = acc + k[4 * g] * v.x;
      acc = acc + k[4 * g + 1] * v.y;
      acc = acc + k[4 * g + 2] * v.z;
      acc = acc + k[4 * g + 3] * v.w;
    }
    const float b0 = __shfl_sync(group, acc, 0, 4);
    const float b1 = __shfl_sync(group, acc, 1, 4);
    const float b2 = __shfl_sync(group, acc, 2, 4);
    const float b3 = __shfl_sync(group, acc, 3, 4);
    const float c = IndexHeadTerm(b0, b1, b2, b3, ws[h]);
    score = h == 0 ? c : score + c;
  }
  if (b == 0) *out = IndexRankKey(score);
}

// ---- q_format "mxfp4": block sums on the int8 tensor cores --------------------
// QuantizeQueryKernel rounds each token's q to MXFP4 once (qscratch: int8
// codes q2[64][128] holding twice the e2m1 value, f32 factors Q[4][64]).
// ScoreKernelMxfp4 then gives each warp tiles of 16 consecutive entries (one
// logical block holds two tiles, so a tile needs one block-table read): per
// 32-channel block b and 8 heads, one mma.m16n8k32 s8 x s8 -> s32 forms the
// 16 x 8 integer block sums S exactly. Channels are permuted identically in
// both operands (lane c of a quad holds channels 8c..8c+7 of the block,
// which are 4 consecutive packed key bytes); an integer sum does not care.
// The accumulator starts at 0x4B400000, so its bits read as a float are
// 1.5 * 2^23 + S, and one fma gives u = fl(S * K) = fma(bits, K, -1.5 * 2^23 * K)
// (exact products; valid while that constant is finite: key scale bytes 1
// to 231, else the tile takes the subtract-then-multiply path). The head sum
// is the balanced tree of dsv4/indexer.h: within a lane, then across the
// quad's lanes by shuffles.
constexpr int kQuantThreads = 256;                           // 32 (head, block) pairs
constexpr int kMmaThreads = 128;
constexpr int kMmaWarps = kMmaThreads / 32;
constexpr int kTile = 16;                                    // entries per warp tile
constexpr int kMaxTilesPerWarp = 16;
constexpr uint32_t kMagicBits = 0x4B400000u;                 // 1.5 * 2^23
constexpr float kMagic = 12582912.f;
constexpr uint32_t kFastScaleMax = 231;

// qscratch of the CUDA handler: the MMA's B operands in fragment order, so a
// lane's 8 bytes for (8 heads j, block b) are at ((j * 4 + b) * 32 + lane) * 8:
// lane (g, c) = (lane / 4, lane % 4) holds head 8j + g, channels 32b + 8c ..
// 32b + 8c + 7. Then the f32 factors Q[b][h].
// Eight lanes per (head, block), four channels each: the block's amax by
// shuffles, then every lane codes its four values and stores them as one
// word of the fragment. Grid (T, 8): 32 (head, block) pairs per CTA.
__global__ void __launch_bounds__(kQuantThreads) QuantizeQueryKernel(IndexerTopkArgs a) {
  const int64_t t = blockIdx.x;
  const TokenInfo ti = ReadToken(a, t);
  if (!ti.ok || ti.n == 0) return;
  const int pair = blockIdx.y * (kQuantThreads / 8) + threadIdx.x / 8;
  const int h = pair / kIndexScales, b = pair % kIndexScales, r = threadIdx.x % 8;
  const uint2 raw = *reinterpret_cast<const uint2*>(
      a.q + (t * kIndexHeads + h) * kIndexDim + b * kMxfp4Block + 4 * r);
  const float x[4] = {num::BitsFloat(raw.x << 16), num::BitsFloat(raw.x & 0xffff0000u),
                      num::BitsFloat(raw.y << 16), num::BitsFloat(raw.y & 0xffff0000u)};
  float amax = num::Mxfp4AmaxFloor();
#pragma unroll
  for (int v = 0; v < 4; ++v) amax = num::MaxF(amax, num::AbsF(x[v]));
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) amax = num::MaxF(amax, __shfl_xor_sync(cuda::kFull, amax, o));
  const uint8_t sb = num::Mxfp4ScaleByte(amax);
  const float s = num::E8m0ToF32(sb);
  uint32_t word = 0;
#pragma unroll
  for (int v = 0; v < 4; ++v)
    word |= static_cast<uint32_t>(static_cast<uint8_t>(E2m1Twice(num::Mxfp4Code(x[v], s))))
            << (8 * v);
  uint8_t* qs = a.qscratch + t * kQueryScratchBytes;
  // channels 32b + 4r .. +3: half r % 2 of lane (h % 8, r / 2)'s 8 bytes
  uint32_t* frag = reinterpret_cast<uint32_t*>(qs) +
                   2 * (((h / 8) * kIndexScales + b) * 32 + (h % 8) * 4 + r / 2) + r % 2;
  *frag = word;
  if (r == 0) reinterpret_cast<float*>(qs + kQueryCodeBytes)[b * kIndexHeads + h] = IndexQueryFactor(sb);
}

// Four e2m1 codes (the low 16 bits, code k in bits 4k..4k+3) -> four int8
// holding twice their values: magnitudes and negated magnitudes by byte
// permutes of two 8-entry tables, then a permute picks by the sign bit.
__device__ __forceinline__ uint32_t E2m1x4ToInt8x4(uint32_t nib) {
  const uint32_t sel = nib & 0x7777u;
  const uint32_t pos = __byte_perm(0x03020100u, 0x0C080604u, sel);   // 0 1 2 3 | 4 6 8 12
  const uint32_t neg = __byte_perm(0xFDFEFF00u, 0xF4F8FAFCu, sel);   // negated
  return __byte_perm(pos, neg, 0x3210u | ((nib & 0x8888u) >> 1));
}

__device__ __forceinline__ void MmaS8(uint32_t (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                      uint32_t a3, uint32_t b0, uint32_t b1) {
  const uint32_t c = kMagicBits;
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%10,%10,%10};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(c));
}

// d > 0 ? d : 0 (NaN -> 0) in one instruction. fmaxf may return -0 for
// d = -0; a zero's sign cannot change a sum with a non-zero term, and the
// rank key treats -0 as +0, so the keys equal the definition's.
__device__ __forceinline__ float Relu(float d) { return fmaxf(d, 0.f); }

// Levels 2..6 of the head tree. p[j] (level 1) holds heads 8j+2c, 8j+2c+1
// of lane c of the quad; every lane of the quad returns the full sum.
__device__ __forceinline__ float QuadHeadTree(const float (&p)[8], int c) {
  const bool odd = c & 1, high = c & 2;
  float l2[4], l3[2];
#pragma unroll
  for (int k = 0; k < 4; ++k) {      // heads 4i..4i+3: lanes c, c^1; keep j = 2k + (c & 1)
    const float mine = odd ? p[2 * k + 1] : p[2 * k], send = odd ? p[2 * k] : p[2 * k + 1];
    l2[k] = mine + __shfl_xor_sync(cuda::kFull, send, 1);
  }
#pragma unroll
  for (int m = 0; m < 2; ++m) {      // heads 8j..8j+7: lanes c, c^2; keep j = 4m + c
    const float mine = high ? l2[2 * m + 1] : l2[2 * m], send = high ? l2[2 * m] : l2[2 * m + 1];
    l3[m] = mine + __shfl_xor_sync(cuda::kFull, send, 2);
  }
#pragma unroll
  for (int m = 0; m < 2; ++m) l3[m] = l3[m] + __shfl_xor_sync(cuda::kFull, l3[m], 1);  // 16 heads
#pragma unroll
  for (int m = 0; m < 2; ++m) l3[m] = l3[m] + __shfl_xor_sync(cuda::kFull, l3[m], 2);  // 32 heads
  return l3[0] + l3[1];
}

// Scores of the tile's entries g and g + 8 (this lane's rows).
template <bool kFast>
__device__ __forceinline__ void ScoreTileMxfp4(const uint2* bfrag,
                                               const float2 (*qf_s)[kIndexHeads / 2],
                                               const float2* w_s, const uint32_t (&kg)[4],
                                               const uint32_t (&kh)[4], uint32_t sg, uint32_t sh,
                                               int c, float* score_g, float* score_h) {
  float acc[8][4];
#pragma unroll
  for (int b = 0; b < kIndexScales; ++b) {
    const uint32_t a0 = E2m1x4ToInt8x4(kg[b] & 0xffffu), a2 = E2m1x4ToInt8x4(kg[b] >> 16);
    const uint32_t a1 = E2m1x4ToInt8x4(kh[b] & 0xffffu), a3 = E2m1x4ToInt8x4(kh[b] >> 16);
    // fast tiles hold scale bytes 1..231: 2^(byte - 127) is the byte as an exponent
    const float Kg = kFast ? __uint_as_float(((sg >> (8 * b)) & 255u) << 23)
                           : num::E8m0ToF32(static_cast<uint8_t>(sg >> (8 * b)));
    const float Kh = kFast ? __uint_as_float(((sh >> (8 * b)) & 255u) << 23)
                           : num::E8m0ToF32(static_cast<uint8_t>(sh >> (8 * b)));
    const float MKg = -kMagic * Kg, MKh = -kMagic * Kh;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t d[4];
      const uint2 bq = bfrag[(j * kIndexScales + b) * 32];
      MmaS8(d, a0, a1, a2, a3, bq.x, bq.y);
      const float2 Q = qf_s[b][4 * j + c];
      float u[4];
      if (kFast) {
        u[0] = fmaf(__uint_as_float(d[0]), Kg, MKg);
        u[1] = fmaf(__uint_as_float(d[1]), Kg, MKg);
        u[2] = fmaf(__uint_as_float(d[2]), Kh, MKh);
        u[3] = fmaf(__uint_as_float(d[3]), Kh, MKh);
      } else {
        u[0] = (__uint_as_float(d[0]) - kMagic) * Kg;
        u[1] = (__uint_as_float(d[1]) - kMagic) * Kg;
        u[2] = (__uint_as_float(d[2]) - kMagic) * Kh;
        u[3] = (__uint_as_float(d[3]) - kMagic) * Kh;
      }
      if (b == 0) {
        acc[j][0] = u[0] * Q.x;
        acc[j][1] = u[1] * Q.y;
        acc[j][2] = u[2] * Q.x;
        acc[j][3] = u[3] * Q.y;
      } else {
        acc[j][0] = fmaf(u[0], Q.x, acc[j][0]);
        acc[j][1] = fmaf(u[1], Q.y, acc[j][1]);
        acc[j][2] = fmaf(u[2], Q.x, acc[j][2]);
        acc[j][3] = fmaf(u[3], Q.y, acc[j][3]);
      }
    }
  }
  float pg[8], ph[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {      // level 1: heads 8j+2c and 8j+2c+1
    const float2 w = w_s[4 * j + c];
    pg[j] = w.x * Relu(acc[j][0]) + w.y * Relu(acc[j][1]);
    ph[j] = w.x * Relu(acc[j][2]) + w.y * Relu(acc[j][3]);
  }
  *score_g = QuadHeadTree(pg, c);
  *score_h = QuadHeadTree(ph, c);
}

// Every scale byte of the word in [1, kFastScaleMax] (byte - 1 <= max - 1,
// four bytes at once).
__device__ __forceinline__ bool FastScales(uint32_t s) {
  return __vcmpleu4(__vsub4(s, 0x01010101u), (kFastScaleMax - 1) * 0x01010101u) == 0xffffffffu;
}

// Key bytes of one tile for this lane (rows g and g + 8, channels 8c.. of
// each block) and their scale words; false for a missing block (no loads).
struct TileKeys {
  uint32_t kg[4], kh[4], sg, sh;
};

__device__ __forceinline__ bool LoadTileKeys(const IndexerTopkArgs& a, int64_t l, int32_t block,
                                             int64_t e0, int g, int c, TileKeys* k) {
  if (block < 0 || block >= a.N) return false;
  const int64_t row_g = (l * a.N + block) * kPerBlock + e0 % kPerBlock + g;
  const uint32_t* pg = reinterpret_cast<const uint32_t*>(a.packed + row_g * kIndexPacked);
  const uint32_t* ph = pg + 8 * kIndexPacked / 4;
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    k->kg[b] = __ldg(pg + 4 * b + c);
    k->kh[b] = __ldg(ph + 4 * b + c);
  }
  k->sg = __ldg(reinterpret_cast<const uint32_t*>(a.scale + row_g * kIndexScales));
  k->sh = __ldg(reinterpret_cast<const uint32_t*>(a.scale + (row_g + 8) * kIndexScales));
  return true;
}

// One CTA: one token, kMmaWarps * tiles_per_warp * 16 consecutive entries;
// warp w takes tiles w, w + 4, ...; the next tile's keys are loaded while
// the current one is scored.
__global__ void __launch_bounds__(kMmaThreads, 4) ScoreKernelMxfp4(IndexerTopkArgs a,
                                                                   int tiles_per_warp) {
  __shared__ uint2 bfrag_s[kQueryCodeBytes / 8];            // B operands, fragment order
  __shared__ float2 qf_s[kIndexScales][kIndexHeads / 2];   // Q[b][h], two heads a float2
  __shared__ float2 w_s[kIndexHeads / 2];
  __shared__ int32_t blocks_s[kMmaWarps * kMaxTilesPerWarp * kTile / kPerBlock];
  const int64_t t = blockIdx.x;
  const TokenInfo ti = ReadToken(a, t);
  const int64_t span = static_cast<int64_t>(kMmaWarps) * tiles_per_warp * kTile;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * span;
  if (!ti.ok || first >= ti.n) return;
  const uint8_t* qs = a.qscratch + t * kQueryScratchBytes;
  const uint4* src = reinterpret_cast<const uint4*>(qs);
  for (int i = threadIdx.x; i < kQueryCodeBytes / 16; i += kMmaThreads)
    reinterpret_cast<uint4*>(bfrag_s)[i] = src[i];
  const float* qfg = reinterpret_cast<const float*>(qs + kQueryCodeBytes);
  for (int i = threadIdx.x; i < kIndexScales * kIndexHeads; i += kMmaThreads)
    (&qf_s[0][0].x)[i] = qfg[i];
  if (threadIdx.x < kIndexHeads) (&w_s[0].x)[threadIdx.x] = a.weights[t * kIndexHeads + threadIdx.x];
  if (threadIdx.x < span / kPerBlock) {
    const int64_t j = first / kPerBlock + threadIdx.x;
    blocks_s[threadIdx.x] = j < a.MB ? a.block_table[ti.slot * a.MB + j] : -1;
  }
  __syncthreads();

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const uint2* bfrag = bfrag_s + lane;
  uint32_t* keys = a.scratch + t * a.E;
  const int64_t l = *a.layer;
  const int64_t stride = static_cast<int64_t>(kMmaWarps) * kTile;
  int64_t e0 = first + warp * kTile;
  TileKeys cur, next;
  bool cur_ok = e0 < ti.n && LoadTileKeys(a, l, blocks_s[(e0 - first) / kPerBlock], e0, g, c, &cur);
  for (int it = 0; it < tiles_per_warp && e0 < ti.n; ++it, e0 += stride) {   // uniform per warp
    const int64_t e1 = e0 + stride;
    const bool next_ok = it + 1 < tiles_per_warp && e1 < ti.n &&
                         LoadTileKeys(a, l, blocks_s[(e1 - first) / kPerBlock], e1, g, c, &next);
    if (!cur_ok) {
      if (lane < kTile && e0 + lane < ti.n) keys[e0 + lane] = 0;
    } else {
      float score_g, score_h;
      if (__all_sync(cuda::kFull, FastScales(cur.sg) && FastScales(cur.sh)))
        ScoreTileMxfp4<true>(bfrag, qf_s, w_s, cur.kg, cur.kh, cur.sg, cur.sh, c, &score_g, &score_h);
      else
        ScoreTileMxfp4<false>(bfrag, qf_s, w_s, cur.kg, cur.kh, cur.sg, cur.sh, c, &score_g, &score_h);
      if (c == 0 && e0 + g < ti.n) keys[e0 + g] = IndexRankKey(score_g);
      if (c == 1 && e0 + g + 8 < ti.n) keys[e0 + g + 8] = IndexRankKey(score_h);
    }
    cur = next;
    cur_ok = next_ok;
  }
}

// Tiles per warp: enough CTAs for about four per multiprocessor, at most
// kMaxTilesPerWarp (each CTA first loads the token's 9 KB of q operands).
// DSV4_INDEXER_TILES=n (read once) fixes it, for benchmarks.
int TilesPerWarp(int64_t T, int64_t E) {
  static const int forced = [] {
    const char* v = std::getenv("DSV4_INDEXER_TILES");
    const int n = v ? std::atoi(v) : 0;
    return n >= 1 && n <= kMaxTilesPerWarp ? n : 0;
  }();
  if (forced) return forced;
  const int64_t per_tile_cta = static_cast<int64_t>(kTile) * kMmaWarps * cuda::SmCount() * 4;
  const int64_t tpw = T * E / per_tile_cta;
  return static_cast<int>(tpw < 1 ? 1 : tpw > kMaxTilesPerWarp ? kMaxTilesPerWarp : tpw);
}

// Inclusive sum over the block's threads of one value each; returns the
// exclusive prefix and (via *total) the block total. `warp_sums` holds
// kSelectThreads / 32 ints.
__device__ int BlockExclusiveScan(int x, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int v = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < kSelectThreads / 32; ++w) {
    int s = warp_sums[w];
    if (w < warp) before += s;
    all += s;
  }
  __syncthreads();
  *total = all;
  return before + v - x;
}

// f(key) for keys[tid], keys[tid + kSelectThreads], ... below n; eight loads
// are issued before their uses, so a pass is not one L2 round trip per key.
template <typename F>
__device__ __forceinline__ void ForEachKey(const uint32_t* keys, int64_t n, F f) {
  constexpr int kUnroll = 8;
  int64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * kSelectThreads < n; i += kUnroll * kSelectThreads) {
    uint32_t k[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) k[u] = keys[i + u * kSelectThreads];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) f(k[u]);
  }
  for (; i < n; i += kSelectThreads) f(keys[i]);
}

__global__ void __launch_bounds__(kSelectThreads) SelectKernel(IndexerTopkArgs a, int kp) {
  extern __shared__ unsigned long long sel[];   // kp composite keys
  __shared__ int hist[256];
  __shared__ int warp_sums[kSelectThreads / 32];
  __shared__ uint32_t s_prefix, s_need, s_ncand;
  __shared__ int s_gt;
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x;
  const int64_t l = *a.layer;
  if (t == 0 && tid == 0 && (l < 0 || l >= a.L)) atomicAdd(&a.errors[kBadLayer], 1);
  if (t >= a.T) return;
  int32_t* out = a.indices + t * a.K;
  const TokenInfo ti = ReadToken(a, t);
  if (!ti.ok) {
    if (tid == 0 && l >= 0 && l < a.L) {
      const int64_t s = a.slot[t];
      if (s != -1 && (s < 0 || s >= a.R)) atomicAdd(&a.errors[kBadSlot], 1);
      else if (s != -1) atomicAdd(&a.errors[kBadPosition], 1);
    }
    for (int64_t r = tid; r < a.K; r += kSelectThreads) out[r] = -1;
    return;
  }
  const int64_t n = ti.n;
  for (int64_t j = tid; j * kPerBlock < n; j += kSelectThreads) {
    const int64_t b = a.block_table[ti.slot * a.MB + j];
    if (b < 0 || b >= a.N) atomicAdd(&a.errors[kMissingBlock], 1);
  }
  const uint32_t* keys = a.scratch + t * a.E;

  // ---- range and count of the candidate keys (one pass, no atomics) ----
  // Scores of one token are of similar size, so their rank keys share the
  // top bits; a radix on fixed bytes would pile every key of the first pass
  // into one or two bins (serialized shared atomics). The radix starts at
  // the highest bit where the smallest and largest keys differ instead.
  uint32_t lo = 0xffffffffu, hi = 0;
  int cnt = 0;
  ForEachKey(keys, n, [&](uint32_t key) {
    if (key != 0) {
      lo = min(lo, key);
      hi = max(hi, key);
      ++cnt;
    }
  });
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
  }
  __shared__ uint32_t w_lo[kSelectThreads / 32], w_hi[kSelectThreads / 32];
  if ((tid & 31) == 0) {
    w_lo[tid >> 5] = lo;
    w_hi[tid >> 5] = hi;
    warp_sums[tid >> 5] = cnt;
  }
  __syncthreads();
  if (tid == 0) {
    uint32_t l0 = 0xffffffffu, h0 = 0, c0 = 0;
    for (int w = 0; w < kSelectThreads / 32; ++w) {
      l0 = min(l0, w_lo[w]);
      h0 = max(h0, w_hi[w]);
      c0 += static_cast<uint32_t>(warp_sums[w]);
    }
    s_ncand = c0;
    s_prefix = h0;
    s_need = l0 ^ h0;
  }
  __syncthreads();
  const uint32_t ncand = s_ncand, diff = s_need;
  uint32_t prefix = 0, need = 0;
  if (ncand > static_cast<uint32_t>(a.K)) {
    // ---- radix select: the K-th largest key, 8 bits a pass from the top
    // differing bit (keys equal above it are the common prefix) ----
    need = static_cast<uint32_t>(a.K);
    int top = diff ? 31 - __clz(diff) : -1;
    uint32_t mask = top < 0 ? ~0u : top == 31 ? 0u : ~((2u << top) - 1u);   // bits above top
    prefix = s_prefix & mask;
    __syncthreads();
    for (; top >= 0; top -= 8) {
      const int width = top + 1 < 8 ? top + 1 : 8;
      const int shift = top + 1 - width;
      for (int b = tid; b < 256; b += kSelectThreads) hist[b] = 0;
      __syncthreads();
      ForEachKey(keys, n, [&](uint32_t key) {
        if (key != 0 && (key & mask) == prefix)
          atomicAdd(&hist[(key >> shift) & ((1u << width) - 1u)], 1);
      });
      __syncthreads();
      if (tid < 32) {
        // lane L holds bins 8(31-L) .. 8(31-L)+7: lane 0 the highest
        const int base = 8 * (31 - tid);
        int c[8], sum = 0;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          c[e] = hist[base + e];
          sum += c[e];
        }
        int incl = sum;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          int y = __shfl_up_sync(0xffffffffu, incl, o);
          if (tid >= o) incl += y;
        }
        const int excl = incl - sum;
        // the keys matching the prefix number at least `need`: one lane crosses
        if (excl < static_cast<int>(need) && incl >= static_cast<int>(need)) {
          int cum = excl;
          for (int e = 7; e >= 0; --e) {
            if (cum + c[e] >= static_cast<int>(need)) {
              s_prefix = prefix | (static_cast<uint32_t>(base + e) << shift);
              s_need = need - static_cast<uint32_t>(cum);
              break;
            }
            cum += c[e];
          }
        }
      }
      __syncthreads();
      prefix = s_prefix;
      need = s_need;
      mask |= ((1u << width) - 1u) << shift;
      __syncthreads();
    }
    // top < 0 from the start: every candidate holds the same key; the first
    // K by index are taken (prefix = that key, need = K)
  }
  const uint32_t thr = prefix;
  const int64_t m = ncand < static_cast<uint32_t>(a.K) ? ncand : a.K;
  const int64_t n_gt = m - need;   // keys above thr (all of them)

  // ---- collect: all keys > thr in any order, the first `need` keys == thr ----
  for (int r = tid; r < kp; r += kSelectThreads) sel[r] = 0ull;
  if (tid == 0) s_gt = 0;
  __syncthreads();
  int taken_eq = 0;
  for (int64_t start = 0; start < n; start += kSelectThreads) {
    const int64_t i = start + tid;
    const uint32_t key = i < n ? keys[i] : 0u;
    const unsigned long long comp =
        (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
    if (key != 0 && key > thr) sel[atomicAdd(&s_gt, 1)] = comp;
    if (need > 0 && static_cast<uint32_t>(taken_eq) < need) {   // uniform across the block
      const int eq = (key != 0 && key == thr) ? 1 : 0;
      int total;
      const int rank = taken_eq + BlockExclusiveScan(eq, warp_sums, &total);
      if (eq && static_cast<uint32_t>(rank) < need) sel[n_gt + rank] = comp;
      taken_eq += total;
    }
  }
  __syncthreads();

  // ---- bitonic sort, descending ----
  for (int size = 2; size <= kp; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int x = tid; x < kp; x += kSelectThreads) {
        const int y = x ^ stride;
        if (y > x) {
          const unsigned long long u = sel[x], v = sel[y];
          const bool desc = (x & size) == 0;
          if (desc ? (u < v) : (u > v)) {
            sel[x] = v;
            sel[y] = u;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int64_t r = tid; r < a.K; r += kSelectThreads)
    out[r] = r < m ? static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(sel[r])) : -1;
}

// Which score kernel runs. Both give the same bits. On an H100 (see
// benchmarks/RESULTS-indexer.md) the four-lane kernel is faster only while
// the grid is small (it is bound by shared-memory wavefronts: its lanes read
// four distinct q addresses per load where the one-thread kernel's warp reads
// one), so it runs when T * E <= kSplitMaxWork. DSV4_INDEXER_SCORE=entry or
// =split forces one (read once, on the host) for comparisons.
constexpr int64_t kSplitMaxWork = 16384;

bool SplitScores(int64_t T, int64_t E) {
  static const int forced = [] {
    const char* v = std::getenv("DSV4_INDEXER_SCORE");
    if (v && std::string(v) == "entry") return 0;
    if (v && std::string(v) == "split") return 1;
    return -1;
  }();
  return forced >= 0 ? forced == 1 : T * E <= kSplitMaxWork;
}

ffi::Error IndexerTopkImpl(cudaStream_t stream, ffi::AnyBuffer layer, ffi::AnyBuffer token_slot,
                           ffi::AnyBuffer token_pos, ffi::AnyBuffer q, ffi::AnyBuffer weights,
                           ffi::AnyBuffer block_table, ffi::AnyBuffer errors_in,
                           ffi::AnyBuffer packed, ffi::AnyBuffer scale,
                           ffi::Result<ffi::AnyBuffer> indices,
                           ffi::Result<ffi::AnyBuffer> scratch,
                           ffi::Result<ffi::AnyBuffer> qscratch,
                           ffi::Result<ffi::AnyBuffer> errors, int64_t q_format) {
  IndexerTopkArgs a;
  DSV4_RETURN_IF_ERROR(ValidateIndexerTopk(layer, token_slot, token_pos, q, weights, block_table,
                                           errors_in, packed, scale, *indices, *scratch,
                                           *qscratch, *errors, q_format, &a));
  if (a.K > kMaxK)
    return ffi::Error::InvalidArgument("indices (result): k must be at most " +
                                       std::to_string(kMaxK) + " on CUDA, got " +
                                       std::to_string(a.K));
  if (a.T > 0 && a.E > 0) {
    const int64_t chunks = (a.E + kScoreThreads - 1) / kScoreThreads;
    if (chunks > 65535 || a.T > 0x7fffffff)
      return ffi::Error::InvalidArgument("indexer_topk: too many tokens or entries for one grid");
    if (a.q_format == kQueryMxfp4) {
      const int tpw = TilesPerWarp(a.T, a.E);
      const int64_t span = static_cast<int64_t>(kMmaWarps) * tpw * kTile;
      const int64_t ctas = (a.E + span - 1) / span;
      if (ctas > 65535)
        return ffi::Error::InvalidArgument("indexer_topk: too many entries for one grid");
      QuantizeQueryKernel<<<dim3(static_cast<unsigned>(a.T), kIndexHeads * kIndexScales * 8 /
                                                                  kQuantThreads),
                            kQuantThreads, 0, stream>>>(a);
      ScoreKernelMxfp4<<<dim3(static_cast<unsigned>(a.T), static_cast<unsigned>(ctas)),
                         kMmaThreads, 0, stream>>>(a, tpw);
    } else if (SplitScores(a.T, a.E)) {
      const int64_t groups = (a.E + kGroupEntries - 1) / kGroupEntries;
      if (groups > 65535)
        return ffi::Error::InvalidArgument("indexer_topk: too many entries for one grid");
      ScoreKernelSplit<<<dim3(static_cast<unsigned>(a.T), static_cast<unsigned>(groups)),
                         kScoreThreads, 0, stream>>>(a);
    } else {
      ScoreKernel<<<dim3(static_cast<unsigned>(a.T), static_cast<unsigned>(chunks)),
                    kScoreThreads, 0, stream>>>(a);
    }
  }
  int kp = 1;
  while (kp < a.K) kp <<= 1;
  const unsigned grid = static_cast<unsigned>(a.T > 0 ? a.T : 1);
  SelectKernel<<<grid, kSelectThreads, kp * sizeof(unsigned long long), stream>>>(a, kp);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("indexer_topk launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(IndexerTopkCuda, IndexerTopkImpl,
                              BindIndexerTopk(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
