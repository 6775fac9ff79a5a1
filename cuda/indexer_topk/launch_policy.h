// indexer_topk's launch shapes and choices: pure functions of shapes and device properties.
//
// The op's shapes are T tokens and E entries a token (MB * 32); the device's
// properties its multiprocessor count and L2 size. The choices, with the
// examples the static_asserts at the end check (132 multiprocessors and 50 MB
// of L2: an H100):
//
//   T     E        score kernel (bf16 | mxfp4)             evict_first  select CTAs
//   8     256      split | pairs, 1 tile a warp            no           1
//   32    2048     one-thread | 16 columns, 1 tile a warp  no           1
//   64    16384    one-thread | 16 columns, 16 tiles       yes (71 MB)  1
//   4096  2048     one-thread | 16 columns, 4 tiles        yes          1
//   6     65536    one-thread | 16 columns, 6 tiles        no           4
//   1     262144   one-thread | 16 columns, 4 tiles        no           8
//
// With rows_per_request G > 1, where RowsPerCta groups, the mxfp4 choices
// take the grid's CTA rows, ceil(T / G), for T (a CTA scores G rows:
// ScoreKernelMxfp4Rows): a verify step of 64 requests of 4 rows at 64k is
// then shaped as 64 decode tokens; one of a request of 4 rows is not grouped.
//
// None of these changes a result bit: every kernel shape computes the same
// scores and the same selection (tests/ops/test_indexer_topk_scores.py and
// tests/ops/test_indexer_topk_select.py run each of them).
#pragma once

#include <algorithm>
#include <cstdint>

#include "dsv4/indexer.h"
#include "dsv4/layout.h"
#include "dsv4/numerics.h"

namespace dsv4 {
namespace indexer {

constexpr int64_t kPerBlock = kBlockTokens / kCsaRatio;      // entries of one logical block

// ---- score kernels of q_format "bf16": one entry a thread, or four lanes an entry ----
constexpr int kScoreThreads = 256;
// The four-lane kernel (ScoreKernelSplit) is bound by shared-memory
// wavefronts (its lanes read four distinct q addresses a load where the
// one-thread kernel's warp reads one), so on an H100 it is faster only while
// the grid is small: up to this many (token, entry) pairs.
constexpr int64_t kSplitMaxWork = 16384;

// ---- score kernel of q_format "mxfp4" (ScoreKernelMxfp4) ----
constexpr int kMmaThreads = 512;                             // one CTA a multiprocessor
constexpr int kMmaWarps = kMmaThreads / 32;
constexpr int kTile = 32;                                    // entries per warp tile
static_assert(kTile == kPerBlock, "a tile is one logical block");
constexpr int kMaxTilesPerWarp = 32;
static_assert(kMmaWarps * kMaxTilesPerWarp <= kMmaThreads, "a thread reads each tile's block");
constexpr int kScoreCtasPerSm = 1;
// Tiles a score CTA works on at once: one a warp, or one a pair of warps
// (ScoreKernelMxfp4's kPairs).
DSV4_HD constexpr int TileColumns(bool pairs) { return pairs ? kMmaWarps / 2 : kMmaWarps; }

// ---- the top-k select (SelectKernel) ----
constexpr int kSelectThreads = 1024;
constexpr int kRegKeys = 16;     // keys per select thread held in registers (n <= 16384)
// The portable cluster size. Clusters of 16 were slower than 8 at 1M context
// on an H100: a 16-CTA cluster needs a whole GPC free.
constexpr int kMaxSelectCtas = 8;

// Whether q_format "bf16" scores with the four-lane kernel (else one thread
// an entry). Both give the same bits.
constexpr bool SplitScores(int64_t T, int64_t E) { return T * E <= kSplitMaxWork; }

// Tiles per warp of the mxfp4 score kernel: CTAs in whole waves of resident
// ones (one a multiprocessor), at most kMaxTilesPerWarp. T > 0.
constexpr int TilesPerWarp(int64_t T, int64_t E, int sm_count) {
  const int64_t resident = static_cast<int64_t>(sm_count) * kScoreCtasPerSm;
  const int64_t units = (E + kMmaWarps * kTile - 1) / (kMmaWarps * kTile);   // a tile a warp
  const int64_t waves = (T * units + resident * kMaxTilesPerWarp - 1) / (resident * kMaxTilesPerWarp);
  const int64_t per_token = std::max<int64_t>(1, resident * std::max<int64_t>(waves, 1) / T);
  const int64_t tpw = (units + per_token - 1) / per_token;
  return static_cast<int>(tpw < 1 ? 1 : tpw > kMaxTilesPerWarp ? kMaxTilesPerWarp : tpw);
}

// Whether the mxfp4 score kernel runs in pairs of warps (ScoreKernelMxfp4's
// kPairs): when every warp would have one tile and the twice as many CTAs
// still fit one wave. Such a grid sees only a tile's latency, and a pair
// halves it.
constexpr bool PairWarps(int64_t T, int64_t E, int tiles_per_warp, int sm_count) {
  const int64_t resident = static_cast<int64_t>(sm_count) * kScoreCtasPerSm;
  const int64_t pair_span = TileColumns(true) * kTile;
  return tiles_per_warp == 1 && T * ((E + pair_span - 1) / pair_span) <= resident;
}

// Rows a score CTA takes for rows_per_request G (ScoreKernelMxfp4Rows when
// more than one): G where a CTA a row would give each warp at least
// kRowsMinTilesPerWarp tiles on average (the grid is throughput-bound, and
// reading and decoding each tile once for G rows saves work), else 1. The
// grouped CTA pays a fixed latency first (G queries rounded, G rows' state),
// about 14 us on an H200, which only enough tiles a warp hide. Measured with
// 4 rows a request on an H200 (docs/perf/indexer.md, "Verify rows"): the
// choice follows the tiles a warp whatever the context: 8 lose 12-15 %,
// 16 break even to +7 %, 31 win 8 %, 62 win 16 %, 124 win 21 %.
constexpr int64_t kRowsMinTilesPerWarp = 12;
constexpr int RowsPerCta(int64_t T, int64_t E, int G, int sm_count) {
  const int64_t tiles = T * ((E + kTile - 1) / kTile);
  return G > 1 && tiles >= kRowsMinTilesPerWarp * sm_count * kMmaWarps ? G : 1;
}

// Whether the mxfp4 score kernel streams the keys with evict_first
// (StreamPolicy): where they are more than L2 holds, so no line of theirs is
// read again in the call anyway, and the rank keys the select reads next
// stay. Where the keys fit, it would cost the next call, which then finds
// them in L2 (both measured: docs/perf/indexer.md, "Ideas tried").
constexpr bool KeysEvictFirst(int64_t T, int64_t E, int64_t l2_bytes) {
  return static_cast<double>(T) * static_cast<double>(E) * (kIndexPacked + kIndexScales) >
         static_cast<double>(l2_bytes);
}

// CTAs a token's select spreads over (one cluster): the fewest that hold
// their chunks of the E keys in registers, at most kMaxSelectCtas. On an
// H100 spreading a select that fits one CTA was slower: the cluster barriers
// and the hand-off cost more than the shorter passes save.
constexpr int SelectCtas(int64_t E) {
  int ctas = 1;
  while (ctas < kMaxSelectCtas && E > ctas * int64_t{kRegKeys * kSelectThreads}) ctas *= 2;
  return ctas;
}

// The table above, on an H100.
constexpr int kH100Sms = 132;
constexpr int64_t kH100L2 = int64_t{50} << 20;
static_assert(SplitScores(8, 256) && !SplitScores(32, 2048), "split: small grids only");
static_assert(TilesPerWarp(8, 256, kH100Sms) == 1 && PairWarps(8, 256, 1, kH100Sms), "");
static_assert(TilesPerWarp(32, 2048, kH100Sms) == 1 && !PairWarps(32, 2048, 1, kH100Sms),
              "256 CTAs of pairs: more than one wave");
static_assert(TilesPerWarp(64, 16384, kH100Sms) == 16 && KeysEvictFirst(64, 16384, kH100L2), "");
static_assert(TilesPerWarp(4096, 2048, kH100Sms) == 4 && KeysEvictFirst(4096, 2048, kH100L2), "");
static_assert(TilesPerWarp(6, 65536, kH100Sms) == 6 && !KeysEvictFirst(6, 65536, kH100L2), "");
static_assert(TilesPerWarp(1, 262144, kH100Sms) == 4 && !KeysEvictFirst(1, 262144, kH100L2), "");
// a verify step (1 + 3 rows a request): B = 64 at 64k groups (62 tiles a
// warp), B = 8 at 64k does not (8), B = 1 at 1M does (16: even)
static_assert(RowsPerCta(256, 16384, 4, kH100Sms) == 4 && RowsPerCta(32, 16384, 4, kH100Sms) == 1 &&
              RowsPerCta(4, 1024, 4, kH100Sms) == 1 && RowsPerCta(4, 262144, 4, kH100Sms) == 4 &&
              RowsPerCta(256, 16384, 1, kH100Sms) == 1, "");
static_assert(SelectCtas(16384) == 1 && SelectCtas(16385) == 2 && SelectCtas(65536) == 4 &&
              SelectCtas(262144) == 8 && SelectCtas(int64_t{1} << 22) == 8, "");

}  // namespace indexer
}  // namespace dsv4
