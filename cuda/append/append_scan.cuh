// The append role's per-token scan (AppendScan), the way a call of at most
// kScanCall rows decides its cells' winners (the rule: cuda/append/append_block.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "append/append_rows.cuh"
#include "common/launch.cuh"
#include "common/layer_checks.cuh"

namespace dsv4 {
namespace append_kernel {

// Calls of at most kScanCall rows: a warp a token (several, one after
// another, where the tokens outnumber the grid's warps), plan.block_tokens
// tokens a block, so that the host can spread a decode step's tokens over
// the multiprocessors (each is a short chain of dependent loads and an
// encode; one block ran them four to a warp, one after another). The warp
// looks through every row's slot and position for rows that beat its token
// in its cell (the same slot and ring slot, a larger position, or the same
// one later in the call); only such a row is read, for its finiteness, and
// the first finite one ends the search. A call whose cells hold one token
// each (a decode step) reads every row once. Any order.
//
// The metadata is looked through in a copy in the block's shared memory that
// all its threads load in one round (kGroup rows a load) before one barrier:
// a token's search is one round of global loads for the whole call, and the
// block's warps share the copy (from global memory, 128 rows a round, the
// search took T/128 rounds of dependent loads, each warp its own). A call of
// at most kGlobalScanCall rows is searched in global memory instead: one round
// of loads there, where the copy's round and barrier cost more. Both measured:
// docs/perf/decode-step.md, "Ideas tried".

// The staged copy: `slot` (-1 for a row dropped by its slot or position) and
// `pos`, `groups` groups of kGroup rows each.
struct StagedCall {
  const int4* slot;
  const int4* pos;
  int64_t groups;
};

// Loads the call's metadata into `smem` (plan.smem bytes); every thread of
// the block calls, then one barrier.
__device__ inline StagedCall StageCall(const AppendArgs& a, unsigned char* smem) {
  const int64_t groups = (a.T + kGroup - 1) / kGroup;
  int4* slot = reinterpret_cast<int4*>(smem);
  int4* pos = slot + groups;
  const bool vector = GroupLoads(a);
  for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
    int4 s = LoadGroup(a.slot, g, a.T, vector, -1);
    const int4 p = LoadGroup(a.pos, g, a.T, vector, 0);
    auto kept = [&a](int32_t s, int32_t p) {
      return s >= 0 && s < a.R && p >= 0 && p < a.max_context ? s : -1;
    };
    s = make_int4(kept(s.x, p.x), kept(s.y, p.y), kept(s.z, p.z), kept(s.w, p.w));
    slot[g] = s;
    pos[g] = p;
  }
  __syncthreads();
  return StagedCall{slot, pos, groups};
}

// Whether row u (slot su, position pu) beats token t (slot s, position p) in
// t's cell; su == s: u is not dropped (the staged copy's slot says so).
__device__ __forceinline__ bool Beats(int32_t s, int32_t p, int64_t t, int32_t su, int32_t pu,
                                      int64_t u) {
  return su == s && ((pu ^ p) & (kWindow - 1)) == 0 && (pu > p || (pu == p && u > t));
}

// Whether a finite row beats token t (valid: slot s, position p), from the
// staged copy. All lanes of the warp call.
__device__ inline bool BeatenStaged(const AppendArgs& a, const StagedCall& call, int64_t t,
                                    int32_t s, int32_t p) {
  const int lane = threadIdx.x & 31;
  for (int64_t g0 = 0; g0 < call.groups; g0 += 32 * kBatch) {
    unsigned beats[kBatch];  // bit k: row kGroup * g + k
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t g = g0 + 32 * j + lane;
      beats[j] = 0;
      if (g < call.groups) {
        const int4 su = call.slot[g];
        if (su.x == s || su.y == s || su.z == s || su.w == s) {  // a row of t's slot
          const int4 pu = call.pos[g];
#pragma unroll
          for (int k = 0; k < kGroup; ++k)
            beats[j] |= unsigned{Beats(s, p, t, Lane4(su, k), Lane4(pu, k), g * kGroup + k)} << k;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      for (unsigned m = __ballot_sync(cuda::kFull, beats[j] != 0); m != 0; m &= m - 1) {
        const int src = __ffs(m) - 1;
        const int64_t g = g0 + 32 * j + src;
        for (unsigned b = __shfl_sync(cuda::kFull, beats[j], src); b != 0; b &= b - 1)
          if (WarpFinite(LoadRow(a, g * kGroup + __ffs(b) - 1))) return true;
      }
  }
  return false;
}

// The same, searching the call's metadata in global memory (calls of at
// most kGlobalScanCall rows: one round of loads).
__device__ inline bool BeatenInGlobal(const AppendArgs& a, int64_t t, int32_t s, int32_t p) {
  const int lane = threadIdx.x & 31;
  for (int64_t base = 0; base < a.T; base += 32 * kBatch) {
    bool beats[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {  // kBatch loads of each kind in flight
      const int64_t u = base + 32 * j + lane;
      int32_t su = -1, pu = 0;
      if (u < a.T) {
        su = __ldg(a.slot + u);
        pu = __ldg(a.pos + u);
      }
      beats[j] = pu < a.max_context && Beats(s, p, t, su, pu, u);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j)
      for (unsigned m = __ballot_sync(cuda::kFull, beats[j]); m != 0; m &= m - 1) {
        const int64_t u = base + 32 * j + __ffs(m) - 1;
        if (WarpFinite(LoadRow(a, u))) return true;  // a finite row takes the cell
      }
  }
  return false;
}

// Token t of a scan: counted if dropped, written if it wins its cell. Its
// slot, position and row are loaded by the caller; `call` is the staged copy
// (no groups: the call is searched in global memory). All lanes of the warp call.
__device__ inline void ScanToken(const AppendArgs& a, const StagedCall& call, int64_t l,
                                 int64_t t, int32_t s, int32_t p, const Row& row) {
  const int lane = threadIdx.x & 31;
  const bool slot_ok = s >= 0 && s < a.R, valid = slot_ok && p >= 0 && p < a.max_context;
  if (!valid) {  // counted once, by the token's own warp (warp-uniform)
    if (lane == 0 && s != -1) cuda::CountErrorAtomic(a.errors, slot_ok ? kBadPosition : kBadSlot, t);
    return;
  }
  if (!WarpFinite(row)) {
    if (lane == 0) cuda::CountErrorAtomic(a.errors, kNonfinite, t);
    return;
  }
  const bool beaten =
      call.groups > 0 ? BeatenStaged(a, call, t, s, p) : BeatenInGlobal(a, t, s, p);
  if (!beaten) WriteEntry(a, l, s, p, row);
}

__device__ inline void AppendScan(const AppendArgs& a, const AppendPlan& plan, unsigned block,
                                  unsigned char* smem) {
  cuda::WaitForPrevious();  // everything below reads what earlier kernels wrote
  cuda::LetNextStart();     // a kernel launched overlapped after this one waits for it
  const int warp = threadIdx.x >> 5;
  const int64_t stride = int64_t{plan.blocks} * plan.block_tokens;
  int64_t t = int64_t{block} * plan.block_tokens + warp;
  const bool has = warp < plan.block_tokens && t < a.T;
  int32_t s = -1, p = 0;
  Row row;
  if (has) {  // all three loads at once: the row's address needs only t
    s = __ldg(a.slot + t);
    p = __ldg(a.pos + t);
    row = LoadRow(a, t);
  }
  // the staged copy's loads go out beside the token's (none: search global memory)
  const StagedCall call = plan.staged ? StageCall(a, smem) : StagedCall{nullptr, nullptr, 0};
  int64_t l;
  if (!cuda::LayerOkCountedBy(block == 0, a.layer, a.L, a.errors, &l) || !has) return;
  for (;;) {  // grid-stride, where the tokens outnumber the grid's warps
    ScanToken(a, call, l, t, s, p, row);
    t += stride;
    if (t >= a.T) return;
    s = __ldg(a.slot + t);
    p = __ldg(a.pos + t);
    row = LoadRow(a, t);
  }
}

}  // namespace append_kernel
}  // namespace dsv4
