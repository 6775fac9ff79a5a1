// The prefill flush kernel's block code: the window plan of
// dsv4/flush_windows.h run in parallel over (request, entry), shared by the
// flush kernels (cuda/flush.cu) and write_layer's prefill launch
// (cuda/write_layer.cu). Decode-sized calls keep the serial kernel of
// cuda/flush_block.cuh (UseWindowPlan below picks by shape alone).
//
// Classification: every block scans the call's metadata (8 bytes a row) into
// two bitmaps of R bits in its shared memory: the slots that start a run of
// rows, and the irregular slots (a second run, a step of position other
// than +1, or a position outside the block table). A per-slot check at
// 8 bytes a row costs each block 32 KiB at T = 4k, 64 KiB at 8k, 512 KiB at
// 64k, read from L2 in parallel with the other blocks: well under the cost
// of the entries themselves (a few microseconds at 64k), with no scratch
// result (a pre-pass kernel would need one, and a launch more) and no
// cluster launch.
//
// Work: block b of G owns rows [T b / G, T (b+1) / G) and finds the work
// anchored at them: a regular request's first row (its edge entries, in
// increasing order, after finding its last row by a 512-way search); a row
// at the start of a window whose entry is a middle entry (two metadata
// loads decide it); an irregular request's first row (the serial
// flush_kernel::WalkRequest). One thread per channel (threads 0..127 also
// the indexer's) folds an entry's rows, eight at a time: their operands are
// loaded together, one block-wide vote per batch says which rows hold a NaN
// or Inf, then the folds run in row order. Rows are counted (MISSING_BLOCK,
// NONFINITE) by the entry that folds their b half (HCA: their entry), so
// once each.
#pragma once

#include <cuda_runtime.h>

#include "dsv4/flush_windows.h"
#include "flush.h"
#include "flush_block.cuh"
#include "kernels.cuh"

namespace dsv4 {
namespace flush_kernel {

// Calls of at least this many rows take the window plan (prefill); smaller
// ones (decode: a row or a few per request) keep the serial kernel.
constexpr int64_t kPlanMinRows = 256;
// The two slot bitmaps must fit a block's shared memory (2 x 16 KiB).
constexpr int64_t kPlanMaxSlots = int64_t{1} << 17;
constexpr int kBatchRows = 8;  // rows of an entry loaded together

inline bool UseWindowPlan(int64_t T, int64_t R) {
  return T >= kPlanMinRows && R <= kPlanMaxSlots;
}
__host__ __device__ inline int64_t PlanBitmapWords(int64_t R) { return (R + 31) / 32; }
inline size_t PlanSmem(int64_t R) { return static_cast<size_t>(2 * PlanBitmapWords(R) * 4); }
inline unsigned PlanGrid(int64_t T) { return cuda::GridFor(T, 16, 2); }

// The work items a block found among its rows.
enum PlanRole : int { kEdge = 0, kMiddle = 1, kIrregular = 2 };

struct PlanShared {
  int32_t item_row[kThreads];
  int8_t item_role[kThreads];
  int items;
  uint32_t bad_rows;  // rows of the batch that hold NaN/Inf (bit i: row i)
};

// ---- classification --------------------------------------------------------------
__device__ __forceinline__ bool SlotBit(const uint32_t* bits, int64_t s) {
  return (bits[s >> 5] >> (s & 31)) & 1u;
}

// Fills the run-start bitmap (bits[0 .. words)) and the irregular-slot
// bitmap (bits[words .. 2 words)) from every row of the call.
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
  }
  __syncthreads();
}

// The end (exclusive) of the run of rows of slot s that starts at t0, the
// rows of a regular slot being one run: a 512-way search (monotone: rows
// t0 .. end-1 are s, no later row is).
__device__ inline int64_t RunEnd(const FlushArgs& a, int64_t s, int64_t t0) {
  int64_t lo = t0, hi = a.T;  // lo is in the run, hi past it
  while (hi - lo > 1) {
    const int64_t step = (hi - lo + kThreads - 1) / kThreads;
    const int64_t probe = lo + (threadIdx.x + 1) * step;
    const int in = probe < hi && __ldg(a.slot + probe) == s;
    const int64_t k = __syncthreads_count(in);
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

// ---- one entry ----------------------------------------------------------------------
// The operands of one row for this thread's channel: z = score + ape and kv of
// the half it folds, main and indexer, and whether the row's values this
// thread checks (both halves) are finite.
struct RowIn {
  float z = 0.f, v = 0.f, iz = 0.f, iv = 0.f;
  bool finite = true;
};

template <bool kCsa>
__device__ __forceinline__ RowIn LoadRow(const FlushArgs& a, int64_t t, int64_t q, bool b_half) {
  const int c = threadIdx.x;
  const CompressorView& mv = a.main;
  constexpr int64_t mw = kCsa ? 2 * kHeadDim : kHeadDim;
  constexpr int64_t m = kCsa ? kCsaRatio : kHcaRatio;
  const int64_t half = kCsa && b_half ? kHeadDim : 0, other = kCsa && !b_half ? kHeadDim : 0;
  const float* kv = mv.kv + t * mw;
  const float* sc = mv.score + t * mw;
  RowIn r;
  const float s = __ldg(sc + half + c), ap = __ldg(mv.ape + (q % m) * mw + half + c);
  r.v = __ldg(kv + half + c);
  r.z = s + ap;
  r.finite = num::IsFinite(s) && num::IsFinite(r.v);
  if (kCsa) r.finite = r.finite && num::IsFinite(__ldg(sc + other + c)) &&
                       num::IsFinite(__ldg(kv + other + c));
  if (kCsa && c < kIndexDim) {
    constexpr int64_t iw = 2 * kIndexDim;
    const int64_t ih = b_half ? kIndexDim : 0, io = b_half ? 0 : kIndexDim;
    const float* ikv = a.index.kv + t * iw;
    const float* isc = a.index.score + t * iw;
    const float is = __ldg(isc + ih + c);
    r.iv = __ldg(ikv + ih + c);
    r.iz = is + __ldg(a.index.ape + (q % m) * iw + ih + c);
    r.finite = r.finite && num::IsFinite(is) && num::IsFinite(r.iv) &&
               num::IsFinite(__ldg(isc + io + c)) && num::IsFinite(__ldg(ikv + io + c));
  }
  return r;
}

// Rows of the batch (bit i: row i) whose any checked value is NaN/Inf,
// agreed by the whole block.
__device__ __forceinline__ uint32_t BlockBadRows(uint32_t mine, PlanShared& ps) {
  if (threadIdx.x == 0) ps.bad_rows = 0u;
  __syncthreads();
  const uint32_t warp = __reduce_or_sync(cuda::kFull, mine);
  if ((threadIdx.x & 31) == 0 && warp != 0u) atomicOr(&ps.bad_rows, warp);
  __syncthreads();
  return ps.bad_rows;
}

// Runs entry job j of slot s: row of position q is t_ref + (q - p_ref).
template <bool kCsa>
__device__ void RunEntry(const FlushArgs& a, int64_t l, int64_t s, int64_t t_ref, int64_t p_ref,
                         const EntryJob& j, FlushShared& sh, PlanShared& ps) {
  const int c = threadIdx.x;
  const bool ich = kCsa && c < kIndexDim;
  constexpr int64_t coff = kCsa ? 2 : 1;
  constexpr int64_t m = kCsa ? kCsaRatio : kHcaRatio;
  const Acc3 acc_base{a.main.comp + (l * a.R + s) * coff * 3 * kHeadDim, kHeadDim};
  Acc3 iacc_base{nullptr, kIndexDim};
  if (ich) iacc_base.base = a.index.comp + (l * a.R + s) * 2 * 3 * kIndexDim;
  num::SoftmaxAcc acc = num::EmptyAcc(), iacc = num::EmptyAcc();
  if (j.carried >= 0) {
    acc = Acc3{acc_base.base + j.carried * 3 * kHeadDim, kHeadDim}.Load(c);
    if (ich) iacc = Acc3{iacc_base.base + j.carried * 3 * kIndexDim, kIndexDim}.Load(c);
  }
  int missing = 0, nonfinite = 0;  // thread 0's counts of the b rows
  for (int64_t q0 = j.rows.lo; q0 <= j.rows.hi; q0 += kBatchRows) {
    RowIn in[kBatchRows];
    uint32_t bad = 0u;
#pragma unroll
    for (int i = 0; i < kBatchRows; ++i) {
      const int64_t q = q0 + i;
      if (q <= j.rows.hi) in[i] = LoadRow<kCsa>(a, t_ref + (q - p_ref), q, q >= j.b_from);
      bad |= in[i].finite ? 0u : 1u << i;
    }
    bad = BlockBadRows(bad, ps);
#pragma unroll
    for (int i = 0; i < kBatchRows; ++i) {
      const int64_t q = q0 + i;
      if (q > j.rows.hi) continue;
      const int64_t block = __ldg(a.block_table + s * a.MB + q / kBlockTokens);
      const bool counts = q >= j.b_from && c == 0;
      if (block < 0 || block >= a.N) {
        missing += counts;
      } else if ((bad >> i) & 1u) {
        nonfinite += counts;
      } else {
        acc = num::AccumulateAcc(acc, in[i].z, in[i].v);
        if (ich) iacc = num::AccumulateAcc(iacc, in[i].iz, in[i].iv);
      }
    }
  }
  if (c == 0 && missing != 0) atomicAdd(&a.errors[kMissingBlock], missing);
  if (c == 0 && nonfinite != 0) atomicAdd(&a.errors[kNonfinite], nonfinite);
  if (j.acc >= 0) {  // stays open: accumulator j.acc after the call
    Acc3{acc_base.base + j.acc * 3 * kHeadDim, kHeadDim}.Store(c, acc);
    if (ich) Acc3{iacc_base.base + j.acc * 3 * kIndexDim, kIndexDim}.Store(c, iacc);
    return;
  }
  const int64_t block = __ldg(a.block_table + s * a.MB + j.e * m / kBlockTokens);
  if (block < 0 || block >= a.N) return;  // not stored; its rows were counted
  const int64_t e = (l * a.N + block) * a.per_block + j.e % a.per_block;
  BlockEpilogue(num::FinalizeAcc(acc), kHeadDim, a.main.norm, a.main.inv_freq, j.e * m, sh.x,
                &sh.ss[0]);
  StoreEntry(a.pool, e, sh.x);
  if (kCsa) {
    const float ipooled = ich ? num::FinalizeAcc(iacc) : 0.f;
    BlockEpilogue(ipooled, kIndexDim, a.index.norm, a.index.inv_freq, j.e * m, sh.ix, &sh.ss[1]);
    StoreIndexKey(a, e, sh.ix);  // ends with a barrier
  } else {
    __syncthreads();  // StoreEntry read sh.x
  }
}

// ---- the block ----------------------------------------------------------------------
// The role of row t (slot s, already known valid), or -1.
template <bool kCsa>
__device__ __forceinline__ int RowRole(const FlushArgs& a, const uint32_t* irregular, int64_t s,
                                       int64_t t) {
  const bool first_of_run = t == 0 || __ldg(a.slot + t - 1) != s;
  if (SlotBit(irregular, s)) return first_of_run ? kIrregular : -1;
  if (first_of_run) return kEdge;
  constexpr int64_t m = kCsa ? kCsaRatio : kHcaRatio;
  if (__ldg(a.pos + t) % m != 0) return -1;
  const int64_t back = t - MiddleCheckBack(kCsa), ahead = t + MiddleCheckAhead(kCsa);
  const bool middle = back >= 0 && __ldg(a.slot + back) == s && ahead < a.T &&
                      __ldg(a.slot + ahead) == s;
  return middle ? kMiddle : -1;
}

template <bool kCsa>
__device__ void RunItem(const FlushArgs& a, int64_t l, int64_t t, int role, FlushShared& sh,
                        PlanShared& ps) {
  const int64_t s = __ldg(a.slot + t), p = __ldg(a.pos + t);
  if (role == kMiddle) {
    RunEntry<kCsa>(a, l, s, t, p, MiddleJob(kCsa, p / (kCsa ? kCsaRatio : kHcaRatio)), sh, ps);
  } else if (role == kEdge) {
    const WindowPlan w = PlanWindows(kCsa, p, RunEnd(a, s, t) - t);
    for (int64_t e = w.w0; e <= w.last(); e = w.next_edge(e))
      RunEntry<kCsa>(a, l, s, t, p, w.Job(e), sh, ps);
  } else if (FirstRowOfSlot(a, s, t)) {
    WalkRequest<kCsa>(a, l, s, t, sh);
  }
}

// Block `block` of `blocks`; `bits` is PlanSmem(R) bytes of shared memory.
template <bool kCsa>
__device__ void FlushPlanBlock(const FlushArgs& a, unsigned block, unsigned blocks,
                               uint32_t* bits, FlushShared& sh, PlanShared& ps) {
  const int64_t words = PlanBitmapWords(a.R);
  for (int64_t i = threadIdx.x; i < 2 * words; i += kThreads) bits[i] = 0u;
  __syncthreads();
  cuda::WaitForPrevious();  // everything below reads what earlier kernels wrote
  int64_t l;
  if (!cuda::LayerOkCountedBy(block == 0, a.layer, a.L, a.errors, &l)) return;
  ClassifySlots(a, bits, words);
  const uint32_t* irregular = bits + words;
  const int64_t begin = a.T * block / blocks, end = a.T * (block + 1) / blocks;
  int bad_slot = 0;
  for (int64_t base = begin; base < end; base += kThreads) {
    if (threadIdx.x == 0) ps.items = 0;
    __syncthreads();
    const int64_t t = base + threadIdx.x;
    if (t < end) {
      const int64_t s = __ldg(a.slot + t);
      if (s != -1 && (s < 0 || s >= a.R)) {
        ++bad_slot;
      } else if (s >= 0) {
        const int role = RowRole<kCsa>(a, irregular, s, t);
        if (role >= 0) {
          const int i = atomicAdd(&ps.items, 1);
          ps.item_row[i] = static_cast<int32_t>(t);
          ps.item_role[i] = static_cast<int8_t>(role);
        }
      }
    }
    __syncthreads();
    const int items = ps.items;
    for (int i = 0; i < items; ++i) RunItem<kCsa>(a, l, ps.item_row[i], ps.item_role[i], sh, ps);
    __syncthreads();  // the list is rewritten next round
  }
  cuda::WarpCount(a.errors, kBadSlot, bad_slot);
}

template <bool kCsa>
__global__ void __launch_bounds__(kThreads, 1) FlushPlanKernel(FlushArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ FlushShared sh;
  __shared__ PlanShared ps;
  FlushPlanBlock<kCsa>(a, blockIdx.x, gridDim.x, reinterpret_cast<uint32_t*>(smem), sh, ps);
}

// The prefill launch (UseWindowPlan(a.T, a.R) holds), overlapped with its
// predecessor's tail as the other write kernels are.
template <bool kCsa>
cudaError_t LaunchFlushPlan(cudaStream_t stream, const FlushArgs& a) {
  return cuda::LaunchOverlapped(FlushPlanKernel<kCsa>, dim3(PlanGrid(a.T)), dim3(kThreads),
                                PlanSmem(a.R), 1u, stream, a);
}

}  // namespace flush_kernel
}  // namespace dsv4
