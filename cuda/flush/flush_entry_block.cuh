// flush's window plan, one entry a block (HCA): one thread per channel of
// the 512-wide entry folds the entry's rows, eight at a time (their operands
// loaded together, one block-wide vote per batch on which rows hold a NaN or
// Inf), then the block runs the entry's epilogue (flush_block.cuh's
// BlockCloseEntry). An HCA
// entry folds 128 rows, so a thread per channel keeps the chain of folds
// short; the block barriers of the epilogue are paid once per 128 rows.
#pragma once

#include <cuda_runtime.h>

#include "common/bf16_chunks.cuh"
#include "dsv4/flush.h"
#include "dsv4/flush_windows.h"
#include "flush/flush_block.cuh"

namespace dsv4 {
namespace flush_kernel {

constexpr int kBatchRows = 8;  // rows of an entry loaded together

// The block's vote on a batch's rows.
struct BatchVote {
  uint32_t bad_rows;  // rows of the batch that hold NaN/Inf (bit i: row i)
};

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
__device__ __forceinline__ uint32_t BlockBadRows(uint32_t mine, BatchVote& ps) {
  if (threadIdx.x == 0) ps.bad_rows = 0u;
  __syncthreads();
  const uint32_t warp = __reduce_or_sync(cuda::kFull, mine);
  if ((threadIdx.x & 31) == 0 && warp != 0u) atomicOr(&ps.bad_rows, warp);
  __syncthreads();
  return ps.bad_rows;
}

// Runs entry job j of slot s: row of position q is t_ref + (q - p_ref). The
// block's StageChannelParams come before (FlushPlanBlock, once).
template <bool kCsa>
__device__ void RunEntry(const FlushArgs& a, int64_t l, int64_t s, int64_t t_ref, int64_t p_ref,
                         const EntryJob& j, FlushShared& sh, BatchVote& ps) {
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
  int64_t first_missing = kNoRow, first_nonfinite = kNoRow;  // and the first rows, q increasing
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
        if (counts && missing++ == 0) first_missing = t_ref + (q - p_ref);
      } else if ((bad >> i) & 1u) {
        if (counts && nonfinite++ == 0) first_nonfinite = t_ref + (q - p_ref);
      } else {
        acc = num::AccumulateAcc(acc, in[i].z, in[i].v);
        if (ich) iacc = num::AccumulateAcc(iacc, in[i].iz, in[i].iv);
      }
    }
  }
  if (c == 0 && missing != 0) cuda::CountErrorAtomic(a.errors, kMissingBlock, first_missing, missing);
  if (c == 0 && nonfinite != 0)
    cuda::CountErrorAtomic(a.errors, kNonfinite, first_nonfinite, nonfinite);
  if (j.acc >= 0) {  // stays open: accumulator j.acc after the call
    Acc3{acc_base.base + j.acc * 3 * kHeadDim, kHeadDim}.Store(c, acc);
    if (ich) Acc3{iacc_base.base + j.acc * 3 * kIndexDim, kIndexDim}.Store(c, iacc);
    return;
  }
  const int64_t block = __ldg(a.block_table + s * a.MB + j.e * m / kBlockTokens);
  if (block < 0 || block >= a.N) return;  // not stored; its rows were counted
  const int64_t e = (l * a.N + block) * a.per_block + j.e % a.per_block;
  BlockCloseEntry<kCsa, Part::kAll>(a, e, num::FinalizeAcc(acc),
                                    ich ? num::FinalizeAcc(iacc) : 0.f, j.e * m, sh);
}

}  // namespace flush_kernel
}  // namespace dsv4
