// How an append warp reads the call: a token's 1 KB row (coalesced, a lane
// two chunks), its finiteness vote and its entry's encode, and the call's
// slots and positions kGroup rows a load.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "append/append_plan.cuh"
#include "common/bf16_chunks.cuh"
#include "common/entry_warp.cuh"

namespace dsv4 {
namespace append_kernel {

// One token row, held by a warp: lane L has chunks L and L + 32.
struct Row {
  uint4 lo, hi;
};

__device__ __forceinline__ Row LoadRow(const AppendArgs& a, int64_t t) {
  const uint4* row = reinterpret_cast<const uint4*>(a.kv) + t * cuda::kChunks;
  const int lane = threadIdx.x & 31;
  return Row{__ldg(row + lane), __ldg(row + lane + 32)};
}

__device__ __forceinline__ bool WarpFinite(const Row& r) {
  return __all_sync(cuda::kFull, cuda::Bf16x8Finite(r.lo) && cuda::Bf16x8Finite(r.hi));
}

// Stores the row of the token at position p of slot s as its cell's entry.
__device__ __forceinline__ void WriteEntry(const AppendArgs& a, int64_t l, int64_t s, int64_t p,
                                           const Row& r) {
  const int64_t e = (l * a.R + s) * kWindow + (p & (kWindow - 1));
  float lo[8], hi[8];
  cuda::UnpackBf16x8(r.lo, lo);
  cuda::UnpackBf16x8(r.hi, hi);
  cuda::WarpEncodeEntry(a.pool, e, lo, hi);
  if ((threadIdx.x & 31) == 0) a.swa_pos[e] = static_cast<int32_t>(p);
}

// ---- the metadata in groups -----------------------------------------------------------
// Whether slot and position can be read kGroup rows a 16-byte load (XLA
// aligns its buffers; a slice at an odd offset would not be).
__device__ __forceinline__ bool GroupLoads(const AppendArgs& a) {
  return ((reinterpret_cast<uintptr_t>(a.slot) | reinterpret_cast<uintptr_t>(a.pos)) & 15) == 0;
}

// Rows kGroup * g .. kGroup * g + 3 of `v` (n rows); `fill` past the end.
__device__ __forceinline__ int4 LoadGroup(const int32_t* v, int64_t g, int64_t n, bool vector,
                                          int32_t fill) {
  const int64_t r = int64_t{kGroup} * g;
  if (vector && r + kGroup <= n) return __ldg(reinterpret_cast<const int4*>(v) + g);
  int4 x = make_int4(fill, fill, fill, fill);
  if (r < n) x.x = __ldg(v + r);
  if (r + 1 < n) x.y = __ldg(v + r + 1);
  if (r + 2 < n) x.z = __ldg(v + r + 2);
  if (r + 3 < n) x.w = __ldg(v + r + 3);
  return x;
}

__device__ __forceinline__ int32_t Lane4(const int4& x, int k) {
  return k == 0 ? x.x : k == 1 ? x.y : k == 2 ? x.z : x.w;
}

}  // namespace append_kernel
}  // namespace dsv4
