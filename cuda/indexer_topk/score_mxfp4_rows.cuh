// indexer_topk's mxfp4 scores of groups of rows (rows_per_request > 1): ScoreKernelMxfp4Rows,
// each key tile read and decoded once for a group's rows of one request.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/launch.cuh"
#include "common/layer_checks.cuh"
#include "dsv4/indexer_topk.h"
#include "indexer_topk/key_tile_ring.cuh"
#include "indexer_topk/launch_policy.h"
#include "indexer_topk/mxfp4_head_tree.cuh"
#include "indexer_topk/mxfp4_mma.cuh"
#include "indexer_topk/mxfp4_query.cuh"
#include "indexer_topk/score_mxfp4.cuh"
#include "indexer_topk/token.cuh"

namespace dsv4 {
namespace indexer {
namespace {  // internal linkage: see cuda/indexer_topk/indexer_topk.cu

constexpr int kMaxRowsPerCta = static_cast<int>(kMaxRowsPerRequest);
static_assert(kMaxRowsPerCta <= 32, "a bit a row in a mask");
// Rows whose queries one pass of the CTA's threads rounds (a thread a
// (head, block) pair, whole warps a row).
constexpr int kRowsPerPass = kMmaThreads / kQueryPairs;
static_assert(kMmaThreads % kQueryPairs == 0 && kQueryPairs % 32 == 0, "whole warps a row");

// Dynamic shared memory of a CTA of `rows` rows: the key rings, then the
// rows' rounded queries.
constexpr size_t RowsDynamicBytes(int rows) {
  return kRingBytes + static_cast<size_t>(rows) * sizeof(QueryOperands);
}
static_assert(kRingBytes % alignof(QueryOperands) == 0, "the queries follow the rings aligned");
// ScoreKernelMxfp4Rows' static shared memory (blocks_s, the per-row
// words); with the most rows, all of it within the 227 KB a CTA may take on
// sm_90 and sm_100 (kMaxRowsPerRequest's bound).
constexpr size_t kRowsStaticBytes = 4 * kMmaWarps * kMaxTilesPerWarp + 16 * kMaxRowsPerCta;
static_assert(RowsDynamicBytes(kMaxRowsPerCta) + kRowsStaticBytes <= 227 * 1024,
              "kMaxRowsPerRequest rounded queries and the rings fit a CTA");

// The kernel's dynamic shared memory (every extern __shared__ array is the
// same bytes): the key rings, then a QueryOperands a row.
extern __shared__ __align__(16) uint32_t rows_dyn[];

__device__ __forceinline__ QueryOperands& RowQuery(int r) {
  return reinterpret_cast<QueryOperands*>(rows_dyn + kRingBytes / 4)[r];
}

// BlockTileL4Sums of row r out of line (BlockTileL4's reasons); the row's
// operands are found from r here, so the compiler sees them in shared memory
// at fixed offsets from one base.
__device__ __noinline__ float4 BlockTileL4Row(const uint32_t* st, int r, int g, int c, int lane) {
  const QueryOperands& qo = RowQuery(r);
  return BlockTileL4Sums(st, qo.block + lane, qo.qf, qo.w, g, c);
}

// ScoreKernelMxfp4 for a group of rows: CTA x takes rows x G .. x G + G - 1
// (G = rows_per_cta, fewer in the last CTA), the same entry span of each as
// ScoreKernelMxfp4's CTA of one row. It rounds every row's query into its
// own QueryOperands (shared memory past the rings), then scores the rows by
// slot: the rows sharing the first row's slot together, then those of the
// next slot, and so on (a verify step's group is one slot). For a slot's
// rows each warp copies a key tile once, decodes it once (DecodeFastTile)
// and runs every row's MMAs and head tree on it, storing each row's rank
// keys below that row's own visible count. Per row everything is as in
// ScoreKernelMxfp4: a bad slot or position, or a NaN or Inf in its q or
// weights, leaves the row out (nothing counted here, the select drops and
// counts it); MISSING_BLOCK once per missing block the row needs; a row with
// a head outside the fast form's guards, or a tile with a key outside them
// below the largest visible count of the slot's rows, takes the per-block
// form (the same bits: the form decides the time only).
// Launched only where a CTA a row would give each warp at least 12 tiles
// (RowsPerCta, launch_policy.h), always in single warps.
__global__ void __launch_bounds__(kMmaThreads, kScoreCtasPerSm)
    ScoreKernelMxfp4Rows(IndexerTopkArgs a, int tiles_per_warp, bool evict_first,
                         int rows_per_cta) {
  __shared__ int32_t blocks_s[kMmaWarps * kMaxTilesPerWarp];
  __shared__ int32_t n_s[kMaxRowsPerCta];       // visible entries (0: a bad row), < 2^31
  __shared__ int32_t slot_s[kMaxRowsPerCta];
  __shared__ int nonfinite_s[kMaxRowsPerCta];   // a NaN or Inf in the row's q or weights
  __shared__ int slow_s[kMaxRowsPerCta];        // a head of the row outside the fast form
  // overlapped launch: ScoreKernelMxfp4's reasons
  cuda::WaitForPrevious();
  cuda::LetNextStart();
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * rows_per_cta;
  const int rows = static_cast<int>(a.T - t0 < rows_per_cta ? a.T - t0 : rows_per_cta);
  const int pass_row = threadIdx.x / kQueryPairs, pair = threadIdx.x % kQueryPairs;
  // the first pass's queries first (ScoreKernelMxfp4's reason)
  QueryBlockRaw qraw{};
  if (pass_row < rows)
    qraw = LoadQueryBlock(a, t0 + pass_row, pair / kIndexScales, pair % kIndexScales);
  constexpr int columns = TileColumns(false);
  // entries as int: E = MB * 32 < 2^31 (a position is an int32)
  const int span = columns * tiles_per_warp * kTile;
  const int first = static_cast<int>(blockIdx.y) * span;
  if (threadIdx.x < rows) {
    const TokenInfo ti = ReadToken(a, t0 + threadIdx.x);
    n_s[threadIdx.x] = ti.ok ? static_cast<int32_t>(ti.n) : 0;
    slot_s[threadIdx.x] = static_cast<int32_t>(ti.slot);
    nonfinite_s[threadIdx.x] = 0;
    slow_s[threadIdx.x] = 0;
  }
  __syncthreads();
  uint32_t live = 0;                                           // rows with entries in the span
  for (int r = 0; r < rows; ++r)
    if (n_s[r] > first) live |= 1u << r;
  if (!live) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int column = warp;                                     // tiles column + columns * it
  const int own_row = g + 8 * c;                               // the row this lane finishes
  const uint32_t byte_c = 0x4440u + c;                         // permute: byte c, zeros above
  const int64_t l = *a.layer;
  // row r's rank keys (recomputed where used: a register less across the tile loop)
  const auto row_keys = [&](int r) {
    return a.scratch + (static_cast<int64_t>(blockIdx.x) * rows_per_cta + r) * a.E;
  };
  const TileStream ts = WarpTileStream(a, l, evict_first, rows_dyn, warp, lane);
  auto ring_s = reinterpret_cast<uint32_t (*)[kStages][kTileWords]>(rows_dyn);
  const int j_first = first / kTile;                          // this CTA's first logical block
  uint32_t todo = live, slow = 0;
  bool rounded = false;
  while (todo) {                                               // uniform: one slot's rows a turn
    const int32_t slot = slot_s[__ffs(todo) - 1];
    uint32_t group = 0;
    for (int r = 0; r < rows; ++r)
      if ((todo >> r & 1) && slot_s[r] == slot) group |= 1u << r;
    todo &= ~group;
    if (rounded) __syncthreads();                              // the last turn's blocks_s is read
    if (threadIdx.x < columns * tiles_per_warp) {
      const int j = j_first + threadIdx.x;
      blocks_s[threadIdx.x] = j < a.MB ? a.block_table[slot * a.MB + j] : -1;
    }
    __syncthreads();
    // this warp's tiles below the largest visible count of the turn's rows
    int n_max = 0;
    int tiles = 0;
    const auto count_tiles = [&] {
      n_max = 0;
      for (int r = 0; r < rows; ++r)
        if ((group >> r & 1) && n_s[r] > n_max) n_max = n_s[r];
      tiles = 0;
      while (tiles < tiles_per_warp && first + (column + columns * tiles) * kTile < n_max) ++tiles;
    };
    count_tiles();
    auto issue = [&](int it) {
      if (it < tiles) ts.Issue(blocks_s[column + columns * it], it % kStages, lane);
      cuda::CpAsyncCommit();                                   // empty groups keep the count
    };
#pragma unroll 1
    for (int it = 0; it < kStages - 1; ++it) issue(it);
    if (!rounded) {
      // every live row's query while the first tiles arrive, a pass of
      // kRowsPerPass rows at a time (whole warps a row), the next pass's
      // loads ahead of this one's arithmetic (zeroed where a row has none:
      // the copy below then never reads an unset register)
#pragma unroll 1
      for (int p = 0; p * kRowsPerPass < rows; ++p) {
        const int r = p * kRowsPerPass + pass_row, rn = r + kRowsPerPass;
        QueryBlockRaw next{};
        if (rn < rows && (live >> rn & 1))
          next = LoadQueryBlock(a, t0 + rn, pair / kIndexScales, pair % kIndexScales);
        if (r < rows && (live >> r & 1)) {
          if (!QueryBlockFinite(qraw)) nonfinite_s[r] = 1;
          if (!QuantizeQueryPair(qraw, pair / kIndexScales, pair % kIndexScales, RowQuery(r)))
            slow_s[r] = 1;
        }
        qraw = next;
      }
      // warp r: row r's weights' signs, for the fast form's tree (TreeSigns)
      static_assert(kIndexHeads == 64, "two weights a lane");
      if (warp < rows && (live >> warp & 1)) {
        const float* w = a.weights + (t0 + warp) * kIndexHeads;
        const uint32_t neg_lo = __float_as_uint(w[lane]) >> 31;
        const uint32_t neg_hi = __float_as_uint(w[32 + lane]) >> 31;
        const uint64_t neg = __ballot_sync(cuda::kFull, neg_lo) |
                             static_cast<uint64_t>(__ballot_sync(cuda::kFull, neg_hi)) << 32;
        if (lane < 4) RowQuery(warp).tree[lane] = MakeTreeSigns(neg, lane);
      }
      __syncthreads();
      uint32_t nonfinite = 0;                                  // NONFINITE: the select drops them
      for (int r = 0; r < rows; ++r) {
        if (nonfinite_s[r]) nonfinite |= 1u << r;
        if (slow_s[r]) slow |= 1u << r;
      }
      live &= ~nonfinite;
      group &= ~nonfinite;
      todo &= ~nonfinite;
      count_tiles();
      rounded = true;
    }
    if (threadIdx.x < columns * tiles_per_warp) {
      // each (row, logical block) is read by one CTA: it counts a missing one
      const int j = j_first + threadIdx.x;
      const int32_t block = blocks_s[threadIdx.x];
      if (block < 0 || block >= a.N)
        for (int r = 0; r < rows; ++r)
          if ((group >> r & 1) && j * kPerBlock < n_s[r])
            cuda::CountErrorAtomic(a.errors, kMissingBlock, t0 + r);
    }
    const bool any_fast = (group & ~slow) != 0;
    for (int it = 0; it < tiles; ++it) {                    // uniform per warp
      const int32_t block = blocks_s[column + columns * it];
      issue(it + kStages - 1);
      cuda::CpAsyncWait<kStages - 1>();
      __syncwarp();
      const int e0 = first + (column + columns * it) * kTile;
      if (block < 0 || block >= a.N) {
        for (uint32_t m = group; m; m &= m - 1) {
          const int r = __ffs(m) - 1;
          if (e0 + lane < n_s[r]) row_keys(r)[e0 + lane] = 0;
        }
        __syncwarp();
        continue;
      }
      const uint32_t* st = &ring_s[warp][it % kStages][0];
      // the tile's form: keys past every row's entries count as fast
      uint32_t shifts;
      float kf;
      bool fast = IndexKeyFast(st[kScaleWord + own_row], &shifts, &kf);
      if (e0 + own_row >= n_max) fast = true, shifts = 0;
      const bool tile_fast = any_fast && __all_sync(cuda::kFull, fast);
      const uint32_t fast_rows = tile_fast ? group & ~slow : 0u;   // rows in the fast form
      uint32_t keys[2][2][2][4];                               // decoded once for every row
      if (tile_fast) {
        uint4 kv[4];
        uint2 tab[4];
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          kv[h] = *reinterpret_cast<const uint4*>(st + (g + 8 * h) * kRowWords + 4 * c);
          const uint32_t sk = Prmt(__shfl_sync(cuda::kFull, shifts, 4 * g + h), 0u, byte_c);
          tab[h] = make_uint2(0x03020100u << sk, 0x0C080604u << sk);
        }
        DecodeFastTile(kv, tab, keys);
      }
#pragma unroll 1
      for (uint32_t todo_rows = group; todo_rows; todo_rows &= todo_rows - 1) {
        const int r = __ffs(todo_rows) - 1;
        const int n = n_s[r];
        if (e0 >= n) continue;                                 // uniform
        float l4[4];   // levels 1-4 of rows g + 8h
        float m5 = 1.f, m6 = 1.f, kr = 1.f;
        if (fast_rows >> r & 1) {
          const QueryOperands& qo = RowQuery(r);
          const TreeSigns& signs = qo.tree[c];
          float lo[4], hi[4];
          FastTileHalfDecoded<0>(qo.fast + lane, qo.leaf + c, signs, qo.start + c, keys, lo);
          FastTileHalfDecoded<1>(qo.fast + lane, qo.leaf + c, signs, qo.start + c, keys, hi);
#pragma unroll
          for (int h = 0; h < 4; ++h) l4[h] = JoinHeadHalves(lo[h], hi[h], signs);
          kr = kf * signs.root;                                // both powers of two
          m5 = signs.l5, m6 = signs.l6;
        } else {
          const float4 v = BlockTileL4Row(st, r, g, c, lane);
          l4[0] = v.x, l4[1] = v.y, l4[2] = v.z, l4[3] = v.w;
        }
        const float score = kr * QuadHeadTree(l4, c, m5, m6);
        if (e0 + own_row < n) row_keys(r)[e0 + own_row] = IndexRankKey(score);
      }
      __syncwarp();                                            // the stage is free for its next tile
    }
    cuda::CpAsyncWait<0>();                                    // the ring is free for the next turn
    __syncwarp();
  }
}

}  // namespace
}  // namespace indexer
}  // namespace dsv4
