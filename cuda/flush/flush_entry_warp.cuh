// flush's window plan, one entry a warp (CSA): a warp folds the entry's 8
// rows and runs its epilogue on its own, so a block has up to 16 entries in
// flight and no block barrier on an entry's path. The arithmetic is the block
// code's (flush_block.cuh: BlockCloseEntry), bit for bit: the same partial
// sums in the same order, the same butterflies.
#pragma once

#include <cuda_runtime.h>

#include "common/bf16_chunks.cuh"
#include "common/entry_warp.cuh"
#include "dsv4/flush.h"
#include "dsv4/flush_windows.h"
#include "flush/flush_block.cuh"

namespace dsv4 {
namespace flush_kernel {

// Lane L holds channels
// 8L .. 8L+7 (`lo`) and 256+8L .. 256+8L+7 (`hi`) of the 512-wide entry, the
// layout cuda::WarpEncodeEntry stores, and indexer channels 4L .. 4L+3.
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kLaneCh = 16;  // main channels a lane holds
constexpr int kLaneIch = 4;  // indexer channels a lane holds

// Per-warp shared scratch: the row under its epilogue, for the strided
// partial sums of RMSNorm and the Hadamard butterflies.
struct WarpScratch {
  float x[kHeadDim];
  float ix[kIndexDim];
};

__device__ __forceinline__ int LaneChannel(int i) {  // channel of lane value i
  const int lane = threadIdx.x & 31;
  return i < 8 ? 8 * lane + i : 256 + 8 * lane + (i - 8);
}

// 16 floats of a lane at row `src` (channels 8L.. and 256+8L..).
__device__ __forceinline__ void LoadLane16(const float* src, float* out) {
  const int lane = threadIdx.x & 31;
  const float4* lo = reinterpret_cast<const float4*>(src + 8 * lane);
  const float4* hi = reinterpret_cast<const float4*>(src + 256 + 8 * lane);
  const float4 v[4] = {__ldg(lo), __ldg(lo + 1), __ldg(hi), __ldg(hi + 1)};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out[4 * k] = v[k].x;
    out[4 * k + 1] = v[k].y;
    out[4 * k + 2] = v[k].z;
    out[4 * k + 3] = v[k].w;
  }
}

__device__ __forceinline__ void LoadLane4(const float* src, float* out) {
  const float4 v = __ldg(reinterpret_cast<const float4*>(src) + (threadIdx.x & 31));
  out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}

__device__ __forceinline__ bool AllFinite(const float* x, int n) {
  bool ok = true;
  for (int i = 0; i < n; ++i) ok = ok && num::IsFinite(x[i]);
  return ok;
}

// One row's operands for a lane: z = score + ape and kv of the half folded,
// main and indexer, and whether the whole row (both halves, indexer too) is
// finite, agreed by the warp.
struct WarpRow {
  float z[kLaneCh], v[kLaneCh], iz[kLaneIch], iv[kLaneIch];
  bool finite;
};

template <bool kCsa>
__device__ __forceinline__ void LoadWarpRow(const FlushArgs& a, int64_t t, int64_t q, bool b_half,
                                            WarpRow& r) {
  constexpr int64_t mw = kCsa ? 2 * kHeadDim : kHeadDim;
  constexpr int64_t m = kCsa ? kCsaRatio : kHcaRatio;
  const int64_t half = kCsa && b_half ? kHeadDim : 0;
  const float* kv = a.main.kv + t * mw;
  const float* sc = a.main.score + t * mw;
  float s[kLaneCh], ap[kLaneCh];
  LoadLane16(kv + half, r.v);
  LoadLane16(sc + half, s);
  LoadLane16(a.main.ape + (q % m) * mw + half, ap);
  bool ok = AllFinite(s, kLaneCh) && AllFinite(r.v, kLaneCh);
  if (kCsa) {
    // the other half only decides whether the row is dropped
    const int64_t other = b_half ? 0 : kHeadDim;
    float os[kLaneCh], ov[kLaneCh];
    LoadLane16(sc + other, os);
    LoadLane16(kv + other, ov);
    ok = ok && AllFinite(os, kLaneCh) && AllFinite(ov, kLaneCh);
    constexpr int64_t iw = 2 * kIndexDim;
    const int64_t ih = b_half ? kIndexDim : 0, io = b_half ? 0 : kIndexDim;
    const float* ikv = a.index.kv + t * iw;
    const float* isc = a.index.score + t * iw;
    float is[kLaneIch], iap[kLaneIch], ios[kLaneIch], iov[kLaneIch];
    LoadLane4(ikv + ih, r.iv);
    LoadLane4(isc + ih, is);
    LoadLane4(a.index.ape + (q % m) * iw + ih, iap);
    LoadLane4(isc + io, ios);
    LoadLane4(ikv + io, iov);
    ok = ok && AllFinite(is, kLaneIch) && AllFinite(r.iv, kLaneIch) &&
         AllFinite(ios, kLaneIch) && AllFinite(iov, kLaneIch);
#pragma unroll
    for (int i = 0; i < kLaneIch; ++i) r.iz[i] = is[i] + iap[i];
  }
#pragma unroll
  for (int i = 0; i < kLaneCh; ++i) r.z[i] = s[i] + ap[i];
  r.finite = __all_sync(cuda::kFull, ok);
}

// BlockCloseEntry's epilogue on values a lane holds: `v[n]` of channels
// ch(i) on entry, the bf16-valued row on return. RoPE pairs (2k, 2k+1) sit in
// one lane, so only the norm's sum needs the row in `xs`.
template <int n, typename Channel>
__device__ __forceinline__ void WarpEpilogue(float* v, int d, Channel ch, const float* norm,
                                             const float* inv_freq, int64_t pos, float* xs) {
#pragma unroll
  for (int i = 0; i < n; ++i) {
    v[i] = num::RoundBf16(v[i]);
    xs[ch(i)] = v[i];
  }
  __syncwarp();
  const float inv = num::RmsInvFromSumSquares(WarpSumSquares(xs, d), d);
#pragma unroll
  for (int i = 0; i < n; ++i) v[i] = num::RoundBf16((v[i] * inv) * __ldg(norm + ch(i)));
  const int r0 = d - kRopeDim;
#pragma unroll
  for (int i = 0; i < n; i += 2) {
    const int c = ch(i);
    if (c < r0) continue;
    const int k = (c - r0) >> 1;
    float y0, y1;
    num::RopePair(v[i], v[i + 1], static_cast<float>(pos) * __ldg(inv_freq + k), &y0, &y1);
    v[i] = num::RoundBf16(y0);
    v[i + 1] = num::RoundBf16(y1);
  }
  __syncwarp();  // xs is free again
}

// BlockCloseEntry's Hadamard, bf16 rounding and MXFP4 of the indexer key held
// as v[4] (channels 4L .. 4L+3), in the warp's `ix`.
__device__ __forceinline__ void WarpStoreIndexKey(const FlushArgs& a, int64_t e, const float* v,
                                                  float* ix) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < kLaneIch; ++i) ix[4 * lane + i] = v[i];
  __syncwarp();
  for (int h = 1; h < kIndexDim; h <<= 1) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int c = lane + 32 * u;  // butterfly c of 64
      const int j = (c / h) * 2 * h + (c % h);
      const float x0 = ix[j], x1 = ix[j + h];
      ix[j] = x0 + x1;
      ix[j + h] = x0 - x1;
    }
    __syncwarp();
  }
  // MXFP4 block b holds channels 32b .. 32b+31: lane L takes channel 32b + L
#pragma unroll
  for (int b = 0; b < kIndexDim / 32; ++b) StoreMxfp4Block(a, e, b, ix[32 * b + lane]);
  __syncwarp();
}

// Runs entry job j of slot s with one warp: the row of position q is
// t_ref + (q - p_ref). With `ready`, the accumulator it leaves is stored
// only once *ready reaches `need`.
template <bool kCsa>
__device__ __noinline__ void RunEntryWarp(const FlushArgs& a, int64_t l, int64_t s, int64_t t_ref,
                             int64_t p_ref, const EntryJob& j, WarpScratch& ws,
                             const volatile int* ready = nullptr, int need = 0) {
  const int lane = threadIdx.x & 31;
  constexpr int64_t coff = kCsa ? 2 : 1;
  constexpr int64_t m = kCsa ? kCsaRatio : kHcaRatio;
  float* acc_base = a.main.comp + (l * a.R + s) * coff * 3 * kHeadDim;
  float* iacc_base = kCsa ? a.index.comp + (l * a.R + s) * 2 * 3 * kIndexDim : nullptr;
  num::SoftmaxAcc acc[kLaneCh], iacc[kLaneIch];
#pragma unroll
  for (int i = 0; i < kLaneCh; ++i) acc[i] = num::EmptyAcc();
#pragma unroll
  for (int i = 0; i < kLaneIch; ++i) iacc[i] = num::EmptyAcc();
  if (j.carried >= 0) {
    const Acc3 row{acc_base + j.carried * 3 * kHeadDim, kHeadDim};
#pragma unroll
    for (int i = 0; i < kLaneCh; ++i) acc[i] = row.Load(LaneChannel(i));
    if (kCsa) {
      const Acc3 irow{iacc_base + j.carried * 3 * kIndexDim, kIndexDim};
#pragma unroll
      for (int i = 0; i < kLaneIch; ++i) iacc[i] = irow.Load(4 * lane + i);
    }
  }
  int missing = 0, nonfinite = 0;  // lane 0's counts of the b rows
  int64_t first_missing = kNoRow, first_nonfinite = kNoRow;  // and the first rows, q increasing
  int64_t block = -1, block_of = -1;
  for (int64_t q = j.rows.lo; q <= j.rows.hi; ++q) {
    if (q / kBlockTokens != block_of) {
      block_of = q / kBlockTokens;
      block = __ldg(a.block_table + s * a.MB + block_of);
    }
    const bool counts = q >= j.b_from && lane == 0;
    if (block < 0 || block >= a.N) {
      if (counts && missing++ == 0) first_missing = t_ref + (q - p_ref);
      continue;
    }
    WarpRow r;
    LoadWarpRow<kCsa>(a, t_ref + (q - p_ref), q, q >= j.b_from, r);
    if (!r.finite) {
      if (counts && nonfinite++ == 0) first_nonfinite = t_ref + (q - p_ref);
      continue;
    }
#pragma unroll
    for (int i = 0; i < kLaneCh; ++i) acc[i] = num::AccumulateAcc(acc[i], r.z[i], r.v[i]);
    if (kCsa) {
#pragma unroll
      for (int i = 0; i < kLaneIch; ++i) iacc[i] = num::AccumulateAcc(iacc[i], r.iz[i], r.iv[i]);
    }
  }
  if (missing != 0) cuda::CountErrorAtomic(a.errors, kMissingBlock, first_missing, missing);
  if (nonfinite != 0) cuda::CountErrorAtomic(a.errors, kNonfinite, first_nonfinite, nonfinite);
  if (j.acc >= 0) {  // stays open: accumulator j.acc after the call
    // the request's entries that read the carried rows go first (`ready`
    // counts those of them done, `need` of them in all)
    if (ready != nullptr && lane == 0)
      while (*ready < need) {
      }
    __syncwarp();
    const Acc3 row{acc_base + j.acc * 3 * kHeadDim, kHeadDim};
#pragma unroll
    for (int i = 0; i < kLaneCh; ++i) row.Store(LaneChannel(i), acc[i]);
    if (kCsa) {
      const Acc3 irow{iacc_base + j.acc * 3 * kIndexDim, kIndexDim};
#pragma unroll
      for (int i = 0; i < kLaneIch; ++i) irow.Store(4 * lane + i, iacc[i]);
    }
    return;
  }
  const int64_t eb = __ldg(a.block_table + s * a.MB + j.e * m / kBlockTokens);
  if (eb < 0 || eb >= a.N) return;  // not stored; its rows were counted
  const int64_t e = (l * a.N + eb) * a.per_block + j.e % a.per_block;
  float v[kLaneCh];
#pragma unroll
  for (int i = 0; i < kLaneCh; ++i) v[i] = num::FinalizeAcc(acc[i]);
  WarpEpilogue<kLaneCh>(v, kHeadDim, [](int i) { return LaneChannel(i); }, a.main.norm, a.main.inv_freq, j.e * m, ws.x);
  cuda::WarpEncodeEntry(a.pool, e, v, v + 8);
  if (kCsa) {
    float iv[kLaneIch];
#pragma unroll
    for (int i = 0; i < kLaneIch; ++i) iv[i] = num::FinalizeAcc(iacc[i]);
    WarpEpilogue<kLaneIch>(iv, kIndexDim, [lane](int i) { return 4 * lane + i; }, a.index.norm,
                           a.index.inv_freq, j.e * m, ws.ix);
    WarpStoreIndexKey(a, e, iv, ws.ix);
  }
}

}  // namespace flush_kernel
}  // namespace dsv4
