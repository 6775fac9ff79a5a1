// The attention kernel on CUDA cores, for devices without Hopper's wgmma
// (sm_100a builds it; attention.cu launches it where ComputeMajor() != 9):
// one CTA per (query token, group of 16 heads), 8 warps of 2 heads each.
//
// The CTA walks the token's candidate items (attention_items.cuh) 256 at a
// time: each thread decides one item (counting its BAD_INDEX /
// MISSING_BLOCK in the CTA of the first head group only), the items seen are
// compacted in item order (deterministic), and they are processed in tiles
// of 32 rows dequantized to bf16 in shared memory (a chunk row is encoded
// into a per-warp one-entry pool first, so it reads back as append stores
// it). Each warp then runs the online softmax of its heads over the tile: a
// lane owns the 16 channels of its two 8-channel chunks (the entry layout of
// bf16_chunks.cuh), the logit is a warp sum, the weights e^(s - m) are rounded to
// bf16 for P.V and summed unrounded for the denominator, and the running max
// starts at the sink (docs/design.md §6: the online form rounds each weight
// relative to the running max; the bound there covers it).
#pragma once

#include <cuda_runtime.h>

#include "attention_finish.cuh"
#include "attention_items.cuh"
#include "launch.cuh"

namespace dsv4 {
namespace cuda {
namespace simt {

using cuda::kFromChunk;
using cuda::kFromPool;
using cuda::kFromRing;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kHeadsPerWarp = 2;
constexpr int kHeadsPerCta = kWarps * kHeadsPerWarp;
constexpr int kTileRows = 32;
constexpr int kLaneChannels = 2 * cuda::kChunk;   // channels a lane owns

struct Shared {
  alignas(16) uint16_t tile[kTileRows][kHeadDim];
  // one-entry pools, one per warp, for encoding a chunk row as append does
  ChunkScratch<kWarps> scratch;
  int64_t sel[kThreads];
  uint8_t src[kThreads];
  int warp_count[kWarps];
  int first_pos;
};

// A lane's 16 channels of a bf16 row (global or shared) as fp32.
__device__ __forceinline__ void LoadLaneRow(const uint16_t* row, int lane, float* x) {
  const uint4* v = reinterpret_cast<const uint4*>(row);
  cuda::UnpackBf16x8(v[lane], x);
  cuda::UnpackBf16x8(v[lane + 32], x + cuda::kChunk);
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(cuda::kFull, x, off);
  return x;
}

__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(cuda::kFull, x, off));
  return x;
}

// Dequantizes a selected row (source, entry or chunk row) into tile row `out`;
// one warp, all lanes.
__device__ void StageRow(const AttentionArgs& a, Shared& sm, int warp, uint8_t src, int64_t e,
                         uint16_t* out) {
  if (src == kFromRing) {
    cuda::WarpDecodeEntry(a.ring, e, out);
  } else if (src == kFromPool) {
    cuda::WarpDecodeEntry(a.pool, e, out);
  } else {
    uint4 ulo, uhi;
    LoadChunkRow(a, e, &ulo, &uhi);
    uint4* dst = reinterpret_cast<uint4*>(out);
    const int lane = threadIdx.x & 31;
    WarpChunkRowAsStored(sm.scratch.Pool(a.ring.fmt, warp), ulo, uhi, dst + lane,
                         dst + lane + 32);
  }
}

// Online-softmax state of one head in one warp: lane-owned numerator channels.
struct HeadState {
  float q[kLaneChannels];
  float acc[kLaneChannels];
  float m, den;
};

// Folds tile rows 0..n-1 into head state `st`.
__device__ void FoldTile(const Shared& sm, int n, HeadState& st) {
  const int lane = threadIdx.x & 31;
  float mine = -INFINITY;                       // lane j: the logit of row j
  for (int j = 0; j < n; ++j) {
    float v[kLaneChannels];
    LoadLaneRow(sm.tile[j], lane, v);
    float part = 0.f;
#pragma unroll
    for (int i = 0; i < kLaneChannels; ++i) part = part + st.q[i] * v[i];
    const float s = WarpSum(part) * AttnScale();
    if (lane == j) mine = s;
  }
  const float m_new = fmaxf(st.m, WarpMax(mine));
  const float rescale = m_new == st.m ? 1.f : expf(st.m - m_new);
  const float e = lane < n && m_new != -INFINITY ? expf(mine - m_new) : 0.f;
  st.den = st.den * rescale + WarpSum(e);
#pragma unroll
  for (int i = 0; i < kLaneChannels; ++i) st.acc[i] = st.acc[i] * rescale;
  for (int j = 0; j < n; ++j) {
    const float w = num::RoundBf16(__shfl_sync(cuda::kFull, e, j));
    float v[kLaneChannels];
    LoadLaneRow(sm.tile[j], lane, v);
#pragma unroll
    for (int i = 0; i < kLaneChannels; ++i) st.acc[i] = st.acc[i] + w * v[i];
  }
  st.m = m_new;
}

// Writes head h's output row and lse from its final state (or zeros / -inf).
__device__ void FinishHead(const AttentionArgs& a, int64_t t, int64_t h, const HeadState& st,
                           bool live) {
  const int lane = threadIdx.x & 31;
  uint4* out = reinterpret_cast<uint4*>(a.out + (t * a.H + h) * kHeadDim);
  if (!live || st.m == -INFINITY) {
    out[lane] = out[lane + 32] = make_uint4(0, 0, 0, 0);
    if (lane == 0) a.lse[t * a.H + h] = -INFINITY;
    return;
  }
  cuda::WarpWriteAttnRow(a, t, out, st.acc, 1.f / st.den);
  if (lane == 0) a.lse[t * a.H + h] = st.m + logf(st.den);
}

__global__ void __launch_bounds__(kThreads) AttentionSimtKernel(AttentionArgs a) {
  __shared__ Shared sm;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t = blockIdx.x;
  const bool counts = blockIdx.y == 0;          // the first head group counts the token
  AttnToken tok;
  if (!AttnBeginToken(a, t, blockIdx.x == 0 && blockIdx.y == 0 && tid == 0, &tok)) return;
  const int64_t l = tok.l, lk = tok.lk, s = tok.s, p = tok.p;
  bool live = tok.live;
  int err = tok.err;
  // NaN or Inf anywhere in the token's q (all heads): NONFINITE
  bool bad_q = false;
  if (live) {
    const uint16_t* q = a.q + t * a.H * kHeadDim;
    for (int64_t i = tid; i < a.H * kHeadDim; i += kThreads)
      bad_q = bad_q || !num::Bf16IsFinite(__ldg(q + i));
  }
  if (__syncthreads_or(bad_q)) {
    err = kNonfinite;
    live = false;
  }
  if (counts && tid == 0 && err >= 0) atomicAdd(&a.errors[err], 1);

  HeadState st[kHeadsPerWarp];
  const int64_t h0 = blockIdx.y * kHeadsPerCta + warp * kHeadsPerWarp;
#pragma unroll
  for (int k = 0; k < kHeadsPerWarp; ++k) {
    const int64_t h = h0 + k;
    const float sink = h < a.H ? __ldg(a.sink + h) : 0.f;
    st[k].m = sink;
    st[k].den = sink == -INFINITY ? 0.f : 1.f;
#pragma unroll
    for (int i = 0; i < kLaneChannels; ++i) st[k].acc[i] = 0.f;
    if (live && h < a.H) LoadLaneRow(a.q + (t * a.H + h) * kHeadDim, lane, st[k].q);
  }

  if (live) {
    const int64_t first_pos = AttnFirstPos(a, s, &sm.first_pos);
    const int64_t items = AttnCandidates(a, p);
    for (int64_t base = 0; base < items; base += kThreads) {
      uint8_t src = 0;
      int64_t e = 0;
      const int64_t it = base + tid;
      const bool seen =
          it < items && AttnDecideItem(a, l, lk, t, s, p, first_pos, it, counts, true, &src, &e);
      const unsigned ballot = __ballot_sync(cuda::kFull, seen);
      if (lane == 0) sm.warp_count[warp] = __popc(ballot);
      __syncthreads();
      int before = 0, total = 0;
      for (int w = 0; w < kWarps; ++w) {
        before += w < warp ? sm.warp_count[w] : 0;
        total += sm.warp_count[w];
      }
      if (seen) {
        const int k = before + __popc(ballot & ((1u << lane) - 1u));
        sm.sel[k] = e;
        sm.src[k] = src;
      }
      __syncthreads();
      for (int k0 = 0; k0 < total; k0 += kTileRows) {
        const int n = total - k0 < kTileRows ? total - k0 : kTileRows;
        for (int r = warp; r < n; r += kWarps)
          StageRow(a, sm, warp, sm.src[k0 + r], sm.sel[k0 + r], sm.tile[r]);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < kHeadsPerWarp; ++k)
          if (h0 + k < a.H) FoldTile(sm, n, st[k]);
        __syncthreads();
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kHeadsPerWarp; ++k)
    if (h0 + k < a.H) FinishHead(a, t, h0 + k, st[k], live);
}

// The launch: one CTA per (token, 16 heads); T = 0 still runs one CTA, to
// count a bad layer.
inline void LaunchAttentionSimt(const AttentionArgs& a, cudaStream_t stream) {
  dim3 grid(static_cast<unsigned>(a.T > 0 ? a.T : 1),
            static_cast<unsigned>((a.H + kHeadsPerCta - 1) / kHeadsPerCta));
  AttentionSimtKernel<<<grid, kThreads, 0, stream>>>(a);
}

}  // namespace simt
}  // namespace cuda
}  // namespace dsv4

