// The mxfp4 score kernel's head tree: 64 head terms summed pairwise, scaled and signed.
#pragma once

#include <cstdint>

#include "common/bf16_chunks.cuh"

namespace dsv4 {
namespace indexer {
namespace {  // internal linkage: see cuda/indexer_topk/indexer_topk.cu

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

}  // namespace
}  // namespace indexer
}  // namespace dsv4
