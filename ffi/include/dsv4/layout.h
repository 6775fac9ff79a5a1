// Geometry and storage constants of the DSV4 cache (docs/design/overview.md,
// docs/design/formats.md, docs/design/state.md).
// Mirrors dsv4_jax/config.py and dsv4_jax/errors.py; tests compare the two.
#pragma once

#include <cstdint>

namespace dsv4 {

constexpr int kHeadDim = 512;      // entry width d
constexpr int kRopeDim = 64;       // trailing RoPE channels
constexpr int kNopeDim = 448;      // channels stored as fp8
constexpr int kNopeTile = 64;      // ds_fp8: one UE8M0 scale per tile
constexpr int kNopeTiles = 7;
constexpr int kWindow = 128;       // sliding window
constexpr int kCsaRatio = 4;
constexpr int kHcaRatio = 128;
constexpr int kBlockTokens = 128;  // tokens per paged block
constexpr int kIndexDim = 128;
constexpr int kIndexPacked = 64;   // bytes of packed e2m1 codes per key
constexpr int kIndexScales = 4;

// Scratch bytes a prefill chunk row of attention takes on the GPU: its entry
// as append stores it (NoPE codes or bf16 up to 896 bytes, RoPE 128, scales
// up to 8) and one byte saying whether the row was finite (1040 in all), then
// the entry decoded to the 512 bf16 a query sees (1024), which the kernel's
// producer copies into a tile without a pass through registers.
constexpr int kAttnChunkEncodedRow = 1040;
constexpr int kAttnChunkScratchRow = kAttnChunkEncodedRow + 1024;

// Online-softmax accumulator rows (axis of length 3 in comp/icomp).
constexpr int kAccMax = 0, kAccSum = 1, kAccKv = 2;

// A blank (scrubbed or never written) entry: zero codes and scale byte 0x7F
// (1.0 in e8m0; 0x00 would be 2^-127 and 0xFF is NaN).
constexpr uint8_t kBlankScaleE8m0 = 0x7F;

// kv_format attribute of the handlers (dsv4_jax/config.py KV_FORMAT_CODE),
// decoded as this enum (dsv4/attrs.h): int64_t, the type of the scalar a
// Python int becomes.
enum KvFormat : int64_t { kDsFp8 = 0, kFp8Token = 1, kBf16 = 2 };

// Counters of dropped bad input, the index into state.errors.
enum ErrorKind : int {
  kBadSlot = 0,
  kBadPosition = 1,
  kMissingBlock = 2,
  kBadIndex = 3,
  kBadLength = 4,
  kNonfinite = 5,
  kBadLayer = 6,
  kBadBlockAssignment = 7,
  kStaleWindow = 8,
  kNumErrorKinds = 9,
};

// With error detail (CacheConfig(error_detail=True)) each shard's errors row
// is kNumErrorKinds * (1 + kErrorDetailFields) words: the counters, then the
// smallest input row each kind dropped in the running op (the handlers write
// both), then the record the op's Python wrapper keeps (dsv4_jax/errors.py).
constexpr int kErrorDetailFields = 5;
// first_row of a kind no row was counted for (BAD_LAYER always)
constexpr int32_t kNoRow = 0x7FFFFFFF;

}  // namespace dsv4
