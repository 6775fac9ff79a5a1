// The attention kernel on the tensor cores. One CTA per (query token, 64
// heads, split of the token's candidate items); the splits of a token form
// one thread-block cluster and merge their partials through distributed
// shared memory at the end (attention_finish.cuh), so no partial leaves the
// SMs and no second kernel runs. It is built twice, on the two products a
// consumer computes (S = Q.K^T and O += P.V): Hopper's warpgroup wgmma
// (wgmma::Products, sm_90a) and the warp-level mma.sync every tensor-core GPU
// since sm_80 has (warp_mma::Products: Blackwell's path, which the H100 also
// runs under the tests). Three warpgroups:
//  - the producer decides the split's items 128 at a time (attention_items.cuh,
//    counting bad indices and missing blocks once), compacts the seen ones in
//    item order into tiles of 64 rows and fetches each tile's raw fp8 rows
//    (codes, RoPE, the words holding the scales) with cp.async into one of two
//    staging buffers, a tile ahead of the consumers. It holds no row in
//    registers, so its 72 registers suffice.
//  - the two consumer warpgroups (8 warps) dequantize a staged tile to bf16
//    into the 128-byte-swizzled slabs both products read (bf16 pools are read
//    from global memory here; a prefill chunk's rows come encoded as append
//    stores them by AttentionChunkEncodeKernel, non-finite ones unseen).
//    Consumer c then computes S for its half of the tile's rows (64 heads x
//    32 rows, K-dim 512), so S is computed once; the halves exchange their
//    row maxima through shared memory, each writes its bf16 weights (the
//    design's step 4) into the shared P tile, and each runs O += P.V for its
//    half of the 512 output channels with both operands in shared memory.
//    The softmax runs in log2 units (exp2 on the SFU); attention is
//    tolerance-checked, not bit-exact (design §6).
// Raw buffers are handed over by named barriers (full / empty per buffer);
// the consumers share the bf16 tile and P between barriers of their own.
// Rules: docs/design.md §6; budget and designs tried: docs/perf/attention.md.
#pragma once

#include <cuda_runtime.h>

#include "attention_finish.cuh"
#include "attention_items.cuh"
#include "cp_async.cuh"
#include "launch.cuh"
#include "warp_mma.cuh"
#include "wgmma.cuh"

namespace dsv4 {
namespace cuda {
namespace tc {

constexpr int kThreads = 384;      // producer warpgroup + two consumer warpgroups
constexpr int kHeads = kAttnHeads;  // heads a CTA computes: wgmma's M
constexpr int kTileRows = 64;      // rows a tile: S's N, P.V's K
constexpr int kHalfRows = kTileRows / 2;   // S columns a consumer computes
constexpr int kRound = 128;        // items the producer decides at a time
constexpr int kListCap = kTileRows + kRound;
constexpr int kBatch = 2;          // bf16 pools: rows a consumer warp has in flight
constexpr int kRawRow = kNopeDim + 2 * kRopeDim;   // staged fp8 row: codes, then bf16 RoPE
constexpr int kRawChunks = kRawRow / 16;           // its 16-byte copies
constexpr int kMaxSplits = 16;     // a cluster's CTAs (16 needs the non-portable size)
// setmaxnreg moves registers from the producer to the consumers within what
// the launch gave the CTA (384 x 168): 128 x 72 + 256 x 216 = 384 x 168. An
// increase past it would wait forever; below 216 a consumer's wgmma
// accumulators do not fit and ptxas serializes the wgmmas (warning C7512).
constexpr int kProducerRegs = 72;
constexpr int kConsumerRegs = 216;
constexpr int kLaunchRegs = 168;

// Named barriers (0 is __syncthreads).
// Raw buffer b: kRawFull + b (fetched, producer -> consumers), kRawEmpty + b
// (dequantized, consumers -> producer); kConsumerSync: the two consumer
// warpgroups around their shared bf16 tile; kExchange: their row maxima, then
// their halves of P.
enum Barrier : int { kProducerSync = 1, kRawFull = 2, kRawEmpty = 4, kConsumerSync = 6,
                     kExchange = 7 };

// The shared memory of the main loop; the finish reuses its first bytes for
// the partial (AttnPartial, attention_finish.cuh) once the loop is over.
struct LoopShared {
  uint8_t q[8 * wgmma::kSlabBytes];            // the CTA's 64 heads, slabs
  uint8_t tile[8 * wgmma::kSlabBytes];          // the bf16 tile of the consumers
  uint8_t raw[2][kTileRows * kRawRow];          // fp8 rows fetched for the next tiles
  uint8_t p[wgmma::kSlabBytes];                 // P: 64 heads x 64 tile rows, bf16
  uint32_t raw_scale[2][kTileRows][4];          // words holding a row's scales
  int64_t raw_e[2][kTileRows];                  // each staged row's entry or chunk row
  uint8_t raw_src[2][kTileRows];
  uint8_t raw_soff[2][kTileRows];               // first scale byte in raw_scale's words
  int raw_n[2];                                 // rows staged; -1: the end
  int64_t list[kListCap];                       // seen items not yet staged
  uint8_t list_src[kListCap];
  float row_max[2][kHeads];                     // each consumer's tile maxima (log2 units)
  int warp_count[4];
  int first_pos;
  float2 rot[kRopeDim / 2];                     // the token's RoPE cos, sin (the finish's)
};
union Shared {
  LoopShared loop;
  AttnPartial part;
};
static_assert(sizeof(AttnPartial) <= offsetof(LoopShared, p),
              "the partial overlays q, tile and the raw buffers only");
// wgmma's swizzle works on absolute shared addresses: 1024-byte alignment.
constexpr size_t kSharedBytes = sizeof(Shared) + 1024;

__device__ __forceinline__ void BarSync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void BarArrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
// setmaxnreg exists on the arch-specific targets (sm_90a, sm_100a); elsewhere
// every warp keeps the launch's share.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(__CUDA_ARCH_FEAT_SM100_ALL)
#define DSV4_HAS_SETMAXNREG 1
#else
#define DSV4_HAS_SETMAXNREG 0
#endif
template <int kRegs>
__device__ __forceinline__ void RegsDown() {
#if DSV4_HAS_SETMAXNREG
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void RegsUp() {
#if DSV4_HAS_SETMAXNREG
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

// The pool a staged row comes from: the ring, the prefill chunk's rows as
// the encoding pass stored them (AttentionChunkEncodeKernel), or the paged
// pool; and its entries.
__device__ __forceinline__ const EntryPool& SourcePool(const AttentionArgs& a, uint8_t src) {
  return src == kFromRing ? a.ring : src == kFromChunk ? a.chunk : a.pool;
}
__device__ __forceinline__ int64_t PoolEntries(const AttentionArgs& a, uint8_t src) {
  return src == kFromRing    ? a.L * a.R * kWindow
         : src == kFromChunk ? a.T
                             : a.Lk * a.N * a.per_block;
}

// Starts fetching list rows 0..n-1 into staging buffer rb (fp8 pools: codes,
// RoPE and the words holding the scales; bf16 rows are read when the tile is
// dequantized) and records what each row is. One cp.async
// group per thread.
__device__ void FetchRaw(const AttentionArgs& a, LoopShared& sm, int rb, int n) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int r = tid; r < n; r += 128) {
    const int64_t e = sm.list[r];
    sm.raw_e[rb][r] = e;
    sm.raw_src[rb][r] = sm.list_src[r];
    // entry e's 7 scale bytes start at byte 7e, (3 (e mod 4)) mod 4 into its first word
    sm.raw_soff[rb][r] = static_cast<uint8_t>((3 * static_cast<int>(e & 3)) & 3);
  }
  if (tid == 0) sm.raw_n[rb] = n;
  const int fmt = a.ring.fmt;
  if (fmt != kBf16) {
    for (int r = warp; r < n; r += 4) {
      const uint8_t src = sm.list_src[r];
      const EntryPool& pool = SourcePool(a, src);
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
__device__ __forceinline__ EntryRegs StagedEntry(const LoopShared& sm, int fmt, int rb, int r) {
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
                        sm.raw_soff[rb][r];
    x.slo = num::E8m0ToF32(sc[lane >> 3]);
    x.shi = jhi < kNopeChunks ? num::E8m0ToF32(sc[jhi >> 3]) : 1.f;
  } else {
    x.slo = x.shi = *reinterpret_cast<const float*>(sm.raw_scale[rb][r]);
  }
  return x;
}

// 8 e4m3 codes times s as 8 bf16 (e4m3 -> f16 is exact, one fp32 multiply,
// the pair rounded to bf16 by one instruction). Unlike the gathers' DequantChunk
// it does not route NaN codes through the host's scalar rules: attention is
// tolerance-checked, and a NaN code gives a NaN here too.
__device__ __forceinline__ uint4 DequantChunkFast(uint32_t c0, uint32_t c1, float s) {
  const uint32_t c[2] = {c0, c1};
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(c[i >> 1] >> (16 * (i & 1))), __NV_E4M3);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    w[i] = PackBf16x2Rn(f.x * s, f.y * s);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// A staged fp8 row's two chunks of the lane, decoded (RoPE chunks as stored).
__device__ __forceinline__ void StoreStagedChunks(const EntryRegs& x, uint4* lo, uint4* hi) {
  const int jhi = (threadIdx.x & 31) + 32;
  *lo = DequantChunkFast(x.lo.x, x.lo.y, x.slo);
  *hi = jhi < kNopeChunks ? DequantChunkFast(x.hi.x, x.hi.y, x.shi) : x.hi;
}

// Consumers: dequantizes raw buffer rb (n rows) into the bf16 tile, 8 warps
// of both consumer warpgroups, rows past n zero (a masked row must hold
// finite values: its zero weight times NaN is NaN). `cw`: the consumer warp,
// 0..7.
__device__ void DequantTile(const AttentionArgs& a, LoopShared& sm, int rb, int n, int cw) {
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
      else StoreStagedChunks(StagedEntry(sm, fmt, rb, r), lo, hi);
    }
  } else {
    for (int r0 = cw; r0 < kTileRows; r0 += 8 * kBatch) {
      EntryRegs x[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int r = r0 + 8 * k;
        if (r < n) x[k] = WarpLoadEntry(SourcePool(a, sm.raw_src[rb][r]), sm.raw_e[rb][r]);
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int r = r0 + 8 * k;
        uint4 *lo, *hi;
        chunks(r, &lo, &hi);
        if (r >= n) *lo = *hi = make_uint4(0, 0, 0, 0);
        else WarpStoreEntryChunks(fmt, x[k], lo, hi);
      }
    }
  }
}

// The producer warpgroup: decide items [c0, c1) of token t and fetch each
// tile's rows into a raw buffer, handing a buffer to the consumers once its
// copies have landed (while the next tile's are in flight); then the end
// marker.
__device__ void Produce(const AttentionArgs& a, LoopShared& sm, int64_t l, int64_t lk, int64_t t,
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
        it < c1 && AttnDecideItem(a, l, lk, t, s, p, first_pos, it, counts, true, &src, &e);
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

// A consumer warpgroup (c = 0, 1: S columns 32c .. 32c + 31 of each tile,
// output channels 256c .. 256c + 255). Thread layout of the m64nNk16
// fragments: warp w, lane L own head rows 16w + L/4 and 16w + L/4 + 8,
// columns 8j + 2(L % 4) + {0, 1}. It leaves the CTA's partial in shared.part
// for AttnFinish, also with one split: a finish from the registers is unrolled
// over every fragment element (about half the kernel's code, each CTA running
// it once), where the finish through the partial is one short loop and no
// slower.
template <class Products>
__device__ void Consume(const AttentionArgs& a, Shared& shared, int splits, int split, int64_t t,
                        int64_t h0, int c) {
  LoopShared& sm = shared.loop;
  const int tid = threadIdx.x - 128 * (c + 1);
  const int warp = tid >> 5, lane = tid & 31, quad = lane & 3;
  const int row0 = 16 * warp + (lane >> 2);
  // logits in log2 units: s * 512^-0.5 * log2(e), exponentiated by exp2
  const float scale2 = AttnScale() * kLog2e;
  float m[2], den[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t h = h0 + row0 + 8 * i;
    // the sink joins the softmax once: in split 0, on one lane of consumer 0
    const float sink = split == 0 && h < a.H ? __ldg(a.sink + h) * kLog2e : -INFINITY;
    m[i] = sink;
    den[i] = sink == -INFINITY || quad != 0 || c != 0 ? 0.f : 1.f;
  }
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  const int cw = 4 * c + warp;                  // consumer warp, 0..7
  for (int it = 0;; ++it) {
    const int rb = it & 1;
    BarSync(kRawFull + rb, kThreads);
    Products::WaitPV();                         // the last tile's P.V (overlapped the wait)
    const int n = *reinterpret_cast<volatile int*>(&sm.raw_n[rb]);
    if (n < 0) break;
    BarSync(kConsumerSync, 256);                // both done with the tile before
    DequantTile(a, sm, rb, n, cw);
    Products::FenceShared();
    BarArrive(kRawEmpty + rb, kThreads);        // the raw buffer may be refilled
    BarSync(kConsumerSync, 256);                // the whole tile is written
    const uint64_t valid = n >= 64 ? ~0ull : (1ull << n) - 1ull;   // bit r: tile row r seen
    float sc[16];
    Products::Scores(sc, sm.q, sm.tile + kHalfRows * 128 * c, warp);
    // element k: head row row0 + 8 ((k >> 1) & 1), tile row 32c + 8 (k >> 2) + 2 quad + (k & 1)
    const uint32_t vbits = static_cast<uint32_t>(valid >> (kHalfRows * c)) >> (2 * quad);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const int i = (k >> 1) & 1, col = 8 * (k >> 2) + (k & 1);
      sc[k] = (vbits >> col) & 1u ? sc[k] * scale2 : -INFINITY;
      mx[i] = fmaxf(mx[i], sc[k]);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFull, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(kFull, mx[i], 2));
    }
    if (quad == 0) {
      sm.row_max[c][row0] = mx[0];
      sm.row_max[c][row0 + 8] = mx[1];
    }
    BarSync(kExchange, 256);                    // both halves' maxima
    float rescale[2], mu[2], sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float other = sm.row_max[1 - c][row0 + 8 * i];
      const float m_new = fmaxf(m[i], fmaxf(mx[i], other));
      rescale[i] = m_new == m[i] ? 1.f : Exp2(m[i] - m_new);
      m[i] = m_new;
      mu[i] = m_new == -INFINITY ? 0.f : m_new;  // no NaN from -inf - -inf
    }
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const int i = (k >> 1) & 1;
      sc[k] = Exp2(sc[k] - mu[i]);
      sum[i] += sc[k];
    }
    // the weights, rounded to bf16, into P (heads x tile rows, K-major)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int i = 0; i < 2; ++i)
        *reinterpret_cast<uint32_t*>(sm.p + wgmma::ChunkOffset(row0 + 8 * i, 4 * c + j) +
                                     4 * quad) = PackBf16x2Rn(sc[4 * j + 2 * i],
                                                              sc[4 * j + 2 * i + 1]);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) den[i] = den[i] * rescale[i] + sum[i];
    if (__any_sync(kFull, rescale[0] != 1.f || rescale[1] != 1.f)) {
#pragma unroll
      for (int j = 0; j < 32; ++j) {
#pragma unroll
        for (int k = 0; k < 4; ++k) o[4 * j + k] *= rescale[k >> 1];
      }
    }
    Products::FenceShared();
    BarSync(kExchange, 256);                    // P is whole
    Products::IssuePV(o, sm.p, sm.tile, c, warp);
  }
  Products::WaitPV();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    den[i] += __shfl_xor_sync(kFull, den[i], 1);
    den[i] += __shfl_xor_sync(kFull, den[i], 2);
  }
  BarSync(kConsumerSync, 256);                  // both done reading q, the tile and P
  AttnPartial& part = shared.part;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = row0 + 8 * i;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<float2*>(&part.o[r][256 * c + 8 * j + 2 * quad]) =
          make_float2(o[4 * j + 2 * i], o[4 * j + 2 * i + 1]);
    if (quad == 0) {
      if (c == 0) part.m[r] = m[i];
      part.den[c][r] = den[i];
    }
  }
}

// grid (T x splits, ceil(H / 64)), clusters of `splits` along x: CTA x is
// split x % splits of token x / splits. Products: wgmma::Products (sm_90a
// only) or warp_mma::Products.
template <class Products>
__global__ void __launch_bounds__(kThreads, 1)
    AttentionKernel(AttentionArgs a, int splits) {
  extern __shared__ uint8_t smem_raw[];
  Shared& shared = *reinterpret_cast<Shared*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                              ~static_cast<uintptr_t>(1023));
  LoopShared& sm = shared.loop;
  const int tid = threadIdx.x;
  const int64_t t = blockIdx.x / splits, h0 = static_cast<int64_t>(blockIdx.y) * kHeads;
  const int split = static_cast<int>(blockIdx.x % splits);
  const bool first = blockIdx.y == 0 && split == 0;   // counts the token's errors
  WaitForPrevious();                           // every operand may come from the kernel before
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
  if (!live) {                                   // every CTA of the cluster drops it
    AttnWriteDropped(a, t, h0, split == 0);
    return;
  }
  const int64_t first_pos = AttnFirstPos(a, s, &sm.first_pos);
  const int64_t items = AttnCandidates(a, p);
  const int64_t c0 = items * split / splits, c1 = items * (split + 1) / splits;
  Products::FenceShared();                       // q, written above, is read by the products
  __syncthreads();
  if (tid < 128) {
    RegsDown<kProducerRegs>();
    Produce(a, sm, l, lk, t, s, p, first_pos, c0, c1, blockIdx.y == 0);
    if (tid < 32) WarpRopeTable(a, t, sm.rot);   // while the consumers end
    RegsUp<kLaunchRegs>();                       // back to the launch's share for the finish
  } else {
    RegsUp<kConsumerRegs>();
    Consume<Products>(a, shared, splits, split, t, h0, tid < 256 ? 0 : 1);
    RegsDown<kLaunchRegs>();
  }
  // No LetNextStart: a dependent kernel's CTAs would take the SMs this one
  // leaves and wait on them, which overlaps nothing at one CTA an SM.
  AttnFinish(a, shared.part, a.inv_freq != nullptr ? sm.rot : nullptr, splits, t, h0);
}

}  // namespace tc
}  // namespace cuda
}  // namespace dsv4
