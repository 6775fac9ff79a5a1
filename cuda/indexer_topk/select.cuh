// indexer_topk's top-k select: BlockTopK, a block-level routine, and its kernel SelectKernel.
//
// BlockTopK orders a row of rank keys (dsv4/indexer.h: 0 = no candidate) by
// one block of kSelectThreads threads, its keys in registers when they fit
// (kRegKeys a thread), or by a cluster of blocks, each holding a chunk: a
// histogram of the keys' top 12 bits finds the bin of the K-th largest key.
// In the usual case (no bin holding taken keys has more than kRankBinMax)
// one pass drops the keys above that bin into groups by bin and gathers the
// bin's keys, and each key's place is the count of keys above it in its
// group (RankInBins): that orders them (key descending, index ascending) and
// picks the bin's largest without a sort. Else, when the K-th key's bin
// holds at most a key a thread, radix passes among the gathered ones find the
// K-th key; else radix passes of 8 bits below the bin's prefix over the bin's
// keys (or all keys). The keys above it and those equal to it are collected
// (in index order when they overflow the buffer); a bitonic sort (shuffles
// within a warp, shared memory across) orders them.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/bf16_chunks.cuh"
#include "common/launch.cuh"
#include "common/layer_checks.cuh"
#include "dsv4/indexer_topk.h"
#include "indexer_topk/launch_policy.h"
#include "indexer_topk/select_keys.cuh"
#include "indexer_topk/select_order.cuh"
#include "indexer_topk/select_radix.cuh"
#include "indexer_topk/token.cuh"

namespace dsv4 {
namespace indexer {
namespace {  // internal linkage: see cuda/indexer_topk/indexer_topk.cu

namespace cg = cooperative_groups;

constexpr int kMaxK = 4096;         // the selection is sorted in shared memory
constexpr int kTopCopies = 4;       // lane L counts into copy L mod 4
constexpr int kBinKeysCap = kTopCopies * kTopBins;   // keys of one bin, in the same space
// The select orders its keys by rank within their top-bits bins (RankInBins)
// while no bin that holds taken keys has more than this many: each key then
// costs at most this many comparisons, about what the bitonic sort costs.
constexpr int kRankBinMax = 512;

// Dynamic shared memory of a select of K <= kp = 2^j keys: kp composite keys
// (2 kp when kp <= threads, SortOnePerThread's two buffers), then the
// top-bits histograms.
DSV4_HD constexpr size_t SelectDynamicBytes(int kp) {
  return (kp <= kSelectThreads ? 2 : 1) * kp * sizeof(unsigned long long) +
         kTopCopies * kTopBins * sizeof(int);
}
// The most any K <= kMaxK needs.
constexpr size_t kSelectMaxDynamicBytes = std::max(2 * kSelectThreads, kMaxK) *
                                              sizeof(unsigned long long) +
                                          kTopCopies * kTopBins * sizeof(int);

// With kCluster the select's CTAs of one token form a cluster of `ctas`.
// Each holds a contiguous chunk of the token's keys; rank 0, the leader,
// finishes the selection with what the others hand it through distributed
// shared memory. Without, a lone CTA (ctas = 1) works on its own shared
// memory, whose atomics the compiler then knows to be shared-memory ones.
template <bool kCluster>
__device__ __forceinline__ void SelectSync() {
  if (kCluster) cg::this_cluster().sync();   // release / acquire across the cluster
  else __syncthreads();
}
// Where `p` (this CTA's shared memory) lies in CTA `rank` of the cluster.
template <bool kCluster, typename T>
__device__ __forceinline__ T* InCta(T* p, int rank) {
  if constexpr (kCluster) return cg::this_cluster().map_shared_rank(p, rank);
  else return p;
}

// Clears the dynamic shared memory BlockTopK starts from: `sel`, its
// SelectDynamicBytes(kp) bytes. It reads no key, so a kernel may call it
// before it waits for them. Every thread of the block calls it.
__device__ __forceinline__ void ClearSelectBuffers(unsigned long long* sel, int kp) {
  const int sel_words = kp <= kSelectThreads ? 2 * kp : kp;
  int* top_hist = reinterpret_cast<int*>(sel + sel_words);   // kTopCopies x kTopBins
  for (int b = threadIdx.x; b < kTopCopies * kTopBins / 4; b += kSelectThreads)
    reinterpret_cast<int4*>(top_hist)[b] = make_int4(0, 0, 0, 0);
  for (int r = threadIdx.x; r < kp; r += kSelectThreads) sel[r] = 0ull;
}

// BlockTopK: the top K of a row of rank keys, by one block of kSelectThreads threads.
// out[0 .. K) gets the indices of the K largest non-zero keys of row[0 .. n),
// largest first, equal keys by ascending index, then -1 where fewer exist.
// K <= kMaxK, kp = K rounded up to a power of two, `sel` as
// ClearSelectBuffers left it. Every thread of the block calls it, with
// `keys` its block's view of the row: all of it, or with kCluster this
// CTA's chunk (the r-th of `ctas` chunks of ceil(n / ctas) keys for the CTA
// of cluster rank r = `rank`; the leader, rank 0, writes `out`). Threads
// leave it at different points (a cluster's other CTAs once they have handed
// their keys over; the sort's idle warps), so a caller must not synchronize
// the block or the cluster after it.
template <bool kCluster>
__device__ __forceinline__ void BlockTopK(const TokenKeys& keys, const uint32_t* row, int64_t n,
                                          int64_t K, int kp, int ctas, int rank,
                                          unsigned long long* sel, int32_t* out) {
  // kHistCopies histograms, copy c at c * kHistStride (one bank apart): lane L
  // counts into copy L mod kHistCopies, so the lanes of a warp that hit one
  // bin (the keys below one top-bits bin crowd a few) conflict 4 ways, not 32
  __shared__ int hist[kHistCopies * kHistStride];
  __shared__ __align__(16) int chunk_top[kTopBins];   // this CTA's top-bits counts, summed
  __shared__ int warp_sums[kSelectThreads / 32 + 1];
  __shared__ uint32_t s_prefix, s_need, s_ncand;
  __shared__ int s_gt, s_eq, s_nb, s_bin, s_bin_count, s_big;
  const int sel_words = kp <= kSelectThreads ? 2 * kp : kp;
  int* top_hist = reinterpret_cast<int*>(sel + sel_words);   // kTopCopies x kTopBins
  // RankInBins' bin offsets, in copies the bin's gathered keys (bin_buf below) leave alone
  static_assert(kTopCopies >= 4 && 2 * kRankBinMax <= kTopBins, "bin_buf within copy 0");
  int* bin_end = top_hist + kTopBins;         // in a cluster; alone the filled bin_fill
  int* bin_fill = top_hist + 2 * kTopBins;
  int* bin_start = top_hist + 3 * kTopBins;
  if (threadIdx.x < 256) hist[threadIdx.x] = 0;      // RadixSelectOneEach's histogram
  if (threadIdx.x == 0) s_gt = s_eq = s_nb = s_big = 0;
  const int tid = threadIdx.x;

  // ---- the K-th largest key (thr) and how many keys equal to it to take ----
  // A histogram of the keys' top kTopBits bits (the rank key's sign,
  // exponent and three mantissa bits: a token's scores spread over dozens of
  // these bins) counts the candidates and finds the bin holding the K-th
  // largest; that bin's keys are gathered into shared memory, and radix
  // passes over the remaining 20 bits find it there. A bin too large for
  // the buffer (scores crowded into one eighth of a binade) is searched by
  // the same passes over all the keys instead. In a cluster every CTA counts
  // its chunk, reads the others' counts and finds the same bin; each then
  // hands the leader its keys above the bin and in it.
  __syncthreads();
  {
    int* my_top = top_hist + (tid & (kTopCopies - 1)) * kTopBins;
    // no test for key 0 (a missing entry, or past the row in its slot): it
    // counts into bin 0, which no score's key reaches (NaN ranks as -inf, in
    // bin 7) and which the scan below takes as empty
    keys.ForEach([&](uint32_t key, int64_t) { atomicAdd(&my_top[key >> (32 - kTopBits)], 1); });
  }
  __syncthreads();
  // thread tid: bins 4(1023 - tid) .. + 3, so lower threads hold higher bins
  static_assert(kTopBins == 4 * kSelectThreads, "four bins a thread");
  const int b0 = kTopBins - 4 * (tid + 1);
  {
    int c[4] = {0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < kTopCopies; ++k) {
      const int4 v = *reinterpret_cast<const int4*>(top_hist + k * kTopBins + b0);
      c[0] += v.x, c[1] += v.y, c[2] += v.z, c[3] += v.w;
    }
    if (b0 == 0) c[0] = 0;                     // bin 0: the zero keys (see above)
    int4 ahead = make_int4(0, 0, 0, 0);        // cluster: the lower ranks' counts
    if (kCluster) {                            // the cluster's counts: every chunk's
      *reinterpret_cast<int4*>(chunk_top + b0) = make_int4(c[0], c[1], c[2], c[3]);
      SelectSync<kCluster>();
      c[0] = c[1] = c[2] = c[3] = 0;
      for (int r = 0; r < ctas; ++r) {
        if (r == rank) ahead = make_int4(c[0], c[1], c[2], c[3]);
        const int4 v = *reinterpret_cast<const int4*>(InCta<kCluster>(chunk_top, r) + b0);
        c[0] += v.x, c[1] += v.y, c[2] += v.z, c[3] += v.w;
      }
    }
    const int sum = c[0] + c[1] + c[2] + c[3];
    int total;
    int above = BlockExclusiveScan(sum, warp_sums, &total);   // keys in higher bins
    if (tid == 0) s_ncand = static_cast<uint32_t>(total);
    const int k = static_cast<int>(K);
    {
      // RankInBins: where each bin's keys start (the keys in higher bins; the
      // copies were all read before the scan's first barrier) and end, a fill
      // counter each (in a cluster each CTA fills its own part of a group,
      // after the lower ranks' parts), and the largest bin holding taken keys
      // (starting below K)
      const int s3 = above, s2 = s3 + c[3], s1 = s2 + c[2], s0 = s1 + c[1];
      *reinterpret_cast<int4*>(bin_start + b0) = make_int4(s0, s1, s2, s3);
      *reinterpret_cast<int4*>(bin_fill + b0) =
          make_int4(s0 + ahead.x, s1 + ahead.y, s2 + ahead.z, s3 + ahead.w);
      if (kCluster)
        *reinterpret_cast<int4*>(bin_end + b0) =
            make_int4(s0 + c[0], s1 + c[1], s2 + c[2], s3 + c[3]);
      int big = 0;
      if (s3 < k) big = max(big, c[3]);
      if (s2 < k) big = max(big, c[2]);
      if (s1 < k) big = max(big, c[1]);
      if (s0 < k) big = max(big, c[0]);
      big = __reduce_max_sync(cuda::kFull, big);
      if ((tid & 31) == 0 && big > 0) atomicMax(&s_big, big);
    }
    if (total > k && above < k && above + sum >= k) {           // one thread crosses
      for (int e = 3; e >= 0; --e) {
        if (above + c[e] >= k) {
          s_bin = b0 + e;
          s_need = static_cast<uint32_t>(k - above);
          s_bin_count = c[e];
          break;
        }
        above += c[e];
      }
    }
  }
  __syncthreads();
  const uint32_t ncand = s_ncand;
  const bool all_taken = ncand <= static_cast<uint32_t>(K);
  // the common case: the bin holds at most a key a thread. One pass over
  // the keys then takes those above the bin into sel and gathers the bin's
  // (with their indices); the K-th largest is found among these alone.
  const bool small_bin = !all_taken && s_bin_count <= kSelectThreads;
  unsigned long long* bin_buf = reinterpret_cast<unsigned long long*>(top_hist);  // once summed
  uint32_t* bin_keys = reinterpret_cast<uint32_t*>(top_hist);
  const uint32_t bin = all_taken ? 0u : static_cast<uint32_t>(s_bin);
  if (s_big <= kRankBinMax) {
    // the keys of the bins above the K-th key's (every candidate's bin when
    // all are taken) into their bin's group of the leader's sel, the K-th
    // key's bin into its bin_buf; then each key's place by RankInBins, no sort
    unsigned long long* lead_sel = InCta<kCluster>(sel, 0);
    unsigned long long* lead_bin = InCta<kCluster>(bin_buf, 0);
    int* lead_nb = InCta<kCluster>(&s_nb, 0);
    // one compare for most keys: below the first bin taken from (all taken:
    // every bin but 0, the zero keys'; else the K-th key's bin, bin >= 7)
    const uint32_t first_bin = all_taken ? 1u : bin;
    keys.ForEach([&](uint32_t key, int64_t i) {
      const uint32_t kb = key >> (32 - kTopBits);
      if (kb < first_bin) return;
      if (kb > bin) lead_sel[atomicAdd(&bin_fill[kb], 1)] = Composite(key, i);
      else lead_bin[atomicAdd(lead_nb, 1)] = Composite(key, i);
    });
    SelectSync<kCluster>();
    if (rank != 0) return;
    const int need_bin = all_taken ? 0 : static_cast<int>(s_need);
    const int n_above = all_taken ? static_cast<int>(ncand) : static_cast<int>(K) - need_bin;
    RankInBins(sel, n_above, bin_start, kCluster ? bin_end : bin_fill, bin_buf,
               all_taken ? 0 : s_nb, need_bin, all_taken ? ncand : K, K, out);
    return;
  }
  {
    // into the leader's sel and bin_buf (its top_hist copies, which nobody
    // reads after the sync above), in any order. One atomic a warp and list
    // measured no faster, here and in a cluster.
    unsigned long long* lead_sel = InCta<kCluster>(sel, 0);
    unsigned long long* lead_bin = InCta<kCluster>(bin_buf, 0);
    int* lead_gt = InCta<kCluster>(&s_gt, 0);
    int* lead_nb = InCta<kCluster>(&s_nb, 0);
    if (all_taken) {                           // every candidate
      keys.ForEach([&](uint32_t key, int64_t i) {
        if (key != 0) lead_sel[atomicAdd(lead_gt, 1)] = Composite(key, i);
      });
    } else if (small_bin) {
      keys.ForEach([&](uint32_t key, int64_t i) {
        if (key == 0) return;
        const uint32_t kb = key >> (32 - kTopBits);
        if (kb > bin) lead_sel[atomicAdd(lead_gt, 1)] = Composite(key, i);
        else if (kb == bin) lead_bin[atomicAdd(lead_nb, 1)] = Composite(key, i);
      });
    }
  }
  SelectSync<kCluster>();                      // the leader holds every handed key
  if (rank != 0) return;                       // nothing reads this CTA's memory any more
  // the leader's passes over all the token's keys (the large-bin paths)
  const auto for_all = [&](auto f) {
    if (!kCluster) keys.ForEach(f);
    else KeyRow{row, n, 0}.ForEach(f);
  };
  unsigned long long own = 0;                  // small_bin: this thread's key of the bin
  uint32_t prefix = 0, need = 0;
  if (!all_taken) {
    need = s_need;
    prefix = bin << (32 - kTopBits);
    const uint32_t bin_mask = ~0u << (32 - kTopBits);
    if (small_bin) {
      if (tid < s_nb) own = bin_buf[tid];
      RadixSelectOneEach(static_cast<uint32_t>(own >> 32), 31 - kTopBits, bin_mask, &prefix,
                         &need, hist, &s_prefix, &s_need);
    } else if (s_bin_count <= kBinKeysCap) {
      for_all([&](uint32_t key, int64_t) {
        if (key != 0 && (key & bin_mask) == prefix) bin_keys[atomicAdd(&s_nb, 1)] = key;
      });
      __syncthreads();
      const int nb = s_nb;
      RadixSelect([&](auto f) { for (int r = tid; r < nb; r += kSelectThreads) f(bin_keys[r]); },
                  31 - kTopBits, bin_mask, &prefix, &need, hist, &s_prefix, &s_need);
    } else {
      RadixSelect([&](auto f) { for_all([&](uint32_t key, int64_t) { f(key); }); },
                  31 - kTopBits, bin_mask, &prefix, &need, hist, &s_prefix, &s_need);
    }
  }
  const uint32_t thr = prefix;
  const int64_t m = all_taken ? ncand : K;
  const int64_t n_gt = m - need;   // keys above thr (all of them)

  // ---- collect: every key > thr, and every key == thr while they fit (the
  // sort then puts the lowest indices first); in any order ----
  const auto take = [&](uint32_t key, unsigned long long comp) {
    if (key > thr) {
      sel[atomicAdd(&s_gt, 1)] = comp;
    } else if (need > 0) {
      const int e = atomicAdd(&s_eq, 1);
      if (n_gt + e < kp) sel[n_gt + e] = comp;
    }
  };
  if (small_bin) {                             // the rest are in sel already
    const uint32_t key = static_cast<uint32_t>(own >> 32);
    if (key != 0 && key >= thr) take(key, own);
  } else if (!all_taken) {                     // all_taken: every key is in sel
    for_all([&](uint32_t key, int64_t i) {
      if (key != 0 && key >= thr) take(key, Composite(key, i));
    });
  }
  __syncthreads();
  if (need > 0 && n_gt + s_eq > kp) {
    // more ties at thr than room: the first `need` by index, in index order
    for (int r = n_gt + tid; r < kp; r += kSelectThreads) sel[r] = 0ull;
    __syncthreads();
    int taken_eq = 0;
    for (int64_t start = 0; start < n && static_cast<uint32_t>(taken_eq) < need;
         start += kSelectThreads) {                          // uniform across the block
      const int64_t i = start + tid;
      const uint32_t key = i < n ? row[i] : 0u;
      const int eq = (key != 0 && key == thr) ? 1 : 0;
      int total;
      const int rank = taken_eq + BlockExclusiveScan(eq, warp_sums, &total);
      if (eq && static_cast<uint32_t>(rank) < need) sel[n_gt + rank] = Composite(key, i);
      taken_eq += total;
    }
    __syncthreads();
  }

  // ---- sort, descending ----
  if (kp <= kSelectThreads) {
    const unsigned long long v = SortOnePerThread(tid < kp ? sel[tid] : 0ull, kp, sel);
    if (tid < K)
      out[tid] = tid < m ? CompositeIndex(v) : -1;
    return;
  }
  for (int size = 2; size <= kp; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int x = tid; x < kp; x += kSelectThreads) {
        const int y = x ^ stride;
        if (y > x) {
          const unsigned long long u = sel[x], v = sel[y];
          const bool desc = (x & size) == 0;
          if (desc ? (u < v) : (u > v)) {
            sel[x] = v;
            sel[y] = u;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int64_t r = tid; r < K; r += kSelectThreads)
    out[r] = r < m ? CompositeIndex(sel[r]) : -1;
}

// One token a block (a cluster of `ctas` blocks, kCluster): the token's
// checks and error counts (slot, position, then a NaN or Inf in its q or
// weights: the row all -1), then BlockTopK over its row of the scratch's rank
// keys. Launched overlapped (cuda::LaunchOverlapped): its CTAs clear their
// shared memory and read their token's slot and position before they wait
// for the score kernel. count_missing: the score kernel did not count the
// token's missing blocks (the mxfp4 one does, as it reads the block table).
template <bool kCluster>
__global__ void __launch_bounds__(kSelectThreads) SelectKernel(IndexerTopkArgs a, int kp,
                                                                bool count_missing, int ctas) {
  extern __shared__ unsigned long long sel[];   // SelectDynamicBytes(kp)
  // shared state first: it needs nothing of the score kernel
  ClearSelectBuffers(sel, kp);
  // the token's operands too: written before the score kernel started, so
  // before this kernel did, they may be read ahead of the wait, and the key
  // loads after it need not wait for them
  const int64_t t = kCluster ? blockIdx.x / ctas : blockIdx.x;
  const int64_t l = *a.layer;
  const TokenInfo ti = t < a.T ? ReadToken(a, t) : TokenInfo{false, 0, 0};
  // a good token's q and weights: checked by every CTA of its cluster, so all
  // agree without a cluster barrier (16 KB of reads, before the wait)
  const bool finite = !ti.ok || TokenInputsFinite(a, t);   // ti.ok: the same in the block
  cuda::WaitForPrevious();     // the score kernel's rank keys (launched overlapped)
  cuda::LetNextStart();        // a kernel launched overlapped after this one waits for it
  const int rank = kCluster ? static_cast<int>(cg::this_cluster().block_rank()) : 0;
  const int tid = threadIdx.x;
  if (blockIdx.x == 0 && tid == 0 && (l < 0 || l >= a.L))
    cuda::CountErrorAtomic(a.errors, kBadLayer, kNoRow);
  if (t >= a.T) return;                        // whole clusters: the grid is T * ctas
  int32_t* out = a.indices + t * a.K;
  if (!ti.ok || !finite) {                     // the same for every CTA of the cluster
    if (rank != 0) return;
    if (tid == 0 && l >= 0 && l < a.L) {
      const int64_t s = a.slot[t];
      if (ti.ok) cuda::CountErrorAtomic(a.errors, kNonfinite, t);
      else if (s != -1 && (s < 0 || s >= a.R)) cuda::CountErrorAtomic(a.errors, kBadSlot, t);
      else if (s != -1) cuda::CountErrorAtomic(a.errors, kBadPosition, t);
    }
    for (int64_t r = tid; r < a.K; r += kSelectThreads) out[r] = -1;
    return;
  }
  const int64_t n = ti.n;
  const uint32_t* row = a.scratch + t * a.E;
  const int64_t chunk = kCluster ? (n + ctas - 1) / ctas : n;
  const int64_t lo = kCluster ? min(n, rank * chunk) : 0, hi = kCluster ? min(n, lo + chunk) : n;
  const TokenKeys keys(KeyRow{row + lo, hi - lo, lo});
  if (count_missing && rank == 0) {
    for (int64_t j = tid; j * kPerBlock < n; j += kSelectThreads) {
      const int64_t b = a.block_table[ti.slot * a.MB + j];
      if (b < 0 || b >= a.N) cuda::CountErrorAtomic(a.errors, kMissingBlock, t);
    }
  }
  BlockTopK<kCluster>(keys, row, n, a.K, kp, ctas, rank, sel, out);
}

}  // namespace
}  // namespace indexer
}  // namespace dsv4
