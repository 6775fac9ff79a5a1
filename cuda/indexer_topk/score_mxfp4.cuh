// indexer_topk's scores for q_format "mxfp4": ScoreKernelMxfp4, int8 MMAs on the tensor cores.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/bf16_chunks.cuh"
#include "common/launch.cuh"
#include "common/layer_checks.cuh"
#include "dsv4/indexer_topk.h"
#include "indexer_topk/key_tile_ring.cuh"
#include "indexer_topk/launch_policy.h"
#include "indexer_topk/mxfp4_head_tree.cuh"
#include "indexer_topk/mxfp4_mma.cuh"
#include "indexer_topk/mxfp4_query.cuh"
#include "indexer_topk/token.cuh"

namespace dsv4 {
namespace indexer {
namespace {  // internal linkage: see cuda/indexer_topk/indexer_topk.cu

// One kernel, ScoreKernelMxfp4. Each CTA first rounds its token's q to
// MXFP4 into shared memory (QueryOperands, while its first key tiles load):
// the int8 codes (twice the e2m1 value) and factors Q of the per-block form,
// the fast form's shifted codes, wq and accumulator starts (dsv4/indexer.h).
// qscratch is left alone on CUDA: 16 KB of q per CTA is cheaper to round
// again than a launch.
// ScoreKernelMxfp4 gives each warp tiles of 32 entries, one logical block
// (2 KB of packed keys and 128 B of scale bytes, each contiguous: one
// block-table read, a plain copy into shared memory). mma.m16n8k32 covers 16
// entries and 8 heads; a tile is two row halves of 16.
//  - Fast tiles (the token's heads and the tile's keys within the guards of
//    the fast form): key codes shifted by their block's sk, one MMA chain
//    over all 128 channels gives A per (entry, head). The key operand is
//    unsigned, 128 + code (three instructions a word, no sign to handle), so
//    the chain adds A + 128 * sum(q): it starts from the bits of 2^23 less
//    128 * sum(q) of the head and ends at the bits of 2^23 + A. As a float
//    that is 2^23 + A for A >= 0 and below 2^23 otherwise, so one
//    saturating fma per head gives its term and one fma per node of the
//    head tree adds, scaled by 2^-72 with the weights' signs kept aside
//    (see TreeSigns in mxfp4_head_tree.cuh).
//  - Other tiles, per row half and block b: S from one s8 x s8 MMA
//    (accumulator from 1.5 * 2^23; one fma gives u = fl(S K) while that
//    constant is finite: key scale bytes 1 to 231, else subtract then
//    multiply), then d's chain of products, each rounded before its add.
// Channels are permuted identically in both operands of a form (an integer
// sum does not care): in the fast form lane c of a quad holds block c of a
// key row (its 16 bytes: one shared-memory read, one shift sk) and k-step kk
// its channels 8kk..8kk+7; in the per-block form k-step b is block b and
// lane c holds its channels 8c..8c+7. Heads are placed so that lane c of a
// quad holds heads 16c..16c+15 (n-tile j, column 2c + p: head 16c + 2j + p):
// levels 1-4 of the head tree stay in the lane, levels 5 and 6 take three
// shuffles for the lane's four rows (lane c ends with row g + 8c). A warp
// computes a fast tile's heads in two halves of 32 (FastTileHalf), so that it
// fits 128 registers: 16 warps a multiprocessor.

// A tile in the per-block form: levels 1-4 of the head tree of the lane's
// rows g + 8h (BlockTileL4 and ScoreKernelMxfp4Rows' BlockTileL4Row call it).
__device__ __forceinline__ float4 BlockTileL4Sums(const uint32_t* st, const uint4* bfrag,
                                                  const float2 (*qf_s)[kIndexHeads / 2],
                                                  const float2* w_s, int g, int c) {
  float l4[4];
  const TreeSigns plain = PlainTreeSigns();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    TileKeys cur;
    const uint32_t* rg = st + (g + 16 * half) * kRowWords + c;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      cur.kg[b] = rg[4 * b];
      cur.kh[b] = rg[8 * kRowWords + 4 * b];
    }
    cur.sg = st[kScaleWord + g + 16 * half];
    cur.sh = st[kScaleWord + g + 8 + 16 * half];
    float pg[8], ph[8];
    if (__all_sync(cuda::kFull, FmaScales(cur.sg) && FmaScales(cur.sh)))
      BlockTileSums<true>(bfrag, qf_s, w_s, cur, c, pg, ph);
    else
      BlockTileSums<false>(bfrag, qf_s, w_s, cur, c, pg, ph);
    l4[2 * half] = LaneHeadTree(pg, plain);
    l4[2 * half + 1] = LaneHeadTree(ph, plain);
  }
  return make_float4(l4[0], l4[1], l4[2], l4[3]);
}

// BlockTileL4Sums out of line: rare, and its registers stay out of the fast
// path's. One copy per score kernel (kCaller: its kPairs), so that the
// compiler still folds the caller's shared-memory addresses into it: a copy
// shared by two callers takes them as parameters, and the caller spills.
template <bool kCaller>
__device__ __noinline__ float4 BlockTileL4(const uint32_t* st, const uint4* bfrag,
                                           const float2 (*qf_s)[kIndexHeads / 2],
                                           const float2* w_s, int g, int c) {
  return BlockTileL4Sums(st, bfrag, qf_s, w_s, g, c);
}

// One CTA: one token, columns * tiles_per_warp tiles of consecutive entries;
// the warps of column w take tiles w, w + columns, ..., each keeping
// kStages - 1 of them in flight. One CTA of 16 warps a multiprocessor (128
// registers a thread), so each multiprocessor rounds its token's q once, not
// once per small CTA (with three 4-warp CTAs, an earlier shape, ncu put a
// quarter of the warps' samples in that prologue, waiting on q behind the
// key tiles' loads and repeating its arithmetic).
// kPairs (grids of a tile a warp, PairWarps): 8 columns of two warps; warp
// 2p + hf computes half hf of column p's fast tiles (FastTileHalf; each warp
// copies the tile into its own ring) and warp 2p joins the halves, scores
// per-block tiles alone and stores. A tile's latency is all such a grid
// sees, and one half is about half of it. Else 16 columns of one warp.
// A token with a NaN or Inf in q or its weights is found while its query is
// rounded; the CTA then stops before it counts a missing block or scores a
// key (the select drops the row and counts it once).
template <bool kPairs>
__global__ void __launch_bounds__(kMmaThreads, kScoreCtasPerSm) ScoreKernelMxfp4(IndexerTopkArgs a,
                                                                                 int tiles_per_warp,
                                                                                 bool evict_first) {
  extern __shared__ __align__(16) uint32_t ring_dyn[];       // kRingBytes: the key rings
  __shared__ QueryOperands qo;
  __shared__ int32_t blocks_s[kMmaWarps * kMaxTilesPerWarp];
  // kPairs: warp 2p + 1's halves of the head tree, a buffer per tile parity
  __shared__ float half_l3[kPairs ? 2 : 1][kPairs ? TileColumns(true) : 1][4][32];
  __shared__ int nonfinite_s;                                  // a NaN or Inf in q or weights
  // Launched overlapped (cuda::LaunchOverlapped): every operand, q included,
  // may be what the kernel ahead writes, so nothing is read before the wait.
  // The select may then take the multiprocessors this grid leaves: it reads
  // its token's q, slot and position before its own wait, which is safe as
  // every CTA here has waited before it lets the select start.
  cuda::WaitForPrevious();
  cuda::LetNextStart();
  const int64_t t = blockIdx.x;
  // the query first, even before the token's slot and position (its address
  // needs neither; a CTA that then has nothing to score wasted 16 KB of
  // reads): its loads go out before the key tiles', which would otherwise
  // queue ahead of them (every CTA starts its rings at once)
  QueryBlockRaw qraw[kQueryPairsPerThread];
#pragma unroll
  for (int i = 0; i < kQueryPairsPerThread; ++i) {
    const int pair = threadIdx.x + i * kMmaThreads;
    if (pair < kQueryPairs) qraw[i] = LoadQueryBlock(a, t, pair / kIndexScales, pair % kIndexScales);
  }
  const TokenInfo ti = ReadToken(a, t);
  constexpr int columns = TileColumns(kPairs);
  const int64_t span = static_cast<int64_t>(columns) * tiles_per_warp * kTile;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * span;
  if (!ti.ok || first >= ti.n) return;
  // warp 0: the weights' signs, for the fast form's tree (TreeSigns); read
  // again here (256 bytes), as gathering them from the pair threads would
  // need one more CTA barrier
  static_assert(kIndexHeads == 64, "two weights a lane of warp 0");
  uint32_t neg_lo = 0, neg_hi = 0;
  if (threadIdx.x < 32) {
    neg_lo = __float_as_uint(a.weights[t * kIndexHeads + threadIdx.x]) >> 31;
    neg_hi = __float_as_uint(a.weights[t * kIndexHeads + 32 + threadIdx.x]) >> 31;
  }
  const int64_t j_first = first / kTile;                      // this CTA's first logical block
  if (threadIdx.x < columns * tiles_per_warp) {
    const int64_t j = j_first + threadIdx.x;
    blocks_s[threadIdx.x] = j < a.MB ? a.block_table[ti.slot * a.MB + j] : -1;
  }
  if (threadIdx.x == 0) nonfinite_s = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int column = kPairs ? warp >> 1 : warp;                // tiles column + columns * it
  const int half = kPairs ? warp & 1 : -1;                     // pairs: this warp's heads
  const int own_row = g + 8 * c;                               // the row this lane finishes
  const uint32_t byte_c = 0x4440u + c;                         // permute: byte c, zeros above
  const int64_t l = *a.layer;
  const TileStream ts = WarpTileStream(a, l, evict_first, ring_dyn, warp, lane);
  auto ring_s = reinterpret_cast<uint32_t (*)[kStages][kTileWords]>(ring_dyn);
  uint32_t* keys = a.scratch + t * a.E;
  int tiles = 0;                                               // this warp's tiles below n
  while (tiles < tiles_per_warp && first + (column + columns * tiles) * kTile < ti.n) ++tiles;
  auto issue = [&](int it) {
    if (it < tiles) ts.Issue(blocks_s[column + columns * it], it % kStages, lane);
    cuda::CpAsyncCommit();                                     // empty groups keep the count
  };
#pragma unroll 1
  for (int it = 0; it < kStages - 1; ++it) issue(it);
  // the query, while the first tiles arrive (whole warps of pairs or none)
  bool head_fast = true, finite = true;
#pragma unroll
  for (int i = 0; i < kQueryPairsPerThread; ++i) {
    const int pair = threadIdx.x + i * kMmaThreads;
    if (pair < kQueryPairs) {
      finite &= QueryBlockFinite(qraw[i]);
      head_fast &= QuantizeQueryPair(qraw[i], pair / kIndexScales, pair % kIndexScales, qo);
    }
  }
  if (!finite) nonfinite_s = 1;
  if (threadIdx.x < 32) {
    const uint64_t neg = __ballot_sync(cuda::kFull, neg_lo) |
                         static_cast<uint64_t>(__ballot_sync(cuda::kFull, neg_hi)) << 32;
    if (threadIdx.x < 4) qo.tree[threadIdx.x] = MakeTreeSigns(neg, threadIdx.x);
  }
  const bool token_fast = __syncthreads_and(head_fast);
  if (nonfinite_s) {                                           // NONFINITE: the select drops the row
    cuda::CpAsyncWait<0>();
    return;
  }
  if (threadIdx.x < columns * tiles_per_warp) {
    // each logical block is read by one CTA: it counts a missing one
    const int64_t j = j_first + threadIdx.x;
    const int32_t block = blocks_s[threadIdx.x];
    if (j * kPerBlock < ti.n && (block < 0 || block >= a.N))
      cuda::CountErrorAtomic(a.errors, kMissingBlock, t);
  }
  for (int it = 0; it < tiles; ++it) {                         // uniform per warp
    const int32_t block = blocks_s[column + columns * it];    // read early: hides its latency
    issue(it + kStages - 1);
    cuda::CpAsyncWait<kStages - 1>();
    __syncwarp();
    const int64_t e0 = first + (column + columns * it) * kTile;
    if (block < 0 || block >= a.N) {
      if (half <= 0 && e0 + lane < ti.n) keys[e0 + lane] = 0;
    } else if (half <= 0 || token_fast) {                      // pairs: warp 2p + 1 only helps
      const uint32_t* st = &ring_s[warp][it % kStages][0];
      const bool own_valid = e0 + own_row < ti.n;
      uint32_t shifts;
      float kf;
      bool fast = IndexKeyFast(st[kScaleWord + own_row], &shifts, &kf);
      if (!own_valid) fast = true, shifts = 0;                 // rows past n: not stored
      float l4[4];   // levels 1-4 of rows g + 8h
      float m5 = 1.f, m6 = 1.f;
      if (token_fast && __all_sync(cuda::kFull, fast)) {
        uint4 kv[4];
        uint2 tab[4];
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          kv[h] = *reinterpret_cast<const uint4*>(st + (g + 8 * h) * kRowWords + 4 * c);
          const uint32_t sk = Prmt(__shfl_sync(cuda::kFull, shifts, 4 * g + h), 0u, byte_c);
          tab[h] = make_uint2(0x03020100u << sk, 0x0C080604u << sk);
        }
        const TreeSigns& signs = qo.tree[c];
        float lo[4], hi[4];
        if constexpr (!kPairs) {
          FastTileHalf<0>(qo.fast + lane, qo.leaf + c, signs, qo.start + c, kv, tab, lo);
          FastTileHalf<1>(qo.fast + lane, qo.leaf + c, signs, qo.start + c, kv, tab, hi);
        } else {
          if (half == 0)
            FastTileHalf<0>(qo.fast + lane, qo.leaf + c, signs, qo.start + c, kv, tab, lo);
          else
            FastTileHalf<1>(qo.fast + lane, qo.leaf + c, signs, qo.start + c, kv, tab, hi);
          // the pair's halves meet in shared memory (a buffer per tile parity:
          // warp 2p + 1 writes one while warp 2p may still read the other)
          float(&other)[4][32] = half_l3[it & 1][column];
          if (half == 1) {
#pragma unroll
            for (int h = 0; h < 4; ++h) other[h][lane] = hi[h];
          }
          asm volatile("bar.sync %0, 64;" ::"r"(1 + column) : "memory");
          if (half == 1) {
            __syncwarp();
            continue;
          }
#pragma unroll
          for (int h = 0; h < 4; ++h) hi[h] = other[h][lane];
        }
#pragma unroll
        for (int h = 0; h < 4; ++h) l4[h] = JoinHeadHalves(lo[h], hi[h], signs);
        kf *= signs.root;                                      // both powers of two
        m5 = signs.l5, m6 = signs.l6;
      } else {
        if (half == 1) {                                       // warp 2p scores it alone
          __syncwarp();
          continue;
        }
        kf = 1.f;
        const float4 v = BlockTileL4<kPairs>(st, qo.block + lane, qo.qf, qo.w, g, c);
        l4[0] = v.x, l4[1] = v.y, l4[2] = v.z, l4[3] = v.w;
      }
      const float score = kf * QuadHeadTree(l4, c, m5, m6);
      if (own_valid) keys[e0 + own_row] = IndexRankKey(score);
    }
    __syncwarp();                                              // the stage is free for its next tile
  }
  cuda::CpAsyncWait<0>();
}

}  // namespace
}  // namespace indexer
}  // namespace dsv4
