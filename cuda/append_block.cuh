// The append kernel's block code (rules in dsv4_jax/ops/append.py), shared
// by the append kernel (cuda/append.cu) and write_layer's (cuda/write_layer.cu).
//
// The rule: per (slot, ring slot) cell, of the call's valid tokens whose kv
// row is finite, the largest position wins, ties to the later row. A warp
// reads a token's 1 KB row once, with coalesced 16-byte loads, decides
// finiteness with one vote and, if the token wins its cell, encodes the
// entry from the same registers.
//
// Who wins is decided one of three ways, all exact. A call of at most
// kScanCall rows (a decode step's, a short chunk) gives each token a warp of
// its own that reads every row's slot and position and looks for a row that
// beats its token (AppendScan: no cluster, the tokens spread over the
// multiprocessors, the call's metadata staged in a block's shared memory).
// Larger calls pick one of two after checking the call's shape (all their
// blocks agree):
//
// * Grouped runs (what CacheManager emits): every slot's rows form one
//   contiguous run of consecutive positions (slots in any order, padding and
//   bad slots between runs). Then the tokens of a cell are the run's rows
//   t, t + 128, t + 256, ... of increasing position, so the cell's winner is
//   its highest valid row if finite, else the next finite one below. Token
//   t's warp knows from row t + 128 alone whether t is that highest valid
//   row (same slot there means same run, position p + 128, valid iff below
//   max_context); only that warp writes the cell, walking down 128 rows at a
//   time past NaN/Inf rows (read again: the only second read). Every other
//   warp only counts. One writer per cell, no shared state, grid sized to
//   the tokens.
//
//   The check: the rows are split among the blocks of a thread-block
//   cluster (up to 8; a cluster of one below kClusterCall rows, where every
//   block reading all the metadata is expected to cost less than the
//   cluster's barriers). A row continuing its predecessor's slot must have the
//   next position; a row starting a run sets its slot's bit in a bitmap
//   spread over the cluster's shared memory, and finding the bit already set
//   means a second run of that slot. Every cluster checks the whole call, so
//   each decides alone, and all decide the same; the check reads 8 bytes a
//   row per cluster (4 rows a 16-byte load of each kind), never the rows.
//   Below the clusters the grid is one block a multiprocessor, so that as
//   few blocks as fill the device read the call's metadata.
//
// * Any other call: block b of G owns the cells c = slot * 128 + ring with
//   c mod G = b, and keeps the best key (position << 32 | row + 1) of each
//   in shared memory, passes of table_cap cells where they do not fit. A
//   token's warp checks finiteness first, so only finite tokens enter the
//   64-bit atomicMax, whose result does not depend on arrival order; the
//   winners' rows are then read again and encoded. Every block scans all
//   the metadata here: the price of arbitrary order, paid only by such calls.
//
// Bad slots and positions are counted once, by the first cluster's check; a
// NaN/Inf row once, by the warp that reads it for its own token (grouped) or
// for its owner block (any order). Rows dropped by either rule never win.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cstdint>

#include "append.h"
#include "bf16_chunks.cuh"
#include "entry_warp.cuh"
#include "launch.cuh"
#include "layer_checks.cuh"

namespace dsv4 {
namespace append_kernel {

namespace cg = cooperative_groups;

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

// Static shared memory of an append block.
struct AppendShared {
  int out_of_shape;      // set by any block of the cluster that finds the call not grouped
  int first_pass, last_pass;
};

// The blocks of this block's cluster; a launch without clusters is a cluster
// of one block.
struct Cluster {
  unsigned size, rank;
  __device__ void Sync() const {
    if (size > 1) cg::this_cluster().sync();
    else __syncthreads();
  }
  template <typename T>
  __device__ T* Map(T* p, unsigned r) const {
    return size > 1 ? cg::this_cluster().map_shared_rank(p, static_cast<int>(r)) : p;
  }
};

// One token row, held by a warp: lane L has chunks L and L + 32.
struct Row {
  uint4 lo, hi;
};

__device__ __forceinline__ Row LoadRow(const AppendArgs& a, int64_t t) {
  const uint4* row = reinterpret_cast<const uint4*>(a.kv) + t * cuda::kChunks;
  const int lane = threadIdx.x & 31;
  return Row{__ldg(row + lane), __ldg(row + lane + 32)};
}

__device__ __forceinline__ bool WarpFinite(const Row& r) {
  return __all_sync(cuda::kFull, cuda::Bf16x8Finite(r.lo) && cuda::Bf16x8Finite(r.hi));
}

// Stores the row of the token at position p of slot s as its cell's entry.
__device__ __forceinline__ void WriteEntry(const AppendArgs& a, int64_t l, int64_t s, int64_t p,
                                           const Row& r) {
  const int64_t e = (l * a.R + s) * kWindow + (p & (kWindow - 1));
  float lo[8], hi[8];
  cuda::UnpackBf16x8(r.lo, lo);
  cuda::UnpackBf16x8(r.hi, hi);
  cuda::WarpEncodeEntry(a.pool, e, lo, hi);
  if ((threadIdx.x & 31) == 0) a.swa_pos[e] = static_cast<int32_t>(p);
}

// ---- the metadata in groups -----------------------------------------------------------
// Whether slot and position can be read kGroup rows a 16-byte load (XLA
// aligns its buffers; a slice at an odd offset would not be).
__device__ __forceinline__ bool GroupLoads(const AppendArgs& a) {
  return ((reinterpret_cast<uintptr_t>(a.slot) | reinterpret_cast<uintptr_t>(a.pos)) & 15) == 0;
}

// Rows kGroup * g .. kGroup * g + 3 of `v` (n rows); `fill` past the end.
__device__ __forceinline__ int4 LoadGroup(const int32_t* v, int64_t g, int64_t n, bool vector,
                                          int32_t fill) {
  const int64_t r = int64_t{kGroup} * g;
  if (vector && r + kGroup <= n) return __ldg(reinterpret_cast<const int4*>(v) + g);
  int4 x = make_int4(fill, fill, fill, fill);
  if (r < n) x.x = __ldg(v + r);
  if (r + 1 < n) x.y = __ldg(v + r + 1);
  if (r + 2 < n) x.z = __ldg(v + r + 2);
  if (r + 3 < n) x.w = __ldg(v + r + 3);
  return x;
}

__device__ __forceinline__ int32_t Lane4(const int4& x, int k) {
  return k == 0 ? x.x : k == 1 ? x.y : k == 2 ? x.z : x.w;
}

// ---- the shape check -------------------------------------------------------------------
// The check of one row (slot s at position p, after a row of slot prev_s at
// prev_p): counts it if bad, and flags the call out of shape if it breaks a
// run or starts a second run of its slot.
struct ShapeCheck {
  int bad = 0, bad_slot = 0, bad_pos = 0;

  __device__ __forceinline__ void Row(const AppendArgs& a, const Cluster& c, uint32_t* bitmap,
                                      bool use_bitmap, int32_t s, int32_t p, int32_t prev_s,
                                      int32_t prev_p) {
    if (s < 0 || s >= a.R) {  // padding (also past the block's rows) and bad slots end runs
      bad_slot += s != -1;
      return;
    }
    bad_pos += p < 0 || p >= a.max_context;
    if (prev_s == s) {
      bad |= int64_t{p} != int64_t{prev_p} + 1;
    } else if (use_bitmap) {  // a run of slot s starts here
      const uint32_t w = static_cast<uint32_t>(s) >> 5, bit = 1u << (s & 31);
      bad |= (atomicOr(c.Map(bitmap + w / c.size, w % c.size), bit) & bit) != 0;
    }
  }
};

// Whether every slot's rows form one run of consecutive positions; also
// counts the bad slots and positions where `counts` (the first cluster).
// Ends with a cluster barrier, after which no block reads another's memory.
__device__ inline bool CallIsGrouped(const AppendArgs& a, const AppendPlan& plan,
                                     const Cluster& c, bool counts, uint32_t* bitmap,
                                     AppendShared& sh) {
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t begin = a.T * c.rank / c.size, end = a.T * (c.rank + 1) / c.size;
  const bool use_bitmap = plan.bitmap_words > 0;
  ShapeCheck check;
  check.bad = !use_bitmap;
  // a thread takes groups of kGroup rows, the lanes of a warp consecutive
  // ones: a row's predecessor is the same thread's, or the lane below's
  // last (lane 0 loads it)
  const bool vector = GroupLoads(a);
  for (int64_t g0 = begin / kGroup; g0 < (end + kGroup - 1) / kGroup;
       g0 += int64_t{kThreads} * kGroupBatch) {
    int4 s[kGroupBatch], p[kGroupBatch];
    int32_t before_s[kGroupBatch], before_p[kGroupBatch];
#pragma unroll
    for (int j = 0; j < kGroupBatch; ++j) {
      const int64_t g = g0 + int64_t{j} * kThreads + tid, r = g * kGroup;
      s[j] = LoadGroup(a.slot, g, end, vector, -1);
      p[j] = LoadGroup(a.pos, g, end, vector, 0);
      before_s[j] = -1, before_p[j] = 0;
      if (lane == 0 && r > 0 && r <= end) {
        before_s[j] = __ldg(a.slot + r - 1);
        before_p[j] = __ldg(a.pos + r - 1);
      }
    }
#pragma unroll
    for (int j = 0; j < kGroupBatch; ++j) {
      const int32_t up_s = __shfl_up_sync(cuda::kFull, s[j].w, 1);
      const int32_t up_p = __shfl_up_sync(cuda::kFull, p[j].w, 1);
      int32_t prev_s = lane == 0 ? before_s[j] : up_s, prev_p = lane == 0 ? before_p[j] : up_p;
      const int64_t r = (g0 + int64_t{j} * kThreads + tid) * kGroup;
#pragma unroll
      for (int k = 0; k < kGroup; ++k) {
        const int32_t sk = Lane4(s[j], k), pk = Lane4(p[j], k);
        // rows of the first group that precede the block's own: predecessors only
        if (r + k >= begin) check.Row(a, c, bitmap, use_bitmap, sk, pk, prev_s, prev_p);
        prev_s = sk, prev_p = pk;
      }
    }
  }
  if (counts) {
    cuda::WarpCount(a.errors, kBadSlot, check.bad_slot);
    cuda::WarpCount(a.errors, kBadPosition, check.bad_pos);
  }
  if (__syncthreads_or(check.bad) && tid == 0)
    for (unsigned r = 0; r < c.size; ++r) atomicOr(c.Map(&sh.out_of_shape, r), 1);
  c.Sync();
  return sh.out_of_shape == 0;
}

// ---- grouped runs ----------------------------------------------------------------------
// A token of the grouped path: slot, position, the slot 128 rows later, row.
struct Token {
  int32_t s = -1, p = 0, s_next = -1;
  Row row;
};

__device__ __forceinline__ Token LoadToken(const AppendArgs& a, int64_t t) {
  Token k;
  k.s = __ldg(a.slot + t);
  k.p = __ldg(a.pos + t);
  if (t + kWindow < a.T) k.s_next = __ldg(a.slot + t + kWindow);
  k.row = LoadRow(a, t);
  return k;
}

// Row t (slot s, position p) was the highest valid row of its cell but held
// NaN/Inf: the first finite row 128, 256, ... rows below it in the run wins.
__device__ inline void WriteBelow(const AppendArgs& a, int64_t l, int64_t t, int32_t s,
                                  int32_t p) {
  for (int64_t d = t - kWindow, q = int64_t{p} - kWindow; d >= 0 && q >= 0;
       d -= kWindow, q -= kWindow) {
    if (__ldg(a.slot + d) != s) return;  // before the run: its rows are d + 1 .. t
    const Row r = LoadRow(a, d);
    if (WarpFinite(r)) {
      WriteEntry(a, l, s, q, r);
      return;
    }
  }
}

// One warp per token, grid-stride, the next token loaded before this one is
// used; `first` is this warp's first token, loaded before the check.
__device__ inline void AppendGrouped(const AppendArgs& a, int64_t l, unsigned block,
                                     unsigned blocks, Token first) {
  const int64_t stride = int64_t{blocks} * kWarps;
  int nonfinite = 0;
  Token cur = first;
  for (int64_t t = int64_t{block} * kWarps + (threadIdx.x >> 5); t < a.T; t += stride) {
    Token next;
    if (t + stride < a.T) next = LoadToken(a, t + stride);
    const int32_t s = cur.s, p = cur.p;
    if (s >= 0 && s < a.R && p >= 0 && p < a.max_context) {
      const bool finite = WarpFinite(cur.row);
      nonfinite += !finite;
      // 128 rows on, the same slot is the same run, at position p + 128
      const bool highest = !(cur.s_next == s && int64_t{p} + kWindow < a.max_context);
      if (highest && finite) WriteEntry(a, l, s, p, cur.row);
      else if (highest) WriteBelow(a, l, t, s, p);
    }
    cur = next;
  }
  if ((threadIdx.x & 31) == 0 && nonfinite != 0) atomicAdd(&a.errors[kNonfinite], nonfinite);
}

// ---- any order -------------------------------------------------------------------------
// The cell of token t (slot * 128 + ring slot), or -1 for a dropped token.
__device__ __forceinline__ int64_t CellOf(int32_t s, int32_t p, const AppendArgs& a) {
  if (s < 0 || s >= a.R || p < 0 || p >= a.max_context) return -1;
  return int64_t{s} * kWindow + (p & (kWindow - 1));
}

__device__ inline void AppendAnyOrder(const AppendArgs& a, const AppendPlan& plan, int64_t l,
                                      unsigned block, unsigned long long* table,
                                      AppendShared& sh) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t G = plan.blocks, cap = plan.table_cap;
  // the passes that hold this block's cells (a single pass needs no scan)
  const int64_t passes = ((a.R * kWindow + G - 1) / G + cap - 1) / cap;
  if (tid == 0) {
    sh.first_pass = passes > 1 ? INT_MAX : 0;
    sh.last_pass = passes > 1 ? -1 : 0;
  }
  __syncthreads();
  for (int64_t t = tid; passes > 1 && t < a.T; t += kThreads) {
    const int64_t c = CellOf(__ldg(a.slot + t), __ldg(a.pos + t), a);
    if (c >= 0 && c % G == block) {
      const int q = static_cast<int>(c / G / cap);
      atomicMin(&sh.first_pass, q);
      atomicMax(&sh.last_pass, q);
    }
  }
  __syncthreads();
  const int first_pass = sh.first_pass, last_pass = sh.last_pass;
  int nonfinite = 0;
  for (int q = first_pass; q <= last_pass; ++q) {
    for (int64_t i = tid; i < cap; i += kThreads) table[i] = 0ull;
    __syncthreads();
    // a warp takes 32 rows at a time (kBatch groups loaded together); the
    // rows this block owns in this pass are checked by the whole warp
    // (row indices as int: a call's rows are 1 KB each, far fewer than 2^31)
    for (int base = warp * 32; base < a.T; base += kThreads * kBatch) {
      int idx[kBatch];  // table index (below cap, kTableCap at most) or -1
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int t = base + j * kThreads + lane;
        const int64_t c = t < a.T ? CellOf(__ldg(a.slot + t), __ldg(a.pos + t), a) : -1;
        const int64_t i = c >= 0 && c % G == block ? c / G - int64_t{q} * cap : -1;
        idx[j] = i < cap ? static_cast<int>(i) : -1;
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        for (unsigned m = __ballot_sync(cuda::kFull, idx[j] >= 0); m != 0; m &= m - 1) {
          const int src = __ffs(m) - 1;
          const int t = base + j * kThreads + src;
          const int i = __shfl_sync(cuda::kFull, idx[j], src);
          if (!WarpFinite(LoadRow(a, t))) {
            ++nonfinite;
            continue;
          }
          if (lane == 0)
            atomicMax(&table[i], (static_cast<unsigned long long>(__ldg(a.pos + t)) << 32) |
                                     static_cast<unsigned long long>(t + 1));
        }
      }
    }
    __syncthreads();
    // the winners: lanes read 32 keys, the warp writes each set one
    for (int64_t i0 = int64_t{warp} * 32; i0 < cap; i0 += kThreads) {
      const unsigned long long key = i0 + lane < cap ? table[i0 + lane] : 0ull;
      for (unsigned m = __ballot_sync(cuda::kFull, key != 0ull); m != 0; m &= m - 1) {
        const int src = __ffs(m) - 1;
        const unsigned long long k = __shfl_sync(cuda::kFull, key, src);
        const int64_t t = static_cast<int64_t>(k & 0xffffffffull) - 1;
        const int64_t cell = (int64_t{q} * cap + i0 + src) * G + block;
        WriteEntry(a, l, cell / kWindow, static_cast<int64_t>(k >> 32), LoadRow(a, t));
      }
    }
    __syncthreads();
  }
  if (lane == 0 && nonfinite != 0) atomicAdd(&a.errors[kNonfinite], nonfinite);
}

// ---- scan --------------------------------------------------------------------------------
// Calls of at most kScanCall rows: a warp a token (several, one after
// another, where the tokens outnumber the grid's warps), plan.block_tokens
// tokens a block, so that the host can spread a decode step's tokens over
// the multiprocessors (each is a short chain of dependent loads and an
// encode; one block ran them four to a warp, one after another). The warp
// looks through every row's slot and position for rows that beat its token
// in its cell (the same slot and ring slot, a larger position, or the same
// one later in the call); only such a row is read, for its finiteness, and
// the first finite one ends the search. A call whose cells hold one token
// each (a decode step) reads every row once. Any order.
//
// The metadata is looked through in a copy in the block's shared memory that
// all its threads load in one round (kGroup rows a load) before one barrier:
// a token's search is one round of global loads for the whole call, and the
// block's warps share the copy (from global memory, 128 rows a round, the
// search took T/128 rounds of dependent loads, each warp its own: 3.90 µs at
// 512 rows on an H200, against the original kernel's 3.26). A call of at most
// kGlobalScanCall rows is searched in global memory instead: one round of
// loads there, where the copy's round and barrier cost more (1 row 2.30
// against 2.62 µs, 64 rows 2.46 against 2.78, on an H200).

// The staged copy: `slot` (-1 for a row dropped by its slot or position) and
// `pos`, `groups` groups of kGroup rows each.
struct StagedCall {
  const int4* slot;
  const int4* pos;
  int64_t groups;
};

// Loads the call's metadata into `smem` (plan.smem bytes); every thread of
// the block calls, then one barrier.
__device__ inline StagedCall StageCall(const AppendArgs& a, unsigned char* smem) {
  const int64_t groups = (a.T + kGroup - 1) / kGroup;
  int4* slot = reinterpret_cast<int4*>(smem);
  int4* pos = slot + groups;
  const bool vector = GroupLoads(a);
  for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
    int4 s = LoadGroup(a.slot, g, a.T, vector, -1);
    const int4 p = LoadGroup(a.pos, g, a.T, vector, 0);
    auto kept = [&a](int32_t s, int32_t p) {
      return s >= 0 && s < a.R && p >= 0 && p < a.max_context ? s : -1;
    };
    s = make_int4(kept(s.x, p.x), kept(s.y, p.y), kept(s.z, p.z), kept(s.w, p.w));
    slot[g] = s;
    pos[g] = p;
  }
  __syncthreads();
  return StagedCall{slot, pos, groups};
}

// Whether row u (slot su, position pu) beats token t (slot s, position p) in
// t's cell; su == s: u is not dropped (the staged copy's slot says so).
__device__ __forceinline__ bool Beats(int32_t s, int32_t p, int64_t t, int32_t su, int32_t pu,
                                      int64_t u) {
  return su == s && ((pu ^ p) & (kWindow - 1)) == 0 && (pu > p || (pu == p && u > t));
}

// Whether a finite row beats token t (valid: slot s, position p), from the
// staged copy. All lanes of the warp call.
__device__ inline bool BeatenStaged(const AppendArgs& a, const StagedCall& call, int64_t t,
                                    int32_t s, int32_t p) {
  const int lane = threadIdx.x & 31;
  for (int64_t g0 = 0; g0 < call.groups; g0 += 32 * kBatch) {
    unsigned beats[kBatch];  // bit k: row kGroup * g + k
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t g = g0 + 32 * j + lane;
      beats[j] = 0;
      if (g < call.groups) {
        const int4 su = call.slot[g];
        if (su.x == s || su.y == s || su.z == s || su.w == s) {  // a row of t's slot
          const int4 pu = call.pos[g];
#pragma unroll
          for (int k = 0; k < kGroup; ++k)
            beats[j] |= unsigned{Beats(s, p, t, Lane4(su, k), Lane4(pu, k), g * kGroup + k)} << k;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      for (unsigned m = __ballot_sync(cuda::kFull, beats[j] != 0); m != 0; m &= m - 1) {
        const int src = __ffs(m) - 1;
        const int64_t g = g0 + 32 * j + src;
        for (unsigned b = __shfl_sync(cuda::kFull, beats[j], src); b != 0; b &= b - 1)
          if (WarpFinite(LoadRow(a, g * kGroup + __ffs(b) - 1))) return true;
      }
  }
  return false;
}

// The same, searching the call's metadata in global memory (calls of at
// most kGlobalScanCall rows: one round of loads).
__device__ inline bool BeatenInGlobal(const AppendArgs& a, int64_t t, int32_t s, int32_t p) {
  const int lane = threadIdx.x & 31;
  for (int64_t base = 0; base < a.T; base += 32 * kBatch) {
    bool beats[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {  // kBatch loads of each kind in flight
      const int64_t u = base + 32 * j + lane;
      int32_t su = -1, pu = 0;
      if (u < a.T) {
        su = __ldg(a.slot + u);
        pu = __ldg(a.pos + u);
      }
      beats[j] = pu < a.max_context && Beats(s, p, t, su, pu, u);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      for (unsigned m = __ballot_sync(cuda::kFull, beats[j]); m != 0; m &= m - 1) {
        const int64_t u = base + 32 * j + __ffs(m) - 1;
        if (WarpFinite(LoadRow(a, u))) return true;  // a finite row takes the cell
      }
  }
  return false;
}

// Token t of a scan: counted if dropped, written if it wins its cell. Its
// slot, position and row are loaded by the caller; `call` is the staged copy
// (no groups: the call is searched in global memory). All lanes of the warp call.
__device__ inline void ScanToken(const AppendArgs& a, const StagedCall& call, int64_t l,
                                 int64_t t, int32_t s, int32_t p, const Row& row) {
  const int lane = threadIdx.x & 31;
  const bool slot_ok = s >= 0 && s < a.R, valid = slot_ok && p >= 0 && p < a.max_context;
  if (!valid) {  // counted once, by the token's own warp (warp-uniform)
    if (lane == 0 && s != -1) atomicAdd(&a.errors[slot_ok ? kBadPosition : kBadSlot], 1);
    return;
  }
  if (!WarpFinite(row)) {
    if (lane == 0) atomicAdd(&a.errors[kNonfinite], 1);
    return;
  }
  const bool beaten =
      call.groups > 0 ? BeatenStaged(a, call, t, s, p) : BeatenInGlobal(a, t, s, p);
  if (!beaten) WriteEntry(a, l, s, p, row);
}

__device__ inline void AppendScan(const AppendArgs& a, const AppendPlan& plan, unsigned block,
                                  unsigned char* smem) {
  cuda::WaitForPrevious();  // everything below reads what earlier kernels wrote
  cuda::LetNextStart();     // a kernel launched overlapped after this one waits for it
  const int warp = threadIdx.x >> 5;
  const int64_t stride = int64_t{plan.blocks} * plan.block_tokens;
  int64_t t = int64_t{block} * plan.block_tokens + warp;
  const bool has = warp < plan.block_tokens && t < a.T;
  int32_t s = -1, p = 0;
  Row row;
  if (has) {  // all three loads at once: the row's address needs only t
    s = __ldg(a.slot + t);
    p = __ldg(a.pos + t);
    row = LoadRow(a, t);
  }
  // the staged copy's loads go out beside the token's (none: search global memory)
  const StagedCall call = plan.staged ? StageCall(a, smem) : StagedCall{nullptr, nullptr, 0};
  int64_t l;
  if (!cuda::LayerOkCountedBy(block == 0, a.layer, a.L, a.errors, &l) || !has) return;
  for (;;) {  // grid-stride, where the tokens outnumber the grid's warps
    ScanToken(a, call, l, t, s, p, row);
    t += stride;
    if (t >= a.T) return;
    s = __ldg(a.slot + t);
    p = __ldg(a.pos + t);
    row = LoadRow(a, t);
  }
}

// ---- the role ----------------------------------------------------------------------------
// Block `block` of the plan's append blocks: `smem` is plan.smem bytes of
// dynamic shared memory (the bitmap, then the any-order table).
__device__ inline void AppendBlock(const AppendArgs& a, const AppendPlan& plan, unsigned block,
                                   unsigned char* smem, AppendShared& sh) {
  if (plan.mode == AppendMode::kScan) return AppendScan(a, plan, block, smem);
  const Cluster c{plan.cluster, block % plan.cluster};
  uint32_t* bitmap = reinterpret_cast<uint32_t*>(smem);
  for (int64_t i = threadIdx.x; i < plan.bitmap_words; i += kThreads) bitmap[i] = 0u;
  if (threadIdx.x == 0) sh.out_of_shape = 0;
  c.Sync();                  // every bitmap clear before any block sets a bit
  cuda::WaitForPrevious();   // everything below reads what earlier kernels wrote
  // this warp's first token, loaded now: at small T it is all the work
  const int64_t t0 = int64_t{block} * kWarps + (threadIdx.x >> 5);
  Token first;
  if (t0 < a.T) first = LoadToken(a, t0);
  int64_t l;
  if (!cuda::LayerOkCountedBy(block == 0, a.layer, a.L, a.errors, &l)) return;  // grid-uniform
  if (CallIsGrouped(a, plan, c, block < plan.cluster, bitmap, sh))
    AppendGrouped(a, l, block, plan.blocks, first);
  else
    AppendAnyOrder(a, plan, l, block, reinterpret_cast<unsigned long long*>(smem), sh);
}

}  // namespace append_kernel
}  // namespace dsv4
