// The checks every kernel makes of its layer operand, and how a warp counts
// the rows it drops (docs/design.md §9: counters in state.errors).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "bf16_chunks.cuh"
#include "dsv4/layout.h"

namespace dsv4 {
namespace cuda {

// The layer operand (a device scalar) checked against [0, L). A bad layer is
// counted once, by thread 0 of block 0.
__device__ __forceinline__ bool LayerOk(const int32_t* layer, int64_t L, int32_t* errors,
                                        int64_t* l_out) {
  int64_t l = __ldg(layer);
  if (l < 0 || l >= L) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) atomicAdd(&errors[kBadLayer], 1);
    return false;
  }
  *l_out = l;
  return true;
}

// Adds `n` (per lane) to errors[kind] with one atomic per warp.
__device__ __forceinline__ void WarpCount(int32_t* errors, int kind, int n) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) n += __shfl_xor_sync(kFull, n, off);
  if ((threadIdx.x & 31) == 0 && n != 0) atomicAdd(&errors[kind], n);
}


// LayerOk for a kernel whose blocks take several roles: `counts` names the
// block (its thread 0) that counts a bad layer for this role.
__device__ __forceinline__ bool LayerOkCountedBy(bool counts, const int32_t* layer, int64_t L,
                                                 int32_t* errors, int64_t* l_out) {
  const int64_t l = __ldg(layer);
  if (l < 0 || l >= L) {
    if (counts && threadIdx.x == 0) atomicAdd(&errors[kBadLayer], 1);
    return false;
  }
  *l_out = l;
  return true;
}

}  // namespace cuda
}  // namespace dsv4
