// The warp-wide encode and decode of one 512-channel entry in every
// kv_format (the chunk layout of bf16_chunks.cuh). The arithmetic is the
// shared numerics of dsv4/numerics.h, so a warp produces the bytes
// EncodeEntry / DecodeEntry produce on the host.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/bf16_chunks.cuh"
#include "dsv4/entries.h"
#include "dsv4/layout.h"
#include "dsv4/numerics.h"

namespace dsv4 {
namespace cuda {

// ---- encode ------------------------------------------------------------------------
// Stores entry e of `p` from the bf16-valued fp32 channels a lane owns:
// lo[8] = chunk lane, hi[8] = chunk lane + 32. All 32 lanes must call.
__device__ __forceinline__ void WarpEncodeEntry(const EntryPool& p, int64_t e, const float* lo,
                                                const float* hi) {
  const int lane = threadIdx.x & 31;
  const int jlo = lane, jhi = lane + 32;
  const bool hi_nope = jhi < kNopeChunks;
  uint16_t* rope = p.rope + e * kRopeDim;
  if (p.fmt == kBf16) {
    uint4* nope = reinterpret_cast<uint4*>(reinterpret_cast<uint16_t*>(p.nope) + e * kNopeDim);
    nope[jlo] = PackBf16x8(lo);
    if (hi_nope) nope[jhi] = PackBf16x8(hi);
    else reinterpret_cast<uint4*>(rope)[jhi - kNopeChunks] = PackBf16x8(hi);
    return;
  }
  // amax of each half's chunk (the floor enters every max, as on the host).
  float alo = num::kDsFp8AmaxFloor, ahi = num::kDsFp8AmaxFloor;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    alo = num::MaxF(alo, num::AbsF(lo[i]));
    ahi = num::MaxF(ahi, num::AbsF(hi[i]));
  }
  if (!hi_nope) ahi = num::kDsFp8AmaxFloor;  // RoPE channels are not quantized
  // x / s for the codes: ds_fp8's scales are powers of two, so a multiply by
  // the exact inverse gives the quotient's bits; fp8_token's need the division.
  float slo, shi, mlo = 1.f, mhi = 1.f;
  uint8_t blo = 0, bhi = 0;
  if (p.fmt == kDsFp8) {
    // tile = 8 consecutive lanes of one half
#pragma unroll
    for (int off = 1; off < 8; off <<= 1) {
      alo = num::MaxF(alo, __shfl_xor_sync(kFull, alo, off));
      ahi = num::MaxF(ahi, __shfl_xor_sync(kFull, ahi, off));
    }
    blo = num::Pow2CeilE8m0(alo / num::kE4m3Max);
    bhi = num::Pow2CeilE8m0(ahi / num::kE4m3Max);
    slo = num::E8m0ToF32(blo);
    shi = num::E8m0ToF32(bhi);
    mlo = num::E8m0Inverse(blo);
    mhi = num::E8m0Inverse(bhi);
  } else {  // fp8_token: one scale over the 448 NoPE channels
    float a = num::MaxF(alo, ahi);
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) a = num::MaxF(a, __shfl_xor_sync(kFull, a, off));
    slo = shi = a / num::kE4m3Max;
  }
  // e4m3 saturates at +-448 as the host's clamp does; the pair instruction
  // gives F32ToE4m3's code for every value but NaN (append's rows are finite;
  // only an entry that overflowed in flush could hold one, and then its code
  // may lose the NaN's sign)
  const bool pow2 = p.fmt == kDsFp8;
  auto codes8 = [pow2](const float* x, float s, float inv_s) {
    uint32_t w[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) q[i] = pow2 ? x[4 * h + i] * inv_s : x[4 * h + i] / s;
      w[h] = static_cast<uint32_t>(num::F32PairToE4m3(q[0], q[1])) |
             (static_cast<uint32_t>(num::F32PairToE4m3(q[2], q[3])) << 16);
    }
    return make_uint2(w[0], w[1]);
  };
  uint2* nope = reinterpret_cast<uint2*>(p.nope + e * kNopeDim);
  nope[jlo] = codes8(lo, slo, mlo);
  if (hi_nope) nope[jhi] = codes8(hi, shi, mhi);
  else reinterpret_cast<uint4*>(rope)[jhi - kNopeChunks] = PackBf16x8(hi);
  if (p.fmt == kDsFp8) {
    if ((lane & 7) == 0) {
      p.scale[e * kNopeTiles + (lane >> 3)] = blo;
      if (hi_nope) p.scale[e * kNopeTiles + 4 + (lane >> 3)] = bhi;
    }
  } else if (lane == 0) {
    reinterpret_cast<float*>(p.scale)[e] = slo;
  }
}


// ---- decode ------------------------------------------------------------------------
// The bf16 bits of code * s (exactly num::F32ToBf16(num::E4m3ToF32(c) * s)),
// for one code; the NaN cases follow the host, where a NaN operand of the
// product is returned as it is.
__device__ __forceinline__ uint16_t DequantOne(uint8_t c, float s) {
  if ((c & 0x7fu) == 0x7fu) return num::F32ToBf16(num::E4m3ToF32(c));
  if (num::IsNan(s)) return num::F32ToBf16(s);
  return num::F32ToBf16(num::E4m3ToF32(c) * s);
}

// 8 e4m3 codes times s as 8 bf16. Fast path: the hardware conversions
// (e4m3 -> f16 is exact, the product is one IEEE multiply, f32 -> bf16 is
// round-to-nearest-even like F32ToBf16); NaN codes or a NaN scale take the
// scalar path so that their bits match the host.
__device__ __forceinline__ uint4 DequantChunk(uint2 codes, float s) {
  const uint64_t c = (static_cast<uint64_t>(codes.y) << 32) | codes.x;
  const uint64_t t = (c & 0x7f7f7f7f7f7f7f7full) ^ 0x7f7f7f7f7f7f7f7full;
  const bool nan_code = ((t - 0x0101010101010101ull) & ~t & 0x8080808080808080ull) != 0;
  uint32_t w[4];
  if (nan_code || num::IsNan(s)) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint8_t c0 = static_cast<uint8_t>(c >> (16 * i)), c1 = static_cast<uint8_t>(c >> (16 * i + 8));
      w[i] = static_cast<uint32_t>(DequantOne(c0, s)) |
             (static_cast<uint32_t>(DequantOne(c1, s)) << 16);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>((c >> (16 * i)) & 0xffffu), __NV_E4M3);
      float2 f = __half22float2(*reinterpret_cast<__half2*>(&h));
      __nv_bfloat162 b = __floats2bfloat162_rn(__fmul_rn(f.x, s), __fmul_rn(f.y, s));
      w[i] = *reinterpret_cast<uint32_t*>(&b);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The raw bytes of one entry a lane needs (its two chunks and their
// scales): loading is split from decoding so that a warp can have several
// entries in flight before its first store.
struct EntryRegs {
  uint4 lo, hi;  // fp8: codes in .x/.y (hi: RoPE bf16 in all four for lanes 24..31)
  float slo, shi;
};

// Through the read-only cache: every pool it reads is one no thread of the
// kernel writes.
__device__ __forceinline__ EntryRegs WarpLoadEntry(const EntryPool& p, int64_t e) {
  const int lane = threadIdx.x & 31;
  const int jlo = lane, jhi = lane + 32;
  const bool hi_nope = jhi < kNopeChunks;
  const uint4* rope = reinterpret_cast<const uint4*>(p.rope + e * kRopeDim);
  EntryRegs r;
  r.slo = r.shi = 1.f;
  if (p.fmt == kBf16) {
    const uint4* nope =
        reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(p.nope) + e * kNopeDim);
    r.lo = __ldg(nope + jlo);
    r.hi = hi_nope ? __ldg(nope + jhi)
                   : __ldg(rope + (jhi - kNopeChunks));
    return r;
  }
  const uint2* nope = reinterpret_cast<const uint2*>(p.nope + e * kNopeDim);
  const uint2 clo = __ldg(nope + jlo);
  r.lo = make_uint4(clo.x, clo.y, 0, 0);
  if (hi_nope) {
    const uint2 chi = __ldg(nope + jhi);
    r.hi = make_uint4(chi.x, chi.y, 0, 0);
  } else {
    r.hi = __ldg(rope + (jhi - kNopeChunks));
  }
  if (p.fmt == kDsFp8) {
    r.slo = num::E8m0ToF32(__ldg(p.scale + e * kNopeTiles + (jlo >> 3)));
    if (hi_nope)
      r.shi = num::E8m0ToF32(__ldg(p.scale + e * kNopeTiles + (jhi >> 3)));
  } else {
    r.slo = r.shi = __ldg(reinterpret_cast<const float*>(p.scale) + e);
  }
  return r;
}

// Decodes loaded entry bytes to bf16: the lane's chunk `lane` to *lo and its
// chunk `lane + 32` to *hi (16-byte aligned each; a row in shared memory may
// place its chunks anywhere, e.g. swizzled for the tensor cores).
__device__ __forceinline__ void WarpStoreEntryChunks(int fmt, const EntryRegs& r, uint4* lo,
                                                     uint4* hi) {
  const int jhi = (threadIdx.x & 31) + 32;
  if (fmt == kBf16) {
    *lo = r.lo;
    *hi = r.hi;
    return;
  }
  *lo = DequantChunk(make_uint2(r.lo.x, r.lo.y), r.slo);
  *hi = jhi < kNopeChunks ? DequantChunk(make_uint2(r.hi.x, r.hi.y), r.shi) : r.hi;
}

// Decodes loaded entry bytes to 512 bf16 at `out` (16-byte aligned).
__device__ __forceinline__ void WarpStoreEntry(int fmt, const EntryRegs& r, uint16_t* out) {
  const int lane = threadIdx.x & 31;
  uint4* dst = reinterpret_cast<uint4*>(out);
  WarpStoreEntryChunks(fmt, r, dst + lane, dst + lane + 32);
}

// A zero row of 512 bf16.
__device__ __forceinline__ void WarpZeroRow(uint16_t* out) {
  const int lane = threadIdx.x & 31;
  uint4* dst = reinterpret_cast<uint4*>(out);
  dst[lane] = make_uint4(0, 0, 0, 0);
  dst[lane + 32] = make_uint4(0, 0, 0, 0);
}

}  // namespace cuda
}  // namespace dsv4
