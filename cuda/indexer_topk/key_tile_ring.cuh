// indexer_topk's mxfp4 key tiles: a ring of cp.async stages per warp, a logical block a tile.
#pragma once

#include <cstdint>

#include "common/cp_async.cuh"
#include "dsv4/indexer_topk.h"
#include "indexer_topk/launch_policy.h"

namespace dsv4 {
namespace indexer {
namespace {  // internal linkage: see cuda/indexer_topk/indexer_topk.cu

// A tile in shared memory: the block's 32 packed keys (64 bytes each, rows
// g and g + 1 of a quarter warp's 16-byte reads fill 32 distinct banks),
// then its 32 scale words.
// Two stages: one tile ahead of the one in use; every deeper ring measured
// made the score kernel slower (docs/perf/indexer.md, "Ideas tried").
constexpr int kStages = 2;
constexpr int kRowWords = kIndexPacked / 4;                  // 16
constexpr int kScaleWord = kTile * kRowWords;                // 512
constexpr int kTileWords = kScaleWord + kTile;               // 544
constexpr int64_t kBlockKeyBytes = static_cast<int64_t>(kPerBlock) * kIndexPacked;     // 2048
constexpr int64_t kBlockScaleBytes = static_cast<int64_t>(kPerBlock) * kIndexScales;   // 128
constexpr int kRingBytes = kMmaWarps * kStages * kTileWords * 4;                      // dynamic

// The key stream's L2 policy: evict_first where the keys are more than L2
// holds (KeysEvictFirst), so that lines read once go before the rank keys
// the select reads next; else evict_normal.
__device__ __forceinline__ uint64_t StreamPolicy(bool evict_first) {
  uint64_t p;
  if (evict_first) asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  else asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(p));
  return p;
}
// A warp's view of its tiles: lane L copies 16-byte chunks L, L + 32, L + 64
// and L + 96 of the keys and (lanes 0-7) chunk L of the scales.
struct TileStream {
  const uint8_t* packed;     // layer's packed keys + this lane's first chunk
  const uint8_t* scale;      // layer's scale bytes + this lane's chunk
  uint32_t dst;              // this lane's shared address in stage 0
  int64_t N;
  uint64_t policy;           // StreamPolicy

  // Starts the copy of `block` into `stage`; nothing for a missing block.
  __device__ __forceinline__ void Issue(int32_t block, int stage, int lane) const {
    if (block < 0 || block >= N) return;
    const uint32_t d = dst + static_cast<uint32_t>(stage) * kTileWords * 4;
    const uint8_t* src = packed + static_cast<int64_t>(block) * kBlockKeyBytes;
#pragma unroll
    for (int i = 0; i < 4; ++i) cuda::CpAsync16(d + 512 * i, src + 512 * i, policy);
    if (lane < 8)
      cuda::CpAsync16(d + kScaleWord * 4, scale + static_cast<int64_t>(block) * kBlockScaleBytes,
                      policy);
  }
};

// Warp `warp`'s stream of layer l's tiles into its ring in `ring_dyn`
// (kMmaWarps rings of kStages tiles, the start of the kernel's dynamic shared
// memory); the ring as an array, for reading the tiles.
__device__ __forceinline__ TileStream WarpTileStream(const IndexerTopkArgs& a, int64_t l,
                                                     bool evict_first, uint32_t* ring_dyn,
                                                     int warp, int lane) {
  TileStream ts;
  ts.N = a.N;
  ts.policy = StreamPolicy(evict_first);
  ts.packed = a.packed + l * a.N * kBlockKeyBytes + lane * 16;
  ts.scale = a.scale + l * a.N * kBlockScaleBytes + (lane & 7) * 16;
  auto ring_s = reinterpret_cast<uint32_t (*)[kStages][kTileWords]>(ring_dyn);
  ts.dst = static_cast<uint32_t>(__cvta_generic_to_shared(&ring_s[warp][0][0])) + lane * 16;
  return ts;
}

}  // namespace
}  // namespace indexer
}  // namespace dsv4
