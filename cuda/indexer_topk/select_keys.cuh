// The top-k select's view of a row of rank keys (registers or memory) and its composite key.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "indexer_topk/launch_policy.h"

namespace dsv4 {
namespace indexer {
namespace {  // internal linkage: see cuda/indexer_topk/indexer_topk.cu

constexpr int kTopBits = 12;        // the select's first histogram: the keys' top bits
constexpr int kTopBins = 1 << kTopBits;
// The select counts key 0 (a missing entry) into bin 0 unchecked and takes
// that bin as empty: every score's key, down to -inf's, must lie above it.
static_assert((0x007fffffu >> (32 - kTopBits)) > 0, "-inf's rank key above bin 0");

// Rank keys first .. first + n - 1 of a token's scratch row (`keys` points
// at key `first`), read from memory: f(key, index) for each, eight loads
// issued before their uses. Every lane of a warp makes the same calls (a key
// past n reads as 0), so f may use warp-wide votes.
struct KeyRow {
  const uint32_t* keys;
  int64_t n, first;

  template <typename F>
  __device__ __forceinline__ void ForEach(F f) const {
    constexpr int kUnroll = 8;
    const int64_t warp_first = threadIdx.x & ~31;
    for (int64_t base = 0; warp_first + base < n; base += kUnroll * kSelectThreads) {
      uint32_t k[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + threadIdx.x + u * kSelectThreads;
        k[u] = i < n ? keys[i] : 0u;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) f(k[u], first + base + threadIdx.x + u * kSelectThreads);
    }
  }
};

// A KeyRow as one select CTA reads it: held in registers (16 a thread, key
// tid + u * kSelectThreads in r[u]) when n <= kRegKeys * kSelectThreads, so
// every pass after the first load costs no memory traffic; else read from
// the scratch row on each pass. Keys past n read as 0, as a missing entry.
struct TokenKeys {
  KeyRow row;
  bool in_regs;
  int slots;                 // in registers: slots holding some thread's key
  uint32_t r[kRegKeys];

  // (32-bit bounds and one base pointer, so a slot costs a compare and a load
  // at an immediate offset)
  __device__ explicit TokenKeys(KeyRow kr)
      : row(kr), in_regs(kr.n <= kRegKeys * kSelectThreads),
        slots(in_regs ? static_cast<int>((kr.n + kSelectThreads - 1) / kSelectThreads) : 0) {
    if (in_regs) {
      const uint32_t* p = row.keys + threadIdx.x;
      const int left = static_cast<int>(row.n) - static_cast<int>(threadIdx.x);
#pragma unroll
      for (int u = 0; u < kRegKeys; ++u) r[u] = u * kSelectThreads < left ? p[u * kSelectThreads] : 0u;
    }
  }

  // (in registers: only the slots that hold a key of some thread, so a
  // short row costs as many steps as it has keys a thread)
  template <typename F>
  __device__ __forceinline__ void ForEach(F f) const {
    if (!in_regs) return row.ForEach(f);
#pragma unroll
    for (int u = 0; u < kRegKeys; ++u) {
      if (u >= slots) break;   // uniform
      f(r[u], row.first + threadIdx.x + u * kSelectThreads);
    }
  }
};

// Composite sort key: rank key above, then the lower index first.
__device__ __forceinline__ unsigned long long Composite(uint32_t key, int64_t i) {
  return (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
}
// The index a composite holds.
__device__ __forceinline__ int32_t CompositeIndex(unsigned long long comp) {
  return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(comp));
}

}  // namespace
}  // namespace indexer
}  // namespace dsv4
