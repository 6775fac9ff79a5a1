// The CPU flush's pieces shared by the serial walk (flush_cpu.cc) and the
// window plan's handler (flush_plan_cpu.cc): accumulator rows, folding one
// token's half into one, and storing a closed entry. Both paths use these
// very functions, so they fold and round identically.
#pragma once

#include <cstdint>

#include "dsv4/flush.h"

namespace dsv4 {
namespace host_flush {

// Accumulator `acc` (0 or 1) of request slot s in layer l: rows max, sum, kv.
inline float* AccRow(const CompressorView& v, int64_t R, int64_t l, int64_t s, int acc) {
  return v.comp + ((l * R + s) * v.coff + acc) * 3 * int64_t{v.d};
}

// Adds channels [src, src + d) of token t at position p to accumulator `acc`.
inline void Fold(float* acc, const CompressorView& v, int64_t t, int64_t p, int src) {
  const int64_t width = int64_t{v.coff} * v.d;
  const float* kv = v.kv + t * width + src;
  const float* score = v.score + t * width + src;
  const float* ape = v.ape + (p % v.m) * width + src;
  for (int c = 0; c < v.d; ++c) {
    num::SoftmaxAcc a{acc[c], acc[v.d + c], acc[2 * v.d + c]};
    a = num::AccumulateAcc(a, score[c] + ape[c], kv[c]);
    acc[c] = a.m;
    acc[v.d + c] = a.s;
    acc[2 * v.d + c] = a.kv;
  }
}

inline void Finalize(const float* acc, int d, float* out) {
  for (int c = 0; c < d; ++c)
    out[c] = num::FinalizeAcc(num::SoftmaxAcc{acc[c], acc[d + c], acc[2 * d + c]});
}

inline void SetEmpty(float* acc, int d) {
  for (int c = 0; c < d; ++c) {
    acc[c] = num::NegInf();
    acc[d + c] = 0.f;
    acc[2 * d + c] = 0.f;
  }
}

inline bool TokenInputsFinite(const CompressorView& v, int64_t t) {
  const int64_t w = int64_t{v.coff} * v.d;
  return num::RowIsFinite(v.kv + t * w, w) && num::RowIsFinite(v.score + t * w, w);
}

// Pool entry of window w of a request whose block holding it is `block`
// (m divides the block size, so a window lies in one block).
inline int64_t EntryIndex(const FlushArgs& a, int64_t l, int64_t block, int64_t w) {
  return (l * a.N + block) * a.per_block + w % a.per_block;
}

// Epilogue and store of closed CSA entry w (pooled main value, indexer key).
inline void StoreCsaEntry(const FlushArgs& a, int64_t e, int64_t w, float* pooled, float* ikey) {
  EntryEpilogue(pooled, kHeadDim, a.main.norm, a.main.inv_freq, w * kCsaRatio);
  EncodeEntry(a.pool, e, pooled);
  IndexKeyEpilogue(ikey, a.index.norm, a.index.inv_freq, w * kCsaRatio);
  EncodeIndexKey(ikey, a.index_packed + e * kIndexPacked, a.index_scale + e * kIndexScales);
}

// Epilogue and store of closed HCA entry w.
inline void StoreHcaEntry(const FlushArgs& a, int64_t e, int64_t w, float* pooled) {
  EntryEpilogue(pooled, kHeadDim, a.main.norm, a.main.inv_freq, w * kHcaRatio);
  EncodeEntry(a.pool, e, pooled);
}

}  // namespace host_flush
}  // namespace dsv4
