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
//    item order into tiles of 64 rows and dequantizes each tile straight from
//    global memory into one of two bf16 tiles, in the 128-byte-swizzled slabs
//    both products read: four lanes a row, all of a row's loads in flight
//    before its first store, so the fetch costs a lane two round trips a tile
//    and the consumers' products of the other tile run meanwhile. What needs
//    no arithmetic (RoPE, bf16 rows, a prefill chunk's rows, which come
//    decoded once to bf16 by attention_chunk.cuh, non-finite ones unseen)
//    goes by cp.async instead.
//  - the two consumer warpgroups (8 warps) only run the products: consumer c
//    computes S for its half of the tile's rows (64 heads x 32 rows, K-dim
//    512), so S is computed once; the halves exchange their row maxima
//    through shared memory, each writes its bf16 weights (the design's step
//    4) into the shared P tile, and each runs O += P.V for its half of the 512
//    output channels with both operands in shared memory. The softmax runs in
//    log2 units (exp2 on the SFU); attention is tolerance-checked, not
//    bit-exact (docs/design/operations.md).
// The bf16 tiles are handed over by named barriers (full / empty per tile);
// the consumers share P between barriers of their own.
// Rules: docs/design/operations.md; budget and designs tried: docs/perf/attention.md.
#pragma once

#include <cuda_runtime.h>

#include "attention/attention_finish.cuh"
#include "attention/attention_items.cuh"
#include "attention/warp_mma.cuh"
#include "attention/wgmma.cuh"
#include "common/cp_async.cuh"
#include "common/launch.cuh"

namespace dsv4 {
namespace cuda {
namespace tc {

constexpr int kThreads = 384;      // producer warpgroup + two consumer warpgroups
constexpr int kHeads = kAttnHeads;  // heads a CTA computes: wgmma's M
constexpr int kTileRows = 64;      // rows a tile: S's N, P.V's K
constexpr int kHalfRows = kTileRows / 2;   // S columns a consumer computes
constexpr int kRound = 128;        // items the producer decides at a time
constexpr int kListCap = kTileRows + kRound;
constexpr int kRowLanes = 4;       // producer lanes that load and dequantize a row
constexpr int kFp8Loads = kNopeDim / 16 / kRowLanes;    // a lane's 16-byte code loads a row
constexpr int kRopeLoads = kRopeDim * 2 / 16 / kRowLanes;   // and RoPE loads
constexpr int kMaxSplits = 16;     // a cluster's CTAs (16 needs the non-portable size)
// setmaxnreg moves registers from the producer to the consumers within what
// the launch gave the CTA (384 x 168): 128 x 120 + 256 x 192 = 384 x 168. An
// increase past it would wait forever. A producer lane holds one row's part
// (40 registers) at a time: holding both of its rows at once took 136 (with
// spills), left the consumers 184 and slowed the kernel (docs/perf/attention.md).
constexpr int kProducerRegs = 120;
constexpr int kConsumerRegs = 192;
constexpr int kLaunchRegs = 168;

// Named barriers (0 is __syncthreads).
// bf16 tile b: kTileFull + b (dequantized, producer -> consumers), kTileEmpty
// + b (both products done with it, consumers -> producer); kConsumerSync: the
// two consumer warpgroups before the partial overlays the tiles; kExchange:
// their row maxima, then their halves of P.
enum Barrier : int { kProducerSync = 1, kTileFull = 2, kTileEmpty = 4, kConsumerSync = 6,
                     kExchange = 7 };

// The shared memory of the main loop; the finish reuses its first bytes for
// the partial (AttnPartial, attention_finish.cuh) once the loop is over.
struct LoopShared {
  uint8_t q[8 * wgmma::kSlabBytes];             // the CTA's 64 heads, slabs
  uint8_t tile[2][8 * wgmma::kSlabBytes];       // bf16 tiles: one dequantized while one is read
  uint8_t p[wgmma::kSlabBytes];                 // P: 64 heads x 64 tile rows, bf16
  int tile_n[2];                                // rows in tile b; -1: the end
  int64_t list[kListCap];                       // seen items not yet dequantized
  uint8_t list_src[kListCap];
  float row_max[2][kHeads];                     // each consumer's tile maxima (log2 units)
  int warp_count[4];
  AttnChunkScratch chunk;
  float2 rot[kRopeDim / 2];                     // the token's RoPE cos, sin (the finish's)
};
union Shared {
  LoopShared loop;
  AttnPartial part;
};
static_assert(sizeof(AttnPartial) <= offsetof(LoopShared, p),
              "the partial overlays q and the tiles only");
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

// The pool a dequantized row comes from: the ring or the paged pool (a
// prefill chunk's rows come decoded, AttnCopyBf16Row); and its entries.
__device__ __forceinline__ const EntryPool& SourcePool(const AttentionArgs& a, uint8_t src) {
  return src == kFromRing ? a.ring : a.pool;
}
__device__ __forceinline__ int64_t PoolEntries(const AttentionArgs& a, uint8_t src) {
  return src == kFromRing ? a.L * a.R * kWindow : a.Lk * a.N * a.per_block;
}

// Copies a bf16 row (NoPE chunks at `nope`, RoPE chunks at `rope`) into row r
// of a bf16 tile by cp.async, the lane's chunks qd, qd + 4, ...: nothing
// passes through registers, and the copies are in flight until the tile's
// wait.
__device__ __forceinline__ void CopyBf16RowAsync(const uint4* nope, const uint4* rope, int qd,
                                                 uint8_t* tile, int r) {
#pragma unroll
  for (int j = 0; j < kChunks / kRowLanes; ++j) {
    const int c = qd + kRowLanes * j;
    CpAsync16(tile + wgmma::ChunkOffset(r, c), c < kNopeChunks ? nope + c : rope + (c - kNopeChunks));
  }
}

// The bf16 row of list item (src, e): a prefill chunk's row as the chunk
// passes decoded it, or an entry of a bf16 ring or pool.
__device__ __forceinline__ void Bf16Row(const AttentionArgs& a, uint8_t src, int64_t e,
                                        const uint4** nope, const uint4** rope) {
  if (src == kFromChunk) {
    *nope = reinterpret_cast<const uint4*>(a.chunk_rows + e * kHeadDim);
    *rope = *nope + kNopeChunks;
    return;
  }
  const EntryPool& pool = SourcePool(a, src);
  *nope = reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(pool.nope) +
                                         e * kNopeDim);
  *rope = reinterpret_cast<const uint4*>(pool.rope + e * kRopeDim);
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

// One fp8 row's bytes that a producer lane loads into registers: lane q of
// the row's four owns 16-byte code pieces q, q + 4, ..., so a quad reads 64
// contiguous bytes a load. Its bf16 RoPE pieces q, q + 4 go to the tile by
// cp.async, as bf16 rows do (DequantRowsToTileFmt): fewer registers a row,
// no store pass for them.
struct RowPart {
  uint4 v[kFp8Loads];                // the codes
  uint32_t scale[3];                 // ds_fp8: the words holding the row's 7 scale bytes
  int soff;                          // the first scale byte in them
};

// Issues the loads of the lane's part of entry e (fp8 pools; not waited for).
template <int kFmt>
__device__ __forceinline__ void LoadRowPart(const AttentionArgs& a, uint8_t src, int64_t e,
                                            int qd, RowPart* x) {
  const EntryPool& pool = SourcePool(a, src);
  const uint4* codes = reinterpret_cast<const uint4*>(pool.nope + e * kNopeDim);
#pragma unroll
  for (int j = 0; j < kFp8Loads; ++j) x->v[j] = __ldg(codes + qd + kRowLanes * j);
  if constexpr (kFmt == kDsFp8) {
    // entry e's 7 scale bytes start at byte 7e, (3 (e mod 4)) mod 4 into its first word;
    // they lie in 3 aligned words, none read past the pool
    const int64_t word = e * kNopeTiles / 4;
    const int64_t words = (PoolEntries(a, src) * kNopeTiles + 3) / 4;
#pragma unroll
    for (int k = 0; k < 3; ++k)
      x->scale[k] = word + k < words
                        ? __ldg(reinterpret_cast<const uint32_t*>(pool.scale) + word + k)
                        : 0u;
    x->soff = (3 * static_cast<int>(e & 3)) & 3;
  } else {
    x->scale[0] = __ldg(reinterpret_cast<const uint32_t*>(pool.scale) + e);   // fp8_token's float
  }
}

// Dequantizes the lane's codes of a row into row r of a bf16 tile: code
// piece qd + 4j is channels 16 (qd + 4j) .. + 15, chunks 2 (qd + 4j) and + 1,
// all of ds_fp8's scale tile j.
template <int kFmt>
__device__ __forceinline__ void StoreRowPart(const RowPart& x, int qd, uint8_t* tile, int r) {
  const uint64_t sw = (static_cast<uint64_t>(x.scale[1]) << 32) | x.scale[0];
#pragma unroll
  for (int j = 0; j < kFp8Loads; ++j) {
    float s;
    if constexpr (kFmt == kDsFp8) {
      const int byte = x.soff + j;
      const uint32_t b = byte < 8 ? static_cast<uint32_t>(sw >> (8 * byte))
                                  : x.scale[2] >> (8 * (byte - 8));
      s = num::E8m0ToF32(static_cast<uint8_t>(b));
    } else {
      s = __uint_as_float(x.scale[0]);
    }
    const int c = 2 * (qd + kRowLanes * j);
    *reinterpret_cast<uint4*>(tile + wgmma::ChunkOffset(r, c)) =
        DequantChunkFast(x.v[j].x, x.v[j].y, s);
    *reinterpret_cast<uint4*>(tile + wgmma::ChunkOffset(r, c + 1)) =
        DequantChunkFast(x.v[j].z, x.v[j].w, s);
  }
}

// The producer warpgroup's filling of bf16 tile `tile` with list rows
// 0..n-1, rows n..63 zero (a masked row must hold finite values: its zero
// weight times NaN is NaN). Four lanes a row, two rows a lane (r and r + 32)
// one after the other. An fp8 row's codes are dequantized through registers,
// every load of a row issued before its first store: a lane's two rows are
// its only dependent chains a tile (both rows' loads in flight spill). What
// needs no arithmetic goes by cp.async in the same quads, fire and forget:
// an fp8 row's RoPE, a bf16 pool's rows, a prefill chunk's rows as decoded
// once. The tile waits for its copies once, at its end.
template <int kFmt>
__device__ __forceinline__ void DequantRowsToTileFmt(const AttentionArgs& a, const LoopShared& sm,
                                                     uint8_t* tile, int n) {
  const int tid = threadIdx.x, qd = tid & (kRowLanes - 1), r0 = tid / kRowLanes;
  constexpr int kRowsALane = kTileRows * kRowLanes / 128;
  for (int i = 0; i < kRowsALane; ++i) {
    const int r = r0 + 32 * i;
    if (r >= n) {
      for (int c = qd; c < kChunks; c += kRowLanes)
        *reinterpret_cast<uint4*>(tile + wgmma::ChunkOffset(r, c)) = make_uint4(0, 0, 0, 0);
      continue;
    }
    const uint8_t src = sm.list_src[r];
    const int64_t e = sm.list[r];
    if (kFmt == kBf16 || src == kFromChunk) {
      const uint4 *nope, *rope;
      Bf16Row(a, src, e, &nope, &rope);
      CopyBf16RowAsync(nope, rope, qd, tile, r);
    } else {
      const uint4* rope = reinterpret_cast<const uint4*>(SourcePool(a, src).rope + e * kRopeDim);
#pragma unroll
      for (int j = 0; j < kRopeLoads; ++j)
        CpAsync16(tile + wgmma::ChunkOffset(r, kNopeChunks + qd + kRowLanes * j),
                  rope + qd + kRowLanes * j);
      RowPart x;
      LoadRowPart<kFmt>(a, src, e, qd, &x);
      StoreRowPart<kFmt>(x, qd, tile, r);
    }
  }
  CpAsyncCommit();   // wait_group waits for committed groups only
  CpAsyncWait<0>();
}

// One instantiation per pool format, chosen once a tile: the row loop tests
// no format (docs/perf/attention.md measures the difference).
__device__ __forceinline__ void DequantRowsToTile(const AttentionArgs& a, const LoopShared& sm,
                                                  uint8_t* tile, int n) {
  if (a.ring.fmt == kDsFp8) DequantRowsToTileFmt<kDsFp8>(a, sm, tile, n);
  else if (a.ring.fmt == kFp8Token) DequantRowsToTileFmt<kFp8Token>(a, sm, tile, n);
  else DequantRowsToTileFmt<kBf16>(a, sm, tile, n);
}

// The producer warpgroup: decide the items of [c0, c1) of token t that can
// be seen (AttnLiveItems), 128 at a time, and dequantize each tile of 64
// seen items into one of the two bf16 tiles (the consumers' products run on
// the other), handing it over once written; then the end marker.
template <class Products>
__device__ __forceinline__ void Produce(const AttentionArgs& a, LoopShared& sm, int64_t l,
                                        int64_t lk, int64_t t, int64_t s, int64_t p,
                                        const AttnChunkRows& chunk, int64_t c0, int64_t c1,
                                        bool counts) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int pending = 0, tiles = 0;
  auto emit = [&](int n) {
    const int b = tiles & 1;
    if (tiles >= 2) BarSync(kTileEmpty + b, kThreads);   // tile tiles - 2 was read
    DequantRowsToTile(a, sm, sm.tile[b], n);
    if (tid == 0) sm.tile_n[b] = n;
    Products::FenceShared();
    BarArrive(kTileFull + b, kThreads);
    ++tiles;
    // move the items not dequantized to the front of the list
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
  // decides items base .. min(base + 128, hi) - 1, emitting each full tile
  auto decide_round = [&](int64_t base, int64_t hi) {
    uint8_t src = 0;
    int64_t e = 0;
    const int64_t it = base + tid;
    const bool seen =
        it < hi && AttnDecideItem(a, l, lk, t, s, p, chunk, it, counts, true, &src, &e);
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
  };
  int64_t live[3][2];
  AttnLiveItems(a, c1, chunk, live);
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    const int64_t hi = min(c1, live[k][1]);
    for (int64_t base = max(c0, live[k][0]); base < hi; base += kRound) decide_round(base, hi);
  }
  if (pending > 0) emit(pending);
  // the end marker in the next tile, then every release the consumers owe
  const int b = tiles & 1;
  if (tiles >= 2) BarSync(kTileEmpty + b, kThreads);
  if (tid == 0) sm.tile_n[b] = -1;
  BarArrive(kTileFull + b, kThreads);
  if (tiles >= 1) BarSync(kTileEmpty + ((tiles - 1) & 1), kThreads);
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
__device__ __forceinline__ void Consume(const AttentionArgs& a, Shared& shared, int splits,
                                        int split, int64_t t, int64_t h0, int c) {
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
  for (int it = 0;; ++it) {
    const int b = it & 1;
    BarSync(kTileFull + b, kThreads);
    Products::WaitPV();                         // the last tile's P.V (overlapped the wait)
    if (it >= 1) BarArrive(kTileEmpty + (b ^ 1), kThreads);   // that tile may be refilled
    const int n = *reinterpret_cast<volatile int*>(&sm.tile_n[b]);
    if (n < 0) break;
    const uint8_t* tile = sm.tile[b];
    const uint64_t valid = n >= 64 ? ~0ull : (1ull << n) - 1ull;   // bit r: tile row r seen
    float sc[16];
    Products::Scores(sc, sm.q, tile + kHalfRows * 128 * c, warp);
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
    Products::IssuePV(o, sm.p, tile, c, warp);
  }
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
  // wgmma's swizzle works on absolute shared addresses: a 1024-byte aligned
  // base, found by adding an offset to the __shared__ array itself. Formed
  // through an integer, the pointer loses its state space and every tile
  // access compiles to a generic ST.E / LD.E instead of STS / LDS.
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const uint32_t raw = SharedAddress(smem_raw);
  Shared& shared = *reinterpret_cast<Shared*>(smem_raw + (((raw + 1023u) & ~1023u) - raw));
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
  if (first && tid == 0 && err >= 0) CountErrorAtomic(a.errors, err, t);
  if (!live) {                                   // every CTA of the cluster drops it
    AttnWriteDropped(a, t, h0, split == 0);
    return;
  }
  const AttnChunkRows chunk = AttnScanChunk(a, t, s, &sm.chunk);
  const int64_t items = AttnCandidates(a, p);
  const int64_t c0 = items * split / splits, c1 = items * (split + 1) / splits;
  Products::FenceShared();                       // q, written above, is read by the products
  __syncthreads();
  if (tid < 128) {
    RegsDown<kProducerRegs>();
    Produce<Products>(a, sm, l, lk, t, s, p, chunk, c0, c1, blockIdx.y == 0);
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
