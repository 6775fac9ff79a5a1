// The mxfp4 score kernel's query: q rounded to MXFP4 in shared memory, in MMA fragment order.
#pragma once

#include <cstdint>

#include "common/bf16_chunks.cuh"
#include "dsv4/indexer.h"
#include "dsv4/indexer_topk.h"
#include "dsv4/numerics.h"
#include "indexer_topk/launch_policy.h"
#include "indexer_topk/mxfp4_head_tree.cuh"
#include "indexer_topk/mxfp4_mma.cuh"
#include "indexer_topk/token.cuh"

namespace dsv4 {
namespace indexer {
namespace {  // internal linkage: see cuda/indexer_topk/indexer_topk.cu

constexpr int kFragWords = kQueryCodeBytes / 16;             // uint4 per code region
constexpr int kQueryPairs = kIndexHeads * kIndexScales;      // (head, block) pairs of q
constexpr int kQueryPairsPerThread = (kQueryPairs + kMmaThreads - 1) / kMmaThreads;
static_assert(kQueryPairs % 32 == 0 && kMmaThreads % 32 == 0, "whole warps of query pairs");

// Per-block form: the uint32 of the code region holding head h, channels
// 32b + 4r .. + 3, in fragment order: a uint4 per (n-tile j, block pair,
// lane) with .xy for the even block and .zw for the odd one.
__device__ __forceinline__ int BlockFragWord(int h, int b, int r) {
  const int j = (h % 16) / 2, n = 2 * (h / 16) + h % 2;
  return 4 * ((j * 2 + b / 2) * 32 + n * 4 + r / 2) + 2 * (b % 2) + r % 2;
}

// Fast form: block b in quad lane b, k-step kk = r / 2 (a uint4 per (n-tile
// j, k-step pair, lane): .xy the even k-step, .zw the odd one).
__device__ __forceinline__ int FastFragWord(int h, int b, int r) {
  const int j = (h % 16) / 2, n = 2 * (h / 16) + h % 2, kk = r / 2;
  return 4 * ((j * 2 + kk / 2) * 32 + n * 4 + b) + 2 * (kk % 2) + r % 2;
}

// The token's query as the MMAs read it, in shared memory: the MXFP4
// rounding of q (dsv4/indexer.h) in both fragment orders, the per-block
// factors and weights, and the fast form's head terms, accumulator starts
// and tree signs. The fast-form constants of heads 16c + 2j, +1 sit at index
// 4j + c, so the four quad lanes' 16-byte reads of one j fall in distinct
// banks.
struct QueryOperands {
  uint4 fast[kFragWords];                    // shifted codes, fast fragment order
  uint4 block[kFragWords];                   // codes, per-block fragment order
  float2 qf[kIndexScales][kIndexHeads / 2];  // Q[b][h], two heads a float2
  float2 w[kIndexHeads / 2];
  float4 leaf[kIndexHeads / 2];              // s, s', -2^23 s, -2^23 s' (s = |wq| 2^-72)
  uint4 start[kIndexHeads / 2];              // S, S', S, S'
  TreeSigns tree[4];                         // of quad lane c
};

// One (head, block) of the token's query as loaded: 32 bf16 and the head's
// weight.
struct QueryBlockRaw {
  uint4 q[kMxfp4Block / 8];
  float w;
};
__device__ __forceinline__ QueryBlockRaw LoadQueryBlock(const IndexerTopkArgs& a, int64_t t, int h,
                                                        int b) {
  QueryBlockRaw r;
  const uint4* src =
      reinterpret_cast<const uint4*>(a.q + (t * kIndexHeads + h) * kIndexDim + b * kMxfp4Block);
#pragma unroll
  for (int i = 0; i < kMxfp4Block / 8; ++i) r.q[i] = src[i];
  r.w = a.weights[t * kIndexHeads + h];
  return r;
}

// Whether a loaded (head, block) holds no NaN or Inf, its weight included.
__device__ __forceinline__ bool QueryBlockFinite(const QueryBlockRaw& raw) {
  bool ok = num::IsFinite(raw.w);
#pragma unroll
  for (int i = 0; i < kMxfp4Block / 8; ++i) ok &= QueryWordFinite(raw.q[i]);
  return ok;
}

// One (head h, block b) of the token's query into `qo`: the block's scale
// byte, its 32 codes and (with the head's other three blocks, in lanes
// 4(h mod 8) + b of this warp) the head's fast-form guards and code sum.
// Returns whether the head is within the guards.
__device__ bool QuantizeQueryPair(const QueryBlockRaw& raw, int h, int b, QueryOperands& qo) {
  const float w = raw.w;
  float x[kMxfp4Block];
#pragma unroll
  for (int i = 0; i < kMxfp4Block / 8; ++i) {
    const uint32_t v[4] = {raw.q[i].x, raw.q[i].y, raw.q[i].z, raw.q[i].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      x[8 * i + 2 * e] = num::BitsFloat(v[e] << 16);
      x[8 * i + 2 * e + 1] = num::BitsFloat(v[e] & 0xffff0000u);
    }
  }
  int8_t q2[kMxfp4Block];
  const uint32_t sb = QuantizeIndexQueryBlock(x, q2);
  uint32_t mq = sb, maxq = sb;
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    mq = min(mq, __shfl_xor_sync(cuda::kFull, mq, o));
    maxq = max(maxq, __shfl_xor_sync(cuda::kFull, maxq, o));
  }
  const float wq = IndexQueryFastWeight(mq, maxq, w);
  const uint32_t sq = num::IsNan(wq) ? 0 : sb - mq;
  int sum = 0;
#pragma unroll
  for (int r = 0; r < kMxfp4Block / 4; ++r) {
    uint32_t word = 0, shifted = 0;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const uint32_t code = static_cast<uint8_t>(q2[4 * r + v]);
      word |= code << (8 * v);
      shifted |= ((code << sq) & 255u) << (8 * v);
    }
    sum = __dp4a(static_cast<int>(shifted), 0x01010101, sum);   // four signed bytes
    reinterpret_cast<uint32_t*>(qo.block)[BlockFragWord(h, b, r)] = word;
    reinterpret_cast<uint32_t*>(qo.fast)[FastFragWord(h, b, r)] = shifted;
  }
  (&qo.qf[b][0].x)[h] = IndexQueryFactor(sb);
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) sum += __shfl_xor_sync(cuda::kFull, sum, o);
  if (b == 0) {
    const int pair = h / 2, slot = 4 * (pair % 8) + pair / 8, p = h % 2;
    (&qo.w[0].x)[h] = w;
    const float sw = num::AbsF(wq) * __uint_as_float(kLeafScaleBits);   // exact in the guards
    (&qo.leaf[slot].x)[p] = sw;
    (&qo.leaf[slot].x)[2 + p] = -kFastMagic * sw;
    // |128 sum| < 2^21: the start's bits are those of a float in [2^22, 2^24)
    uint32_t* st = &qo.start[slot].x + p;
    st[0] = st[2] = kFastMagicBits - 128u * static_cast<uint32_t>(sum);
  }
  return !num::IsNan(wq);
}

}  // namespace
}  // namespace indexer
}  // namespace dsv4
