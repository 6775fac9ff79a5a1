// The flush kernel's block code for CSA and HCA layers, shared by the flush
// kernels (cuda/flush.cu) and write_layer's (cuda/write_layer.cu).
//
// One launch per call. Each request of the call is walked by exactly one
// block: the block that meets the request's first row (rows are dealt to
// blocks grid-stride; a row whose slot appeared in an earlier row is not a
// first row). That block folds the request's tokens in row order, exactly
// the host's order, with one thread per channel holding that channel's
// online-softmax accumulators in registers (threads 0..127 also the
// indexer's). The gating is the host's (ffi/flush.h): the k-th row of the
// request has the expected position p0 + k, and the row whose expected
// position ends window w closes it, dropped or not. A closing row runs the
// epilogue across the block (shared memory for RMSNorm's ordered partial
// sums, RoPE pairs and the Hadamard butterflies) and one warp stores the
// entry. Dropped rows are counted once each, by the block that owns the row
// (bad slot) or the request (bad position, missing block, NaN/Inf).
#pragma once

#include <cuda_runtime.h>

#include "flush.h"
#include "kernels.cuh"

namespace dsv4 {
namespace flush_kernel {

constexpr int kThreads = kHeadDim;  // one thread per channel of an entry

struct FlushShared {
  float x[kHeadDim];    // main entry under its epilogue
  float ix[kIndexDim];  // indexer key under its epilogue
  float ss[2];          // sums of squares (main, index)
  int next_row;         // offset of the request's next row within a searched span
};

// The epilogue of docs/design.md §3 on a d-channel row held one channel per thread
// (threads >= d only take part in the barriers). `v` is this thread's pooled
// value; on return xs[0..d) holds the bf16-valued row to store.
__device__ inline void BlockEpilogue(float v, int d, const float* norm, const float* inv_freq,
                              int64_t pos, float* xs, float* ss) {
  const int c = threadIdx.x;
  const bool active = c < d;
  if (active) {
    v = num::RoundBf16(v);
    xs[c] = v;
  }
  __syncthreads();
  if (c < 32) {
    // the 32 strided partial sums of num::SumSquares, then its halving fold
    float part = 0.f;
    for (int k = c; k < d; k += 32) part = part + xs[k] * xs[k];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) part = part + __shfl_down_sync(cuda::kFull, part, off);
    if (c == 0) *ss = part;
  }
  __syncthreads();
  if (active) {
    const float inv = num::RmsInvFromSumSquares(*ss, d);
    v = num::RoundBf16((v * inv) * __ldg(norm + c));
    xs[c] = v;
  }
  __syncthreads();
  const int r0 = d - kRopeDim;
  const bool rope = active && c >= r0;
  if (rope) {
    const int k = (c - r0) >> 1;
    float y0, y1;
    num::RopePair(xs[r0 + 2 * k], xs[r0 + 2 * k + 1],
                  static_cast<float>(pos) * __ldg(inv_freq + k), &y0, &y1);
    v = num::RoundBf16((c & 1) ? y1 : y0);
  }
  __syncthreads();
  if (rope) xs[c] = v;
  __syncthreads();
}

// Warp 0 stores the main entry held in xs.
__device__ inline void StoreEntry(const EntryPool& pool, int64_t e, const float* xs) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  float lo[8], hi[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    lo[i] = xs[8 * lane + i];
    hi[i] = xs[256 + 8 * lane + i];
  }
  cuda::WarpEncodeEntry(pool, e, lo, hi);
}

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

// Hadamard, bf16 rounding and MXFP4 of the indexer key in ix (threads 0..127
// hold a channel; all threads reach the barriers).
__device__ inline void StoreIndexKey(const FlushArgs& a, int64_t e, float* ix) {
  const int c = threadIdx.x;
  for (int h = 1; h < kIndexDim; h <<= 1) {
    if (c < kIndexDim / 2) {
      const int j = (c / h) * 2 * h + (c % h);
      const float x0 = ix[j], x1 = ix[j + h];
      ix[j] = x0 + x1;
      ix[j + h] = x0 - x1;
    }
    __syncthreads();
  }
  if (c < kIndexDim) StoreMxfp4Block(a, e, c >> 5, ix[c]);
  __syncthreads();
}

// One row's operands for one thread's channel(s), loaded ahead of use:
// score, ape and kv of the half folded into `cur` (b) and into `nxt` (a),
// main and indexer; the row's expected position, whether it gates, the block
// of its window (-1 if missing) and its error (or -1; NaN/Inf decided later).
struct TokenIn {
  int64_t ep = 0, block = -1;
  bool gates = false;
  int err = -1;
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

// Walks the rows of request slot s from its first row t0 on, in row order,
// under the rule of ffi/flush.h (expected positions p0 + k).
template <bool kCsa>
__device__ void WalkRequest(const FlushArgs& a, int64_t l, int64_t s, int64_t t0, FlushShared& sh) {
  const int c = threadIdx.x;
  const CompressorView& mv = a.main;
  const int64_t coff = kCsa ? 2 : 1;
  const int64_t mw = coff * kHeadDim;
  const int64_t m = kCsa ? kCsaRatio : kHcaRatio;
  const Acc3 cur_row{mv.comp + (l * a.R + s) * coff * 3 * kHeadDim, kHeadDim};
  const Acc3 nxt_row{cur_row.base + 3 * kHeadDim, kHeadDim};
  num::SoftmaxAcc cur = cur_row.Load(c), nxt = num::EmptyAcc();
  if (kCsa) nxt = nxt_row.Load(c);
  // indexer (CSA): threads 0..127
  const bool ich = kCsa && c < kIndexDim;
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
  // folded, so the chain slot -> block table -> projections is not paid in
  // full per row. The order of the folds is unchanged.
  //
  // The next row of s from row `from` on (T if none); block-uniform. A
  // request's rows usually follow each other; otherwise the block searches
  // blockDim.x rows a step, so the search past the request's last row costs
  // (T - t) / blockDim.x steps rather than T - t loads per thread.
  auto next_row = [&](int64_t from) -> int64_t {
    if (from >= a.T || __ldg(a.slot + from) == s) return from;
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
  };
  const int64_t limit = GatingLimit(a.max_context, a.MB);
  auto load = [&](int64_t t, int64_t ep) {
    TokenIn in;
    in.ep = ep;
    in.gates = Gates(ep, limit);
    in.err = kBadPosition;
    in.block = -1;
    if (in.gates) {
      const int64_t block = __ldg(a.block_table + s * a.MB + ep / kBlockTokens);
      in.err = GatedRowError(__ldg(a.pos + t), ep, block, a.N);
      if (block >= 0 && block < a.N) in.block = block;
    }
    const int64_t pm = in.gates ? ep % m : 0;
    const float* kv = mv.kv + t * mw;
    const float* sc = mv.score + t * mw;
    const float* ape = mv.ape + pm * mw;
    const int hb = kCsa ? kHeadDim : 0;  // the half folded into `cur`
    in.sb = __ldg(sc + hb + c);
    in.ab = __ldg(ape + hb + c);
    in.vb = __ldg(kv + hb + c);
    if (kCsa) {
      in.sa = __ldg(sc + c);
      in.aa = __ldg(ape + c);
      in.va = __ldg(kv + c);
    }
    if (ich) {
      const float* ikv = a.index.kv + t * iw;
      const float* isc = a.index.score + t * iw;
      const float* iape = a.index.ape + pm * iw;
      in.isb = __ldg(isc + kIndexDim + c);
      in.iab = __ldg(iape + kIndexDim + c);
      in.ivb = __ldg(ikv + kIndexDim + c);
      in.isa = __ldg(isc + c);
      in.iaa = __ldg(iape + c);
      in.iva = __ldg(ikv + c);
    }
    return in;
  };
  bool touched = false;
  int64_t t = t0;  // t0 is the first row of s
  TokenIn in = load(t, static_cast<int64_t>(__ldg(a.pos + t0)));
  while (t < a.T) {
    const int64_t tn = next_row(t + 1);
    TokenIn nin;
    if (tn < a.T) nin = load(tn, in.ep + 1);
    const TokenIn cin = in;
    t = tn;
    in = nin;
    if (!cin.gates) {  // expected position outside [0, max_context): nothing to close
      if (c == 0) atomicAdd(&a.errors[kBadPosition], 1);
      continue;
    }
    touched = true;
    bool fold = cin.err < 0;
    if (!fold) {
      if (c == 0) atomicAdd(&a.errors[cin.err], 1);
    } else {
      // NaN/Inf anywhere in the row's inputs drops it: each thread checks the
      // channels it loaded, the block decides together (cin.err is uniform).
      bool bad = !(num::IsFinite(cin.sb) && num::IsFinite(cin.vb));
      if (kCsa) bad = bad || !(num::IsFinite(cin.sa) && num::IsFinite(cin.va));
      if (ich) {
        bad = bad || !(num::IsFinite(cin.isb) && num::IsFinite(cin.ivb) &&
                       num::IsFinite(cin.isa) && num::IsFinite(cin.iva));
      }
      if (__syncthreads_or(bad)) {
        if (c == 0) atomicAdd(&a.errors[kNonfinite], 1);
        fold = false;
      }
    }
    if (fold) {
      cur = num::AccumulateAcc(cur, cin.sb + cin.ab, cin.vb);
      if (kCsa) nxt = num::AccumulateAcc(nxt, cin.sa + cin.aa, cin.va);
      if (ich) {
        icur = num::AccumulateAcc(icur, cin.isb + cin.iab, cin.ivb);
        inxt = num::AccumulateAcc(inxt, cin.isa + cin.iaa, cin.iva);
      }
    }
    if (cin.ep % m != m - 1) continue;
    // The row's expected position ends window w: it closes, dropped row or not.
    const int64_t w = cin.ep / m;
    const float pooled = num::FinalizeAcc(cur);
    float ipooled = 0.f;
    if (kCsa) {
      cur = nxt;
      nxt = num::EmptyAcc();
    } else {
      cur = num::EmptyAcc();
    }
    if (ich) {
      ipooled = num::FinalizeAcc(icur);
      icur = inxt;
      inxt = num::EmptyAcc();
    }
    if (cin.block < 0) continue;  // no block to store the entry in (block-uniform)
    const int64_t e = (l * a.N + cin.block) * a.per_block + w % a.per_block;
    BlockEpilogue(pooled, kHeadDim, mv.norm, mv.inv_freq, w * m, sh.x, &sh.ss[0]);
    StoreEntry(a.pool, e, sh.x);
    if (kCsa) {
      BlockEpilogue(ipooled, kIndexDim, a.index.norm, a.index.inv_freq, w * m, sh.ix, &sh.ss[1]);
      StoreIndexKey(a, e, sh.ix);  // ends with a barrier
    } else {
      __syncthreads();  // StoreEntry read sh.x
    }
  }
  if (!touched) return;
  cur_row.Store(c, cur);
  if (kCsa) nxt_row.Store(c, nxt);
  if (ich) {
    icur_row.Store(c, icur);
    inxt_row.Store(c, inxt);
  }
}

// The flush of one block: requests are found by their first rows, dealt to
// the role's `blocks` blocks grid-stride (`block` is this one's index).
template <bool kCsa>
__device__ void FlushBlock(const FlushArgs& a, unsigned block, unsigned blocks, FlushShared& sh) {
  cuda::WaitForPrevious();  // everything below reads what earlier kernels wrote
  int64_t l;
  if (!cuda::LayerOkCountedBy(block == 0, a.layer, a.L, a.errors, &l)) return;
  for (int64_t t0 = block; t0 < a.T; t0 += blocks) {
    const int64_t s = __ldg(a.slot + t0);
    if (s == -1) continue;
    if (s < 0 || s >= a.R) {
      if (threadIdx.x == 0) atomicAdd(&a.errors[kBadSlot], 1);
      continue;
    }
    // Is t0 the first row of request s? (block-uniform)
    if (t0 > 0 && __ldg(a.slot + t0 - 1) == s) continue;
    int seen = 0;
    for (int64_t i = threadIdx.x; i < t0; i += blockDim.x) seen |= __ldg(a.slot + i) == s;
    if (__syncthreads_or(seen)) continue;
    WalkRequest<kCsa>(a, l, s, t0, sh);
  }
}

// Blocks of a flush launch (or of write_layer's flush role).
inline unsigned FlushGrid(int64_t T) { return cuda::GridFor(T, 1, 2); }

}  // namespace flush_kernel
}  // namespace dsv4
