// CUDA handler of indexer_topk (operands in ffi/indexer_topk.h, rules in
// dsv4_jax/ops/indexer.py, arithmetic order in dsv4/indexer.h).
//
// Two launches on the handler's stream, no host sync, no allocation (the
// per-entry rank keys live in the op's `scratch` result):
//  1. ScoreKernel (or ScoreKernelSplit for small grids, see SplitScores),
//     grid (T, entry chunks): the token's q (as fp32) and weights in shared
//     memory; one thread per visible entry reads its key through the block
//     table (4 x 16-byte loads + the 4 scale bytes), decodes it into 128
//     registers and computes the score in the fixed order (the split kernel:
//     4 lanes per entry, one 32-channel block each); it stores the rank key
//     (0 for an entry of a missing block).
//  2. SelectKernel, one block per token: an MSB-first radix select (4 passes
//     of 8 bits) finds the k-th largest key; one ordered pass collects the
//     keys above it and the lowest-indexed keys equal to it; a bitonic sort
//     in shared memory orders them (key descending, index ascending).
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "handlers_cuda.h"
#include "indexer_topk.h"

namespace dsv4 {
namespace {

constexpr int kScoreThreads = 256;
constexpr int kSelectThreads = 512;
constexpr int kMaxK = 4096;
constexpr int64_t kPerBlock = kBlockTokens / kCsaRatio;

struct TokenInfo {
  bool ok;       // a good token of a good layer
  int64_t slot;
  int64_t n;     // visible entries
};

__device__ TokenInfo ReadToken(const IndexerTopkArgs& a, int64_t t) {
  TokenInfo ti{false, 0, 0};
  int64_t l = *a.layer, s = a.slot[t], p = a.pos[t];
  if (l < 0 || l >= a.L || s < 0 || s >= a.R || p < 0) return ti;
  ti.ok = true;
  ti.slot = s;
  ti.n = IndexVisible(p, a.E);
  return ti;
}

__global__ void __launch_bounds__(kScoreThreads) ScoreKernel(IndexerTopkArgs a) {
  __shared__ __align__(16) float qs[kIndexHeads * kIndexDim];
  __shared__ float ws[kIndexHeads];
  const int64_t t = blockIdx.x;
  const TokenInfo ti = ReadToken(a, t);
  const int64_t first = static_cast<int64_t>(blockIdx.y) * kScoreThreads;
  if (!ti.ok || first >= ti.n) return;
  // q: 8192 bf16 = 1024 x 16 bytes, four per thread
  const uint4* qg = reinterpret_cast<const uint4*>(a.q + t * kIndexHeads * kIndexDim);
  for (int v = threadIdx.x; v < kIndexHeads * kIndexDim / 8; v += kScoreThreads) {
    uint4 raw = qg[v];
    uint32_t w4[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      qs[8 * v + 2 * e] = num::BitsFloat(w4[e] << 16);
      qs[8 * v + 2 * e + 1] = num::BitsFloat(w4[e] & 0xffff0000u);
    }
  }
  if (threadIdx.x < kIndexHeads) ws[threadIdx.x] = a.weights[t * kIndexHeads + threadIdx.x];
  __syncthreads();

  const int64_t i = first + threadIdx.x;
  if (i >= ti.n) return;
  uint32_t* out = a.scratch + t * a.E + i;
  const int64_t block = a.block_table[ti.slot * a.MB + i / kPerBlock];
  if (block < 0 || block >= a.N) {
    *out = 0;
    return;
  }
  const int64_t row = (static_cast<int64_t>(*a.layer) * a.N + block) * kPerBlock + i % kPerBlock;
  const uint4* pk = reinterpret_cast<const uint4*>(a.packed + row * kIndexPacked);
  uint4 p4[4];
#pragma unroll
  for (int v = 0; v < 4; ++v) p4[v] = pk[v];
  const uint32_t sc = *reinterpret_cast<const uint32_t*>(a.scale + row * kIndexScales);
  float k[kIndexDim];
#pragma unroll
  for (int b = 0; b < kIndexScales; ++b) {
    const float s = num::E8m0ToF32(static_cast<uint8_t>(sc >> (8 * b)));
    const uint32_t w4[4] = {p4[b].x, p4[b].y, p4[b].z, p4[b].w};
#pragma unroll
    for (int c = 0; c < 32; ++c) k[32 * b + c] = E2m1Value(w4[c / 8] >> (4 * (c % 8))) * s;
  }
  float score = 0.f;
#pragma unroll 1
  for (int h = 0; h < kIndexHeads; ++h) {
    const float4* qh = reinterpret_cast<const float4*>(qs + h * kIndexDim);
    float blk[kIndexScales];
#pragma unroll
    for (int b = 0; b < kIndexScales; ++b) {
      float4 v = qh[8 * b];
      const float* kb = k + 32 * b;
      float acc = kb[0] * v.x;
      acc = acc + kb[1] * v.y;
      acc = acc + kb[2] * v.z;
      acc = acc + kb[3] * v.w;
#pragma unroll
      for (int g = 1; g < 8; ++g) {
        v = qh[8 * b + g];
        acc = acc + kb[4 * g] * v.x;
        acc = acc + kb[4 * g + 1] * v.y;
        acc = acc + kb[4 * g + 2] * v.z;
        acc = acc + kb[4 * g + 3] * v.w;
      }
      blk[b] = acc;
    }
    const float c = IndexHeadTerm(blk[0], blk[1], blk[2], blk[3], ws[h]);
    score = h == 0 ? c : score + c;
  }
  *out = IndexRankKey(score);
}

// Same scores, four lanes per entry: lane b of a group of 4 holds the 32
// key values of block b and forms blk[b] for every head; the group swaps the
// four block sums by shuffles and every lane finishes d, the head term and
// the running score identically (lane 0 stores). A quarter of the registers
// and of the serial chain of ScoreKernel per entry. q sits in shared memory
// with 4 floats of padding after each 32-float block, so the four lanes'
// 16-byte reads of one head fall in distinct banks.
constexpr int kGroupEntries = kScoreThreads / 4;
constexpr int kQBlockStride = kMxfp4Block + 4;
constexpr int kQHeadStride = kIndexScales * kQBlockStride;

__global__ void __launch_bounds__(kScoreThreads) ScoreKernelSplit(IndexerTopkArgs a) {
  __shared__ __align__(16) float qs[kIndexHeads * kQHeadStride];
  __shared__ float ws[kIndexHeads];
  const int64_t t = blockIdx.x;
  const TokenInfo ti = ReadToken(a, t);
  const int64_t first = static_cast<int64_t>(blockIdx.y) * kGroupEntries;
  if (!ti.ok || first >= ti.n) return;
  const uint4* qg = reinterpret_cast<const uint4*>(a.q + t * kIndexHeads * kIndexDim);
  for (int v = threadIdx.x; v < kIndexHeads * kIndexDim / 8; v += kScoreThreads) {
    uint4 raw = qg[v];
    uint32_t w4[4] = {raw.x, raw.y, raw.z, raw.w};
    const int c0 = 8 * v;                     // first channel of these 8 (same head, block)
    float* dst = qs + (c0 / kIndexDim) * kQHeadStride + ((c0 % kIndexDim) / kMxfp4Block) * kQBlockStride +
                 c0 % kMxfp4Block;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      dst[2 * e] = num::BitsFloat(w4[e] << 16);
      dst[2 * e + 1] = num::BitsFloat(w4[e] & 0xffff0000u);
    }
  }
  if (threadIdx.x < kIndexHeads) ws[threadIdx.x] = a.weights[t * kIndexHeads + threadIdx.x];
  __syncthreads();

  const int lane = threadIdx.x & 31;
  const int b = threadIdx.x & 3;
  const unsigned group = 0xfu << (lane & ~3);
  const int64_t i = first + (threadIdx.x >> 2);
  if (i >= ti.n) return;                      // whole groups leave together
  uint32_t* out = a.scratch + t * a.E + i;
  const int64_t block = a.block_table[ti.slot * a.MB + i / kPerBlock];
  if (block < 0 || block >= a.N) {
    if (b == 0) *out = 0;
    return;
  }
  const int64_t row = (static_cast<int64_t>(*a.layer) * a.N + block) * kPerBlock + i % kPerBlock;
  const uint4 p4 = reinterpret_cast<const uint4*>(a.packed + row * kIndexPacked)[b];
  const float s = num::E8m0ToF32(a.scale[row * kIndexScales + b]);
  const uint32_t w4[4] = {p4.x, p4.y, p4.z, p4.w};
  float k[kMxfp4Block];
#pragma unroll
  for (int c = 0; c < kMxfp4Block; ++c) k[c] = E2m1Value(w4[c / 8] >> (4 * (c % 8))) * s;
  const float4* qb = reinterpret_cast<const float4*>(qs + b * kQBlockStride);
  float score = 0.f;
#pragma unroll 2
  for (int h = 0; h < kIndexHeads; ++h) {
    const float4* qh = qb + h * (kQHeadStride / 4);
    float4 v = qh[0];
    float acc = k[0] * v.x;
    acc = acc + k[1] * v.y;
    acc = acc + k[2] * v.z;
    acc = acc + k[3] * v.w;
#pragma unroll
    for (int g = 1; g < 8; ++g) {
      v = qh[g];
      acc = acc + k[4 * g] * v.x;
      acc = acc + k[4 * g + 1] * v.y;
      acc = acc + k[4 * g + 2] * v.z;
      acc = acc + k[4 * g + 3] * v.w;
    }
    const float b0 = __shfl_sync(group, acc, 0, 4);
    const float b1 = __shfl_sync(group, acc, 1, 4);
    const float b2 = __shfl_sync(group, acc, 2, 4);
    const float b3 = __shfl_sync(group, acc, 3, 4);
    const float c = IndexHeadTerm(b0, b1, b2, b3, ws[h]);
    score = h == 0 ? c : score + c;
  }
  if (b == 0) *out = IndexRankKey(score);
}

// Inclusive sum over the block's threads of one value each; returns the
// exclusive prefix and (via *total) the block total. `warp_sums` holds
// kSelectThreads / 32 ints.
__device__ int BlockExclusiveScan(int x, int* warp_sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int v = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int y = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += y;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < kSelectThreads / 32; ++w) {
    int s = warp_sums[w];
    if (w < warp) before += s;
    all += s;
  }
  __syncthreads();
  *total = all;
  return before + v - x;
}

__global__ void __launch_bounds__(kSelectThreads) SelectKernel(IndexerTopkArgs a, int kp) {
  extern __shared__ unsigned long long sel[];   // kp composite keys
  __shared__ int hist[256];
  __shared__ int warp_sums[kSelectThreads / 32];
  __shared__ uint32_t s_prefix, s_need, s_ncand;
  __shared__ int s_gt;
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x;
  const int64_t l = *a.layer;
  if (t == 0 && tid == 0 && (l < 0 || l >= a.L)) atomicAdd(&a.errors[kBadLayer], 1);
  if (t >= a.T) return;
  int32_t* out = a.indices + t * a.K;
  const TokenInfo ti = ReadToken(a, t);
  if (!ti.ok) {
    if (tid == 0 && l >= 0 && l < a.L) {
      const int64_t s = a.slot[t];
      if (s != -1 && (s < 0 || s >= a.R)) atomicAdd(&a.errors[kBadSlot], 1);
      else if (s != -1) atomicAdd(&a.errors[kBadPosition], 1);
    }
    for (int64_t r = tid; r < a.K; r += kSelectThreads) out[r] = -1;
    return;
  }
  const int64_t n = ti.n;
  for (int64_t j = tid; j * kPerBlock < n; j += kSelectThreads) {
    const int64_t b = a.block_table[ti.slot * a.MB + j];
    if (b < 0 || b >= a.N) atomicAdd(&a.errors[kMissingBlock], 1);
  }
  const uint32_t* keys = a.scratch + t * a.E;

  // ---- radix select: the K-th largest non-zero key ----
  uint32_t prefix = 0, mask = 0, need = static_cast<uint32_t>(a.K);
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int b = tid; b < 256; b += kSelectThreads) hist[b] = 0;
    __syncthreads();
    for (int64_t i = tid; i < n; i += kSelectThreads) {
      const uint32_t key = keys[i];
      if (key != 0 && (key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
    }
    __syncthreads();
    if (tid < 32) {
      // lane L holds bins 8(31-L) .. 8(31-L)+7: lane 0 the highest
      const int base = 8 * (31 - tid);
      int c[8], sum = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        c[e] = hist[base + e];
        sum += c[e];
      }
      int incl = sum;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (tid >= o) incl += y;
      }
      const int total = __shfl_sync(0xffffffffu, incl, 31);
      const int excl = incl - sum;
      if (pass == 0 && tid == 0) s_ncand = static_cast<uint32_t>(total);
      const bool cross = excl < static_cast<int>(need) && incl >= static_cast<int>(need);
      // exactly one lane crosses, except in pass 0 when there are at most
      // `need` candidates: then all are taken (below) and s_prefix is unused
      if (cross) {
        int cum = excl;
        for (int e = 7; e >= 0; --e) {
          if (cum + c[e] >= static_cast<int>(need)) {
            s_prefix = prefix | (static_cast<uint32_t>(base + e) << shift);
            s_need = need - static_cast<uint32_t>(cum);
            break;
          }
          cum += c[e];
        }
      }
    }
    __syncthreads();
    if (pass == 0 && s_ncand <= static_cast<uint32_t>(a.K)) {
      prefix = 0;
      need = 0;
      break;
    }
    prefix = s_prefix;
    need = s_need;
    mask |= 255u << shift;
    __syncthreads();
  }
  const uint32_t thr = prefix;
  const int64_t m = s_ncand < static_cast<uint32_t>(a.K) ? s_ncand : a.K;
  const int64_t n_gt = m - need;   // keys above thr (all of them)

  // ---- collect: all keys > thr in any order, the first `need` keys == thr ----
  for (int r = tid; r < kp; r += kSelectThreads) sel[r] = 0ull;
  if (tid == 0) s_gt = 0;
  __syncthreads();
  int taken_eq = 0;
  for (int64_t start = 0; start < n; start += kSelectThreads) {
    const int64_t i = start + tid;
    const uint32_t key = i < n ? keys[i] : 0u;
    const unsigned long long comp =
        (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
    if (key != 0 && key > thr) sel[atomicAdd(&s_gt, 1)] = comp;
    if (need > 0 && static_cast<uint32_t>(taken_eq) < need) {   // uniform across the block
      const int eq = (key != 0 && key == thr) ? 1 : 0;
      int total;
      const int rank = taken_eq + BlockExclusiveScan(eq, warp_sums, &total);
      if (eq && static_cast<uint32_t>(rank) < need) sel[n_gt + rank] = comp;
      taken_eq += total;
    }
  }
  __syncthreads();

  // ---- bitonic sort, descending ----
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
  for (int64_t r = tid; r < a.K; r += kSelectThreads)
    out[r] = r < m ? static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(sel[r])) : -1;
}

// Which score kernel runs. Both give the same bits. On an H100 (see
// benchmarks/RESULTS-indexer.md) the four-lane kernel is faster only while
// the grid is small (it is bound by shared-memory wavefronts: its lanes read
// four distinct q addresses per load where the one-thread kernel's warp reads
// one), so it runs when T * E <= kSplitMaxWork. DSV4_INDEXER_SCORE=entry or
// =split forces one (read once, on the host) for comparisons.
constexpr int64_t kSplitMaxWork = 16384;

bool SplitScores(int64_t T, int64_t E) {
  static const int forced = [] {
    const char* v = std::getenv("DSV4_INDEXER_SCORE");
    if (v && std::string(v) == "entry") return 0;
    if (v && std::string(v) == "split") return 1;
    return -1;
  }();
  return forced >= 0 ? forced == 1 : T * E <= kSplitMaxWork;
}

ffi::Error IndexerTopkImpl(cudaStream_t stream, ffi::AnyBuffer layer, ffi::AnyBuffer token_slot,
                           ffi::AnyBuffer token_pos, ffi::AnyBuffer q, ffi::AnyBuffer weights,
                           ffi::AnyBuffer block_table, ffi::AnyBuffer errors_in,
                           ffi::AnyBuffer packed, ffi::AnyBuffer scale,
                           ffi::Result<ffi::AnyBuffer> indices,
                           ffi::Result<ffi::AnyBuffer> scratch,
                           ffi::Result<ffi::AnyBuffer> errors) {
  IndexerTopkArgs a;
  DSV4_RETURN_IF_ERROR(ValidateIndexerTopk(layer, token_slot, token_pos, q, weights, block_table,
                                           errors_in, packed, scale, *indices, *scratch, *errors,
                                           &a));
  if (a.K > kMaxK)
    return ffi::Error::InvalidArgument("indices (result): k must be at most " +
                                       std::to_string(kMaxK) + " on CUDA, got " +
                                       std::to_string(a.K));
  if (a.T > 0 && a.E > 0) {
    const int64_t chunks = (a.E + kScoreThreads - 1) / kScoreThreads;
    if (chunks > 65535 || a.T > 0x7fffffff)
      return ffi::Error::InvalidArgument("indexer_topk: too many tokens or entries for one grid");
    if (SplitScores(a.T, a.E)) {
      const int64_t groups = (a.E + kGroupEntries - 1) / kGroupEntries;
      if (groups > 65535)
        return ffi::Error::InvalidArgument("indexer_topk: too many entries for one grid");
      ScoreKernelSplit<<<dim3(static_cast<unsigned>(a.T), static_cast<unsigned>(groups)),
                         kScoreThreads, 0, stream>>>(a);
    } else {
      ScoreKernel<<<dim3(static_cast<unsigned>(a.T), static_cast<unsigned>(chunks)),
                    kScoreThreads, 0, stream>>>(a);
    }
  }
  int kp = 1;
  while (kp < a.K) kp <<= 1;
  const unsigned grid = static_cast<unsigned>(a.T > 0 ? a.T : 1);
  SelectKernel<<<grid, kSelectThreads, kp * sizeof(unsigned long long), stream>>>(a, kp);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("indexer_topk launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(IndexerTopkCuda, IndexerTopkImpl,
                              BindIndexerTopk(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
