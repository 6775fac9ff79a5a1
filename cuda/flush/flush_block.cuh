// The flush kernel's block code for CSA and HCA layers, shared by the flush
// kernels (cuda/flush/flush.cu) and write_layer's (cuda/write_layer/write_layer.cu).
//
// One launch per call. Each request of the call is walked by exactly one
// block: the block that meets the request's first row (rows are dealt to
// blocks grid-stride; a row whose slot appeared in an earlier row is not a
// first row). That block folds the request's tokens in row order, exactly
// the host's order, with one thread per channel holding that channel's
// online-softmax accumulators in registers (threads 0..127 also the
// indexer's). The gating is the host's (ffi/include/dsv4/flush.h): the k-th row of the
// request has the expected position p0 + k, and the row whose expected
// position ends window w closes it, dropped or not. A closing row runs the
// epilogue across the block (BlockCloseEntry: the main entry and the indexer
// key side by side, four block barriers) and one warp stores the entry.
// Dropped rows are counted once each, by the block that owns the row (bad
// slot; block 0 where requests are dealt by rank) or the request (bad
// position, missing block, NaN/Inf).
//
// A decode-sized call (T <= kThreads rows) takes each row's slot in one load
// a thread: the rows of a request are a bitmask (MaskRows). Where such a call
// has more rows than the grid has blocks (a verify or commit step: up to
// 1 + k rows a request), requests are dealt by the rank of their first rows
// instead (WalkRanked), so every request is walked in the grid's one wave;
// dealt by row, one block could meet several first rows while others meet
// none. The block
// issues the request's accumulator and first-row loads before it agrees that
// the row is the request's first, so its chain is two rounds of loads, the
// row's vote and the epilogue. Larger calls search for the rows (SearchRows).
// The epilogue's norm weights and RoPE frequencies are read with the first
// round, and a walk stores the accumulators it leaves as soon as its last row
// is folded, before that row's epilogue, so neither waits at the chain's end.
//
// A CSA request's walk may also be split in two (Part): the main entry in
// one block, the indexer key in another (write_layer at decode sizes), each
// folding, closing and storing only its own accumulators, so the main
// entry's chain is as long as an HCA layer's and the key's runs beside it.
#pragma once

#include <cuda_runtime.h>

#include "common/bf16_chunks.cuh"
#include "common/entry_warp.cuh"
#include "common/launch.cuh"
#include "common/layer_checks.cuh"
#include "dsv4/flush.h"

namespace dsv4 {
namespace flush_kernel {

constexpr int kThreads = kHeadDim;  // one thread per channel of an entry

// What a walk computes. kAll: the main entry and, CSA, the indexer key, in
// one block. kMain / kIndex: one of the two, the request's other part walked
// by another block. Every part loads the row values that decide a drop (a
// NaN/Inf anywhere in a row drops it for both), so both decide every row the
// same way; only the parts that hold the main entry count the dropped rows.
enum class Part : int { kAll, kMain, kIndex };

// Whether part p closes the main entry (and counts), and the indexer key.
__host__ __device__ constexpr bool HasEntry(Part p) { return p != Part::kIndex; }
__host__ __device__ constexpr bool HasKey(bool csa, Part p) { return csa && p != Part::kMain; }

struct FlushShared {
  alignas(16) float x[kHeadDim];  // main entry under its epilogue (WalkRanked: the call's slots first)
  float ix[kIndexDim];  // indexer key under its epilogue
  float ss[2];          // sums of squares (main, index)
  int next_row;         // offset of the request's next row within a searched span
  uint32_t rows[kThreads / 32];  // MaskRows: bit t of the request's rows
  int first_rows[kThreads / 32]; // WalkRanked: first rows of requests, a count per warp
  // The epilogue's parameters, each written and read by its channel's thread
  // (StageChannelParams): RMSNorm weights and the RoPE channels' inverse
  // frequencies, main and indexer.
  float norm[kHeadDim], inorm[kIndexDim], freq[kRopeDim], ifreq[kRopeDim];
};

// MXFP4 block `blk` (channels 32 blk .. 32 blk + 31) of indexer key e, a
// warp's lanes holding one channel each (its Hadamard output x): bf16
// rounding, the block's scale byte, two codes a byte.
__device__ inline void StoreMxfp4Block(const FlushArgs& a, int64_t e, int blk, float x) {
  const int lane = threadIdx.x & 31;
  const float v = num::RoundBf16(x * num::HadamardScale());
  float amax = num::AmaxWith(num::Mxfp4AmaxFloor(), v);
#pragma unroll
  for (int off = 1; off < 32; off <<= 1)
    amax = num::MaxF(amax, __shfl_xor_sync(cuda::kFull, amax, off));
  const uint8_t sb = num::Mxfp4ScaleByte(amax);
  const uint32_t code = num::Mxfp4Encode(v, num::E8m0Inverse(sb));
  const uint32_t odd = __shfl_down_sync(cuda::kFull, code, 1);
  if ((lane & 1) == 0)
    a.index_packed[e * kIndexPacked + 16 * blk + (lane >> 1)] =
        static_cast<uint8_t>(code | (odd << 4));
  if (lane == 0) a.index_scale[e * kIndexScales + blk] = sb;
}

// The sum of squares of xs[0..d) in the documented order (32 strided
// partial sums, then the halving fold), num::SumSquares' value;
// every lane gets it.
__device__ __forceinline__ float WarpSumSquares(const float* xs, int d) {
  const int lane = threadIdx.x & 31;
  float part = 0.f;
  for (int k = lane; k < d; k += 32) part = part + xs[k] * xs[k];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) part = part + __shfl_down_sync(cuda::kFull, part, off);
  return __shfl_sync(cuda::kFull, part, 0);
}

// ---- the epilogue, main entry and indexer key together ------------------------------
// The RoPE step of a channel held one a lane (channel c on lane c mod 32):
// channels c and c ^ 1 form a pair in one warp, so the partner's value comes
// by a shuffle. `rope` must be the same for the whole warp (the RoPE
// channels are whole warps: from 448 of 512 and 64 of 128).
// The RoPE channels are c >= r0; `freq[c - r0]` is channel c's inverse
// frequency (FlushShared, staged by its own thread).
__device__ __forceinline__ float LaneRope(float v, int c, int r0, int64_t pos,
                                          const float* freq) {
  if (c < r0) return v;
  const float other = __shfl_xor_sync(cuda::kFull, v, 1);
  const bool odd = c & 1;
  float y0, y1;
  num::RopePair(odd ? other : v, odd ? v : other, static_cast<float>(pos) * freq[c - r0], &y0,
                &y1);
  return num::RoundBf16(odd ? y1 : y0);
}

// Thread c copies the epilogue's parameters of its channels (main channel c
// and, CSA, c < kIndexDim, indexer channel c, as part kPart needs them) into
// sh, where only it reads them: so they are read from global memory once, at
// the start of a walk, not between the epilogue's barriers, and hold no
// registers meanwhile.
template <bool kCsa, Part kPart>
__device__ __forceinline__ void StageChannelParams(const FlushArgs& a, FlushShared& sh) {
  const int c = threadIdx.x;
  constexpr int r0 = kHeadDim - kRopeDim, ir0 = kIndexDim - kRopeDim;
  if (HasEntry(kPart)) {
    sh.norm[c] = __ldg(a.main.norm + c);
    if (c >= r0) sh.freq[c - r0] = __ldg(a.main.inv_freq + ((c - r0) >> 1));
  }
  if (HasKey(kCsa, kPart) && c < kIndexDim) {
    sh.inorm[c] = __ldg(a.index.norm + c);
    if (c >= ir0) sh.ifreq[c - ir0] = __ldg(a.index.inv_freq + ((c - ir0) >> 1));
  }
}

// The warp that stores the main entry while warps 0-3 make the indexer key.
constexpr int kStoreWarp = kIndexDim / 32;
// Named barrier of the indexer key's four warps (0 is __syncthreads').
constexpr int kIndexBarrier = 1;

// The epilogue of docs/design/semantics.md (and, CSA, the indexer key's with its
// Hadamard step) and the stores, for entry e at position pos: thread c holds
// the pooled value v of channel c and, c < 128, iv of the indexer key's
// channel c; `kPart` says which of the two this block closes (v or iv is
// then unused). The thread's StageChannelParams come before. The two rows
// share the barriers: rounding, then both sums of squares (warps 0 and 1),
// then norm and RoPE (pairs by shuffles). The
// Hadamard butterflies of strides 1-16 are shuffles, those of 32 and 64 one
// exchange among warps 0-3; warp kStoreWarp encodes the entry meanwhile.
// The same arithmetic in the same order as the host's (ffi/include/dsv4/flush.h).
// Every thread of the block calls it; it ends with a barrier, so sh is free.
template <bool kCsa, Part kPart>
__device__ void BlockCloseEntry(const FlushArgs& a, int64_t e, float v, float iv, int64_t pos,
                                FlushShared& sh) {
  constexpr bool kEntry = HasEntry(kPart), kKey = HasKey(kCsa, kPart);
  const int c = threadIdx.x, warp = c >> 5;
  const bool ich = kKey && c < kIndexDim;
  if (kEntry) {
    v = num::RoundBf16(v);
    sh.x[c] = v;
  }
  if (ich) {
    iv = num::RoundBf16(iv);
    sh.ix[c] = iv;
  }
  __syncthreads();
  if (kEntry && warp == 0) {
    const float ss = WarpSumSquares(sh.x, kHeadDim);
    if (c == 0) sh.ss[0] = ss;
  } else if (kKey && warp == 1) {
    const float ss = WarpSumSquares(sh.ix, kIndexDim);
    if (c == 32) sh.ss[1] = ss;
  }
  __syncthreads();
  if (kEntry) {
    v = num::RoundBf16((v * num::RmsInvFromSumSquares(sh.ss[0], kHeadDim)) * sh.norm[c]);
    v = LaneRope(v, c, kHeadDim - kRopeDim, pos, sh.freq);
    sh.x[c] = v;
  }
  if (ich) {
    iv = num::RoundBf16((iv * num::RmsInvFromSumSquares(sh.ss[1], kIndexDim)) * sh.inorm[c]);
    iv = LaneRope(iv, c, kIndexDim - kRopeDim, pos, sh.ifreq);
  }
  __syncthreads();
  if (kEntry && warp == kStoreWarp) {
    const int lane = c & 31;
    float lo[8], hi[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      lo[i] = sh.x[8 * lane + i];
      hi[i] = sh.x[256 + 8 * lane + i];
    }
    cuda::WarpEncodeEntry(a.pool, e, lo, hi);
  }
  if (ich) {
    // Hadamard: stages 1..16 within the warp (the lower channel of a pair
    // keeps x0 + x1, the upper x0 - x1), then 32 and 64 across the warps
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {
      const float other = __shfl_xor_sync(cuda::kFull, iv, h);
      iv = (c & h) ? other - iv : iv + other;
    }
    sh.ix[c] = iv;  // sh.ix was last read before the second barrier
    asm volatile("bar.sync %0, %1;" ::"n"(kIndexBarrier), "n"(kIndexDim) : "memory");
    const int lane = c & 31;
    const float a0 = sh.ix[lane], a1 = sh.ix[lane + 32], a2 = sh.ix[lane + 64],
                a3 = sh.ix[lane + 96];
    const float b0 = a0 + a1, b1 = a0 - a1, b2 = a2 + a3, b3 = a2 - a3;   // stride 32
    const float h = warp == 0 ? b0 + b2 : warp == 1 ? b1 + b3 : warp == 2 ? b0 - b2 : b1 - b3;
    StoreMxfp4Block(a, e, warp, h);
  }
  __syncthreads();
}

// One row's operands for one thread's channel(s), loaded ahead of use:
// score, ape and kv of the half folded into `cur` (b) and into `nxt` (a),
// main and indexer; the row's expected position, whether it gates, and the
// block-table entry of its window and its position as loaded: its error and
// block are decided where the row is folded, so that no load of the row
// waits for another.
struct TokenIn {
  int64_t ep = 0;
  int32_t table = -1, pos = 0;  // as loaded: widened only where used
  bool gates = false;
  float sb = 0.f, ab = 0.f, vb = 0.f, sa = 0.f, aa = 0.f, va = 0.f;
  float isb = 0.f, iab = 0.f, ivb = 0.f, isa = 0.f, iaa = 0.f, iva = 0.f;
};

struct Acc3 {
  float* base;  // rows max, sum, kv of one accumulator, width d
  int d;
  __device__ num::SoftmaxAcc Load(int c) const {
    return num::SoftmaxAcc{base[c], base[d + c], base[2 * d + c]};
  }
  __device__ void Store(int c, num::SoftmaxAcc v) const {
    base[c] = v.m;
    base[d + c] = v.s;
    base[2 * d + c] = v.kv;
  }
};

// How WalkRequest finds a request's rows. Both give the next row of slot s
// at or after `from` (T if none), block-uniform, and whether the walk's
// first row t0 is the request's first row.
//
// SearchRows: any T. The caller has found t0 to be the first row. A
// request's rows usually follow each other; otherwise the block searches
// blockDim.x rows a step, so the search past the request's last row costs
// (T - t) / blockDim.x steps rather than T - t loads per thread.
struct SearchRows {
  const FlushArgs& a;
  int64_t s;
  FlushShared& sh;
  __device__ bool First(int64_t) const { return true; }
  __device__ int64_t Next(int64_t from) const {
    if (from >= a.T || __ldg(a.slot + from) == s) return from;
    const int c = threadIdx.x;
    for (int64_t base = from + 1; base < a.T; base += blockDim.x) {
      if (c == 0) sh.next_row = static_cast<int>(blockDim.x);
      const int64_t i = base + c;
      const bool hit = i < a.T && __ldg(a.slot + i) == s;
      if (!__syncthreads_or(hit)) continue;
      if (hit) atomicMin(&sh.next_row, c);
      __syncthreads();
      const int64_t found = base + sh.next_row;
      __syncthreads();  // read before a later search resets it
      return found;
    }
    return a.T;
  }
};

// MaskRows: T <= kThreads; `my_slot` is row threadIdx.x's slot (-1 past T).
// First() publishes the request's rows as a bitmask (one barrier), Next()
// reads it.
struct MaskRows {
  const FlushArgs& a;
  int64_t s;
  FlushShared& sh;
  int32_t my_slot;
  __device__ bool First(int64_t t0) const {
    const uint32_t mine = __ballot_sync(cuda::kFull, my_slot == s);
    if ((threadIdx.x & 31) == 0) sh.rows[threadIdx.x >> 5] = mine;
    __syncthreads();
    const int w0 = static_cast<int>(t0 >> 5);
    bool earlier = (sh.rows[w0] & ((1u << (t0 & 31)) - 1u)) != 0u;
    for (int w = 0; w < w0; ++w) earlier = earlier || sh.rows[w] != 0u;
    return !earlier;
  }
  __device__ int64_t Next(int64_t from) const {
    for (int64_t w = from >> 5; w < (a.T + 31) >> 5; ++w) {
      const uint32_t bits = sh.rows[w] & (w == (from >> 5) ? ~0u << (from & 31) : ~0u);
      if (bits != 0u) return (w << 5) + __ffs(bits) - 1;
    }
    return a.T;
  }
};

// Walks the rows of request slot s from row t0 (position p0) on, in row
// order, under the rule of ffi/include/dsv4/flush.h (expected positions p0 + k): the
// request's accumulators and t0's operands are loaded first, then `rows`
// decides whether t0 is the request's first row (else nothing happens).
// `kPart` says which accumulators the walk folds, closes and stores; the
// thread's StageChannelParams for that part come before.
template <bool kCsa, Part kPart, typename Rows>
__device__ void WalkRequest(const FlushArgs& a, int64_t l, int64_t s, int64_t t0, int64_t p0,
                            FlushShared& sh, const Rows& rows) {
  constexpr bool kEntry = HasEntry(kPart), kKey = HasKey(kCsa, kPart);
  const int c = threadIdx.x;
  const CompressorView& mv = a.main;
  const int64_t coff = kCsa ? 2 : 1;
  const int64_t mw = coff * kHeadDim;
  const int64_t m = kCsa ? kCsaRatio : kHcaRatio;
  const Acc3 cur_row{mv.comp + (l * a.R + s) * coff * 3 * kHeadDim, kHeadDim};
  const Acc3 nxt_row{cur_row.base + 3 * kHeadDim, kHeadDim};
  num::SoftmaxAcc cur = num::EmptyAcc(), nxt = num::EmptyAcc();
  if (kEntry) cur = cur_row.Load(c);
  if (kEntry && kCsa) nxt = nxt_row.Load(c);
  // indexer (CSA): threads 0..127 read its row values (every part: they
  // decide a drop) and, with the key, fold its accumulators
  const bool irow = kCsa && c < kIndexDim;
  const bool ich = kKey && c < kIndexDim;
  const int64_t iw = 2 * kIndexDim;
  Acc3 icur_row{nullptr, kIndexDim}, inxt_row{nullptr, kIndexDim};
  num::SoftmaxAcc icur = num::EmptyAcc(), inxt = num::EmptyAcc();
  if (ich) {
    icur_row.base = a.index.comp + (l * a.R + s) * 2 * 3 * kIndexDim;
    inxt_row.base = icur_row.base + 3 * kIndexDim;
    icur = icur_row.Load(c);
    inxt = inxt_row.Load(c);
  }
  // Software pipeline: the next row of this request is found and its
  // inputs loaded (addresses always in bounds) before the current row is
  // folded, its block-table entry and position beside its projections (the
  // verdict that needs them waits for the fold), so a row costs one round of
  // loads, overlapped with the row before. The order of the folds is unchanged.
  const int64_t limit = GatingLimit(a.max_context, a.MB);
  auto load = [&](int64_t t, int64_t ep) {
    TokenIn in;
    in.ep = ep;
    in.gates = Gates(ep, limit);
    if (in.gates) {
      in.table = __ldg(a.block_table + s * a.MB + ep / kBlockTokens);
      in.pos = __ldg(a.pos + t);
    }
    const int64_t pm = in.gates ? ep % m : 0;
    const float* kv = mv.kv + t * mw;
    const float* sc = mv.score + t * mw;
    const float* ape = mv.ape + pm * mw;
    const int hb = kCsa ? kHeadDim : 0;  // the half folded into `cur`
    in.sb = __ldg(sc + hb + c);
    in.vb = __ldg(kv + hb + c);
    if (kEntry) in.ab = __ldg(ape + hb + c);
    if (kCsa) {
      in.sa = __ldg(sc + c);
      in.va = __ldg(kv + c);
      if (kEntry) in.aa = __ldg(ape + c);
    }
    if (irow) {
      const float* ikv = a.index.kv + t * iw;
      const float* isc = a.index.score + t * iw;
      in.isb = __ldg(isc + kIndexDim + c);
      in.ivb = __ldg(ikv + kIndexDim + c);
      in.isa = __ldg(isc + c);
      in.iva = __ldg(ikv + c);
    }
    if (ich) {
      const float* iape = a.index.ape + pm * iw;
      in.iab = __ldg(iape + kIndexDim + c);
      in.iaa = __ldg(iape + c);
    }
    return in;
  };
  // the accumulators the walk leaves
  auto store = [&] {
    if (kEntry) cur_row.Store(c, cur);
    if (kEntry && kCsa) nxt_row.Store(c, nxt);
    if (ich) {
      icur_row.Store(c, icur);
      inxt_row.Store(c, inxt);
    }
  };
  bool touched = false, stored = false;
  int64_t t = t0;
  TokenIn in = load(t, p0);
  if (!rows.First(t0)) return;  // block-uniform; the loads above are wasted
  while (t < a.T) {
    const int64_t tn = rows.Next(t + 1);
    TokenIn nin;
    if (tn < a.T) nin = load(tn, in.ep + 1);
    const TokenIn cin = in;
    const int64_t ct = t;  // cin's row
    t = tn;
    in = nin;
    if (!cin.gates) {  // expected position outside [0, max_context): nothing to close
      if (kEntry && c == 0) cuda::CountErrorAtomic(a.errors, kBadPosition, ct);
      continue;
    }
    touched = true;
    const int err = GatedRowError(cin.pos, cin.ep, cin.table, a.N);  // or -1
    const int64_t block = cin.table >= 0 && cin.table < a.N ? cin.table : -1;
    bool fold = err < 0;
    if (!fold) {
      if (kEntry && c == 0) cuda::CountErrorAtomic(a.errors, err, ct);
    } else {
      // NaN/Inf anywhere in the row's inputs drops it: each thread checks the
      // channels it loaded, the block decides together (err is uniform).
      bool bad = !(num::IsFinite(cin.sb) && num::IsFinite(cin.vb));
      if (kCsa) bad = bad || !(num::IsFinite(cin.sa) && num::IsFinite(cin.va));
      if (irow) {
        bad = bad || !(num::IsFinite(cin.isb) && num::IsFinite(cin.ivb) &&
                       num::IsFinite(cin.isa) && num::IsFinite(cin.iva));
      }
      if (__syncthreads_or(bad)) {
        if (kEntry && c == 0) cuda::CountErrorAtomic(a.errors, kNonfinite, ct);
        fold = false;
      }
    }
    if (fold) {
      if (kEntry) cur = num::AccumulateAcc(cur, cin.sb + cin.ab, cin.vb);
      if (kEntry && kCsa) nxt = num::AccumulateAcc(nxt, cin.sa + cin.aa, cin.va);
      if (ich) {
        icur = num::AccumulateAcc(icur, cin.isb + cin.iab, cin.ivb);
        inxt = num::AccumulateAcc(inxt, cin.isa + cin.iaa, cin.iva);
      }
    }
    if (cin.ep % m != m - 1) continue;
    // The row's expected position ends window w: it closes, dropped row or not.
    const int64_t w = cin.ep / m;
    float pooled = 0.f, ipooled = 0.f;
    if (kEntry) {
      pooled = num::FinalizeAcc(cur);
      cur = kCsa ? nxt : num::EmptyAcc();
      nxt = num::EmptyAcc();
    }
    if (ich) {
      ipooled = num::FinalizeAcc(icur);
      icur = inxt;
      inxt = num::EmptyAcc();
    }
    if (t >= a.T) {  // the walk's last row: its stores go out under the epilogue
      store();
      stored = true;
    }
    if (block < 0) continue;  // no block to store the entry in (block-uniform)
    const int64_t e = (l * a.N + block) * a.per_block + w % a.per_block;
    BlockCloseEntry<kCsa, kPart>(a, e, pooled, ipooled, w * m, sh);
  }
  if (touched && !stored) store();
}

// A decode-sized call's requests (T <= kThreads rows; `my_slot` is row
// threadIdx.x's slot, -1 past T) dealt to `blocks` blocks by the rank of
// their first rows: this block walks the requests ranked block, block +
// blocks, ... A row is a first row when no earlier row has its slot: its
// warp's lanes are matched, then the slots of the warps before it read from
// a staged copy. Bad slots (not padding) are counted by block 0.
template <bool kCsa, Part kPart>
__device__ void WalkRanked(const FlushArgs& a, int64_t l, unsigned block, unsigned blocks,
                           FlushShared& sh, int32_t my_slot) {
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const bool valid = my_slot >= 0 && my_slot < a.R;
  if (HasEntry(kPart) && block == 0)  // block-uniform: every lane of each warp counts
    cuda::WarpCount(a.errors, kBadSlot, my_slot != -1 && !valid, t);
  // the staged slots live in the epilogue's buffer until the first walk
  int32_t* slots_s = reinterpret_cast<int32_t*>(sh.x);
  static_assert(kHeadDim >= kThreads, "a slot a thread in sh.x");
  slots_s[t] = my_slot;
  const unsigned same = __match_any_sync(cuda::kFull, my_slot);
  bool first = valid && __ffs(same) - 1 == lane;
  __syncthreads();
  if (first) {
    const int4* s4 = reinterpret_cast<const int4*>(slots_s);
    for (int i = 0; i < 8 * warp; ++i) {
      const int4 v = s4[i];
      first = first && v.x != my_slot && v.y != my_slot && v.z != my_slot && v.w != my_slot;
    }
  }
  const unsigned firsts = __ballot_sync(cuda::kFull, first);
  if (lane == 0) sh.first_rows[warp] = __popc(firsts);
  __syncthreads();
  int rank = __popc(firsts & ((1u << lane) - 1u)), total = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    const int n = sh.first_rows[w];
    rank += w < warp ? n : 0;
    total += n;
  }
  for (int r = static_cast<int>(block); r < total; r += static_cast<int>(blocks)) {
    __syncthreads();  // the last walk is done with sh.next_row and sh.rows
    if (first && rank == r) sh.next_row = t;
    __syncthreads();
    const int64_t t0 = sh.next_row;
    const int64_t s = __ldg(a.slot + t0);
    WalkRequest<kCsa, kPart>(a, l, s, t0, __ldg(a.pos + t0), sh, MaskRows{a, s, sh, my_slot});
  }
}

// The flush of one block: requests are found by their first rows, dealt to
// the role's `blocks` blocks grid-stride (`block` is this one's index); the
// block computes part `kPart` of each (another role's blocks the rest).
// A call of at most kThreads rows (decode) finds a request's rows by
// MaskRows, and every load that needs only row indices (the layer, the
// call's slots, t0's slot and position, the epilogue's parameters) is issued
// before the layer check.
template <bool kCsa, Part kPart = Part::kAll>
__device__ void FlushBlock(const FlushArgs& a, unsigned block, unsigned blocks, FlushShared& sh) {
  constexpr bool kCounts = HasEntry(kPart);
  cuda::WaitForPrevious();  // everything below reads what earlier kernels wrote
  cuda::LetNextStart();     // a kernel launched overlapped after this one waits
  const bool masked = a.T <= kThreads;
  const int32_t my_slot =
      masked && threadIdx.x < a.T ? __ldg(a.slot + threadIdx.x) : int32_t{-1};
  const int64_t first = block;
  const int64_t s_first = first < a.T ? __ldg(a.slot + first) : -1;
  const int64_t p_first = first < a.T ? __ldg(a.pos + first) : 0;
  StageChannelParams<kCsa, kPart>(a, sh);
  int64_t l;
  if (!cuda::LayerOkCountedBy(kCounts && block == 0, a.layer, a.L, a.errors, &l)) return;
  if (masked && a.T > blocks) return WalkRanked<kCsa, kPart>(a, l, block, blocks, sh, my_slot);
  for (int64_t t0 = first; t0 < a.T; t0 += blocks) {
    if (masked && t0 != first) __syncthreads();  // the last walk's reads of sh.rows are done
    const int64_t s = t0 == first ? s_first : __ldg(a.slot + t0);
    if (s == -1) continue;
    if (s < 0 || s >= a.R) {
      if (kCounts && threadIdx.x == 0) cuda::CountErrorAtomic(a.errors, kBadSlot, t0);
      continue;
    }
    if (masked) {
      const int64_t p0 = t0 == first ? p_first : __ldg(a.pos + t0);
      WalkRequest<kCsa, kPart>(a, l, s, t0, p0, sh, MaskRows{a, s, sh, my_slot});
      continue;
    }
    // Is t0 the first row of request s? (block-uniform)
    if (t0 > 0 && __ldg(a.slot + t0 - 1) == s) continue;
    int seen = 0;
    for (int64_t i = threadIdx.x; i < t0; i += blockDim.x) seen |= __ldg(a.slot + i) == s;
    if (__syncthreads_or(seen)) continue;
    WalkRequest<kCsa, kPart>(a, l, s, t0, __ldg(a.pos + t0), sh, SearchRows{a, s, sh});
  }
}

// Blocks of a flush launch (or of write_layer's flush role): up to two a
// multiprocessor, and a decode-sized call (T <= kThreads) at most `wave`, the
// blocks that run at once beside the rest of the launch, its requests then
// dealt to them by rank (WalkRanked) so that none waits for a second wave.
inline unsigned FlushGrid(int64_t T, int64_t wave) {
  const unsigned grid = cuda::GridFor(T, 1, 2);
  if (T > kThreads || grid <= wave) return grid;
  return static_cast<unsigned>(wave < 1 ? 1 : wave);
}

}  // namespace flush_kernel
}  // namespace dsv4
