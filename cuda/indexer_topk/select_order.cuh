// The top-k select's output order: a bitonic sort, or each key's rank within its top-bits bin.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/bf16_chunks.cuh"
#include "indexer_topk/launch_policy.h"
#include "indexer_topk/select_keys.cuh"

namespace dsv4 {
namespace indexer {
namespace {  // internal linkage: see cuda/indexer_topk/indexer_topk.cu

// Bitonic sort (descending) of kp = 2^kLog <= kSelectThreads composites, one
// per thread in a register: partner exchanges by shuffles within a warp and
// through shared memory (two alternating buffers of kp; the first may be
// where v came from: each thread read its own slot) across warps. Only the
// warps holding elements take part (the others return at once): they meet
// on named barrier 1, so idle warps cost no issue slots. The steps are
// unrolled (kLog is a template argument): kp = 512 takes 45 of them, and
// loop control cost more than the exchange. Nothing may use __syncthreads
// after this call.
template <int kLog>
__device__ unsigned long long SortOnePerThread(unsigned long long v, unsigned long long* buf) {
  constexpr int kp = 1 << kLog;
  constexpr int kBusyThreads = kp < 32 ? 32 : kp;
  static_assert(kp <= kSelectThreads, "one element a thread");
  const int tid = threadIdx.x;
  if (tid >= kBusyThreads) return v;
#pragma unroll
  for (int size = 2, parity = 0; size <= kp; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      unsigned long long p;
      if (stride >= 32) {                  // kp >= 64: every busy thread holds one
        unsigned long long* b = buf + parity * kp;
        parity ^= 1;
        b[tid] = v;
        asm volatile("bar.sync 1, %0;" ::"n"(kBusyThreads) : "memory");
        p = b[tid ^ stride];
      } else {
        p = __shfl_xor_sync(cuda::kFull, v, stride);
      }
      // the lower of a pair in a descending run keeps the larger (equal
      // values: the padding zeros, either will do)
      const bool desc = (tid & size) == 0, lower = (tid & stride) == 0;
      v = ((v > p) == (desc == lower)) ? v : p;
    }
  }
  return v;
}

// SortOnePerThread for a runtime kp (a power of two <= kSelectThreads).
__device__ unsigned long long SortOnePerThread(unsigned long long v, int kp,
                                               unsigned long long* buf) {
  switch (kp) {
    case 1: return v;
    case 2: return SortOnePerThread<1>(v, buf);
    case 4: return SortOnePerThread<2>(v, buf);
    case 8: return SortOnePerThread<3>(v, buf);
    case 16: return SortOnePerThread<4>(v, buf);
    case 32: return SortOnePerThread<5>(v, buf);
    case 64: return SortOnePerThread<6>(v, buf);
    case 128: return SortOnePerThread<7>(v, buf);
    case 256: return SortOnePerThread<8>(v, buf);
    case 512: return SortOnePerThread<9>(v, buf);
    default: return SortOnePerThread<10>(v, buf);
  }
}
static_assert(kSelectThreads == 1 << 10, "SortOnePerThread's cases");

// How many of v[lo .. hi) are at most c (unsigned 64-bit). Four counters,
// so that four comparisons are in flight at once: one count (or a borrow
// chain through the one carry flag) makes every comparison wait for the
// last, and a group's ranking is one thread's chain of these.
__device__ __forceinline__ int CountAtMost(const unsigned long long* v, int lo, int hi,
                                           unsigned long long c) {
  // a 64-bit compare and a predicated increment: three instructions each
  const auto step = [&](uint32_t& n, unsigned long long x) {
    asm("{\n\t.reg .pred p;\n\tsetp.le.u64 p, %1, %2;\n\t@p add.u32 %0, %0, 1;\n\t}"
        : "+r"(n)
        : "l"(x), "l"(c));
  };
  uint32_t n[4] = {0, 0, 0, 0};
  int j = lo;
  for (; j + 4 <= hi; j += 4) {
#pragma unroll
    for (int u = 0; u < 4; ++u) step(n[u], v[j + u]);
  }
  for (; j < hi; ++j) step(n[0], v[j]);
  return static_cast<int>((n[0] + n[1]) + (n[2] + n[3]));
}

// The select's output without a sort: composites are distinct, so a key's
// place is the number of taken keys above it. Keys of higher top-bits bins
// are all above it; within its bin they are counted one by one.
//  - above[0 .. n_above): the taken keys of the bins above the K-th key's
//    (all of them when every candidate is taken), grouped by bin: bin b's at
//    [start[b], end[b]) and every group ahead of lower bins' groups, so
//    start[b] is also the number of keys in higher bins;
//  - in_bin[0 .. nb): every key of the K-th key's bin, of which the `need`
//    largest are taken (places n_above ..).
// Writes out[0 .. m) and -1 after, up to K.
__device__ void RankInBins(const unsigned long long* above, int n_above, const int* start,
                           const int* end, const unsigned long long* in_bin, int nb, int need,
                           int64_t m, int64_t K, int32_t* out) {
  const int tid = threadIdx.x;
  for (int x = tid; x < n_above; x += kSelectThreads) {
    const unsigned long long comp = above[x];
    const int b = static_cast<int>(comp >> (64 - kTopBits));
    const int lo = start[b], hi = end[b];
    out[lo + (hi - lo) - CountAtMost(above, lo, hi, comp)] = CompositeIndex(comp);
  }
  // from the last thread down, so these are mostly other warps than the above
  for (int x = kSelectThreads - 1 - tid; x < nb; x += kSelectThreads) {
    const unsigned long long comp = in_bin[x];
    const int r = nb - CountAtMost(in_bin, 0, nb, comp);
    if (r < need) out[n_above + r] = CompositeIndex(comp);
  }
  for (int64_t r = m + tid; r < K; r += kSelectThreads) out[r] = -1;
}

}  // namespace
}  // namespace indexer
}  // namespace dsv4
