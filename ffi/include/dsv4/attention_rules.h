// The scalar rules of the attention op (docs/design/operations.md, `attention`) that the
// CPU handler and the CUDA kernel share: which rows a query sees, the softmax
// scale, and the inverse RoPE of the output. __host__ __device__, built from
// the numerics of dsv4/numerics.h.
#pragma once

#include <cstdint>

#include "dsv4/indexer.h"
#include "dsv4/layout.h"
#include "dsv4/numerics.h"

namespace dsv4 {

// Layer kinds as the `kind` attribute of dsv4_attention spells them.
enum AttnKind : int { kAttnSwa = 0, kAttnCsa = 1, kAttnHca = 2 };

// Which tensor-core kernel a CUDA call runs, the `kernel` attribute (the CPU
// handler has one implementation and ignores it): auto (wgmma on Hopper,
// mma.sync elsewhere) or the warp-level mma.sync one on any GPU.
enum AttnKernel : int { kAttnKernelAuto = 0, kAttnKernelMmaSync = 1 };

// fl32(512^-0.5), the softmax scale of every layer kind; it multiplies the
// fp32 dot product (docs/design/operations.md, attention's step 1).
DSV4_HD float AttnScale() { return 0.044194173824159216f; }

// Whether a window row at position `p` belongs to the window of a query at
// position `t`: t - 128 < p <= t (p >= 0).
DSV4_HD bool WindowSees(int64_t p, int64_t t) { return p >= 0 && p <= t && p > t - kWindow; }

// HCA entries a query at position t >= 0 sees: (t + 1) / 128, capped at
// `limit` (the block table's columns), without overflow at t = 2^31 - 1.
DSV4_HD int64_t HcaVisible(int64_t t, int64_t limit) {
  int64_t n = t / kHcaRatio + (t % kHcaRatio == kHcaRatio - 1 ? 1 : 0);
  return n < limit ? n : limit;
}

// The inverse rotation of one RoPE pair of the output at angle
// fl32(float(t) * inv_freq[k]): (a, b) -> (a cos + b sin, b cos - a sin), fp32.
// (The CUDA kernel computes each pair's cos and sin once a token and rotates
// every head with RotatePairBack.)
DSV4_HD void RotatePairBack(float a, float b, float c, float s, float* y0, float* y1) {
  *y0 = a * c + b * s;
  *y1 = b * c - a * s;
}
DSV4_HD void InverseRopePair(float a, float b, float angle, float* y0, float* y1) {
  RotatePairBack(a, b, cosf(angle), sinf(angle), y0, y1);
}

// Output channels of one head from its fp32 numerator `acc[512]` and
// denominator `denom`: bf16(acc / denom), then the RoPE channels rotated back at
// position t when `inv_freq` is given (else left as attended). Writes bf16 bits.
DSV4_HD void AttnFinishHead(const float* acc, float denom, int64_t t, const float* inv_freq,
                            uint16_t* out) {
  for (int c = 0; c < kNopeDim; ++c) out[c] = num::F32ToBf16(acc[c] / denom);
  const float pos = static_cast<float>(t);
  for (int k = 0; k < kRopeDim / 2; ++k) {
    const int c = kNopeDim + 2 * k;
    float a = num::RoundBf16(acc[c] / denom), b = num::RoundBf16(acc[c + 1] / denom);
    if (inv_freq != nullptr) InverseRopePair(a, b, pos * inv_freq[k], &a, &b);
    out[c] = num::F32ToBf16(a);
    out[c + 1] = num::F32ToBf16(b);
  }
}

}  // namespace dsv4
