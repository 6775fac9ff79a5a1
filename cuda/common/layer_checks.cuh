// The checks every kernel makes of its layer operand, and how a warp counts
// the rows it drops (docs/design/bad-input.md: counters in state.errors).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/bf16_chunks.cuh"
#include "dsv4/error_counts.h"
#include "dsv4/layout.h"

namespace dsv4 {
namespace cuda {

// CountError (dsv4/error_counts.h) on the device: `n` drops of `kind`, the
// smallest at input row `row` (kNoRow: none), by atomics, so the counter and
// the smallest row are the same whatever order the threads count in.
__device__ __forceinline__ void CountErrorAtomic(const ErrorCounts& e, int kind, int64_t row,
                                                 int n = 1) {
  atomicAdd(&e.counts[kind], n);
  if (e.first_row != nullptr && row < kNoRow) atomicMin(&e.first_row[kind], static_cast<int>(row));
}

// The layer operand (a device scalar) checked against [0, L). A bad layer is
// counted once, by thread 0 of block 0.
__device__ __forceinline__ bool LayerOk(const int32_t* layer, int64_t L, const ErrorCounts& errors,
                                        int64_t* l_out) {
  int64_t l = __ldg(layer);
  if (l < 0 || l >= L) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) CountErrorAtomic(errors, kBadLayer, kNoRow);
    return false;
  }
  *l_out = l;
  return true;
}

// Adds `n` (per lane) drops of `kind`, the smallest at the lane's `row`, with
// one count per warp; a lane without drops passes any row.
__device__ __forceinline__ void WarpCount(const ErrorCounts& errors, int kind, int n,
                                          int64_t row) {
  row = n != 0 ? row : kNoRow;
  if (errors.first_row != nullptr) {  // the smallest row only with error detail
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const int64_t other = __shfl_xor_sync(kFull, row, off);
      row = other < row ? other : row;
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) n += __shfl_xor_sync(kFull, n, off);
  if ((threadIdx.x & 31) == 0 && n != 0) CountErrorAtomic(errors, kind, row, n);
}


// LayerOk for a kernel whose blocks take several roles: `counts` names the
// block (its thread 0) that counts a bad layer for this role.
__device__ __forceinline__ bool LayerOkCountedBy(bool counts, const int32_t* layer, int64_t L,
                                                 const ErrorCounts& errors, int64_t* l_out) {
  const int64_t l = __ldg(layer);
  if (l < 0 || l >= L) {
    if (counts && threadIdx.x == 0) CountErrorAtomic(errors, kBadLayer, kNoRow);
    return false;
  }
  *l_out = l;
  return true;
}

}  // namespace cuda
}  // namespace dsv4
