// indexer_topk's scores for q_format "bf16": one thread an entry, or four lanes on small grids.
#pragma once

#include <cuda_runtime.h>

#include "dsv4/indexer_topk.h"
#include "indexer_topk/launch_policy.h"
#include "indexer_topk/token.cuh"


namespace dsv4 {
namespace indexer {
namespace {  // internal linkage: see cuda/indexer_topk/indexer_topk.cu

// Token t's weights into ws[64] (threads 0-63); whether this thread's are finite.
__device__ __forceinline__ bool LoadWeights(const IndexerTopkArgs& a, int64_t t, float* ws) {
  if (threadIdx.x >= kIndexHeads) return true;
  const float w = a.weights[t * kIndexHeads + threadIdx.x];
  ws[threadIdx.x] = w;
  return num::IsFinite(w);
}

// Grid (T, entry chunks of kScoreThreads): the token's q (as fp32) and
// weights in shared memory (a token with a NaN or Inf in them leaves its row
// alone: the select drops it); one thread per visible entry reads its key
// through the block table (4 x 16-byte loads + the 4 scale bytes), decodes
// it into 128 registers and computes the score in the fixed order
// (dsv4/indexer.h); it stores the rank key (0 for an entry of a missing
// block).
__global__ void __launch_bounds__(kScoreThreads) ScoreKernel(IndexerTopkArgs a) {
  __shared__ __align__(16) float qs[kIndexHeads * kIndexDim];
  __shared__ float ws[kIndexHeads];
  const int64_t t = blockIdx.x;
  const TokenInfo ti = ReadToken(a, t);
  const int64_t first = static_cast<int64_t>(blockIdx.y) * kScoreThreads;
  if (!ti.ok || first >= ti.n) return;
  // q: 8192 bf16 = 1024 x 16 bytes, four per thread
  const uint4* qg = reinterpret_cast<const uint4*>(a.q + t * kIndexHeads * kIndexDim);
  bool finite = true;
  for (int v = threadIdx.x; v < kIndexHeads * kIndexDim / 8; v += kScoreThreads) {
    uint4 raw = qg[v];
    finite &= QueryWordFinite(raw);
    uint32_t w4[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      qs[8 * v + 2 * e] = num::BitsFloat(w4[e] << 16);
      qs[8 * v + 2 * e + 1] = num::BitsFloat(w4[e] & 0xffff0000u);
    }
  }
  finite &= LoadWeights(a, t, ws);
  if (!__syncthreads_and(finite)) return;     // NONFINITE: the select drops the row

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
  bool finite = true;
  for (int v = threadIdx.x; v < kIndexHeads * kIndexDim / 8; v += kScoreThreads) {
    uint4 raw = qg[v];
    finite &= QueryWordFinite(raw);
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
  finite &= LoadWeights(a, t, ws);
  if (!__syncthreads_and(finite)) return;     // NONFINITE: the select drops the row

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

}  // namespace
}  // namespace indexer
}  // namespace dsv4
