// Merges the split partials of attention_wgmma.cuh: for each (token, head)
// the splits' fp32 numerators O_i, running maxima m_i and denominators D_i
// (taken relative to m_i) become M = max m_i, O = sum O_i e^(m_i - M),
// D = sum D_i e^(m_i - M), then out = bf16(O / D) with the inverse RoPE and
// lse = M + log D, exactly the finish of a single split (docs/design.md §6).
// One warp per (token, head); a lane owns the entry layout's two chunks.
#pragma once

#include <cuda_runtime.h>

#include "attention_wgmma.cuh"

namespace dsv4 {
namespace cuda {
namespace tc {

constexpr int kCombineWarps = 8;

__global__ void __launch_bounds__(kCombineWarps * 32)
    AttentionCombineKernel(AttentionArgs a, const float* ws, int splits) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCombineWarps + (threadIdx.x >> 5);
  if (row >= a.T * a.H) return;
  const int64_t t = row / a.H, h = row % a.H;
  // Latency-bound work (a few KB a warp): every load of a loop is independent
  // of the others, so the unrolled loops keep several splits' loads in flight.
  float big = -INFINITY;
#pragma unroll 8
  for (int i = 0; i < splits; ++i)
    big = fmaxf(big, WsRow(ws, a, i, t, h)[kHeadDim]);
  uint4* out = reinterpret_cast<uint4*>(a.out + row * kHeadDim);
  if (big == -INFINITY) {                       // dropped, or sees nothing and no sink
    out[lane] = out[lane + 32] = make_uint4(0, 0, 0, 0);
    if (lane == 0) a.lse[row] = -INFINITY;
    return;
  }
  // A live token's splits all wrote their rows (zeros and max -inf where a
  // split saw nothing), so each is read unconditionally and weighted 0 there.
  float acc[2 * kChunk] = {};
  float den = 0.f;
#pragma unroll 4
  for (int i = 0; i < splits; ++i) {
    const float* w = WsRow(ws, a, i, t, h);
    const float mi = w[kHeadDim];
    const float f = mi == -INFINITY ? 0.f : expf(mi - big);
    den = den + w[kHeadDim + 1] * f;
    const float4* lo = reinterpret_cast<const float4*>(w + kChunk * lane);
    const float4* hi = reinterpret_cast<const float4*>(w + kChunk * (lane + 32));
    const float4 v[4] = {lo[0], lo[1], hi[0], hi[1]};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      acc[4 * k + 0] = acc[4 * k + 0] + v[k].x * f;
      acc[4 * k + 1] = acc[4 * k + 1] + v[k].y * f;
      acc[4 * k + 2] = acc[4 * k + 2] + v[k].z * f;
      acc[4 * k + 3] = acc[4 * k + 3] + v[k].w * f;
    }
  }
  float y[2 * kChunk];
#pragma unroll
  for (int k = 0; k < 2 * kChunk; ++k) y[k] = num::RoundBf16(acc[k] / den);
  const int hi_chunk = lane + 32;
  if (a.inv_freq != nullptr && hi_chunk >= kNopeChunks) {   // the lane's RoPE pairs
    const float pos = static_cast<float>(__ldg(a.pos + t));
#pragma unroll
    for (int k = kChunk; k < 2 * kChunk; k += 2) {
      const int pair = (kChunk * hi_chunk + k - kChunk - kNopeDim) / 2;
      InverseRopePair(y[k], y[k + 1], pos * __ldg(a.inv_freq + pair), &y[k], &y[k + 1]);
    }
  }
  out[lane] = PackBf16x8(y);
  out[lane + 32] = PackBf16x8(y + kChunk);
  if (lane == 0) a.lse[row] = big + logf(den);
}

}  // namespace tc
}  // namespace cuda
}  // namespace dsv4
