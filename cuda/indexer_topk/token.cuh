// A query token of indexer_topk as each of its kernels reads it: slot,
// visible entries, and whether its q and weights are finite.
#pragma once

#include <cstdint>

#include "dsv4/indexer_topk.h"

namespace dsv4 {
namespace indexer {
namespace {  // internal linkage: see cuda/indexer_topk/indexer_topk.cu

struct TokenInfo {
  bool ok;       // a good token of a good layer (its q and weights not yet checked)
  int64_t slot;
  int64_t n;     // visible entries
};

__device__ TokenInfo ReadToken(const IndexerTopkArgs& a, int64_t t) {
  TokenInfo ti{false, 0, 0};
  int64_t l = *a.layer, s = a.slot[t], p = a.pos[t];
  if (l < 0 || l >= a.L || s < 0 || s >= a.R || !QueryPositionOk(p, a.MB)) return ti;
  ti.ok = true;
  ti.slot = s;
  ti.n = IndexVisible(p, a.E);
  return ti;
}

// Whether the eight bf16 of a 16-byte word of q are finite. A token with a
// NaN or Inf in q or in its weights is dropped and counted as NONFINITE
// (dsv4_jax/ops/indexer.py); each kernel checks the words it loads anyway.
__device__ __forceinline__ bool QueryWordFinite(uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool ok = true;
#pragma unroll
  for (int e = 0; e < 4; ++e)
    ok &= ((w[e] & 0x7f80u) != 0x7f80u) & ((w[e] & 0x7f800000u) != 0x7f800000u);
  return ok;
}

// Whether token t's q and weights are all finite, by the whole block (a
// barrier: every thread calls it). Reads only inputs, so a kernel launched
// overlapped may call it before it waits for the previous one.
__device__ bool TokenInputsFinite(const IndexerTopkArgs& a, int64_t t) {
  const uint4* qg = reinterpret_cast<const uint4*>(a.q + t * kIndexHeads * kIndexDim);
  bool ok = true;
  for (int v = threadIdx.x; v < kIndexHeads * kIndexDim / 8; v += blockDim.x)
    ok &= QueryWordFinite(qg[v]);
  for (int h = threadIdx.x; h < kIndexHeads; h += blockDim.x)
    ok &= num::IsFinite(a.weights[t * kIndexHeads + h]);
  return __syncthreads_and(ok);
}

}  // namespace
}  // namespace indexer
}  // namespace dsv4
