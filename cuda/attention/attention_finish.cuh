// The end of a tensor-core attention CTA: its partial result for one
// (token, 64 heads) over its share of the token's rows, left in shared memory,
// is merged with the partials of the other CTAs of its thread-block cluster
// (the token's splits) through distributed shared memory, and the finished
// rows are written: out = bf16(O / D) with the inverse RoPE, lse. No partial
// leaves the SM and no second kernel runs (docs/design/operations.md: each split
// keeps fp32 sums relative to its own running max; the merge rescales them
// to the largest max and adds them in fp32 before step 5).
//
// The tensor-core kernel (attention_tensor_core.cuh, both of its builds)
// writes an AttnPartial and then calls AttnFinish with all of its threads.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "attention/attention_items.cuh"

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
// tolerance-checked (docs/design/operations.md), so the approximate form serves.
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

// The cos and sin of each RoPE pair's angle at token t's position
// (fl32(float(pos) * inv_freq[k]), docs/design/operations.md), for AttnFinish: computed once
// a token by one warp, not once a head.
__device__ __forceinline__ void WarpRopeTable(const AttentionArgs& a, int64_t t, float2* rot) {
  const int lane = threadIdx.x & 31;
  if (a.inv_freq == nullptr || lane >= kRopeDim / 2) return;
  float c, s;
  sincosf(static_cast<float>(__ldg(a.pos + t)) * __ldg(a.inv_freq + lane), &s, &c);
  rot[lane] = make_float2(c, s);
}

// Writes one output row from a warp whose lane holds the fp32 numerators of
// channels 4 (lane + 32 k) .. + 3, k = 0..3, in acc[4 k ..]: bf16(acc * inv),
// the RoPE channels rotated back by `rot` (WarpRopeTable; nullptr: none).
__device__ __forceinline__ void WarpWriteAttnRow(const float2* rot, uint2* out, const float* acc,
                                                 float inv) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float y[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) y[j] = num::RoundBf16(acc[4 * k + j] * inv);
    const int ch = 4 * (lane + 32 * k);
    if (k == 3 && rot != nullptr && ch >= kNopeDim) {
      const float4 cs = *reinterpret_cast<const float4*>(rot + (ch - kNopeDim) / 2);
      RotatePairBack(y[0], y[1], cs.x, cs.y, &y[0], &y[1]);
      RotatePairBack(y[2], y[3], cs.z, cs.w, &y[2], &y[3]);
    }
    out[lane + 32 * k] = make_uint2(PackBf16x2Rn(y[0], y[1]), PackBf16x2Rn(y[2], y[3]));
  }
}

// Merges and writes the partials of the `splits` CTAs of this cluster (1:
// this CTA alone, no cluster) for token t, heads h0 .. h0 + 63. Every thread
// of the CTA calls it, after its partial is complete in `part` (the call's
// first barrier orders those writes). Rank r of the cluster finishes heads
// [64 r / splits, 64 (r + 1) / splits), a warp a head, reading every rank's
// partial row.
__device__ __forceinline__ void AttnFinish(const AttentionArgs& a, AttnPartial& part,
                                           const float2* rot, int splits, int64_t t, int64_t h0) {
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
      uint2* out = reinterpret_cast<uint2*>(a.out + (t * a.H + h) * kHeadDim);
      if (big == -INFINITY) {            // sees nothing and has no sink
#pragma unroll
        for (int k = 0; k < 4; ++k) out[lane + 32 * k] = make_uint2(0, 0);
        if (lane == 0) a.lse[t * a.H + h] = -INFINITY;
        continue;
      }
      float acc[16] = {};
#pragma unroll 4
      for (int i = 0; i < splits; ++i) {
        const float fi = __shfl_sync(kFull, f, i);
        const AttnPartial* p = clustered ? cg::this_cluster().map_shared_rank(mine, i) : mine;
        // whole 512-byte runs a load: no bank is read twice
        const float4* row = reinterpret_cast<const float4*>(&p->o[r][0]);
        const float4 v[4] = {row[lane], row[lane + 32], row[lane + 64], row[lane + 96]};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          acc[4 * k + 0] += v[k].x * fi;
          acc[4 * k + 1] += v[k].y * fi;
          acc[4 * k + 2] += v[k].z * fi;
          acc[4 * k + 3] += v[k].w * fi;
        }
      }
      WarpWriteAttnRow(rot, out, acc, 1.f / den);
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
