// The warp layout of a 512-channel row and its 8-channel chunks of bf16:
// 64 chunks, lane L owns chunks L and L + 32 (channels 8L.. and 256 + 8L..);
// chunks 0..55 are the 448 NoPE channels (a ds_fp8 tile is 8 chunks), 56..63
// the 64 RoPE channels. Each access of a warp is one contiguous run (32 x 16
// bytes of bf16, or 32 x 8 bytes of fp8 codes): coalesced, 8 or 16 bytes
// wide. Packing and unpacking a chunk, and its finiteness.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsv4/layout.h"
#include "dsv4/numerics.h"

namespace dsv4 {
namespace cuda {

constexpr int kChunk = 8;                       // channels per chunk
constexpr int kChunks = kHeadDim / kChunk;      // 64
constexpr int kNopeChunks = kNopeDim / kChunk;  // 56
constexpr unsigned kFull = 0xffffffffu;


// ---- bf16 chunk helpers ----------------------------------------------------------
__device__ __forceinline__ void UnpackBf16x8(uint4 u, float* x) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = num::Bf16ToF32(static_cast<uint16_t>(w[i] & 0xffffu));
    x[2 * i + 1] = num::Bf16ToF32(static_cast<uint16_t>(w[i] >> 16));
  }
}

__device__ __forceinline__ uint4 PackBf16x8(const float* x) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = static_cast<uint32_t>(num::F32ToBf16(x[2 * i])) |
           (static_cast<uint32_t>(num::F32ToBf16(x[2 * i + 1])) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}


// Whether 8 bf16 hold no NaN or Inf (exponent bits not all ones).
__device__ __forceinline__ bool Bf16x8Finite(uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool ok = true;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    ok = ok && (w[i] & 0x7f80u) != 0x7f80u && (w[i] & 0x7f800000u) != 0x7f800000u;
  return ok;
}

}  // namespace cuda
}  // namespace dsv4
