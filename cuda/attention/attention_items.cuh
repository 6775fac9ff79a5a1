// What a query token of dsv4_attention sees, decided on the device by the
// CUDA kernel (attention_tensor_core.cuh) with the CPU handler's rules: the
// token's own checks, the prefill chunk's first position per request, and,
// for each candidate item (window position, chunk row, CSA pick or HCA
// entry), whether it is seen and where its row lives. Rules:
// docs/design/operations.md, `attention`.
#pragma once

#include <climits>

#include "common/bf16_chunks.cuh"
#include "common/entry_warp.cuh"
#include "common/layer_checks.cuh"
#include "dsv4/attention.h"

namespace dsv4 {
namespace cuda {

// Where a seen row comes from: the layer's window ring, the call's chunk_kv
// (encoded as append stores it), or the kind's paged pool.
enum AttnSource : uint8_t { kFromRing = 0, kFromChunk = 1, kFromPool = 2 };

__device__ __forceinline__ bool RowFinite(const uint16_t* row) {
  bool ok = true;
  for (int c = 0; c < kHeadDim; ++c) ok = ok && num::Bf16IsFinite(__ldg(row + c));
  return ok;
}

// The lane's two chunks of chunk row `r` of the call (bf16 bits).
__device__ __forceinline__ void LoadChunkRow(const AttentionArgs& a, int64_t r, uint4* lo,
                                             uint4* hi) {
  const int lane = threadIdx.x & 31;
  const uint4* row = reinterpret_cast<const uint4*>(a.chunk_kv + r * kHeadDim);
  *lo = __ldg(row + lane);
  *hi = __ldg(row + lane + 32);
}

// An int32 operand through the read-only cache (AttnCompressedItem's load).
struct LoadReadOnly {
  __device__ __forceinline__ int32_t operator()(const int32_t* p) const { return __ldg(p); }
};

// Counts a dropped item in state.errors when `counts` (one CTA an item counts).
struct CountOnDevice {
  ErrorCounts errors;
  bool counts;
  int64_t t;  // the query's row
  __device__ __forceinline__ void operator()(int err) const {
    if (counts) CountErrorAtomic(errors, err, t);
  }
};

// Whether the call's layer operands are good (BAD_LAYER otherwise).
__device__ __forceinline__ bool AttnLayerOk(const AttentionArgs& a, int64_t* l, int64_t* lk) {
  *l = __ldg(a.layer);
  *lk = __ldg(a.comp_layer);
  return *l >= 0 && *l < a.L && (a.kind == kAttnSwa || (*lk >= 0 && *lk < a.Lk));
}

// The error that drops token (s, p) before its q is looked at, or -1.
__device__ __forceinline__ int AttnTokenError(const AttentionArgs& a, int64_t s, int64_t p) {
  if (s < 0 || s >= a.R) return kBadSlot;
  if (!QueryPositionOk(p, a.MB)) return kBadPosition;
  return -1;
}

// What the first checks of token t found: the layer, its slot and position,
// whether it is live, and the error that drops it (-1: none, or padding).
struct AttnToken {
  int64_t l = 0, lk = 0, s = -1, p = 0;
  bool live = false;
  int err = -1;
};

// The checks every CTA of token t makes first. A bad layer is counted by the
// CTA that `counts_layer` (one per call). False past the last token: T = 0
// still launches one CTA, only to count a bad layer.
__device__ __forceinline__ bool AttnBeginToken(const AttentionArgs& a, int64_t t,
                                               bool counts_layer, AttnToken* k) {
  const bool layer_ok = AttnLayerOk(a, &k->l, &k->lk);
  if (!layer_ok && counts_layer) CountErrorAtomic(a.errors, kBadLayer, kNoRow);
  if (t >= a.T) return false;
  k->s = __ldg(a.slot + t);
  k->p = __ldg(a.pos + t);
  k->live = layer_ok && k->s != -1;
  k->err = k->live ? AttnTokenError(a, k->s, k->p) : -1;
  k->live = k->live && k->err < 0;
  return true;
}

// The chunk rows a query of request s may see. The window sees positions
// p - 127 .. p only, so when the call's good rows of s lie together in row
// order with consecutive positions (as prepare_step lays a chunk out), every
// row a query at row t sees is among rows t - 127 .. t, and the producer
// decides only those; otherwise every chunk row. The candidate items and
// their split among a cluster's CTAs stay the same either way, so the rows
// seen, their order and each CTA's share are the same: this only skips rows
// that cannot be seen, and a call gives the same bits whichever rows it
// finds in one run.
struct AttnChunkRows {
  int64_t first_pos = LLONG_MAX;   // p0 of request s: its smallest good position in the call
  int64_t lo = 0, hi = 0;          // chunk rows lo .. hi - 1 are decided (within the call)
};

// Per CTA scratch of AttnScanChunk: p0, the first and last good row of s,
// their count and the range of pos - row over them.
struct AttnChunkScratch {
  int first_pos, first_row, last_row, count, lag_min, lag_max;
};

// AttnChunkRows of query row t of request s (block-wide: every thread of the
// block calls). Each thread folds its rows in registers and each warp its
// threads by shuffles, so the block's scratch takes one atomic per warp and
// field: every CTA of a prefill call scans all T rows, and per-row shared
// atomics on the same six words serialized the scan behind every query.
__device__ __forceinline__ AttnChunkRows AttnScanChunk(const AttentionArgs& a, int64_t t,
                                                       int64_t s, AttnChunkScratch* sc) {
  AttnChunkRows c;
  if (!a.has_chunk) return c;
  if (threadIdx.x == 0) *sc = AttnChunkScratch{INT_MAX, INT_MAX, -1, 0, INT_MAX, INT_MIN};
  __syncthreads();
  int first_pos = INT_MAX, first_row = INT_MAX, last_row = -1, count = 0;
  int lag_min = INT_MAX, lag_max = INT_MIN;
  for (int64_t r = threadIdx.x; r < a.T; r += blockDim.x) {
    const int64_t rp = __ldg(a.pos + r);
    if (__ldg(a.slot + r) != s || !QueryPositionOk(rp, a.MB)) continue;
    const int lag = static_cast<int>(rp - r);
    first_pos = min(first_pos, static_cast<int>(rp));
    first_row = min(first_row, static_cast<int>(r));
    last_row = max(last_row, static_cast<int>(r));
    ++count;
    lag_min = min(lag_min, lag);
    lag_max = max(lag_max, lag);
  }
  first_pos = __reduce_min_sync(kFull, first_pos);
  first_row = __reduce_min_sync(kFull, first_row);
  last_row = __reduce_max_sync(kFull, last_row);
  count = __reduce_add_sync(kFull, count);
  lag_min = __reduce_min_sync(kFull, lag_min);
  lag_max = __reduce_max_sync(kFull, lag_max);
  if ((threadIdx.x & 31) == 0 && count > 0) {
    atomicMin(&sc->first_pos, first_pos);
    atomicMin(&sc->first_row, first_row);
    atomicMax(&sc->last_row, last_row);
    atomicAdd(&sc->count, count);
    atomicMin(&sc->lag_min, lag_min);
    atomicMax(&sc->lag_max, lag_max);
  }
  __syncthreads();
  const AttnChunkScratch k = *sc;
  c.first_pos = k.first_pos == INT_MAX ? LLONG_MAX : k.first_pos;
  const bool one_run = k.count > 0 && k.last_row - k.first_row + 1 == k.count &&
                       k.lag_min == k.lag_max;
  c.lo = one_run && t - kWindow + 1 > 0 ? t - kWindow + 1 : 0;
  c.hi = one_run ? t + 1 : a.T;
  return c;
}

// Candidate items of a query at position p: the 128 window positions, the
// call's chunk rows, then the CSA picks or the HCA entries it may see.
__device__ __forceinline__ int64_t AttnCandidates(const AttentionArgs& a, int64_t p) {
  const int64_t extra = a.kind == kAttnCsa ? a.K : a.kind == kAttnHca ? HcaVisible(p, a.MB) : 0;
  return kWindow + (a.has_chunk ? a.T : 0) + extra;
}

// The candidate items before `end` worth deciding, as three ranges [lo, hi):
// the window, `chunk`'s rows, the compressed entries.
__device__ __forceinline__ void AttnLiveItems(const AttentionArgs& a, int64_t end,
                                              const AttnChunkRows& chunk, int64_t (*live)[2]) {
  const int64_t after_chunk = kWindow + (a.has_chunk ? a.T : 0);
  live[0][0] = 0;
  live[0][1] = kWindow;
  live[1][0] = kWindow + chunk.lo;
  live[1][1] = kWindow + chunk.hi;
  live[2][0] = after_chunk;
  live[2][1] = end;
}

// Whether item `it` of token t = (s, p) is seen; sets its source and entry
// (or chunk row), and counts a stale window row (one the query needs that
// holds another position), a bad CSA index or a missing block when `counts`
// (one block per item counts). `check_chunk_row` false leaves the
// finiteness of a chunk row to the caller; true reads the encoding pass's
// flag when there is one (a.chunk_finite), else scans the row.
__device__ __forceinline__ bool AttnDecideItem(const AttentionArgs& a, int64_t l, int64_t lk,
                                               int64_t t, int64_t s, int64_t p,
                                               const AttnChunkRows& chunk, int64_t it,
                                               bool counts, bool check_chunk_row, uint8_t* src,
                                               int64_t* e) {
  const int64_t first_pos = chunk.first_pos;
  const int64_t lo = p - kWindow + 1 > 0 ? p - kWindow + 1 : 0;
  if (it < kWindow) {
    const int64_t w = lo + it;
    if (w > p || w >= first_pos) return false;
    *e = AttnRingEntry(a, l, s, w);
    *src = kFromRing;
    const bool held = __ldg(a.swa_pos + *e) == w;
    if (!held && counts) CountErrorAtomic(a.errors, kStaleWindow, t);
    return held;
  }
  it -= kWindow;
  if (a.has_chunk) {
    if (it < a.T) {
      const int64_t rs = __ldg(a.slot + it), rp = __ldg(a.pos + it);
      if (rs != s || !QueryPositionOk(rp, a.MB) || !WindowSees(rp, p)) return false;
      if (check_chunk_row && !(a.chunk_finite != nullptr ? __ldg(a.chunk_finite + it) != 0
                                                        : RowFinite(a.chunk_kv + it * kHeadDim)))
        return false;
      *e = it;
      *src = kFromChunk;
      return true;
    }
    it -= a.T;
  }
  if (!AttnCompressedItem(a, lk, t, s, p, it, LoadReadOnly(), CountOnDevice{a.errors, counts, t}, e))
    return false;
  *src = kFromPool;
  return true;
}

}  // namespace cuda
}  // namespace dsv4
