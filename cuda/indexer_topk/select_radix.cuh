// The top-k select's block-wide scan and radix passes (the k-th largest key, 8 bits a pass).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "indexer_topk/launch_policy.h"

namespace dsv4 {
namespace indexer {
namespace {  // internal linkage: see cuda/indexer_topk/indexer_topk.cu

constexpr int kHistCopies = 8;      // radix histograms per select block
constexpr int kHistStride = 257;

// Inclusive sum over the block's threads of one value each; returns the
// exclusive prefix and (via *total) the block total. `warp_sums` holds
// kSelectThreads / 32 + 1 ints.
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
  static_assert(kSelectThreads / 32 == 32, "warp 0 scans one warp sum a lane");
  if (warp == 0) {                 // warp sums -> exclusive prefixes, the total last
    const int own = warp_sums[lane];
    int incl = own;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    __syncwarp();
    warp_sums[lane] = incl - own;
    if (lane == 31) warp_sums[32] = incl;
  }
  __syncthreads();
  const int before = warp_sums[warp];
  *total = warp_sums[32];
  __syncthreads();                 // warp_sums may be reused at once
  return before + v - x;
}

// Warp 0 of a radix pass: in the 256-bin histogram `bins` of the keys
// matching `pre` (digit at `shift`), the bin where the count from the top
// reaches `need`; writes the key prefix with that digit to *s_prefix and the
// count still needed within the bin to *s_need. Lane L reads bins
// 8(31-L) .. + 7 (lane 0 the highest) and, with `clear`, zeroes them.
__device__ __forceinline__ void CrossingBin(int* bins, uint32_t pre, int shift, uint32_t need,
                                            bool clear, uint32_t* s_prefix, uint32_t* s_need) {
  const int lane = threadIdx.x & 31;
  const int base = 8 * (31 - lane);
  int c[8], sum = 0;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    c[e] = bins[base + e];
    sum += c[e];
    if (clear) bins[base + e] = 0;
  }
  int incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  const int excl = incl - sum;
  const int want = static_cast<int>(need);
  // the keys matching the prefix number at least `need`: one lane crosses
  if (excl < want && incl >= want) {
    int cum = excl;
    for (int e = 7; e >= 0; --e) {
      if (cum + c[e] >= want) {
        *s_prefix = pre | (static_cast<uint32_t>(base + e) << shift);
        *s_need = static_cast<uint32_t>(want - cum);
        break;
      }
      cum += c[e];
    }
  }
}

// Radix passes, 8 bits each from bit `top` down, over the keys that
// for_each(f) hands to f and that equal *prefix in the bits of `mask` (the
// bits above top): the *need-th largest of them. On return *prefix is that
// key and *need how many keys equal to it are taken. Every thread of the
// block calls it; `hist` holds kHistCopies histograms of 256 bins.
template <typename ForEachKey>
__device__ void RadixSelect(ForEachKey for_each, int top, uint32_t mask, uint32_t* prefix,
                            uint32_t* need, int* hist, uint32_t* s_prefix, uint32_t* s_need) {
  const int tid = threadIdx.x;
  for (; top >= 0; top -= 8) {
    const int width = top + 1 < 8 ? top + 1 : 8;
    const int shift = top + 1 - width;
    for (int b = tid; b < kHistCopies * kHistStride; b += kSelectThreads) hist[b] = 0;
    __syncthreads();
    int* my_hist = hist + (tid % kHistCopies) * kHistStride;
    const uint32_t pre = *prefix;
    for_each([&](uint32_t key) {
      if (key != 0 && (key & mask) == pre) atomicAdd(&my_hist[(key >> shift) & ((1u << width) - 1u)], 1);
    });
    __syncthreads();
    if (tid < 256) {                           // copy 0 <- the sum of the copies
      int sum = 0;
#pragma unroll
      for (int c = 0; c < kHistCopies; ++c) sum += hist[c * kHistStride + tid];
      hist[tid] = sum;
    }
    __syncthreads();
    if (tid < 32) CrossingBin(hist, pre, shift, *need, false, s_prefix, s_need);
    __syncthreads();
    *prefix = *s_prefix;
    *need = *s_need;
    mask |= ((1u << width) - 1u) << shift;
    __syncthreads();
  }
}

// RadixSelect for at most one key a thread (0: none): one histogram, which
// must be zero on entry and is left zero, and two barriers a pass.
__device__ void RadixSelectOneEach(uint32_t key, int top, uint32_t mask, uint32_t* prefix,
                                   uint32_t* need, int* hist, uint32_t* s_prefix,
                                   uint32_t* s_need) {
  for (; top >= 0; top -= 8) {
    const int width = top + 1 < 8 ? top + 1 : 8;
    const int shift = top + 1 - width;
    const uint32_t pre = *prefix;
    if (key != 0 && (key & mask) == pre) atomicAdd(&hist[(key >> shift) & ((1u << width) - 1u)], 1);
    __syncthreads();
    if (threadIdx.x < 32) CrossingBin(hist, pre, shift, *need, true, s_prefix, s_need);
    __syncthreads();
    *prefix = *s_prefix;
    *need = *s_need;
    mask |= ((1u << width) - 1u) << shift;
  }
}

}  // namespace
}  // namespace indexer
}  // namespace dsv4
