// One KV entry (512 channels) in the three storage formats of docs/design/formats.md:
// encode from bf16 values, decode to bf16. Serial per entry; shared by the CPU
// handlers and usable per thread on the device.
#pragma once

#include <cstdint>

#include "dsv4/layout.h"
#include "dsv4/numerics.h"

namespace dsv4 {

// Base pointers of a pool's entry leaves; entry `e` is the e-th row of
// [..., 448] / [..., 64] / [..., 7 or 1] (e is a flat 64-bit row index).
struct EntryPool {
  int fmt = kDsFp8;
  uint8_t* nope = nullptr;   // e4m3 codes, or bf16 (2 bytes each) for kBf16
  uint16_t* rope = nullptr;  // bf16 bits
  uint8_t* scale = nullptr;  // e8m0[7] (ds_fp8), f32[1] (fp8_token), none (bf16)
};

// Store the bf16-valued fp32 row x[512] as entry e.
DSV4_HD void EncodeEntry(const EntryPool& p, int64_t e, const float* x) {
  const int64_t e64 = e;
  if (p.fmt == kBf16) {
    uint16_t* nope = reinterpret_cast<uint16_t*>(p.nope) + e64 * kNopeDim;
    for (int c = 0; c < kNopeDim; ++c) nope[c] = num::F32ToBf16(x[c]);
  } else if (p.fmt == kFp8Token) {
    float s = num::QuantizeFp8Token(x, kNopeDim, p.nope + e64 * kNopeDim);
    float* scale = reinterpret_cast<float*>(p.scale) + e64;
    *scale = s;
  } else {
    for (int t = 0; t < kNopeTiles; ++t)
      p.scale[e64 * kNopeTiles + t] = num::QuantizeDsFp8Tile(
          x + t * kNopeTile, kNopeTile, p.nope + e64 * kNopeDim + t * kNopeTile);
  }
  for (int c = 0; c < kRopeDim; ++c) p.rope[e64 * kRopeDim + c] = num::F32ToBf16(x[kNopeDim + c]);
}

// Entry e as 512 bf16 values (bits).
DSV4_HD void DecodeEntry(const EntryPool& p, int64_t e, uint16_t* out) {
  const int64_t e64 = e;
  if (p.fmt == kBf16) {
    const uint16_t* nope = reinterpret_cast<const uint16_t*>(p.nope) + e64 * kNopeDim;
    for (int c = 0; c < kNopeDim; ++c) out[c] = nope[c];
  } else if (p.fmt == kFp8Token) {
    float s = reinterpret_cast<const float*>(p.scale)[e64];
    const uint8_t* q = p.nope + e64 * kNopeDim;
    for (int c = 0; c < kNopeDim; ++c) out[c] = num::F32ToBf16(num::E4m3ToF32(q[c]) * s);
  } else {
    const uint8_t* q = p.nope + e64 * kNopeDim;
    for (int c = 0; c < kNopeDim; ++c)
      out[c] = num::F32ToBf16(num::DequantDsFp8(q[c], p.scale[e64 * kNopeTiles + c / kNopeTile]));
  }
  for (int c = 0; c < kRopeDim; ++c) out[kNopeDim + c] = p.rope[e64 * kRopeDim + c];
}

// MXFP4 indexer key: 128 bf16-valued fp32 -> 64 packed bytes (element 2j in
// the low nibble) + 4 e8m0 scales.
DSV4_HD void EncodeIndexKey(const float* x, uint8_t* packed, uint8_t* scales) {
  for (int b = 0; b < kIndexScales; ++b) {
    uint8_t codes[32];
    scales[b] = num::QuantizeMxfp4Block(x + 32 * b, 32, codes);
    for (int j = 0; j < 16; ++j)
      packed[16 * b + j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
  }
}

}  // namespace dsv4
