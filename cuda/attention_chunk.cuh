// The prefill side of attention on the GPU: a chunk's rows encoded once, as
// append will store them, into the call's scratch (AttnBindChunkScratch in
// ffi/attention.h), with a flag per row saying whether it was finite (a row
// with a NaN or Inf is dropped by append, so no query sees it). The attention
// kernels then read a chunk row like any pool entry, instead of encoding it
// again for every query that sees it (docs/design.md §6: a prefill query sees
// dequantize(quantize(chunk_kv[r])) in the pool's format).
#pragma once

#include <cuda_runtime.h>

#include "attention_items.cuh"
#include "launch.cuh"

namespace dsv4 {
namespace cuda {

// One warp per chunk row, grid-stride.
__global__ void __launch_bounds__(256) AttentionChunkEncodeKernel(AttentionArgs a) {
  WaitForPrevious();
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int lane = threadIdx.x & 31;
  uint8_t* finite = const_cast<uint8_t*>(a.chunk_finite);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       r < a.T; r += warps) {
    uint4 ulo, uhi;
    LoadChunkRow(a, r, &ulo, &uhi);
    const bool ok = __all_sync(kFull, Bf16x8Finite(ulo) && Bf16x8Finite(uhi));
    if (lane == 0) finite[r] = ok ? 1 : 0;
    if (!ok) continue;
    float lo[kChunk], hi[kChunk];
    UnpackBf16x8(ulo, lo);
    UnpackBf16x8(uhi, hi);
    WarpEncodeEntry(a.chunk, r, lo, hi);
  }
  LetNextStart();
}

}  // namespace cuda
}  // namespace dsv4
