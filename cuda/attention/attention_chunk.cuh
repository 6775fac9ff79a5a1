// The prefill side of attention on the GPU: a chunk's rows encoded once, as
// append will store them, into the call's scratch (AttnBindChunkScratch in
// ffi/include/dsv4/attention.h), with a flag per row saying whether it was finite (a row
// with a NaN or Inf is dropped by append, so no query sees it), then decoded
// once to the bf16 rows a query sees (docs/design/operations.md: a prefill query sees
// dequantize(quantize(chunk_kv[r])) in the pool's format). The attention
// kernel's producer copies those rows into its tiles with cp.async, instead
// of dequantizing a chunk row again for each of the up to 128 queries that
// see it.
#pragma once

#include <cuda_runtime.h>

#include "attention/attention_items.cuh"
#include "common/launch.cuh"

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

// One warp per finite chunk row, grid-stride: its encoded entry (the kernel
// above) decoded to a.chunk_rows. A kernel of its own: the encoded bytes are
// read through the read-only cache, which only sees what a kernel before
// wrote.
__global__ void __launch_bounds__(256) AttentionChunkDecodeKernel(AttentionArgs a) {
  WaitForPrevious();
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       r < a.T; r += warps) {
    if (__ldg(a.chunk_finite + r) == 0) continue;
    WarpStoreEntry(a.chunk.fmt, WarpLoadEntry(a.chunk, r), a.chunk_rows + r * kHeadDim);
  }
  LetNextStart();
}

}  // namespace cuda
}  // namespace dsv4
