// The append role's launch plan (cuda/append/append_block.cuh has the rule and the
// three ways a call's winners are decided): its constants, the mode and grid
// PlanAppend chooses on the host from the call's shape, and FitAppendPlan,
// which cuts the grid to the clusters the device holds at once.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "common/launch.cuh"
#include "dsv4/append.h"

namespace dsv4 {
namespace append_kernel {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kTokensPerBlock = 32;    // clustered runs: two a warp, where T leaves enough blocks
constexpr int kMaxCluster = 8;         // the portable cluster size
constexpr int64_t kTableCap = 4096;    // keys of one any-order pass: 32 KiB
constexpr int kBatch = 4;              // metadata rows a thread loads before using them
constexpr int64_t kScanCall = 1024;     // rows up to which every token scans the call
constexpr int64_t kGlobalScanCall = 64; // rows up to which a scan searches global memory
constexpr int64_t kClusterCall = 16384; // rows from which the shape check is split in clusters
constexpr int kRunTokensPerBlock = 16;  // one a warp, clusters of one

enum class AppendMode : int {
  kScan,   // AppendScan: a warp a token, each scanning the call's metadata
  kRuns,   // the shape check, then grouped runs or any order
};

// The append role's launch, chosen on the host from T, R and the most blocks
// that run at once (below the clusters one a multiprocessor; with clusters,
// two a multiprocessor for the append kernel, one beside flush, or what
// MaxActiveClusters allows: see FitAppendPlan).
struct AppendPlan {
  AppendMode mode = AppendMode::kRuns;
  unsigned blocks = 1;       // G, a multiple of `cluster`
  unsigned cluster = 1;      // blocks of one cluster
  int block_tokens = 1;      // kScan: tokens (warps) of a block
  int64_t bitmap_words = 0;  // run-start bitmap words a block keeps (0: too many slots)
  int64_t table_cap = 1;     // cells of one any-order pass
  size_t smem = 0;           // dynamic shared memory a block needs
  bool staged = false;       // kScan: the call's metadata staged in shared memory first
};

// Rows of the metadata loaded together (one 16-byte load of slots, one of
// positions, where the operands are 16-byte aligned).
constexpr int kGroup = 4;
constexpr int kGroupBatch = 2;         // groups a thread of the check loads before using them

// `scan_blocks`: the blocks a scan grid may spread its tokens over (they
// take up to kWarps tokens each).
inline AppendPlan PlanAppend(int64_t T, int64_t R, int64_t most, int64_t scan_blocks) {
  AppendPlan p;
  if (T <= kScanCall) {
    p.mode = AppendMode::kScan;
    const int64_t spread = scan_blocks < 1 ? 1 : scan_blocks;
    int64_t per = (T + spread - 1) / spread;
    per = per < 1 ? 1 : (per > kWarps ? kWarps : per);
    p.block_tokens = static_cast<int>(per);
    const int64_t blocks = (T + per - 1) / per;   // more tokens than that: a warp takes several
    p.blocks = static_cast<unsigned>(blocks < 1 ? 1 : (blocks > spread ? spread : blocks));
    // the staged copy: the call's slots (-1 where dropped) then its positions,
    // each in whole groups of kGroup rows
    p.staged = T > kGlobalScanCall;
    if (p.staged) p.smem = static_cast<size_t>((T + kGroup - 1) / kGroup * kGroup * 8);
    return p;
  }
  const int tokens = T >= kClusterCall ? kTokensPerBlock : kRunTokensPerBlock;
  int64_t want = (T + tokens - 1) / tokens;
  want = want < 1 ? 1 : (want > most ? most : want);
  if (T < kClusterCall) p.cluster = 1;
  else p.cluster = want >= kMaxCluster ? kMaxCluster : want >= 4 ? 4 : want >= 2 ? 2 : 1;
  p.blocks = static_cast<unsigned>((want + p.cluster - 1) / p.cluster * p.cluster);
  const int64_t words = (R + 31) / 32;
  const int64_t per_block = (words + p.cluster - 1) / p.cluster;
  // the bitmap shares the table's memory (the check ends before the table
  // is used); past that many slots only the any-order path runs
  p.bitmap_words = per_block * 4 <= kTableCap * 8 ? per_block : 0;
  const int64_t owned = (R * kWindow + p.blocks - 1) / p.blocks;
  p.table_cap = owned < 1 ? 1 : (owned < kTableCap ? owned : kTableCap);
  const int64_t bytes = p.table_cap * 8 > p.bitmap_words * 4 ? p.table_cap * 8 : p.bitmap_words * 4;
  p.smem = static_cast<size_t>(bytes);
  return p;
}

// PlanAppend for kernel `kKernel` with at most `kBlocksPerSm` blocks a
// multiprocessor, its grid cut to the clusters the device runs at once, so
// that no cluster waits for a second wave (every block walks the whole call,
// so fewer blocks lose nothing but parallelism). The count is asked once a
// device and cluster size, with the most shared memory a plan takes
// (registers, not shared memory, bound these blocks).
template <auto kKernel, int kBlocksPerSm>
AppendPlan FitAppendPlan(int64_t T, int64_t R, int64_t scan_blocks) {
  // below the clusters, one block a multiprocessor: the call's metadata is
  // read by half as many blocks as at two (its warps then take two tokens
  // each at 4,096 rows, the second loaded while the first is used)
  const int64_t blocks_per_sm = T < kClusterCall ? 1 : kBlocksPerSm;
  const int64_t most = blocks_per_sm * cuda::SmCount();
  AppendPlan p = PlanAppend(T, R, most, scan_blocks);
  if (p.cluster <= 1) return p;
  static std::atomic<int> fits[64][4];  // device x cluster 1, 2, 4, 8; 0: not asked yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return p;
  const int c = p.cluster == 2 ? 1 : p.cluster == 4 ? 2 : 3;
  int clusters = fits[dev][c].load(std::memory_order_relaxed);
  if (clusters == 0) {
    const size_t most_smem = static_cast<size_t>(kTableCap) * 8;
    clusters = cuda::MaxActiveClusters(kKernel, kThreads, most_smem, p.cluster);
    fits[dev][c].store(clusters > 0 ? clusters : -1, std::memory_order_relaxed);
  }
  const int64_t fit = int64_t{clusters} * p.cluster;
  if (fit >= p.cluster && fit < p.blocks) p = PlanAppend(T, R, fit, scan_blocks);
  return p;
}

}  // namespace append_kernel
}  // namespace dsv4
