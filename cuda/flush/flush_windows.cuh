// The prefill flush kernel's block code: the window plan of
// dsv4/flush_windows.h run in parallel over (request, entry), shared by the
// flush kernels (cuda/flush/flush.cu) and write_layer's prefill launch
// (cuda/write_layer/write_layer.cu). Decode-sized calls keep the serial kernel of
// cuda/flush/flush_block.cuh (UseWindowPlan below picks by shape and the caller's
// bound on a request's rows).
//
// Classification: every block scans the call's metadata (8 bytes a row) into
// three bitmaps of R bits in its shared memory: the slots that start a run
// of rows, the irregular slots (a second run, a step of position other than
// +1, or a position outside the block table), and the slots with more than
// kSerialRunRows rows. No scratch result and no
// extra launch; the price is that every block reads all of it (32 KiB at
// T = 4k, 512 KiB at 64k), which dominates single calls of 64k rows.
//
// Work: block b of G owns rows [T b / G, T (b+1) / G) and finds the work
// anchored at them: a regular request's first row (its edge entries: those
// reading or leaving the carried accumulators), a row at the start of a
// window whose entry is a middle entry (two metadata loads decide it), an
// irregular request's first row (the serial flush_kernel::WalkRequest, the
// whole block), or a short request's first row (at most kSerialRunRows
// rows: the same serial walk; a verify or commit step's 1 + k rows a
// request). A warp an entry only pays where a request has middle entries to
// run side by side; a short request's few edge entries would run one after
// another on one warp, far slower than a block walking its rows. Rows are
// counted (MISSING_BLOCK, NONFINITE) by the entry that folds their b half
// (HCA: their entry), so once each.
//
// CSA (flush_entry_warp.cuh): one warp an entry, 32 rows a block, so 8
// entries of 8 rows are in flight a block (12 where a request starts). A
// request the plan runs (more than kSerialRunRows rows) is long enough that
// its reading entries all close: its four edge entries run on four warps, and
// the two that leave accumulators store them only after the two readers are
// done (a counter in shared memory).
// HCA (flush_entry_block.cuh): one entry a block, a thread a channel: an
// entry folds 128 rows, and one warp folding them all is far slower than the
// block's barriers (measured: docs/perf/ops.md).
#pragma once

#include <cuda_runtime.h>

#include "common/bf16_chunks.cuh"
#include "common/launch.cuh"
#include "common/layer_checks.cuh"
#include "dsv4/flush.h"
#include "dsv4/flush_windows.h"
#include "flush/flush_block.cuh"
#include "flush/flush_entry_block.cuh"
#include "flush/flush_entry_warp.cuh"

namespace dsv4 {
namespace flush_kernel {

// Calls of at least this many rows take the window plan (prefill); smaller
// ones (decode: a row or a few per request) keep the serial kernel, and so
// do larger ones whose caller bounds every request to kSerialRunRows rows
// (a verify or commit step: 1 + k rows a request), which the plan would
// walk serially anyway, in a second launch.
constexpr int64_t kPlanMinRows = 256;
// The three slot bitmaps (3 x 16 KiB) and the warps' scratch must fit a
// block's shared memory.
constexpr int64_t kPlanMaxSlots = int64_t{1} << 17;
// A regular request of at most this many rows is walked serially by one
// block, as the decode kernel walks it.
constexpr int64_t kSerialRunRows = 16;
// So a CSA request the plan runs holds its first two windows' last positions
// (at most 2 x 4 rows from its first): both entries reading the carried
// accumulators close, and they run beside the two that leave accumulators.
static_assert(kSerialRunRows >= 2 * kCsaRatio, "a planned CSA request is a long run");

inline bool UseWindowPlan(const FlushArgs& a) {
  const bool short_runs = a.max_rows_per_slot >= 1 && a.max_rows_per_slot <= kSerialRunRows;
  return a.T >= kPlanMinRows && a.R <= kPlanMaxSlots && !short_runs;
}
__host__ __device__ inline int64_t PlanBitmapWords(int64_t R) { return (R + 31) / 32; }
constexpr int kPlanBitmaps = 3;
// Where the warps' scratch starts in a plan block's dynamic shared memory,
// after the bitmaps (16-byte aligned).
__host__ __device__ inline int64_t PlanScratchOffset(int64_t R) {
  return (kPlanBitmaps * PlanBitmapWords(R) * 4 + 15) / 16 * 16;
}

// The work items a block found among its rows.
enum PlanRole : int {
  kEdge = 0, kMiddle = 1, kIrregular = 2, kEdgeRead = 3, kEdgeWrite = 4, kShort = 5
};
// Whether a block-wide serial walk runs the item (after the warps' items).
__device__ __forceinline__ bool WalkedByBlock(int role) {
  return role == kIrregular || role == kShort;
}

// A block's list of work items of one round of rows.
struct PlanShared {
  int32_t item_row[kThreads];
  int8_t item_role[kThreads];
  int8_t item_j[kThreads];        // kEdgeRead / kEdgeWrite: which of the two
  int16_t item_ready[kThreads];   // kEdgeWrite: the item whose `ready` it waits on
  int ready[kThreads];            // a long run's first item: its readers done
  int items;
  BatchVote vote;
};

// ---- classification --------------------------------------------------------------
__device__ __forceinline__ bool SlotBit(const uint32_t* bits, int64_t s) {
  return (bits[s >> 5] >> (s & 31)) & 1u;
}

// Fills the run-start bitmap (bits[0 .. words)), the irregular-slot bitmap
// (bits[words .. 2 words)) and the long-run bitmap (bits[2 words .. 3
// words): a row kSerialRunRows after a row of its slot; a regular slot's
// rows are one run, so its bit says the run is longer than that) from every
// row of the call.
__device__ inline void ClassifySlots(const FlushArgs& a, uint32_t* bits, int64_t words) {
  for (int64_t t = threadIdx.x; t < a.T; t += kThreads) {
    const int64_t s = __ldg(a.slot + t);
    if (s < 0 || s >= a.R) continue;
    const int64_t p = __ldg(a.pos + t);
    bool irregular = !PositionInTable(p, a.max_context, a.MB);
    const uint32_t bit = 1u << (s & 31);
    if (t > 0 && __ldg(a.slot + t - 1) == s) {
      irregular = irregular || p != int64_t{__ldg(a.pos + t - 1)} + 1;
    } else {
      irregular = irregular || (atomicOr(bits + (s >> 5), bit) & bit) != 0;
    }
    if (irregular) atomicOr(bits + words + (s >> 5), bit);
    if (t >= kSerialRunRows && __ldg(a.slot + t - kSerialRunRows) == s)
      atomicOr(bits + 2 * words + (s >> 5), bit);
  }
  __syncthreads();
}

// The end (exclusive) of the run of rows of slot s that starts at t0, the
// rows of a regular slot being one run: a 32-way search by one warp
// (monotone: rows t0 .. end-1 are s, no later row is).
__device__ inline int64_t WarpRunEnd(const FlushArgs& a, int64_t s, int64_t t0) {
  const int lane = threadIdx.x & 31;
  int64_t lo = t0, hi = a.T;  // lo is in the run, hi past it
  while (hi - lo > 1) {
    const int64_t step = (hi - lo + 31) / 32;
    const int64_t probe = lo + (lane + 1) * step;
    const int in = probe < hi && __ldg(a.slot + probe) == s;
    const int64_t k = __popc(__ballot_sync(cuda::kFull, in));
    const int64_t next_hi = lo + (k + 1) * step;
    lo = lo + k * step;
    hi = next_hi < hi ? next_hi : hi;
  }
  return hi;
}

// Whether row t of slot s is the first row of s in the call (block-uniform).
__device__ inline bool FirstRowOfSlot(const FlushArgs& a, int64_t s, int64_t t) {
  int seen = 0;
  for (int64_t i = threadIdx.x; i < t; i += kThreads) seen |= __ldg(a.slot + i) == s;
  return !__syncthreads_or(seen);
}

// ---- the block ----------------------------------------------------------------------
// The role of row t (slot s, already known valid), or -1.
template <bool kCsa>
__device__ __forceinline__ int RowRole(const FlushArgs& a, const uint32_t* irregular,
                                       const uint32_t* long_run, int64_t s, int64_t t) {
  const bool first_of_run = t == 0 || __ldg(a.slot + t - 1) != s;
  if (SlotBit(irregular, s)) return first_of_run ? kIrregular : -1;
  if (!SlotBit(long_run, s)) return first_of_run ? kShort : -1;
  if (first_of_run) return kEdge;
  constexpr int64_t m = kCsa ? kCsaRatio : kHcaRatio;
  if (__ldg(a.pos + t) % m != 0) return -1;
  const int64_t back = t - MiddleCheckBack(kCsa), ahead = t + MiddleCheckAhead(kCsa);
  const bool middle = back >= 0 && __ldg(a.slot + back) == s && ahead < a.T &&
                      __ldg(a.slot + ahead) == s;
  return middle ? kMiddle : -1;
}

// One item of a CSA block, run by one warp: a middle entry, or one edge
// entry of a request (kEdgeRead: one reading the carried accumulators, which
// all close; kEdgeWrite: one leaving an accumulator).
__device__ inline void RunItemWarp(const FlushArgs& a, int64_t l, int i, PlanShared& ps,
                            WarpScratch& ws) {
  constexpr int64_t m = kCsaRatio, A = 2;
  const int64_t t = ps.item_row[i], role = ps.item_role[i], j = ps.item_j[i];
  const int64_t s = __ldg(a.slot + t), p = __ldg(a.pos + t);
  if (role == kMiddle) {
    RunEntryWarp<true>(a, l, s, t, p, MiddleJob(true, p / m), ws);
  } else if (role == kEdgeRead) {  // entry w0 + j: the plan up to where it closes
    const WindowPlan w = PlanWindows(true, p, (p / m + A) * m - p);
    RunEntryWarp<true>(a, l, s, t, p, w.Job(w.w0 + j), ws);
    __syncwarp();
    if ((threadIdx.x & 31) == 0) atomicAdd(&ps.ready[i - j], 1);
  } else {  // kEdgeWrite: entry wl + j, stored once both readers are done
    const WindowPlan w = PlanWindows(true, p, WarpRunEnd(a, s, t) - t);
    RunEntryWarp<true>(a, l, s, t, p, w.Job(w.wl + j), ws, &ps.ready[ps.item_ready[i]],
                       static_cast<int>(A));
  }
}

// One item of an HCA block, run by the whole block.
__device__ inline void RunItemBlock(const FlushArgs& a, int64_t l, int64_t t, int role, FlushShared& sh,
                             BatchVote& vote) {
  const int64_t s = __ldg(a.slot + t), p = __ldg(a.pos + t);
  if (role == kMiddle) {
    RunEntry<false>(a, l, s, t, p, MiddleJob(false, p / kHcaRatio), sh, vote);
  } else {  // kEdge: in increasing order
    const WindowPlan w = PlanWindows(false, p, WarpRunEnd(a, s, t) - t);
    for (int64_t e = w.w0; e <= w.last(); e = w.next_edge(e))
      RunEntry<false>(a, l, s, t, p, w.Job(e), sh, vote);
  }
}

// Queues row t's work in the block's list.
template <bool kCsa>
__device__ __forceinline__ void QueueRow(const FlushArgs& a, int64_t s, int64_t t, int role,
                                         PlanShared& ps) {
  if (kCsa && role == kEdge) {
    // a planned CSA request (kSerialRunRows): its two reading entries and
    // two leaving ones, four items
    const int i = atomicAdd(&ps.items, 4);
    ps.ready[i] = 0;
    for (int k = 0; k < 4; ++k) {
      ps.item_row[i + k] = static_cast<int32_t>(t);
      ps.item_role[i + k] = static_cast<int8_t>(k < 2 ? kEdgeRead : kEdgeWrite);
      ps.item_j[i + k] = static_cast<int8_t>(k & 1);
      ps.item_ready[i + k] = i;
    }
    return;
  }
  const int i = atomicAdd(&ps.items, 1);
  ps.item_row[i] = static_cast<int32_t>(t);
  ps.item_role[i] = static_cast<int8_t>(role);
}

// Block `block` of `blocks`; `smem` is PlanSmem<kCsa>(R) bytes of shared
// memory: the two slot bitmaps, then (CSA) every warp's scratch.
template <bool kCsa>
__device__ void FlushPlanBlock(const FlushArgs& a, unsigned block, unsigned blocks,
                               unsigned char* smem, FlushShared& sh, PlanShared& ps) {
  const int64_t words = PlanBitmapWords(a.R);
  uint32_t* bits = reinterpret_cast<uint32_t*>(smem);
  WarpScratch* scratch = reinterpret_cast<WarpScratch*>(smem + PlanScratchOffset(a.R));
  for (int64_t i = threadIdx.x; i < kPlanBitmaps * words; i += kThreads) bits[i] = 0u;
  __syncthreads();
  cuda::WaitForPrevious();  // everything below reads what earlier kernels wrote
  // the epilogue's parameters, once for every entry and walk the block closes
  StageChannelParams<kCsa, Part::kAll>(a, sh);
  int64_t l;
  if (!cuda::LayerOkCountedBy(block == 0, a.layer, a.L, a.errors, &l)) return;
  ClassifySlots(a, bits, words);
  const uint32_t* irregular = bits + words;
  const uint32_t* long_run = bits + 2 * words;
  const int64_t begin = a.T * block / blocks, end = a.T * (block + 1) / blocks;
  const int warp = threadIdx.x >> 5;
  int bad_slot = 0;
  int64_t first_bad_slot = kNoRow;  // a thread's rows come in increasing order
  // rows a round: each queues at most one item (four for a planned CSA
  // request's first row, which has more than four rows), so the list holds
  // a round's items
  constexpr int kRoundRows = kThreads;
  for (int64_t base = begin; base < end; base += kRoundRows) {
    if (threadIdx.x == 0) ps.items = 0;
    __syncthreads();
    const int64_t t = base + threadIdx.x;
    if (t < end) {
      const int64_t s = __ldg(a.slot + t);
      if (s != -1 && (s < 0 || s >= a.R)) {
        if (bad_slot++ == 0) first_bad_slot = t;
      } else if (s >= 0) {
        const int role = RowRole<kCsa>(a, irregular, long_run, s, t);
        if (role >= 0) QueueRow<kCsa>(a, s, t, role, ps);
      }
    }
    __syncthreads();
    const int items = ps.items;
    if constexpr (kCsa) {
      // regular requests' entries: a warp each, all at once; a warp takes
      // its items in increasing order, so an entry waiting for the reading
      // entries of its request never waits on its own warp
      for (int i = warp; i < items; i += kWarpsPerBlock)
        if (!WalkedByBlock(ps.item_role[i])) RunItemWarp(a, l, i, ps, scratch[warp]);
    } else {
      for (int i = 0; i < items; ++i)
        if (!WalkedByBlock(ps.item_role[i])) RunItemBlock(a, l, ps.item_row[i], ps.item_role[i], sh, ps.vote);
    }
    __syncthreads();
    // irregular and short requests: the serial walk, the whole block (a
    // short request is regular: its run's first row is its first row)
    for (int i = 0; i < items; ++i) {
      if (!WalkedByBlock(ps.item_role[i])) continue;
      const int64_t tt = ps.item_row[i], s = __ldg(a.slot + tt);
      if (ps.item_role[i] == kShort || FirstRowOfSlot(a, s, tt))
        WalkRequest<kCsa, Part::kAll>(a, l, s, tt, __ldg(a.pos + tt), sh, SearchRows{a, s, sh});
    }
    __syncthreads();  // the list is rewritten next round
  }
  cuda::WarpCount(a.errors, kBadSlot, bad_slot, first_bad_slot);
}

template <bool kCsa>
__global__ void __launch_bounds__(kThreads, 1) FlushPlanKernel(FlushArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ FlushShared sh;
  __shared__ PlanShared ps;
  FlushPlanBlock<kCsa>(a, blockIdx.x, gridDim.x, smem, sh, ps);
}

// Dynamic shared memory of a plan block: the slot bitmaps, then (CSA) the
// warps' scratch.
template <bool kCsa>
inline size_t PlanSmem(int64_t R) {
  return static_cast<size_t>(PlanScratchOffset(R) +
                             (kCsa ? kWarpsPerBlock * sizeof(WarpScratch) : 0));
}
// CSA: 32 rows a block: 8 middle entries, a warp each, and room for a long
// request's four edge entries beside them, so the edge chain (readers, then
// the entries that leave accumulators) starts at once; HCA: a block an
// entry, grid-stride. Either at least a block a multiprocessor (a row a
// block below that), so that short requests' walks, a block each, run side
// by side.
template <bool kCsa>
inline unsigned PlanGrid(int64_t T) {
  const int64_t by_entries = kCsa ? (T + 31) / 32 : cuda::GridFor(T, 16, 2);
  const int64_t by_walks = T < cuda::SmCount() ? T : cuda::SmCount();
  const int64_t blocks = by_entries > by_walks ? by_entries : by_walks;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

// The prefill launch (UseWindowPlan(a) holds), overlapped with its
// predecessor's tail as the other write kernels are.
template <bool kCsa>
cudaError_t LaunchFlushPlan(cudaStream_t stream, const FlushArgs& a) {
  // past the default 48 KB of dynamic shared memory at large R
  const cudaError_t opt_in = cuda::AllowDynamicShared<FlushPlanKernel<kCsa>>(
      static_cast<int>(PlanSmem<kCsa>(kPlanMaxSlots)));
  if (opt_in != cudaSuccess) return opt_in;
  return cuda::LaunchOverlapped(FlushPlanKernel<kCsa>, dim3(PlanGrid<kCsa>(a.T)),
                                dim3(kThreads), PlanSmem<kCsa>(a.R), 1u, stream, a);
}

}  // namespace flush_kernel
}  // namespace dsv4
