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
//     With q_format "mxfp4": ScoreKernelMxfp4 (each CTA rounds q to MXFP4
//     itself, int8 dot products on the tensor cores, keys streamed through
//     a cp.async ring; see below).
//  2. SelectKernel, one block of 1024 threads per token, the token's keys in
//     registers when they fit (16 a thread; past 16384 keys a cluster of up
//     to 8 blocks a token, each counting its chunk, see SelectCtas and the
//     kernel), launched so that it may start
//     while the score kernel finishes (cuda::LaunchOverlapped; the mxfp4
//     score kernel lets it launch at once, so its CTAs take multiprocessors
//     as score CTAs leave them, clear their shared memory and read their
//     token's slot and position before they wait for the scores): a histogram
//     of the keys' top 12 bits finds the bin of the k-th largest key. In
//     the usual case (no bin holding taken keys has more than 512) one pass
//     drops the keys above that bin into groups by bin and gathers the bin's
//     keys, and each key's place is the count of keys above it in its group
//     (RankInBins): that orders them (key descending, index ascending) and
//     picks the bin's largest without a sort. Else, when the k-th key's bin
//     holds at most 1024 keys, radix passes among the gathered ones find the
//     k-th key; else radix passes of 8 bits below the bin's prefix over the
//     bin's keys (or all keys). The keys above it and those equal to it are
//     collected (in index order when they overflow the buffer); a bitonic
//     sort (shuffles within a warp, shared memory across) orders them.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "handlers_cuda.h"
#include "indexer_topk.h"
#include "kernels.cuh"

namespace dsv4 {
namespace {

namespace cg = cooperative_groups;

constexpr int kScoreThreads = 256;
constexpr int kSelectThreads = 1024;
constexpr int kRegKeys = 16;     // keys per select thread held in registers (n <= 16384)
constexpr int kMaxK = 4096;
constexpr int kHistCopies = 8;      // radix histograms per select block
constexpr int kHistStride = 257;
constexpr int kTopBits = 12;        // the select's first histogram: the keys' top bits
constexpr int kTopBins = 1 << kTopBits;
constexpr int kTopCopies = 4;       // lane L counts into copy L mod 4
// The select counts key 0 (a missing entry) into bin 0 unchecked and takes
// that bin as empty: every score's key, down to -inf's, must lie above it.
static_assert((0x007fffffu >> (32 - kTopBits)) > 0, "-inf's rank key above bin 0");
constexpr int kBinKeysCap = kTopCopies * kTopBins;   // keys of one bin, in the same space
// The select orders its keys by rank within their top-bits bins (RankInBins)
// while no bin that holds taken keys has more than this many: each key then
// costs at most this many comparisons, about what the bitonic sort costs.
constexpr int kRankBinMax = 512;
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

// ---- q_format "mxfp4": dot products on the int8 tensor cores ------------------
// One kernel, ScoreKernelMxfp4. Each CTA first rounds its token's q to
// MXFP4 into shared memory (QueryOperands, while its first key tiles load):
// the int8 codes (twice the e2m1 value) and factors Q of the per-block form,
// the fast form's shifted codes, wq and accumulator starts (dsv4/indexer.h).
// qscratch is left alone on CUDA: 16 KB of q per CTA is cheaper to round
// again than a launch.
// ScoreKernelMxfp4 gives each warp tiles of 32 entries, one logical block
// (2 KB of packed keys and 128 B of scale bytes, each contiguous: one
// block-table read, a plain copy into shared memory). mma.m16n8k32 covers 16
// entries and 8 heads; a tile is two row halves of 16.
//  - Fast tiles (the token's heads and the tile's keys within the guards of
//    the fast form): key codes shifted by their block's sk, one MMA chain
//    over all 128 channels gives A per (entry, head). The key operand is
//    unsigned, 128 + code (three instructions a word, no sign to handle), so
//    the chain adds A + 128 * sum(q): it starts from the bits of 2^23 less
//    128 * sum(q) of the head and ends at the bits of 2^23 + A. As a float
//    that is 2^23 + A for A >= 0 and below 2^23 otherwise, so one
//    saturating fma per head gives its term and one fma per node of the
//    head tree adds, scaled by 2^-72 with the weights' signs kept aside
//    (see TreeSigns).
//  - Other tiles, per row half and block b: S from one s8 x s8 MMA
//    (accumulator from 1.5 * 2^23; one fma gives u = fl(S K) while that
//    constant is finite: key scale bytes 1 to 231, else subtract then
//    multiply), then the fma chain of d.
// Channels are permuted identically in both operands of a form (an integer
// sum does not care): in the fast form lane c of a quad holds block c of a
// key row (its 16 bytes: one shared-memory read, one shift sk) and k-step kk
// its channels 8kk..8kk+7; in the per-block form k-step b is block b and
// lane c holds its channels 8c..8c+7. Heads are placed so that lane c of a
// quad holds heads 16c..16c+15 (n-tile j, column 2c + p: head 16c + 2j + p):
// levels 1-4 of the head tree stay in the lane, levels 5 and 6 take three
// shuffles for the lane's four rows (lane c ends with row g + 8c). A warp
// computes a fast tile's heads in two halves of 32 (FastTileHalf), so that it
// fits 128 registers: 16 warps a multiprocessor.
constexpr int kMmaThreads = 512;                             // one CTA a multiprocessor
constexpr int kMmaWarps = kMmaThreads / 32;
constexpr int kTile = 32;                                    // entries per warp tile
static_assert(kTile == kPerBlock, "a tile is one logical block");
constexpr int kMaxTilesPerWarp = 32;
static_assert(kMmaWarps * kMaxTilesPerWarp <= kMmaThreads, "a thread reads each tile's block");
// Tiles a score CTA works on at once: one a warp, or one a pair of warps
// (ScoreKernelMxfp4's kPairs).
__host__ __device__ constexpr int TileColumns(bool pairs) { return pairs ? kMmaWarps / 2 : kMmaWarps; }
constexpr int kScoreCtasPerSm = 1;
constexpr uint32_t kBlockMagicBits = 0x4B400000u;            // 1.5 * 2^23
constexpr float kBlockMagic = 12582912.f;
constexpr uint32_t kFastMagicBits = 0x4B000000u;             // 2^23
constexpr float kFastMagic = 8388608.f;
constexpr uint32_t kFmaScaleMax = 231;
constexpr int kFragWords = kQueryCodeBytes / 16;             // uint4 per code region
constexpr int kQueryPairs = kIndexHeads * kIndexScales;      // (head, block) pairs of q
constexpr int kQueryPairsPerThread = (kQueryPairs + kMmaThreads - 1) / kMmaThreads;
static_assert(kQueryPairs % 32 == 0 && kMmaThreads % 32 == 0, "whole warps of query pairs");

// Per-block form: the uint32 of the code region holding head h, channels
// 32b + 4r .. + 3, in fragment order: a uint4 per (n-tile j, block pair,
// lane) with .xy for the even block and .zw for the odd one.
__device__ __forceinline__ int BlockFragWord(int h, int b, int r) {
  const int j = (h % 16) / 2, n = 2 * (h / 16) + h % 2;
  return 4 * ((j * 2 + b / 2) * 32 + n * 4 + r / 2) + 2 * (b % 2) + r % 2;
}

// Fast form: block b in quad lane b, k-step kk = r / 2 (a uint4 per (n-tile
// j, k-step pair, lane): .xy the even k-step, .zw the odd one).
__device__ __forceinline__ int FastFragWord(int h, int b, int r) {
  const int j = (h % 16) / 2, n = 2 * (h / 16) + h % 2, kk = r / 2;
  return 4 * ((j * 2 + kk / 2) * 32 + n * 4 + b) + 2 * (kk % 2) + r % 2;
}

__device__ __forceinline__ uint32_t Prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// Per-block form. Eight e2m1 codes (code k in bits 4k..4k+3) -> eight int8
// holding twice their values, as two words (codes 0-3, codes 4-7).
// Magnitudes by a byte permute of an 8-entry table, negated bytewise
// ((0x80 - m) ^ 0x80 = -m mod 256, no borrow for m <= 0x80), then a permute
// picks by the sign bit.
__device__ __forceinline__ void E2m1x8ToInt8(uint32_t w, uint32_t* lo, uint32_t* hi) {
  const uint32_t sel = w & 0x77777777u;
  const uint32_t pick = ((w >> 1) & 0x44444444u) | 0x32103210u;   // +4: the negated word
  const uint32_t pl = Prmt(0x03020100u, 0x0C080604u, sel);          // 0 1 2 3 | 4 6 8 12
  const uint32_t ph = Prmt(0x03020100u, 0x0C080604u, sel >> 16);
  const uint32_t nl = (0x80808080u - pl) ^ 0x80808080u, nh = (0x80808080u - ph) ^ 0x80808080u;
  *lo = Prmt(pl, nl, pick);
  *hi = Prmt(ph, nh, pick >> 16);
}

// Fast form. Eight e2m1 codes -> eight bytes 128 + twice their value times
// 2^sk, as two words. t0, t1: the magnitude table 0 1 2 3 | 4 6 8 12 shifted
// by sk (at most 96). A byte permute with the code as its selector gives the
// magnitude of a positive code and 0 for a negative one (selector bit 3
// copies the table byte's sign bit, 0); with bit 3 flipped, the reverse.
// 0x80 + positive - negative lies in [32, 224] per byte: nothing carries or
// borrows across bytes.
__device__ __forceinline__ void E2m1x8ToBiased(uint32_t w, uint32_t t0, uint32_t t1,
                                               uint32_t* lo, uint32_t* hi) {
  const uint32_t wn = w ^ 0x88888888u;
  *lo = Prmt(t0, t1, w) + 0x80808080u - Prmt(t0, t1, wn);
  *hi = Prmt(t0, t1, w >> 16) + 0x80808080u - Prmt(t0, t1, wn >> 16);
}

// d = A * B + C, C given as four words (s32, or the bits of a magic start);
// A unsigned (the fast form's biased keys) or signed.
template <bool kUnsignedA>
__device__ __forceinline__ void Mma(uint32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1, const uint32_t (&c)[4]) {
  if (kUnsignedA)
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]),
          "r"(c[2]), "r"(c[3]));
  else
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]),
          "r"(c[2]), "r"(c[3]));
}

// d > 0 ? d : 0 (NaN -> 0) in one instruction. fmaxf may return -0 for
// d = -0; a zero's sign cannot change a sum with a non-zero term, and the
// rank key treats -0 as +0, so the keys equal the definition's.
__device__ __forceinline__ float Relu(float d) { return fmaxf(d, 0.f); }

// The fast form's head tree, scaled and signed. With s = |wq| 2^-72 (0 or in
// [2^-122, 2^-22] by the query guards) a head's term is one saturating fma of
// the chain's end x (2^23 + A as a float for A >= 0, below 2^23 otherwise):
// sat(x s - 2^23 s) = fl(A s) = |fl(wq relu(A))| 2^-72 (exact product before
// the one rounding; normal, as A >= 1 and s >= 2^-122; saturation gives 0
// for A <= 0 or NaN, and A s < 1/2 never clamps above). The weight's sign is
// kept aside: every tree value v stands for tau v 2^72 of the definition's
// tree with tau = +-1, and a node of children (a, tau_a), (b, tau_b) is
// fma(a, tau_a tau_b, b) = tau_b fl(tau_a a + tau_b b), sign tau_b. Scaling
// by 2^-72 commutes with each rounding: a sum that lands below 2^-126 is
// exact in both scales (both addends lie on a grid of 2^-145 here, of 2^-73
// there), every other value stays normal. So a head costs one instruction,
// a node one, and the root times tau 2^72 Kf is the definition's score
// rounded once (Kf a power of two, dsv4/indexer.h). The per-block form runs
// the same tree with every tau = +1: fma(a, 1, b) = fl(a + b).
constexpr uint32_t kLeafScaleBits = 0x1B800000u;            // 2^-72
constexpr uint32_t kRootScaleBits = 0x63800000u;            // 2^72

// The multipliers of the nodes one quad lane c computes (heads 16c..16c+15,
// then the quad's levels 5 and 6) and its root factor tau 2^72.
struct TreeSigns {
  float l1[8];   // pair j: heads 16c + 2j, +1
  float l2[4], l3[2], l4;
  float l5, l6;  // with lanes c ^ 1, c ^ 2
  float root;
  float pad[2];
};
static_assert(sizeof(TreeSigns) == 80, "five 16-byte rows");

// A quad lane's TreeSigns from the weights' sign bits (bit h: head h < 0).
// A node takes the sign of its right child, so of its last head.
__device__ TreeSigns MakeTreeSigns(uint64_t neg, int c) {
  const auto sign = [&](int h) { return static_cast<uint32_t>(neg >> h) & 1u; };
  const auto mul = [&](int ha, int hb) { return __uint_as_float(0x3f800000u | ((sign(ha) ^ sign(hb)) << 31)); };
  const int h0 = 16 * c;
  TreeSigns s;
  for (int j = 0; j < 8; ++j) s.l1[j] = mul(h0 + 2 * j, h0 + 2 * j + 1);
  for (int i = 0; i < 4; ++i) s.l2[i] = mul(h0 + 4 * i + 1, h0 + 4 * i + 3);
  for (int i = 0; i < 2; ++i) s.l3[i] = mul(h0 + 8 * i + 3, h0 + 8 * i + 7);
  s.l4 = mul(h0 + 7, h0 + 15);
  s.l5 = mul(h0 + 15, 16 * (c ^ 1) + 15);
  s.l6 = mul(h0 + 15, 16 * (c ^ 2) + 15);
  s.root = __uint_as_float(kRootScaleBits | (sign(h0 + 15) << 31));
  s.pad[0] = s.pad[1] = 0.f;
  return s;
}

// Every multiplier 1: the plain tree of the per-block form.
__device__ __forceinline__ TreeSigns PlainTreeSigns() {
  TreeSigns s;
  for (int j = 0; j < 8; ++j) s.l1[j] = 1.f;
  for (int i = 0; i < 4; ++i) s.l2[i] = 1.f;
  s.l3[0] = s.l3[1] = s.l4 = s.l5 = s.l6 = s.root = 1.f;
  s.pad[0] = s.pad[1] = 0.f;
  return s;
}

// A fast-form head term: sat(x s + m), m = -2^23 s (see above).
__device__ __forceinline__ float FastLeaf(uint32_t bits, float s, float m) {
  float r;
  asm("fma.rn.sat.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(__uint_as_float(bits)), "f"(s), "f"(m));
  return r;
}

// Levels 2 and 3 of the head tree (in the lane) over one half of the lane's
// heads: p[i] = level 1 of heads 16c + 8hf + 2i, +1.
__device__ __forceinline__ float HalfHeadTree(const float (&p)[4], const TreeSigns& s, int hf) {
  return fmaf(fmaf(p[0], s.l2[2 * hf], p[1]), s.l3[hf], fmaf(p[2], s.l2[2 * hf + 1], p[3]));
}

// Level 4 of the head tree: the lane's two halves of heads joined.
__device__ __forceinline__ float JoinHeadHalves(float lo, float hi, const TreeSigns& s) {
  return fmaf(lo, s.l4, hi);
}

// Levels 2..4 of the head tree (in the lane) from level 1: p[j] = heads
// 16c + 2j, +1 of quad lane c.
__device__ __forceinline__ float LaneHeadTree(const float (&p)[8], const TreeSigns& s) {
  const float lo[4] = {p[0], p[1], p[2], p[3]}, hi[4] = {p[4], p[5], p[6], p[7]};
  return JoinHeadHalves(HalfHeadTree(lo, s, 0), HalfHeadTree(hi, s, 1), s);
}

// Levels 5 and 6 for the lane's rows g + 8h (h = 0..3); returns the sum of
// row g + 8c. Level 5 adds lanes c and c ^ 1 (lane c keeps rows h = c mod 2
// and c mod 2 + 2), level 6 lanes c and c ^ 2. Each lane adds the value it
// receives into its own: the sum keeps the lane's sign (m5, m6: the product
// of both lanes' signs), and which lane adds does not matter in IEEE
// arithmetic.
__device__ __forceinline__ float QuadHeadTree(const float (&l4)[4], int c, float m5, float m6) {
  const bool odd = c & 1, high = c & 2;
  const float keep0 = odd ? l4[1] : l4[0], send0 = odd ? l4[0] : l4[1];
  const float keep1 = odd ? l4[3] : l4[2], send1 = odd ? l4[2] : l4[3];
  const float l5a = fmaf(__shfl_xor_sync(cuda::kFull, send0, 1), m5, keep0);   // row h = c mod 2
  const float l5b = fmaf(__shfl_xor_sync(cuda::kFull, send1, 1), m5, keep1);   // row c mod 2 + 2
  return fmaf(__shfl_xor_sync(cuda::kFull, high ? l5a : l5b, 2), m6, high ? l5b : l5a);
}

// Fast form, one half hf of the lane's heads (n-tiles 4hf..4hf+3: heads
// 16c + 8hf .. + 7): levels 1-3 of the head tree for rows g + 8r, scaled and
// signed (see TreeSigns). keys[r]: block c of row g + 8r (word kk: k-step
// kk); tab[r]: its magnitude table. leaf[4j] = (s, s', -2^23 s, -2^23 s')
// and start[4j] = (S, S', S, S'), the accumulator starts, of heads 16c + 2j,
// +1. Each half decodes the keys itself, so that only half the heads'
// accumulators are live at once (a build without the decode was only 2 %
// faster, benchmarks/RESULTS-indexer.md run 12). The compiler merges the two
// identical decodes: the sm_90a loop has one decode's 68 PRMT a tile (run 19).
template <int kHalf>
__device__ __forceinline__ void FastTileHalf(const uint4* bfrag, const float4* leaf,
                                             const TreeSigns& signs, const uint4* start,
                                             const uint4 (&keys)[4], const uint2 (&tab)[4],
                                             float (&l3)[4]) {
  constexpr int j0 = 4 * kHalf;
  uint32_t acc[2][4][4];   // [row half][n-tile - j0][fragment]
#pragma unroll
  for (int bp = 0; bp < 2; ++bp) {
    uint32_t a[2][2][4];   // [row half][k-step of the pair][fragment]
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint4& k0 = keys[2 * t];
        const uint4& k1 = keys[2 * t + 1];
        const uint32_t w0 = bp == 0 ? (e == 0 ? k0.x : k0.y) : (e == 0 ? k0.z : k0.w);
        const uint32_t w1 = bp == 0 ? (e == 0 ? k1.x : k1.y) : (e == 0 ? k1.z : k1.w);
        E2m1x8ToBiased(w0, tab[2 * t].x, tab[2 * t].y, &a[t][e][0], &a[t][e][2]);
        E2m1x8ToBiased(w1, tab[2 * t + 1].x, tab[2 * t + 1].y, &a[t][e][1], &a[t][e][3]);
      }
    }
    // eight independent accumulators between an MMA and the next on the same one
    uint4 bq[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) bq[j] = bfrag[((j0 + j) * 2 + bp) * 32];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        if (bp == 0) {
          const uint4 s = start[4 * (j0 + j)];
          const uint32_t c0[4] = {s.x, s.y, s.z, s.w};
          Mma<true>(acc[t][j], a[t][0], bq[j].x, bq[j].y, c0);
        } else {
          Mma<true>(acc[t][j], a[t][0], bq[j].x, bq[j].y, acc[t][j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int t = 0; t < 2; ++t) Mma<true>(acc[t][j], a[t][1], bq[j].z, bq[j].w, acc[t][j]);
  }
  float p[4][4];   // [row g + 8r][pair]
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 f = leaf[4 * (j0 + j)];
    const float m = signs.l1[j0 + j];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      p[2 * t][j] = fmaf(FastLeaf(acc[t][j][0], f.x, f.z), m, FastLeaf(acc[t][j][1], f.y, f.w));
      p[2 * t + 1][j] = fmaf(FastLeaf(acc[t][j][2], f.x, f.z), m, FastLeaf(acc[t][j][3], f.y, f.w));
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) l3[r] = HalfHeadTree(p[r], signs, kHalf);
}

// Key bytes of one row half for this lane in the per-block form (rows g and
// g + 8 of the half, channels 8c.. of each block) and their scale words.
struct TileKeys {
  uint32_t kg[4], kh[4], sg, sh;
};

// Per-block form: level-1 head sums of rows g and g + 8 of a row half (the
// definition's order). bfrag: the unshifted codes.
template <bool kFmaScale>
__device__ __forceinline__ void BlockTileSums(const uint4* bfrag,
                                              const float2 (*qf_s)[kIndexHeads / 2],
                                              const float2* w_s, const TileKeys& k, int c,
                                              float (&pg)[8], float (&ph)[8]) {
  float acc[8][4];
#pragma unroll
  for (int b = 0; b < kIndexScales; ++b) {
    uint32_t a[4];
    E2m1x8ToInt8(k.kg[b], &a[0], &a[2]);
    E2m1x8ToInt8(k.kh[b], &a[1], &a[3]);
    // scale bytes 1..231: 2^(byte - 127) is the byte as an exponent
    const float Kg = kFmaScale ? __uint_as_float(((k.sg >> (8 * b)) & 255u) << 23)
                               : num::E8m0ToF32(static_cast<uint8_t>(k.sg >> (8 * b)));
    const float Kh = kFmaScale ? __uint_as_float(((k.sh >> (8 * b)) & 255u) << 23)
                               : num::E8m0ToF32(static_cast<uint8_t>(k.sh >> (8 * b)));
    const float MKg = -kBlockMagic * Kg, MKh = -kBlockMagic * Kh;
    const uint32_t start[4] = {kBlockMagicBits, kBlockMagicBits, kBlockMagicBits, kBlockMagicBits};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t d[4];
      const uint4 bq = bfrag[(j * 2 + b / 2) * 32];
      Mma<false>(d, a, b % 2 ? bq.z : bq.x, b % 2 ? bq.w : bq.y, start);
      const float2 Q = qf_s[b][8 * c + j];
      float u[4];
      if (kFmaScale) {
        u[0] = fmaf(__uint_as_float(d[0]), Kg, MKg);
        u[1] = fmaf(__uint_as_float(d[1]), Kg, MKg);
        u[2] = fmaf(__uint_as_float(d[2]), Kh, MKh);
        u[3] = fmaf(__uint_as_float(d[3]), Kh, MKh);
      } else {
        u[0] = (__uint_as_float(d[0]) - kBlockMagic) * Kg;
        u[1] = (__uint_as_float(d[1]) - kBlockMagic) * Kg;
        u[2] = (__uint_as_float(d[2]) - kBlockMagic) * Kh;
        u[3] = (__uint_as_float(d[3]) - kBlockMagic) * Kh;
      }
      if (b == 0) {
        acc[j][0] = u[0] * Q.x;
        acc[j][1] = u[1] * Q.y;
        acc[j][2] = u[2] * Q.x;
        acc[j][3] = u[3] * Q.y;
      } else {
        acc[j][0] = fmaf(u[0], Q.x, acc[j][0]);
        acc[j][1] = fmaf(u[1], Q.y, acc[j][1]);
        acc[j][2] = fmaf(u[2], Q.x, acc[j][2]);
        acc[j][3] = fmaf(u[3], Q.y, acc[j][3]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 w = w_s[8 * c + j];
    pg[j] = w.x * Relu(acc[j][0]) + w.y * Relu(acc[j][1]);
    ph[j] = w.x * Relu(acc[j][2]) + w.y * Relu(acc[j][3]);
  }
}

// Every scale byte of the word in [1, kFmaScaleMax] (byte - 1 <= max - 1,
// four bytes at once).
__device__ __forceinline__ bool FmaScales(uint32_t s) {
  return __vcmpleu4(__vsub4(s, 0x01010101u), (kFmaScaleMax - 1) * 0x01010101u) == 0xffffffffu;
}

// ---- key tiles: a cp.async ring per warp ----
// A tile in shared memory: the block's 32 packed keys (64 bytes each, rows
// g and g + 1 of a quarter warp's 16-byte reads fill 32 distinct banks),
// then its 32 scale words.
// Two stages: one tile ahead of the one in use. Deeper rings measured
// slower on an H100 (benchmarks/RESULTS-indexer.md run 12, score kernel at
// B = 64, 64k: with 12 warps 48.2 us for 2 stages, 49.0 for 3, 49.4 for 4,
// 52.7 for 7; with 16 warps 47.4 for 2, 50.9 for 4).
constexpr int kStages = 2;
constexpr int kRowWords = kIndexPacked / 4;                  // 16
constexpr int kScaleWord = kTile * kRowWords;                // 512
constexpr int kTileWords = kScaleWord + kTile;               // 544
constexpr int64_t kBlockKeyBytes = static_cast<int64_t>(kPerBlock) * kIndexPacked;     // 2048
constexpr int64_t kBlockScaleBytes = static_cast<int64_t>(kPerBlock) * kIndexScales;   // 128
constexpr int kRingBytes = kMmaWarps * kStages * kTileWords * 4;                      // dynamic

// With an L2 eviction policy (StreamPolicy).
__device__ __forceinline__ void CpAsync16(uint32_t smem, const void* gmem, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;"
               ::"r"(smem), "l"(gmem), "l"(policy)
               : "memory");
}
// The key stream's L2 policy: evict_first where the keys are more than L2
// holds (KeysEvictFirst), so that lines read once go before the rank keys
// the select reads next; else evict_normal.
__device__ __forceinline__ uint64_t StreamPolicy(bool evict_first) {
  uint64_t p;
  if (evict_first) asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  else asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(p));
  return p;
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// A warp's view of its tiles: lane L copies 16-byte chunks L, L + 32, L + 64
// and L + 96 of the keys and (lanes 0-7) chunk L of the scales.
struct TileStream {
  const uint8_t* packed;     // layer's packed keys + this lane's first chunk
  const uint8_t* scale;      // layer's scale bytes + this lane's chunk
  uint32_t dst;              // this lane's shared address in stage 0
  int64_t N;
  uint64_t policy;           // StreamPolicy

  // Starts the copy of `block` into `stage`; nothing for a missing block.
  __device__ __forceinline__ void Issue(int32_t block, int stage, int lane) const {
    if (block < 0 || block >= N) return;
    const uint32_t d = dst + static_cast<uint32_t>(stage) * kTileWords * 4;
    const uint8_t* src = packed + static_cast<int64_t>(block) * kBlockKeyBytes;
#pragma unroll
    for (int i = 0; i < 4; ++i) CpAsync16(d + 512 * i, src + 512 * i, policy);
    if (lane < 8)
      CpAsync16(d + kScaleWord * 4, scale + static_cast<int64_t>(block) * kBlockScaleBytes, policy);
  }
};

// A tile in the per-block form: levels 1-4 of the head tree of the lane's
// rows g + 8h. Out of line: rare, and its registers stay out of the fast
// path's. One copy per score kernel (kCaller: its kPairs), so that the
// compiler still folds the caller's shared-memory addresses into it: a copy
// shared by two callers takes them as parameters, and the caller spills.
template <bool kCaller>
__device__ __noinline__ float4 BlockTileL4(const uint32_t* st, const uint4* bfrag,
                                           const float2 (*qf_s)[kIndexHeads / 2],
                                           const float2* w_s, int g, int c) {
  float l4[4];
  const TreeSigns plain = PlainTreeSigns();
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    TileKeys cur;
    const uint32_t* rg = st + (g + 16 * half) * kRowWords + c;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      cur.kg[b] = rg[4 * b];
      cur.kh[b] = rg[8 * kRowWords + 4 * b];
    }
    cur.sg = st[kScaleWord + g + 16 * half];
    cur.sh = st[kScaleWord + g + 8 + 16 * half];
    float pg[8], ph[8];
    if (__all_sync(cuda::kFull, FmaScales(cur.sg) && FmaScales(cur.sh)))
      BlockTileSums<true>(bfrag, qf_s, w_s, cur, c, pg, ph);
    else
      BlockTileSums<false>(bfrag, qf_s, w_s, cur, c, pg, ph);
    l4[2 * half] = LaneHeadTree(pg, plain);
    l4[2 * half + 1] = LaneHeadTree(ph, plain);
  }
  return make_float4(l4[0], l4[1], l4[2], l4[3]);
}

// The token's query as the MMAs read it, in shared memory: the MXFP4
// rounding of q (dsv4/indexer.h) in both fragment orders, the per-block
// factors and weights, and the fast form's head terms, accumulator starts
// and tree signs. The fast-form constants of heads 16c + 2j, +1 sit at index
// 4j + c, so the four quad lanes' 16-byte reads of one j fall in distinct
// banks.
struct QueryOperands {
  uint4 fast[kFragWords];                    // shifted codes, fast fragment order
  uint4 block[kFragWords];                   // codes, per-block fragment order
  float2 qf[kIndexScales][kIndexHeads / 2];  // Q[b][h], two heads a float2
  float2 w[kIndexHeads / 2];
  float4 leaf[kIndexHeads / 2];              // s, s', -2^23 s, -2^23 s' (s = |wq| 2^-72)
  uint4 start[kIndexHeads / 2];              // S, S', S, S'
  TreeSigns tree[4];                         // of quad lane c
};

// One (head, block) of the token's query as loaded: 32 bf16 and the head's
// weight.
struct QueryBlockRaw {
  uint4 q[kMxfp4Block / 8];
  float w;
};
__device__ __forceinline__ QueryBlockRaw LoadQueryBlock(const IndexerTopkArgs& a, int64_t t, int h,
                                                        int b) {
  QueryBlockRaw r;
  const uint4* src =
      reinterpret_cast<const uint4*>(a.q + (t * kIndexHeads + h) * kIndexDim + b * kMxfp4Block);
#pragma unroll
  for (int i = 0; i < kMxfp4Block / 8; ++i) r.q[i] = src[i];
  r.w = a.weights[t * kIndexHeads + h];
  return r;
}

// One (head h, block b) of the token's query into `qo`: the block's scale
// byte, its 32 codes and (with the head's other three blocks, in lanes
// 4(h mod 8) + b of this warp) the head's fast-form guards and code sum.
// Returns whether the head is within the guards.
__device__ bool QuantizeQueryPair(const QueryBlockRaw& raw, int h, int b, QueryOperands& qo) {
  const float w = raw.w;
  float x[kMxfp4Block];
#pragma unroll
  for (int i = 0; i < kMxfp4Block / 8; ++i) {
    const uint32_t v[4] = {raw.q[i].x, raw.q[i].y, raw.q[i].z, raw.q[i].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      x[8 * i + 2 * e] = num::BitsFloat(v[e] << 16);
      x[8 * i + 2 * e + 1] = num::BitsFloat(v[e] & 0xffff0000u);
    }
  }
  int8_t q2[kMxfp4Block];
  const uint32_t sb = QuantizeIndexQueryBlock(x, q2);
  uint32_t mq = sb, maxq = sb;
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    mq = min(mq, __shfl_xor_sync(cuda::kFull, mq, o));
    maxq = max(maxq, __shfl_xor_sync(cuda::kFull, maxq, o));
  }
  const float wq = IndexQueryFastWeight(mq, maxq, w);
  const uint32_t sq = num::IsNan(wq) ? 0 : sb - mq;
  int sum = 0;
#pragma unroll
  for (int r = 0; r < kMxfp4Block / 4; ++r) {
    uint32_t word = 0, shifted = 0;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const uint32_t code = static_cast<uint8_t>(q2[4 * r + v]);
      word |= code << (8 * v);
      shifted |= ((code << sq) & 255u) << (8 * v);
    }
    sum = __dp4a(static_cast<int>(shifted), 0x01010101, sum);   // four signed bytes
    reinterpret_cast<uint32_t*>(qo.block)[BlockFragWord(h, b, r)] = word;
    reinterpret_cast<uint32_t*>(qo.fast)[FastFragWord(h, b, r)] = shifted;
  }
  (&qo.qf[b][0].x)[h] = IndexQueryFactor(sb);
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) sum += __shfl_xor_sync(cuda::kFull, sum, o);
  if (b == 0) {
    const int pair = h / 2, slot = 4 * (pair % 8) + pair / 8, p = h % 2;
    (&qo.w[0].x)[h] = w;
    const float sw = num::AbsF(wq) * __uint_as_float(kLeafScaleBits);   // exact in the guards
    (&qo.leaf[slot].x)[p] = sw;
    (&qo.leaf[slot].x)[2 + p] = -kFastMagic * sw;
    // |128 sum| < 2^21: the start's bits are those of a float in [2^22, 2^24)
    uint32_t* st = &qo.start[slot].x + p;
    st[0] = st[2] = kFastMagicBits - 128u * static_cast<uint32_t>(sum);
  }
  return !num::IsNan(wq);
}

// One CTA: one token, columns * tiles_per_warp tiles of consecutive entries;
// the warps of column w take tiles w, w + columns, ..., each keeping
// kStages - 1 of them in flight. One CTA of 16 warps a multiprocessor (128
// registers a thread), so each multiprocessor rounds its token's q once, not
// once per small CTA (with three 4-warp CTAs, an earlier shape, ncu put a
// quarter of the warps' samples in that prologue, waiting on q behind the
// key tiles' loads and repeating its arithmetic; benchmarks/RESULTS-indexer.md
// runs 11 and 12).
// kPairs (grids of a tile a warp, PairWarps): 8 columns of two warps; warp
// 2p + hf computes half hf of column p's fast tiles (FastTileHalf; each warp
// copies the tile into its own ring) and warp 2p joins the halves, scores
// per-block tiles alone and stores. A tile's latency is all such a grid
// sees, and one half is about half of it. Else 16 columns of one warp.
template <bool kPairs>
__global__ void __launch_bounds__(kMmaThreads, kScoreCtasPerSm) ScoreKernelMxfp4(IndexerTopkArgs a,
                                                                                 int tiles_per_warp,
                                                                                 bool evict_first) {
  extern __shared__ __align__(16) uint32_t ring_dyn[];       // kRingBytes: the key rings
  __shared__ QueryOperands qo;
  __shared__ int32_t blocks_s[kMmaWarps * kMaxTilesPerWarp];
  // kPairs: warp 2p + 1's halves of the head tree, a buffer per tile parity
  __shared__ float half_l3[kPairs ? 2 : 1][kPairs ? TileColumns(true) : 1][4][32];
  cuda::LetNextStart();        // the select may take multiprocessors this grid leaves
  const int64_t t = blockIdx.x;
  // the query first, even before the token's slot and position (its address
  // needs neither; a CTA that then has nothing to score wasted 16 KB of
  // reads): its loads go out before the key tiles', which would otherwise
  // queue ahead of them (every CTA starts its rings at once)
  QueryBlockRaw qraw[kQueryPairsPerThread];
#pragma unroll
  for (int i = 0; i < kQueryPairsPerThread; ++i) {
    const int pair = threadIdx.x + i * kMmaThreads;
    if (pair < kQueryPairs) qraw[i] = LoadQueryBlock(a, t, pair / kIndexScales, pair % kIndexScales);
  }
  const TokenInfo ti = ReadToken(a, t);
  constexpr int columns = TileColumns(kPairs);
  const int64_t span = static_cast<int64_t>(columns) * tiles_per_warp * kTile;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * span;
  if (!ti.ok || first >= ti.n) return;
  // warp 0: the weights' signs, for the fast form's tree (TreeSigns); read
  // again here (256 bytes), as gathering them from the pair threads would
  // need one more CTA barrier
  static_assert(kIndexHeads == 64, "two weights a lane of warp 0");
  uint32_t neg_lo = 0, neg_hi = 0;
  if (threadIdx.x < 32) {
    neg_lo = __float_as_uint(a.weights[t * kIndexHeads + threadIdx.x]) >> 31;
    neg_hi = __float_as_uint(a.weights[t * kIndexHeads + 32 + threadIdx.x]) >> 31;
  }
  if (threadIdx.x < columns * tiles_per_warp) {
    // each logical block is read here by one CTA: it counts a missing one
    const int64_t j = first / kTile + threadIdx.x;
    const int32_t block = j < a.MB ? a.block_table[ti.slot * a.MB + j] : -1;
    blocks_s[threadIdx.x] = block;
    if (j * kPerBlock < ti.n && (block < 0 || block >= a.N)) atomicAdd(&a.errors[kMissingBlock], 1);
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int column = kPairs ? warp >> 1 : warp;                // tiles column + columns * it
  const int half = kPairs ? warp & 1 : -1;                     // pairs: this warp's heads
  const int own_row = g + 8 * c;                               // the row this lane finishes
  const uint32_t byte_c = 0x4440u + c;                         // permute: byte c, zeros above
  const int64_t l = *a.layer;
  TileStream ts;
  ts.N = a.N;
  ts.policy = StreamPolicy(evict_first);
  ts.packed = a.packed + l * a.N * kBlockKeyBytes + lane * 16;
  ts.scale = a.scale + l * a.N * kBlockScaleBytes + (lane & 7) * 16;
  auto ring_s = reinterpret_cast<uint32_t (*)[kStages][kTileWords]>(ring_dyn);
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(&ring_s[warp][0][0]));
  ts.dst = ring + lane * 16;
  uint32_t* keys = a.scratch + t * a.E;
  int tiles = 0;                                               // this warp's tiles below n
  while (tiles < tiles_per_warp && first + (column + columns * tiles) * kTile < ti.n) ++tiles;
  auto issue = [&](int it) {
    if (it < tiles) ts.Issue(blocks_s[column + columns * it], it % kStages, lane);
    CpAsyncCommit();                                           // empty groups keep the count
  };
#pragma unroll 1
  for (int it = 0; it < kStages - 1; ++it) issue(it);
  // the query, while the first tiles arrive (whole warps of pairs or none)
  bool head_fast = true;
#pragma unroll
  for (int i = 0; i < kQueryPairsPerThread; ++i) {
    const int pair = threadIdx.x + i * kMmaThreads;
    if (pair < kQueryPairs)
      head_fast &= QuantizeQueryPair(qraw[i], pair / kIndexScales, pair % kIndexScales, qo);
  }
  if (threadIdx.x < 32) {
    const uint64_t neg = __ballot_sync(cuda::kFull, neg_lo) |
                         static_cast<uint64_t>(__ballot_sync(cuda::kFull, neg_hi)) << 32;
    if (threadIdx.x < 4) qo.tree[threadIdx.x] = MakeTreeSigns(neg, threadIdx.x);
  }
  const bool token_fast = __syncthreads_and(head_fast);
  for (int it = 0; it < tiles; ++it) {                         // uniform per warp
    const int32_t block = blocks_s[column + columns * it];    // read early: hides its latency
    issue(it + kStages - 1);
    CpAsyncWait<kStages - 1>();
    __syncwarp();
    const int64_t e0 = first + (column + columns * it) * kTile;
    if (block < 0 || block >= a.N) {
      if (half <= 0 && e0 + lane < ti.n) keys[e0 + lane] = 0;
    } else if (half <= 0 || token_fast) {                      // pairs: warp 2p + 1 only helps
      const uint32_t* st = &ring_s[warp][it % kStages][0];
      const bool own_valid = e0 + own_row < ti.n;
      uint32_t shifts;
      float kf;
      bool fast = IndexKeyFast(st[kScaleWord + own_row], &shifts, &kf);
      if (!own_valid) fast = true, shifts = 0;                 // rows past n: not stored
      float l4[4];   // levels 1-4 of rows g + 8h
      float m5 = 1.f, m6 = 1.f;
      if (token_fast && __all_sync(cuda::kFull, fast)) {
        uint4 kv[4];
        uint2 tab[4];
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          kv[h] = *reinterpret_cast<const uint4*>(st + (g + 8 * h) * kRowWords + 4 * c);
          const uint32_t sk = Prmt(__shfl_sync(cuda::kFull, shifts, 4 * g + h), 0u, byte_c);
          tab[h] = make_uint2(0x03020100u << sk, 0x0C080604u << sk);
        }
        const TreeSigns& signs = qo.tree[c];
        float lo[4], hi[4];
        if constexpr (!kPairs) {
          FastTileHalf<0>(qo.fast + lane, qo.leaf + c, signs, qo.start + c, kv, tab, lo);
          FastTileHalf<1>(qo.fast + lane, qo.leaf + c, signs, qo.start + c, kv, tab, hi);
        } else {
          if (half == 0)
            FastTileHalf<0>(qo.fast + lane, qo.leaf + c, signs, qo.start + c, kv, tab, lo);
          else
            FastTileHalf<1>(qo.fast + lane, qo.leaf + c, signs, qo.start + c, kv, tab, hi);
          // the pair's halves meet in shared memory (a buffer per tile parity:
          // warp 2p + 1 writes one while warp 2p may still read the other)
          float(&other)[4][32] = half_l3[it & 1][column];
          if (half == 1) {
#pragma unroll
            for (int h = 0; h < 4; ++h) other[h][lane] = hi[h];
          }
          asm volatile("bar.sync %0, 64;" ::"r"(1 + column) : "memory");
          if (half == 1) {
            __syncwarp();
            continue;
          }
#pragma unroll
          for (int h = 0; h < 4; ++h) hi[h] = other[h][lane];
        }
#pragma unroll
        for (int h = 0; h < 4; ++h) l4[h] = JoinHeadHalves(lo[h], hi[h], signs);
        kf *= signs.root;                                      // both powers of two
        m5 = signs.l5, m6 = signs.l6;
      } else {
        if (half == 1) {                                       // warp 2p scores it alone
          __syncwarp();
          continue;
        }
        kf = 1.f;
        const float4 v = BlockTileL4<kPairs>(st, qo.block + lane, qo.qf, qo.w, g, c);
        l4[0] = v.x, l4[1] = v.y, l4[2] = v.z, l4[3] = v.w;
      }
      const float score = kf * QuadHeadTree(l4, c, m5, m6);
      if (own_valid) keys[e0 + own_row] = IndexRankKey(score);
    }
    __syncwarp();                                              // the stage is free for its next tile
  }
  CpAsyncWait<0>();
}

// Tiles per warp: CTAs in whole waves of resident ones (one a
// multiprocessor), at most kMaxTilesPerWarp. DSV4_INDEXER_TILES=n (read
// once) fixes it, for benchmarks.
int TilesPerWarp(int64_t T, int64_t E) {
  static const int forced = [] {
    const char* v = std::getenv("DSV4_INDEXER_TILES");
    const int n = v ? std::atoi(v) : 0;
    return n >= 1 && n <= kMaxTilesPerWarp ? n : 0;
  }();
  if (forced) return forced;
  const int64_t resident = static_cast<int64_t>(cuda::SmCount()) * kScoreCtasPerSm;
  const int64_t units = (E + kMmaWarps * kTile - 1) / (kMmaWarps * kTile);   // a tile a warp
  const int64_t waves = (T * units + resident * kMaxTilesPerWarp - 1) / (resident * kMaxTilesPerWarp);
  const int64_t per_token = std::max<int64_t>(1, resident * std::max<int64_t>(waves, 1) / T);
  const int64_t tpw = (units + per_token - 1) / per_token;
  return static_cast<int>(tpw < 1 ? 1 : tpw > kMaxTilesPerWarp ? kMaxTilesPerWarp : tpw);
}

// Whether the score kernel runs in pairs (ScoreKernelMxfp4): when every warp
// would have one tile and the twice as many CTAs still fit one wave.
// DSV4_INDEXER_PAIRS=0 or 1 (read once) forces it, for comparisons.
bool PairWarps(int64_t T, int64_t E, int tiles_per_warp) {
  static const int forced = cuda::EnvSwitch("DSV4_INDEXER_PAIRS");
  if (forced >= 0) return forced == 1;
  const int64_t resident = static_cast<int64_t>(cuda::SmCount()) * kScoreCtasPerSm;
  const int64_t pair_span = TileColumns(true) * kTile;
  return tiles_per_warp == 1 && T * ((E + pair_span - 1) / pair_span) <= resident;
}

// Inclusive sum over the block's threads of one value each; returns the
// exclusive prefix and (via *total) the block total. `warp_sums` holds
// kSelectThreads / 32 + 1 ints.
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
  static_assert(kSelectThreads / 32 == 32, "warp 0 scans one warp sum a lane");
  if (warp == 0) {                 // warp sums -> exclusive prefixes, the total last
    const int own = warp_sums[lane];
    int incl = own;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    __syncwarp();
    warp_sums[lane] = incl - own;
    if (lane == 31) warp_sums[32] = incl;
  }
  __syncthreads();
  const int before = warp_sums[warp];
  *total = warp_sums[32];
  __syncthreads();                 // warp_sums may be reused at once
  return before + v - x;
}

// Rank keys first .. first + n - 1 of a token's scratch row (`keys` points
// at key `first`), read from memory: f(key, index) for each, eight loads
// issued before their uses. Every lane of a warp makes the same calls (a key
// past n reads as 0), so f may use warp-wide votes.
struct KeyRow {
  const uint32_t* keys;
  int64_t n, first;

  template <typename F>
  __device__ __forceinline__ void ForEach(F f) const {
    constexpr int kUnroll = 8;
    const int64_t warp_first = threadIdx.x & ~31;
    for (int64_t base = 0; warp_first + base < n; base += kUnroll * kSelectThreads) {
      uint32_t k[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + threadIdx.x + u * kSelectThreads;
        k[u] = i < n ? keys[i] : 0u;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) f(k[u], first + base + threadIdx.x + u * kSelectThreads);
    }
  }
};

// A KeyRow as one select CTA reads it: held in registers (16 a thread, key
// tid + u * kSelectThreads in r[u]) when n <= kRegKeys * kSelectThreads, so
// every pass after the first load costs no memory traffic; else read from
// the scratch row on each pass. Keys past n read as 0, as a missing entry.
struct TokenKeys {
  KeyRow row;
  bool in_regs;
  int slots;                 // in registers: slots holding some thread's key
  uint32_t r[kRegKeys];

  // (32-bit bounds and one base pointer, so a slot costs a compare and a load
  // at an immediate offset)
  __device__ explicit TokenKeys(KeyRow kr)
      : row(kr), in_regs(kr.n <= kRegKeys * kSelectThreads),
        slots(in_regs ? static_cast<int>((kr.n + kSelectThreads - 1) / kSelectThreads) : 0) {
    if (in_regs) {
      const uint32_t* p = row.keys + threadIdx.x;
      const int left = static_cast<int>(row.n) - static_cast<int>(threadIdx.x);
#pragma unroll
      for (int u = 0; u < kRegKeys; ++u) r[u] = u * kSelectThreads < left ? p[u * kSelectThreads] : 0u;
    }
  }

  // (in registers: only the slots that hold a key of some thread, so a
  // short row costs as many steps as it has keys a thread)
  template <typename F>
  __device__ __forceinline__ void ForEach(F f) const {
    if (!in_regs) return row.ForEach(f);
#pragma unroll
    for (int u = 0; u < kRegKeys; ++u) {
      if (u >= slots) break;   // uniform
      f(r[u], row.first + threadIdx.x + u * kSelectThreads);
    }
  }
};

// Warp 0 of a radix pass: in the 256-bin histogram `bins` of the keys
// matching `pre` (digit at `shift`), the bin where the count from the top
// reaches `need`; writes the key prefix with that digit to *s_prefix and the
// count still needed within the bin to *s_need. Lane L reads bins
// 8(31-L) .. + 7 (lane 0 the highest) and, with `clear`, zeroes them.
__device__ __forceinline__ void CrossingBin(int* bins, uint32_t pre, int shift, uint32_t need,
                                            bool clear, uint32_t* s_prefix, uint32_t* s_need) {
  const int lane = threadIdx.x & 31;
  const int base = 8 * (31 - lane);
  int c[8], sum = 0;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    c[e] = bins[base + e];
    sum += c[e];
    if (clear) bins[base + e] = 0;
  }
  int incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  const int excl = incl - sum;
  const int want = static_cast<int>(need);
  // the keys matching the prefix number at least `need`: one lane crosses
  if (excl < want && incl >= want) {
    int cum = excl;
    for (int e = 7; e >= 0; --e) {
      if (cum + c[e] >= want) {
        *s_prefix = pre | (static_cast<uint32_t>(base + e) << shift);
        *s_need = static_cast<uint32_t>(want - cum);
        break;
      }
      cum += c[e];
    }
  }
}

// Radix passes, 8 bits each from bit `top` down, over the keys that
// for_each(f) hands to f and that equal *prefix in the bits of `mask` (the
// bits above top): the *need-th largest of them. On return *prefix is that
// key and *need how many keys equal to it are taken. Every thread of the
// block calls it; `hist` holds kHistCopies histograms of 256 bins.
template <typename ForEachKey>
__device__ void RadixSelect(ForEachKey for_each, int top, uint32_t mask, uint32_t* prefix,
                            uint32_t* need, int* hist, uint32_t* s_prefix, uint32_t* s_need) {
  const int tid = threadIdx.x;
  for (; top >= 0; top -= 8) {
    const int width = top + 1 < 8 ? top + 1 : 8;
    const int shift = top + 1 - width;
    for (int b = tid; b < kHistCopies * kHistStride; b += kSelectThreads) hist[b] = 0;
    __syncthreads();
    int* my_hist = hist + (tid % kHistCopies) * kHistStride;
    const uint32_t pre = *prefix;
    for_each([&](uint32_t key) {
      if (key != 0 && (key & mask) == pre) atomicAdd(&my_hist[(key >> shift) & ((1u << width) - 1u)], 1);
    });
    __syncthreads();
    if (tid < 256) {                           // copy 0 <- the sum of the copies
      int sum = 0;
#pragma unroll
      for (int c = 0; c < kHistCopies; ++c) sum += hist[c * kHistStride + tid];
      hist[tid] = sum;
    }
    __syncthreads();
    if (tid < 32) CrossingBin(hist, pre, shift, *need, false, s_prefix, s_need);
    __syncthreads();
    *prefix = *s_prefix;
    *need = *s_need;
    mask |= ((1u << width) - 1u) << shift;
    __syncthreads();
  }
}

// RadixSelect for at most one key a thread (0: none): one histogram, which
// must be zero on entry and is left zero, and two barriers a pass.
__device__ void RadixSelectOneEach(uint32_t key, int top, uint32_t mask, uint32_t* prefix,
                                   uint32_t* need, int* hist, uint32_t* s_prefix,
                                   uint32_t* s_need) {
  for (; top >= 0; top -= 8) {
    const int width = top + 1 < 8 ? top + 1 : 8;
    const int shift = top + 1 - width;
    const uint32_t pre = *prefix;
    if (key != 0 && (key & mask) == pre) atomicAdd(&hist[(key >> shift) & ((1u << width) - 1u)], 1);
    __syncthreads();
    if (threadIdx.x < 32) CrossingBin(hist, pre, shift, *need, true, s_prefix, s_need);
    __syncthreads();
    *prefix = *s_prefix;
    *need = *s_need;
    mask |= ((1u << width) - 1u) << shift;
  }
}

// Composite sort key: rank key above, then the lower index first.
__device__ __forceinline__ unsigned long long Composite(uint32_t key, int64_t i) {
  return (static_cast<unsigned long long>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
}
// The index a composite holds.
__device__ __forceinline__ int32_t CompositeIndex(unsigned long long comp) {
  return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(comp));
}

// Bitonic sort (descending) of kp = 2^kLog <= kSelectThreads composites, one
// per thread in a register: partner exchanges by shuffles within a warp and
// through shared memory (two alternating buffers of kp; the first may be
// where v came from: each thread read its own slot) across warps. Only the
// warps holding elements take part (the others return at once): they meet
// on named barrier 1, so idle warps cost no issue slots. The steps are
// unrolled (kLog is a template argument): kp = 512 takes 45 of them, and
// loop control cost more than the exchange. Nothing may use __syncthreads
// after this call.
template <int kLog>
__device__ unsigned long long SortOnePerThread(unsigned long long v, unsigned long long* buf) {
  constexpr int kp = 1 << kLog;
  constexpr int kBusyThreads = kp < 32 ? 32 : kp;
  static_assert(kp <= kSelectThreads, "one element a thread");
  const int tid = threadIdx.x;
  if (tid >= kBusyThreads) return v;
#pragma unroll
  for (int size = 2, parity = 0; size <= kp; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      unsigned long long p;
      if (stride >= 32) {                  // kp >= 64: every busy thread holds one
        unsigned long long* b = buf + parity * kp;
        parity ^= 1;
        b[tid] = v;
        asm volatile("bar.sync 1, %0;" ::"n"(kBusyThreads) : "memory");
        p = b[tid ^ stride];
      } else {
        p = __shfl_xor_sync(cuda::kFull, v, stride);
      }
      // the lower of a pair in a descending run keeps the larger (equal
      // values: the padding zeros, either will do)
      const bool desc = (tid & size) == 0, lower = (tid & stride) == 0;
      v = ((v > p) == (desc == lower)) ? v : p;
    }
  }
  return v;
}

// SortOnePerThread for a runtime kp (a power of two <= kSelectThreads).
__device__ unsigned long long SortOnePerThread(unsigned long long v, int kp,
                                               unsigned long long* buf) {
  switch (kp) {
    case 1: return v;
    case 2: return SortOnePerThread<1>(v, buf);
    case 4: return SortOnePerThread<2>(v, buf);
    case 8: return SortOnePerThread<3>(v, buf);
    case 16: return SortOnePerThread<4>(v, buf);
    case 32: return SortOnePerThread<5>(v, buf);
    case 64: return SortOnePerThread<6>(v, buf);
    case 128: return SortOnePerThread<7>(v, buf);
    case 256: return SortOnePerThread<8>(v, buf);
    case 512: return SortOnePerThread<9>(v, buf);
    default: return SortOnePerThread<10>(v, buf);
  }
}
static_assert(kSelectThreads == 1 << 10, "SortOnePerThread's cases");

// How many of v[lo .. hi) are at most c (unsigned 64-bit). Four counters,
// so that four comparisons are in flight at once: one count (or a borrow
// chain through the one carry flag) makes every comparison wait for the
// last, and a group's ranking is one thread's chain of these.
__device__ __forceinline__ int CountAtMost(const unsigned long long* v, int lo, int hi,
                                           unsigned long long c) {
  // a 64-bit compare and a predicated increment: three instructions each
  const auto step = [&](uint32_t& n, unsigned long long x) {
    asm("{\n\t.reg .pred p;\n\tsetp.le.u64 p, %1, %2;\n\t@p add.u32 %0, %0, 1;\n\t}"
        : "+r"(n)
        : "l"(x), "l"(c));
  };
  uint32_t n[4] = {0, 0, 0, 0};
  int j = lo;
  for (; j + 4 <= hi; j += 4) {
#pragma unroll
    for (int u = 0; u < 4; ++u) step(n[u], v[j + u]);
  }
  for (; j < hi; ++j) step(n[0], v[j]);
  return static_cast<int>((n[0] + n[1]) + (n[2] + n[3]));
}

// The select's output without a sort: composites are distinct, so a key's
// place is the number of taken keys above it. Keys of higher top-bits bins
// are all above it; within its bin they are counted one by one.
//  - above[0 .. n_above): the taken keys of the bins above the K-th key's
//    (all of them when every candidate is taken), grouped by bin: bin b's at
//    [start[b], end[b]) and every group ahead of lower bins' groups, so
//    start[b] is also the number of keys in higher bins;
//  - in_bin[0 .. nb): every key of the K-th key's bin, of which the `need`
//    largest are taken (places n_above ..).
// Writes out[0 .. m) and -1 after, up to K.
__device__ void RankInBins(const unsigned long long* above, int n_above, const int* start,
                           const int* end, const unsigned long long* in_bin, int nb, int need,
                           int64_t m, int64_t K, int32_t* out) {
  const int tid = threadIdx.x;
  for (int x = tid; x < n_above; x += kSelectThreads) {
    const unsigned long long comp = above[x];
    const int b = static_cast<int>(comp >> (64 - kTopBits));
    const int lo = start[b], hi = end[b];
    out[lo + (hi - lo) - CountAtMost(above, lo, hi, comp)] = CompositeIndex(comp);
  }
  // from the last thread down, so these are mostly other warps than the above
  for (int x = kSelectThreads - 1 - tid; x < nb; x += kSelectThreads) {
    const unsigned long long comp = in_bin[x];
    const int r = nb - CountAtMost(in_bin, 0, nb, comp);
    if (r < need) out[n_above + r] = CompositeIndex(comp);
  }
  for (int64_t r = m + tid; r < K; r += kSelectThreads) out[r] = -1;
}

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

// count_missing: the score kernel did not count the token's missing blocks
// (the mxfp4 one does, as it reads the block table).
// by_rank: RankInBins orders the keys where it may (kRankBinMax), else the sort.
template <bool kCluster>
__global__ void __launch_bounds__(kSelectThreads) SelectKernel(IndexerTopkArgs a, int kp,
                                                                bool count_missing, int ctas,
                                                                bool by_rank) {

  // kp composite keys (2 kp when kp <= threads), then the top-bits histograms
  extern __shared__ unsigned long long sel[];
  // kHistCopies histograms, copy c at c * kHistStride (one bank apart): lane L
  // counts into copy L mod kHistCopies, so the lanes of a warp that hit one
  // bin (the keys below one top-bits bin crowd a few) conflict 4 ways, not 32
  __shared__ int hist[kHistCopies * kHistStride];
  __shared__ __align__(16) int chunk_top[kTopBins];   // this CTA's top-bits counts, summed
  __shared__ int warp_sums[kSelectThreads / 32 + 1];
  __shared__ uint32_t s_prefix, s_need, s_ncand;
  __shared__ int s_gt, s_eq, s_nb, s_bin, s_bin_count, s_big;
  const int sel_words = kp <= kSelectThreads ? 2 * kp : kp;
  // shared state first: it needs nothing of the score kernel
  int* top_hist = reinterpret_cast<int*>(sel + sel_words);   // kTopCopies x kTopBins
  // RankInBins' bin offsets, in copies the bin's gathered keys (bin_buf below) leave alone
  static_assert(kTopCopies >= 4 && 2 * kRankBinMax <= kTopBins, "bin_buf within copy 0");
  int* bin_end = top_hist + kTopBins;         // in a cluster; alone the filled bin_fill
  int* bin_fill = top_hist + 2 * kTopBins;
  int* bin_start = top_hist + 3 * kTopBins;
  for (int b = threadIdx.x; b < kTopCopies * kTopBins / 4; b += kSelectThreads)
    reinterpret_cast<int4*>(top_hist)[b] = make_int4(0, 0, 0, 0);
  for (int r = threadIdx.x; r < kp; r += kSelectThreads) sel[r] = 0ull;
  if (threadIdx.x < 256) hist[threadIdx.x] = 0;      // RadixSelectOneEach's histogram
  if (threadIdx.x == 0) s_gt = s_eq = s_nb = s_big = 0;
  // the token's operands too: written before the score kernel started, so
  // before this kernel did, they may be read ahead of the wait, and the key
  // loads after it need not wait for them
  const int64_t t = kCluster ? blockIdx.x / ctas : blockIdx.x;
  const int64_t l = *a.layer;
  const TokenInfo ti = t < a.T ? ReadToken(a, t) : TokenInfo{false, 0, 0};
  cuda::WaitForPrevious();     // the score kernel's rank keys (launched overlapped)
  const int rank = kCluster ? static_cast<int>(cg::this_cluster().block_rank()) : 0;
  const int tid = threadIdx.x;
  if (blockIdx.x == 0 && tid == 0 && (l < 0 || l >= a.L)) atomicAdd(&a.errors[kBadLayer], 1);
  if (t >= a.T) return;                        // whole clusters: the grid is T * ctas
  int32_t* out = a.indices + t * a.K;
  if (!ti.ok) {                                // the same for every CTA of the cluster
    if (rank != 0) return;
    if (tid == 0 && l >= 0 && l < a.L) {
      const int64_t s = a.slot[t];
      if (s != -1 && (s < 0 || s >= a.R)) atomicAdd(&a.errors[kBadSlot], 1);
      else if (s != -1) atomicAdd(&a.errors[kBadPosition], 1);
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
      if (b < 0 || b >= a.N) atomicAdd(&a.errors[kMissingBlock], 1);
    }
  }

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
    const int K = static_cast<int>(a.K);
    if (by_rank) {
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
      if (s3 < K) big = max(big, c[3]);
      if (s2 < K) big = max(big, c[2]);
      if (s1 < K) big = max(big, c[1]);
      if (s0 < K) big = max(big, c[0]);
      big = __reduce_max_sync(cuda::kFull, big);
      if ((tid & 31) == 0 && big > 0) atomicMax(&s_big, big);
    }
    if (total > K && above < K && above + sum >= K) {           // one thread crosses
      for (int e = 3; e >= 0; --e) {
        if (above + c[e] >= K) {
          s_bin = b0 + e;
          s_need = static_cast<uint32_t>(K - above);
          s_bin_count = c[e];
          break;
        }
        above += c[e];
      }
    }
  }
  __syncthreads();
  const uint32_t ncand = s_ncand;
  const bool all_taken = ncand <= static_cast<uint32_t>(a.K);
  // the common case: the bin holds at most a key a thread. One pass over
  // the keys then takes those above the bin into sel and gathers the bin's
  // (with their indices); the K-th largest is found among these alone.
  const bool small_bin = !all_taken && s_bin_count <= kSelectThreads;
  unsigned long long* bin_buf = reinterpret_cast<unsigned long long*>(top_hist);  // once summed
  uint32_t* bin_keys = reinterpret_cast<uint32_t*>(top_hist);
  const uint32_t bin = all_taken ? 0u : static_cast<uint32_t>(s_bin);
  if (by_rank && s_big <= kRankBinMax) {
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
    const int n_above = all_taken ? static_cast<int>(ncand) : static_cast<int>(a.K) - need_bin;
    RankInBins(sel, n_above, bin_start, kCluster ? bin_end : bin_fill, bin_buf,
               all_taken ? 0 : s_nb, need_bin, all_taken ? ncand : a.K, a.K, out);
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
  const int64_t m = all_taken ? ncand : a.K;
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
      const uint32_t key = i < n ? a.scratch[t * a.E + i] : 0u;
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
    if (tid < a.K)
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
  for (int64_t r = tid; r < a.K; r += kSelectThreads)
    out[r] = r < m ? CompositeIndex(sel[r]) : -1;
}

// CTAs a token's select spreads over (one cluster): the fewest that hold
// their chunks of the E keys in registers, at most kMaxSelectCtas (the
// portable cluster size). On an H100 (benchmarks/RESULTS-indexer.md, run
// 10) spreading a select that fits one CTA was slower (the cluster barriers
// and hand-off cost more than the shorter passes save), and clusters of 16
// were slower than 8 at 1M context (a 16-CTA cluster needs a whole GPC free).
// DSV4_SELECT_CTAS=n (1, 2, 4 or 8; read once) fixes it, for comparisons.
constexpr int kMaxSelectCtas = 8;

int SelectCtas(int64_t E) {
  static const int forced = [] {
    const char* v = std::getenv("DSV4_SELECT_CTAS");
    const int n = v ? std::atoi(v) : 0;
    return n >= 1 && n <= kMaxSelectCtas && (n & (n - 1)) == 0 ? n : 0;
  }();
  if (forced) return forced;
  int ctas = 1;
  while (ctas < kMaxSelectCtas && E > ctas * int64_t{kRegKeys * kSelectThreads}) ctas *= 2;
  return ctas;
}

// Whether the score kernel streams the keys with evict_first (StreamPolicy):
// where they are more than L2 holds, so no line of theirs is read again in
// the call anyway. On an H100 (benchmarks/RESULTS-indexer.md run 16) that
// took B = 64, 64k (72 MB) from 58.8 to 55.8 us; where the keys fit (B = 1,
// 1M: 18 MB) it cost 1 us, as a benchmark's next call then finds them in L2.
// DSV4_INDEXER_EVICT=0 or 1 (read once) forces it, for comparisons.
bool KeysEvictFirst(const IndexerTopkArgs& a) {
  static const int forced = cuda::EnvSwitch("DSV4_INDEXER_EVICT");
  if (forced >= 0) return forced == 1;
  const double key_bytes =
      static_cast<double>(a.T) * static_cast<double>(a.E) * (kIndexPacked + kIndexScales);
  return key_bytes > static_cast<double>(cuda::L2Bytes());
}

// Whether the select may order its keys by rank within their top-bits bins
// (RankInBins) instead of radix passes and a sort.
// DSV4_SELECT_RANK=0 (read once) forces the sort, for comparisons.
bool RankSelect() {
  static const bool on = cuda::EnvSwitch("DSV4_SELECT_RANK") != 0;
  return on;
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

// Lets both instances of a kernel template take `bytes` of dynamic shared
// memory; the first error, if any.
template <typename KernelA, typename KernelB>
cudaError_t AllowDynamicShared(KernelA* a, KernelB* b, size_t bytes) {
  const cudaError_t e = cudaFuncSetAttribute(a, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  return e != cudaSuccess ? e : cudaFuncSetAttribute(b, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

ffi::Error IndexerTopkImpl(cudaStream_t stream, ffi::AnyBuffer layer, ffi::AnyBuffer token_slot,
                           ffi::AnyBuffer token_pos, ffi::AnyBuffer q, ffi::AnyBuffer weights,
                           ffi::AnyBuffer block_table, ffi::AnyBuffer errors_in,
                           ffi::AnyBuffer packed, ffi::AnyBuffer scale,
                           ffi::Result<ffi::AnyBuffer> indices,
                           ffi::Result<ffi::AnyBuffer> scratch,
                           ffi::Result<ffi::AnyBuffer> qscratch,
                           ffi::Result<ffi::AnyBuffer> errors, int64_t q_format) {
  IndexerTopkArgs a;
  DSV4_RETURN_IF_ERROR(ValidateIndexerTopk(layer, token_slot, token_pos, q, weights, block_table,
                                           errors_in, packed, scale, *indices, *scratch,
                                           *qscratch, *errors, q_format, &a));
  if (a.K > kMaxK)
    return ffi::Error::InvalidArgument("indices (result): k must be at most " +
                                       std::to_string(kMaxK) + " on CUDA, got " +
                                       std::to_string(a.K));
  if (a.T > 0 && a.E > 0) {
    const int64_t chunks = (a.E + kScoreThreads - 1) / kScoreThreads;
    if (chunks > 65535 || a.T > 0x7fffffff)
      return ffi::Error::InvalidArgument("indexer_topk: too many tokens or entries for one grid");
    if (a.q_format == kQueryMxfp4) {
      const int tpw = TilesPerWarp(a.T, a.E);
      const bool pairs = PairWarps(a.T, a.E, tpw);
      const int64_t span = static_cast<int64_t>(TileColumns(pairs)) * tpw * kTile;
      const int64_t ctas = (a.E + span - 1) / span;
      if (ctas > 65535)
        return ffi::Error::InvalidArgument("indexer_topk: too many entries for one grid");
      // static and dynamic shared memory together pass the default 48 KB
      static const cudaError_t opt_in =
          AllowDynamicShared(ScoreKernelMxfp4<false>, ScoreKernelMxfp4<true>, kRingBytes);
      if (opt_in != cudaSuccess)
        return ffi::Error::Internal(std::string("indexer_topk shared memory: ") +
                                    cudaGetErrorString(opt_in));
      const dim3 grid(static_cast<unsigned>(a.T), static_cast<unsigned>(ctas));
      const bool evict_first = KeysEvictFirst(a);
      if (pairs)
        ScoreKernelMxfp4<true><<<grid, kMmaThreads, kRingBytes, stream>>>(a, tpw, evict_first);
      else
        ScoreKernelMxfp4<false><<<grid, kMmaThreads, kRingBytes, stream>>>(a, tpw, evict_first);
    } else if (SplitScores(a.T, a.E)) {
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
  const size_t sel_bytes = (kp <= kSelectThreads ? 2 : 1) * kp * sizeof(unsigned long long) +
                           kTopCopies * kTopBins * sizeof(int);
  constexpr size_t kSelectMaxBytes = std::max(2 * kSelectThreads, kMaxK) * sizeof(unsigned long long) +
                                     kTopCopies * kTopBins * sizeof(int);
  // both kernels' shared memory limit, once
  static const cudaError_t select_opt_in =
      AllowDynamicShared(SelectKernel<false>, SelectKernel<true>, kSelectMaxBytes);
  if (select_opt_in != cudaSuccess)
    return ffi::Error::Internal(std::string("indexer_topk select shared memory: ") +
                                cudaGetErrorString(select_opt_in));
  const int ctas = a.T > 0 ? SelectCtas(a.E) : 1;
  if (a.T * ctas > 0x7fffffff)
    return ffi::Error::InvalidArgument("indexer_topk: too many tokens for one select grid");
  const unsigned grid = static_cast<unsigned>(a.T > 0 ? a.T * ctas : 1);
  const bool count_missing = a.q_format != kQueryMxfp4;
  const bool rank = RankSelect();
  cudaError_t err =
      ctas > 1 ? cuda::LaunchOverlapped(SelectKernel<true>, dim3(grid), dim3(kSelectThreads),
                                        sel_bytes, static_cast<unsigned>(ctas), stream, a, kp,
                                        count_missing, ctas, rank)
               : cuda::LaunchOverlapped(SelectKernel<false>, dim3(grid), dim3(kSelectThreads),
                                        sel_bytes, 1u, stream, a, kp, count_missing, 1, rank);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("indexer_topk launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(IndexerTopkCuda, IndexerTopkImpl,
                              BindIndexerTopk(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
