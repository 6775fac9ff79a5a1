// The attention kernel on Hopper's tensor cores (sm_90a, wgmma). One CTA per
// (query token, 64 heads, split of the token's candidate items), three
// warpgroups:
//  - the producer decides the split's items 128 at a time (attention_items.cuh,
//    counting bad indices and missing blocks once), compacts the seen ones in
//    item order into tiles of 64 rows and fetches each tile's raw fp8 rows
//    (codes, RoPE, the words holding the scales) with cp.async into one of two
//    staging buffers, a tile ahead of the consumers. It holds no row in
//    registers, so its 72 registers suffice.
//  - the two consumer warpgroups (8 warps) dequantize a staged tile to bf16
//    into the 128-byte-swizzled layout wgmma reads (bf16 pools are read from
//    global memory here; a prefill chunk row is encoded as append stores it,
//    a non-finite one zeroed and masked), then each runs S = Q.K^T over the
//    whole tile (64 heads x 64 rows, K-dim 512, both redundantly: no exchange
//    between them) and the online softmax, then O += P.V for its half of the
//    512 output channels (P rounded to bf16 in registers, the design's step 4).
// Raw buffers are handed over by named barriers (full / empty per buffer);
// the consumers share one bf16 tile between two barriers of their own. With
// one split the consumers write the final bf16 rows and lse; with several
// they write unnormalized fp32 partials (O, running max, denominator) to the
// workspace and attention_combine.cuh merges them. Rules: docs/design.md §6;
// budget and designs tried: docs/perf/attention.md.
#pragma once

#include <cuda_runtime.h>

#include "attention_items.cuh"
#include "cp_async.cuh"
#include "wgmma.cuh"

namespace dsv4 {
namespace cuda {
namespace tc {

constexpr int kThreads = 384;      // producer warpgroup + two consumer warpgroups
constexpr int kHeads = 64;         // heads a CTA computes: wgmma's M
constexpr int kTileRows = 64;      // rows a tile: S's N, P.V's K
constexpr int kRound = 128;        // items the producer decides at a time
constexpr int kListCap = kTileRows + kRound;
constexpr int kBatch = 2;          // bf16 pools: rows a producer warp has in flight
constexpr int kRawRow = kNopeDim + 2 * kRopeDim;   // staged fp8 row: codes, then bf16 RoPE
constexpr int kRawChunks = kRawRow / 16;           // its 16-byte copies
// setmaxnreg moves registers from the producer to the consumers within what
// the launch gave the CTA (384 x 168): 128 x 72 + 256 x 216 = 384 x 168. An
// increase past it would wait forever; below 216 a consumer's wgmma
// accumulators do not fit and ptxas serializes the wgmmas (warning C7512).
constexpr int kProducerRegs = 72;
constexpr int kConsumerRegs = 216;

// Named barriers (0 is __syncthreads).
// Raw buffer b: kRawFull + b (fetched, producer -> consumers), kRawEmpty + b
// (dequantized, consumers -> producer); kConsumerSync: the two consumer
// warpgroups around their shared bf16 tile.
enum Barrier : int { kProducerSync = 1, kRawFull = 2, kRawEmpty = 4, kConsumerSync = 6 };

struct Shared {
  uint8_t q[8 * wgmma::kSlabBytes];            // the CTA's 64 heads, slabs
  uint8_t tile[8 * wgmma::kSlabBytes];          // the bf16 tile of the consumers
  uint8_t raw[2][kTileRows * kRawRow];          // fp8 rows fetched for the next tiles
  uint32_t raw_scale[2][kTileRows][4];          // words holding a row's scales
  int64_t raw_e[2][kTileRows];                  // each staged row's entry or chunk row
  uint8_t raw_src[2][kTileRows];
  int raw_n[2];                                 // rows staged; -1: the end
  int64_t list[kListCap];                       // seen items not yet staged
  uint8_t list_src[kListCap];
  uint64_t valid;                               // bit r: tile row r seen
  ChunkScratch<8> scratch;                      // one pool per consumer warp
  int warp_count[4];
  int first_pos;
};
// wgmma's swizzle works on absolute shared addresses: 1024-byte alignment.
constexpr size_t kSharedBytes = sizeof(Shared) + 1024;

__device__ __forceinline__ void BarSync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void BarArrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
template <int kRegs>
__device__ __forceinline__ void RegsDown() {
#if DSV4_HAS_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void RegsUp() {
#if DSV4_HAS_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  return static_cast<uint32_t>(num::F32ToBf16(lo)) |
         (static_cast<uint32_t>(num::F32ToBf16(hi)) << 16);
}

// Workspace row of (split, token, head): f32[splits, T, heads padded to 64, 516].
template <typename F>   // float or const float
__device__ __forceinline__ F* WsRow(F* ws, const AttentionArgs& a, int split, int64_t t,
                                    int64_t h) {
  const int64_t hp = (a.H + kHeads - 1) / kHeads * kHeads;
  return ws + ((split * a.T + t) * hp + h) * kAttnWorkspaceRow;
}

// A dropped token's rows: out 0, lse -inf (or, split, an empty partial).
__device__ void WriteDropped(const AttentionArgs& a, float* ws, int splits, int split, int64_t t,
                             int64_t h0) {
  const int tid = threadIdx.x;
  if (splits == 1) {
    for (int i = tid; i < kHeads * kChunks; i += kThreads) {
      const int64_t h = h0 + i / kChunks;
      if (h < a.H)
        reinterpret_cast<uint4*>(a.out + (t * a.H + h) * kHeadDim)[i % kChunks] =
            make_uint4(0, 0, 0, 0);
    }
    for (int i = tid; i < kHeads; i += kThreads)
      if (h0 + i < a.H) a.lse[t * a.H + h0 + i] = -INFINITY;
  } else {
    for (int i = tid; i < kHeads; i += kThreads) {
      float* w = WsRow(ws, a, split, t, h0 + i);
      w[kHeadDim] = -INFINITY;
      w[kHeadDim + 1] = 0.f;
    }
  }
}

// A chunk row encoded as append stores it and decoded to the lane's two
// chunks; false (and zeros) for a row with a NaN or Inf, which no query sees.
__device__ bool StageChunkRow(const AttentionArgs& a, Shared& sm, int warp, int64_t r, uint4* lo,
                              uint4* hi) {
  uint4 ulo, uhi;
  LoadChunkRow(a, r, &ulo, &uhi);
  if (!__all_sync(kFull, Bf16x8Finite(ulo) && Bf16x8Finite(uhi))) {
    *lo = *hi = make_uint4(0, 0, 0, 0);
    return false;
  }
  WarpChunkRowAsStored(sm.scratch.Pool(a.ring.fmt, warp), ulo, uhi, lo, hi);
  return true;
}

// Entries in the pool a staged row comes from.
__device__ __forceinline__ int64_t PoolEntries(const AttentionArgs& a, uint8_t src) {
  return src == kFromRing ? a.L * a.R * kWindow : a.Lk * a.N * a.per_block;
}

// Starts fetching list rows 0..n-1 into staging buffer rb (fp8 pools: codes,
// RoPE and the words holding the scales; bf16 pools and chunk rows are read
// when the tile is dequantized) and records what each row is. One cp.async
// group per thread.
__device__ void FetchRaw(const AttentionArgs& a, Shared& sm, int rb, int n) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int r = tid; r < n; r += 128) {
    sm.raw_e[rb][r] = sm.list[r];
    sm.raw_src[rb][r] = sm.list_src[r];
  }
  if (tid == 0) sm.raw_n[rb] = n;
  const int fmt = a.ring.fmt;
  if (fmt != kBf16) {
    for (int r = warp; r < n; r += 4) {
      const uint8_t src = sm.list_src[r];
      if (src == kFromChunk) continue;
      const EntryPool& pool = src == kFromRing ? a.ring : a.pool;
      const int64_t e = sm.list[r];
      uint8_t* dst = sm.raw[rb] + r * kRawRow;
      for (int c = lane; c < kRawChunks; c += 32) {
        const uint8_t* g = c < kNopeDim / 16
                               ? pool.nope + e * kNopeDim + c * 16
                               : reinterpret_cast<const uint8_t*>(pool.rope + e * kRopeDim) +
                                     (c - kNopeDim / 16) * 16;
        CpAsync16(dst + c * 16, g);
      }
      if (fmt == kDsFp8 && lane < 3) {
        // the 7 scale bytes lie in 3 aligned words; none is read past the pool
        const int64_t word = e * kNopeTiles / 4 + lane;
        const int64_t left = PoolEntries(a, src) * kNopeTiles - 4 * word;
        if (left > 0)
          CpAsync4(&sm.raw_scale[rb][r][lane], pool.scale + 4 * word, left < 4 ? int(left) : 4);
      } else if (fmt == kFp8Token && lane == 0) {
        CpAsync4(&sm.raw_scale[rb][r][0], reinterpret_cast<const float*>(pool.scale) + e, 4);
      }
    }
  }
  CpAsyncCommit();
}

// A staged fp8 row as the lane's EntryRegs (what WarpLoadEntry reads from
// the pool).
__device__ __forceinline__ EntryRegs StagedEntry(const Shared& sm, int fmt, int rb, int r) {
  const int lane = threadIdx.x & 31, jhi = lane + 32;
  const uint8_t* raw = sm.raw[rb] + r * kRawRow;
  EntryRegs x;
  const uint2 clo = *reinterpret_cast<const uint2*>(raw + lane * kChunk);
  x.lo = make_uint4(clo.x, clo.y, 0, 0);
  if (jhi < kNopeChunks) {
    const uint2 chi = *reinterpret_cast<const uint2*>(raw + jhi * kChunk);
    x.hi = make_uint4(chi.x, chi.y, 0, 0);
  } else {
    x.hi = *reinterpret_cast<const uint4*>(raw + kNopeDim + (jhi - kNopeChunks) * 16);
  }
  if (fmt == kDsFp8) {
    const uint8_t* sc = reinterpret_cast<const uint8_t*>(sm.raw_scale[rb][r]) +
                        sm.raw_e[rb][r] * kNopeTiles % 4;
    x.slo = num::E8m0ToF32(sc[lane >> 3]);
    x.shi = jhi < kNopeChunks ? num::E8m0ToF32(sc[jhi >> 3]) : 1.f;
  } else {
    x.slo = x.shi = *reinterpret_cast<const float*>(sm.raw_scale[rb][r]);
  }
  return x;
}

// Consumers: dequantizes raw buffer rb (n rows) into the bf16 tile, 8 warps
// of both consumer warpgroups, rows past n zero (a masked row must hold
// finite values: its zero weight times NaN is NaN); clears the valid bit of a
// non-finite chunk row. `cw`: the consumer warp, 0..7.
__device__ void DequantTile(const AttentionArgs& a, Shared& sm, int rb, int n, int cw) {
  const int lane = threadIdx.x & 31, fmt = a.ring.fmt;
  auto chunks = [&](int r, uint4** lo, uint4** hi) {
    *lo = reinterpret_cast<uint4*>(sm.tile + wgmma::ChunkOffset(r, lane));
    *hi = reinterpret_cast<uint4*>(sm.tile + wgmma::ChunkOffset(r, lane + 32));
  };
  if (fmt != kBf16) {
    for (int r = cw; r < kTileRows; r += 8) {
      uint4 *lo, *hi;
      chunks(r, &lo, &hi);
      if (r >= n) *lo = *hi = make_uint4(0, 0, 0, 0);
      else if (sm.raw_src[rb][r] != kFromChunk)
        WarpStoreEntryChunks(fmt, StagedEntry(sm, fmt, rb, r), lo, hi);
    }
  } else {
    for (int r0 = cw; r0 < kTileRows; r0 += 8 * kBatch) {
      EntryRegs x[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int r = r0 + 8 * k;
        if (r < n && sm.raw_src[rb][r] != kFromChunk)
          x[k] = WarpLoadEntry(sm.raw_src[rb][r] == kFromRing ? a.ring : a.pool, sm.raw_e[rb][r]);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int r = r0 + 8 * k;
        uint4 *lo, *hi;
        chunks(r, &lo, &hi);
        if (r >= n) *lo = *hi = make_uint4(0, 0, 0, 0);
        else if (sm.raw_src[rb][r] != kFromChunk) WarpStoreEntryChunks(fmt, x[k], lo, hi);
      }
    }
  }
  if (a.has_chunk) {
    for (int r = cw; r < n; r += 8) {
      if (sm.raw_src[rb][r] != kFromChunk) continue;
      uint4 *lo, *hi;
      chunks(r, &lo, &hi);
      if (!StageChunkRow(a, sm, cw, sm.raw_e[rb][r], lo, hi) && lane == 0)
        atomicAnd(reinterpret_cast<unsigned long long*>(&sm.valid), ~(1ull << r));
    }
  }
}

// The producer warpgroup: decide items [c0, c1) of token t and fetch each
// tile's rows into a raw buffer, handing a buffer to the consumers once its
// copies have landed (while the next tile's are in flight); then the end
// marker.
__device__ void Produce(const AttentionArgs& a, Shared& sm, int64_t l, int64_t lk, int64_t t,
                        int64_t s, int64_t p, int64_t first_pos, int64_t c0, int64_t c1,
                        bool counts) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int pending = 0, tiles = 0;
  auto hand_over = [&](int tile, bool newest) {   // tile's copies landed: to the consumers
    if (newest) CpAsyncWait<0>();
    else CpAsyncWait<1>();
    BarSync(kProducerSync, 128);
    BarArrive(kRawFull + (tile & 1), kThreads);
  };
  auto emit = [&](int n) {
    const int rb = tiles & 1;
    if (tiles >= 2) BarSync(kRawEmpty + rb, kThreads);   // tile tiles-2 dequantized
    FetchRaw(a, sm, rb, n);
    ++tiles;
    if (tiles >= 2) hand_over(tiles - 2, false);
    // move the items not staged to the front of the list
    pending -= n;
    int64_t e = 0;
    uint8_t src = 0;
    if (tid < pending) {
      e = sm.list[n + tid];
      src = sm.list_src[n + tid];
    }
    BarSync(kProducerSync, 128);
    if (tid < pending) {
      sm.list[tid] = e;
      sm.list_src[tid] = src;
    }
    BarSync(kProducerSync, 128);
  };
  for (int64_t base = c0; base < c1; base += kRound) {
    uint8_t src = 0;
    int64_t e = 0;
    const int64_t it = base + tid;
    const bool seen =
        it < c1 && AttnDecideItem(a, l, lk, t, s, p, first_pos, it, counts, false, &src, &e);
    const unsigned ballot = __ballot_sync(kFull, seen);
    if (lane == 0) sm.warp_count[warp] = __popc(ballot);
    BarSync(kProducerSync, 128);
    int before = 0, total = 0;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      before += w < warp ? sm.warp_count[w] : 0;
      total += sm.warp_count[w];
    }
    if (seen) {
      const int k = pending + before + __popc(ballot & ((1u << lane) - 1u));
      sm.list[k] = e;
      sm.list_src[k] = src;
    }
    BarSync(kProducerSync, 128);
    pending += total;
    while (pending >= kTileRows) emit(kTileRows);
  }
  if (pending > 0) emit(pending);
  if (tiles >= 1) hand_over(tiles - 1, true);
  // the end marker in the next buffer, then every release the consumers owe
  const int rb = tiles & 1;
  if (tiles >= 2) BarSync(kRawEmpty + rb, kThreads);
  if (tid == 0) sm.raw_n[rb] = -1;
  BarArrive(kRawFull + rb, kThreads);
  if (tiles >= 1) BarSync(kRawEmpty + ((tiles - 1) & 1), kThreads);
}

// A consumer warpgroup (c = 0, 1: output channels 256c .. 256c + 255). Thread
// layout of the m64nNk16 fragments: warp w, lane L own head rows
// 16w + L/4 and 16w + L/4 + 8, columns 8j + 2(L % 4) + {0, 1}.
__device__ void Consume(const AttentionArgs& a, Shared& sm, float* ws, int splits, int split,
                        int64_t t, int64_t h0, int64_t p, int c) {
  const int tid = threadIdx.x - 128 * (c + 1);
  const int warp = tid >> 5, lane = tid & 31, quad = lane & 3;
  const int row0 = 16 * warp + (lane >> 2);
  float m[2], den[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t h = h0 + row0 + 8 * i;
    // the sink joins the softmax once: in split 0, on one lane of the row
    const float sink = split == 0 && h < a.H ? __ldg(a.sink + h) : -INFINITY;
    m[i] = sink;
    den[i] = sink == -INFINITY || quad != 0 ? 0.f : 1.f;
  }
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  const int cw = 4 * c + warp;                  // consumer warp, 0..7
  for (int it = 0;; ++it) {
    const int rb = it & 1;
    BarSync(kRawFull + rb, kThreads);
    const int n = *reinterpret_cast<volatile int*>(&sm.raw_n[rb]);
    if (n < 0) break;
    if (threadIdx.x == 128) sm.valid = n >= 64 ? ~0ull : (1ull << n) - 1ull;
    BarSync(kConsumerSync, 256);                // both done with the tile before; valid set
    DequantTile(a, sm, rb, n, cw);
    wgmma::FenceSharedForAsync();
    BarArrive(kRawEmpty + rb, kThreads);        // the raw buffer may be refilled
    BarSync(kConsumerSync, 256);                // the whole tile is written
    const uint64_t valid = *reinterpret_cast<volatile uint64_t*>(&sm.valid);
    const uint8_t* tile = sm.tile;
    float sc[32];
    wgmma::Fence();
#pragma unroll
    for (int k = 0; k < 32; ++k)
      wgmma::MmaSS64(sc, wgmma::KMajor(sm.q, k), wgmma::KMajor(tile, k), k > 0);
    wgmma::Commit();
    wgmma::WaitAll();
    // S's fragment: element k is head row row0 + 8 ((k >> 1) & 1), tile row
    // (column) 8 (k >> 2) + 2 quad + (k & 1).
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const int i = (k >> 1) & 1, col = 8 * (k >> 2) + 2 * quad + (k & 1);
      sc[k] = (valid >> col) & 1ull ? sc[k] * AttnScale() : -INFINITY;
      mx[i] = fmaxf(mx[i], sc[k]);
    }
    float rescale[2], sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFull, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFull, mx[i], 2));
      const float m_new = fmaxf(m[i], mx[i]);
      rescale[i] = m_new == m[i] ? 1.f : expf(m[i] - m_new);
      m[i] = m_new;
    }
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const int i = (k >> 1) & 1;
      sc[k] = m[i] == -INFINITY ? 0.f : expf(sc[k] - m[i]);
      sum[i] += sc[k];
    }
    uint32_t pa[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) pa[k] = PackBf16x2(sc[2 * k], sc[2 * k + 1]);
#pragma unroll
    for (int i = 0; i < 2; ++i) den[i] = den[i] * rescale[i] + sum[i];
#pragma unroll
    for (int j = 0; j < 32; ++j) {
#pragma unroll
      for (int k = 0; k < 4; ++k) o[4 * j + k] *= rescale[k >> 1];
    }
    wgmma::Fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint32_t frag[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
      wgmma::MmaRS256(o, frag, wgmma::NMajor(tile, 4 * c, kk));
    }
    wgmma::Commit();
    wgmma::WaitAll();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    den[i] += __shfl_xor_sync(kFull, den[i], 1);
    den[i] += __shfl_xor_sync(kFull, den[i], 2);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t h = h0 + row0 + 8 * i;
    if (splits > 1) {
      float* w = WsRow(ws, a, split, t, h);
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<float2*>(w + 256 * c + 8 * j + 2 * quad) =
            make_float2(o[4 * j + 2 * i], o[4 * j + 2 * i + 1]);
      if (c == 0 && quad == 0) {
        w[kHeadDim] = m[i];
        w[kHeadDim + 1] = den[i];
      }
      continue;
    }
    if (h >= a.H) continue;
    const bool empty = m[i] == -INFINITY;     // sees nothing and no sink
    uint16_t* out = a.out + (t * a.H + h) * kHeadDim;
    const float pos = static_cast<float>(p);
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = 256 * c + 8 * j + 2 * quad;
      float y0 = empty ? 0.f : num::RoundBf16(o[4 * j + 2 * i] / den[i]);
      float y1 = empty ? 0.f : num::RoundBf16(o[4 * j + 2 * i + 1] / den[i]);
      if (!empty && a.inv_freq != nullptr && col >= kNopeDim)
        InverseRopePair(y0, y1, pos * __ldg(a.inv_freq + (col - kNopeDim) / 2), &y0, &y1);
      *reinterpret_cast<uint32_t*>(out + col) = PackBf16x2(y0, y1);
    }
    if (c == 0 && quad == 0) a.lse[t * a.H + h] = empty ? -INFINITY : m[i] + logf(den[i]);
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    AttentionWgmmaKernel(AttentionArgs a, float* ws, int splits) {
  extern __shared__ uint8_t smem_raw[];
  Shared& sm = *reinterpret_cast<Shared*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                          ~static_cast<uintptr_t>(1023));
  const int tid = threadIdx.x;
  const int64_t t = blockIdx.x, h0 = static_cast<int64_t>(blockIdx.y) * kHeads;
  const int split = static_cast<int>(blockIdx.z);
  const bool first = blockIdx.y == 0 && split == 0;   // counts the token's errors
  AttnToken tok;
  if (!AttnBeginToken(a, t, blockIdx.x == 0 && first && tid == 0, &tok)) return;
  const int64_t l = tok.l, lk = tok.lk, s = tok.s, p = tok.p;
  bool live = tok.live;
  int err = tok.err;
  // q: the CTA's heads into shared memory (zero rows past H), and the token's
  // NaN/Inf check over every head
  bool bad_q = false;
  if (live) {
    const uint4* q = reinterpret_cast<const uint4*>(a.q + t * a.H * kHeadDim);
    for (int i = tid; i < kHeads * kChunks; i += kThreads) {
      const int r = i / kChunks, ch = i % kChunks;
      uint8_t* dst = sm.q + wgmma::ChunkOffset(r, ch);
      if (h0 + r < a.H) CpAsync16(dst, q + (h0 + r) * kChunks + ch);
      else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
    CpAsyncCommit();
    if (a.H > kHeads) {                          // heads of the token's other CTAs
      for (int64_t i = tid; i < a.H * kChunks; i += kThreads) {
        const int64_t h = i / kChunks;
        if (h < h0 || h >= h0 + kHeads) bad_q = bad_q || !Bf16x8Finite(__ldg(q + i));
      }
    }
    CpAsyncWait<0>();
    for (int i = tid; i < kHeads * kChunks; i += kThreads)
      if (h0 + i / kChunks < a.H)
        bad_q = bad_q || !Bf16x8Finite(*reinterpret_cast<const uint4*>(
                             sm.q + wgmma::ChunkOffset(i / kChunks, i % kChunks)));
  }
  if (__syncthreads_or(bad_q)) {
    err = kNonfinite;
    live = false;
  }
  if (first && tid == 0 && err >= 0) atomicAdd(&a.errors[err], 1);
  if (!live) {
    WriteDropped(a, ws, splits, split, t, h0);
    return;
  }
  const int64_t first_pos = AttnFirstPos(a, s, &sm.first_pos);
  const int64_t items = AttnCandidates(a, p);
  const int64_t c0 = items * split / splits, c1 = items * (split + 1) / splits;
  wgmma::FenceSharedForAsync();                  // q, written above, is read by wgmma
  __syncthreads();
  if (tid < 128) {
    RegsDown<kProducerRegs>();
    Produce(a, sm, l, lk, t, s, p, first_pos, c0, c1, blockIdx.y == 0);
  } else {
    RegsUp<kConsumerRegs>();
    Consume(a, sm, ws, splits, split, t, h0, p, tid < 256 ? 0 : 1);
  }
}

}  // namespace tc
}  // namespace cuda
}  // namespace dsv4
