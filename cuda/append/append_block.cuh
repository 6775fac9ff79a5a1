// The append kernel's block code (rules in dsv4_jax/ops/append.py), shared
// by the append kernel (cuda/append/append.cu) and write_layer's
// (cuda/write_layer/write_layer.cu): the shape check, grouped runs, any
// order and the role's entry, AppendBlock. Its launch plan is
// append_plan.cuh, a warp's reads of the call append_rows.cuh, the
// per-token scan append_scan.cuh.
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

#include <climits>
#include <cstdint>

#include "append/append_plan.cuh"
#include "append/append_rows.cuh"
#include "append/append_scan.cuh"
#include "common/launch.cuh"
#include "common/layer_checks.cuh"

namespace dsv4 {
namespace append_kernel {

namespace cg = cooperative_groups;

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

// ---- the shape check -------------------------------------------------------------------
// The check of one row (slot s at position p, after a row of slot prev_s at
// prev_p): counts it if bad, and flags the call out of shape if it breaks a
// run or starts a second run of its slot.
struct ShapeCheck {
  int bad = 0, bad_slot = 0, bad_pos = 0;
  int64_t first_bad_slot = kNoRow, first_bad_pos = kNoRow;  // rows come in increasing order

  __device__ __forceinline__ void Row(const AppendArgs& a, const Cluster& c, uint32_t* bitmap,
                                      bool use_bitmap, int64_t t, int32_t s, int32_t p,
                                      int32_t prev_s, int32_t prev_p) {
    if (s < 0 || s >= a.R) {  // padding (also past the block's rows) and bad slots end runs
      if (s != -1 && bad_slot++ == 0) first_bad_slot = t;
      return;
    }
    if ((p < 0 || p >= a.max_context) && bad_pos++ == 0) first_bad_pos = t;
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
        if (r + k >= begin) check.Row(a, c, bitmap, use_bitmap, r + k, sk, pk, prev_s, prev_p);
        prev_s = sk, prev_p = pk;
      }
    }
  }
  if (counts) {
    cuda::WarpCount(a.errors, kBadSlot, check.bad_slot, check.first_bad_slot);
    cuda::WarpCount(a.errors, kBadPosition, check.bad_pos, check.first_bad_pos);
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
  int64_t first_nonfinite = kNoRow;  // a warp's tokens come in increasing order
  Token cur = first;
  for (int64_t t = int64_t{block} * kWarps + (threadIdx.x >> 5); t < a.T; t += stride) {
    Token next;
    if (t + stride < a.T) next = LoadToken(a, t + stride);
    const int32_t s = cur.s, p = cur.p;
    if (s >= 0 && s < a.R && p >= 0 && p < a.max_context) {
      const bool finite = WarpFinite(cur.row);
      if (!finite && nonfinite++ == 0) first_nonfinite = t;
      // 128 rows on, the same slot is the same run, at position p + 128
      const bool highest = !(cur.s_next == s && int64_t{p} + kWindow < a.max_context);
      if (highest && finite) WriteEntry(a, l, s, p, cur.row);
      else if (highest) WriteBelow(a, l, t, s, p);
    }
    cur = next;
  }
  if ((threadIdx.x & 31) == 0 && nonfinite != 0)
    cuda::CountErrorAtomic(a.errors, kNonfinite, first_nonfinite, nonfinite);
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
  int64_t first_nonfinite = kNoRow;
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
            first_nonfinite = t < first_nonfinite ? t : first_nonfinite;
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
  if (lane == 0 && nonfinite != 0)
    cuda::CountErrorAtomic(a.errors, kNonfinite, first_nonfinite, nonfinite);
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
