// The end of a tensor-core attention CTA: its partial result for one
// (token, 64 heads) over its share of the token's rows, left in shared memory,
// is merged with the partials of the other CTAs of its thread-block cluster
// (the token's splits) through distributed shared memory, and the finished
// rows are written: out = bf16(O / D) with the inverse RoPE, lse. No partial
// leaves the SM and no second kernel runs (docs/design.md §6: each split
// keeps fp32 sums relative to its own running max; the merge rescales them
// to the largest max and adds them in fp32 before step 5).
//
// The tensor-core kernel (attention_tensor_core.cuh, both of its builds)
// writes an AttnPartial and then calls AttnFinish with all of its threads.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "attention_items.cuh"

namespace dsv4 {
namespace cuda {

constexpr int kAttnHeads = 64;                  // heads a CTA computes (wgmma's M)
constexpr int kPartialRow = kHeadDim + 4;       // floats a partial row holds (padding: banks)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// A CTA's partial for its 64 heads: the numerator O and the denominator
// den[0] + den[1] (two halves of the CTA may keep their own sums), both
// relative to the running max m, which is in log2 units (logit * log2 e):
// the kernels exponentiate with exp2.
struct AttnPartial {
  float o[kAttnHeads][kPartialRow];
  float m[kAttnHeads];
  float den[2][kAttnHeads];
};

// 2^x (x <= 0 here; -inf gives 0): the SFU's exp2. Attention's outputs are
// tolerance-checked (design §6), so the approximate form serves.
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t PackBf16x2Rn(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Writes one output row from a warp whose lane holds the fp32 numerators of
// its two chunks (acc[0..7]: chunk lane, acc[8..15]: chunk lane + 32, the
// layout of bf16_chunks.cuh): bf16(acc * inv_den), the inverse RoPE of the
// lane's RoPE pairs at token t's position, packed.
__device__ __forceinline__ void WarpWriteAttnRow(const AttentionArgs& a, int64_t t, uint4* out,
                                                 const float* acc, float inv) {
  const int lane = threadIdx.x & 31;
  float y[2 * kChunk];
#pragma unroll
  for (int k = 0; k < 2 * kChunk; ++k) y[k] = num::RoundBf16(acc[k] * inv);
  if (a.inv_freq != nullptr && lane + 32 >= kNopeChunks) {   // the lane's RoPE pairs
    const float pos = static_cast<float>(__ldg(a.pos + t));
#pragma unroll
    for (int k = kChunk; k < 2 * kChunk; k += 2) {
      const int pair = (kChunk * (lane + 32) + k - kChunk - kNopeDim) / 2;
      InverseRopePair(y[k], y[k + 1], pos * __ldg(a.inv_freq + pair), &y[k], &y[k + 1]);
    }
  }
  uint32_t w[2 * kChunk / 2];
#pragma unroll
  for (int k = 0; k < kChunk; ++k) w[k] = PackBf16x2Rn(y[2 * k], y[2 * k + 1]);
  out[lane] = make_uint4(w[0], w[1], w[2], w[3]);
  out[lane + 32] = make_uint4(w[4], w[5], w[6], w[7]);
}

// Writes head h of token t from one m64nNk16 accumulator fragment row
// (elements o[4j + 2i + b], output channel col0 + 8j + b, j = 0..31) of a
// CTA that saw all of the token's rows: bf16(o / den), the inverse RoPE on
// channels 448.., and lse (by the thread that `writes_lse`).
__device__ __forceinline__ void AttnFinishFragmentRow(const AttentionArgs& a, int64_t t,
                                                      int64_t h, float m, float den,
                                                      const float (&o)[128], int i, int col0,
                                                      bool writes_lse) {
  if (h >= a.H) return;
  uint16_t* out = a.out + (t * a.H + h) * kHeadDim;
  const bool empty = m == -INFINITY;            // sees nothing and has no sink
  const float inv = empty ? 0.f : 1.f / den;
  const float pos = static_cast<float>(__ldg(a.pos + t));
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    const int col = col0 + 8 * j;
    float y0 = num::RoundBf16(o[4 * j + 2 * i] * inv);
    float y1 = num::RoundBf16(o[4 * j + 2 * i + 1] * inv);
    if (a.inv_freq != nullptr && col >= kNopeDim)
      InverseRopePair(y0, y1, pos * __ldg(a.inv_freq + (col - kNopeDim) / 2), &y0, &y1);
    *reinterpret_cast<uint32_t*>(out + col) = PackBf16x2Rn(y0, y1);
  }
  if (writes_lse) a.lse[t * a.H + h] = empty ? -INFINITY : (m + __log2f(den)) * kLn2;
}

// Merges and writes the partials of the `splits` (>= 2) CTAs of this
// cluster for token t, heads h0 .. h0 + 63. Every thread of the CTA calls
// it, after its partial is complete in `part` (the call's first cluster
// barrier orders those writes). Rank r of the cluster finishes heads
// [64 r / splits, 64 (r + 1) / splits), a warp a head, reading every rank's
// partial row.
__device__ __forceinline__ void AttnFinish(const AttentionArgs& a, AttnPartial& part, int splits,
                                           int64_t t, int64_t h0) {
  namespace cg = cooperative_groups;
  const bool clustered = splits > 1;
  if (clustered) cg::this_cluster().sync();
  else __syncthreads();
  const int rank = clustered ? static_cast<int>(cg::this_cluster().block_rank()) : 0;
  const int warp = static_cast<int>(threadIdx.x >> 5), lane = threadIdx.x & 31;
  const int nfwarps = static_cast<int>(blockDim.x >> 5);
  {
    const int r0 = kAttnHeads * rank / splits, r1 = kAttnHeads * (rank + 1) / splits;
    for (int r = r0 + warp; r < r1; r += nfwarps) {
      const int64_t h = h0 + r;
      if (h >= a.H) break;
      // lane i < splits reads rank i's max and denominator
      const AttnPartial* mine = &part;
      const AttnPartial* theirs =
          clustered && lane < splits ? cg::this_cluster().map_shared_rank(mine, lane) : mine;
      const float mi = lane < splits ? theirs->m[r] : -INFINITY;
      const float di = lane < splits ? theirs->den[0][r] + theirs->den[1][r] : 0.f;
      float big = mi;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) big = fmaxf(big, __shfl_xor_sync(kFull, big, off));
      const float f = mi == -INFINITY ? 0.f : Exp2(mi - big);
      float den = di * f;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) den += __shfl_xor_sync(kFull, den, off);
      uint4* out = reinterpret_cast<uint4*>(a.out + (t * a.H + h) * kHeadDim);
      if (big == -INFINITY) {            // sees nothing and has no sink
        out[lane] = out[lane + 32] = make_uint4(0, 0, 0, 0);
        if (lane == 0) a.lse[t * a.H + h] = -INFINITY;
        continue;
      }
      float acc[2 * kChunk] = {};
#pragma unroll 4
      for (int i = 0; i < splits; ++i) {
        const float fi = __shfl_sync(kFull, f, i);
        const AttnPartial* p = clustered ? cg::this_cluster().map_shared_rank(mine, i) : mine;
        const float4* lo = reinterpret_cast<const float4*>(&p->o[r][kChunk * lane]);
        const float4* hi = reinterpret_cast<const float4*>(&p->o[r][kChunk * (lane + 32)]);
        const float4 v[4] = {lo[0], lo[1], hi[0], hi[1]};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          acc[4 * k + 0] += v[k].x * fi;
          acc[4 * k + 1] += v[k].y * fi;
          acc[4 * k + 2] += v[k].z * fi;
          acc[4 * k + 3] += v[k].w * fi;
        }
      }
      WarpWriteAttnRow(a, t, out, acc, 1.f / den);
      if (lane == 0) a.lse[t * a.H + h] = (big + __log2f(den)) * kLn2;
    }
  }
  // no CTA leaves while another may still read its shared memory
  if (clustered) cg::this_cluster().sync();
}

// A dropped token's rows (out 0, lse -inf) for heads h0 .. h0 + 63, written
// by rank 0 of its cluster (every rank drops the same token).
__device__ __forceinline__ void AttnWriteDropped(const AttentionArgs& a, int64_t t, int64_t h0,
                                                 bool writer) {
  if (!writer) return;
  for (int i = threadIdx.x; i < kAttnHeads * kChunks; i += blockDim.x) {
    const int64_t h = h0 + i / kChunks;
    if (h < a.H)
      reinterpret_cast<uint4*>(a.out + (t * a.H + h) * kHeadDim)[i % kChunks] =
          make_uint4(0, 0, 0, 0);
  }
  for (int i = threadIdx.x; i < kAttnHeads; i += blockDim.x)
    if (h0 + i < a.H) a.lse[t * a.H + h0 + i] = -INFINITY;
}

}  // namespace cuda
}  // namespace dsv4
