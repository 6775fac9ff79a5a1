// CPU handler of indexer_topk (operands in indexer_topk.h, rules in
// dsv4_jax/ops/indexer.py). Per token: rank keys of the visible entries into
// the scratch row, then the k largest (key descending, index ascending).
#include <algorithm>
#include <functional>
#include <vector>

#include "handlers_cpu.h"
#include "indexer_topk.h"

namespace dsv4 {
namespace {

ffi::Error IndexerTopkImpl(ffi::AnyBuffer layer, ffi::AnyBuffer token_slot,
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
  const bool mxfp4 = a.q_format == kQueryMxfp4;
  for (int64_t i = 0; i < a.T * a.K; ++i) a.indices[i] = -1;
  int64_t l;
  if (!HostLayerOk(a.layer, a.L, a.errors, &l)) return ffi::Error::Success();
  constexpr int64_t per_block = kBlockTokens / kCsaRatio;
  std::vector<float> qf(kIndexHeads * kIndexDim);
  std::vector<uint64_t> cand;
  for (int64_t t = 0; t < a.T; ++t) {
    const int64_t s = a.slot[t], p = a.pos[t];
    if (s == -1) continue;
    if (s < 0 || s >= a.R) {
      ++a.errors[kBadSlot];
      continue;
    }
    if (p < 0) {
      ++a.errors[kBadPosition];
      continue;
    }
    const int64_t n = IndexVisible(p, a.E);
    const uint16_t* qt = a.q + t * kIndexHeads * kIndexDim;
    int8_t* q2 = nullptr;   // the token's rounded query in qscratch (mxfp4 only)
    float* qfac = nullptr;
    if (mxfp4) {
      q2 = reinterpret_cast<int8_t*>(a.qscratch + t * kQueryScratchBytes);
      qfac = reinterpret_cast<float*>(a.qscratch + t * kQueryScratchBytes + kQueryCodeBytes);
      for (int h = 0; h < kIndexHeads; ++h)
        for (int b = 0; b < kIndexScales; ++b)
          qfac[b * kIndexHeads + h] = QuantizeIndexQueryBlock(
              qt + h * kIndexDim + b * kMxfp4Block, q2 + h * kIndexDim + b * kMxfp4Block);
    } else {
      for (int64_t c = 0; c < kIndexHeads * kIndexDim; ++c) qf[c] = num::Bf16ToF32(qt[c]);
    }
    const float* w = a.weights + t * kIndexHeads;
    uint32_t* keys = a.scratch + t * a.E;
    cand.clear();
    for (int64_t j = 0; j * per_block < n; ++j) {
      const int64_t block = a.block_table[s * a.MB + j];
      const int64_t end = std::min(n, (j + 1) * per_block);
      if (block < 0 || block >= a.N) {
        ++a.errors[kMissingBlock];
        for (int64_t i = j * per_block; i < end; ++i) keys[i] = 0;
        continue;
      }
      for (int64_t i = j * per_block; i < end; ++i) {
        const int64_t row = (l * a.N + block) * per_block + i % per_block;
        const uint8_t* pk = a.packed + row * kIndexPacked;
        const uint8_t* sk = a.scale + row * kIndexScales;
        float score;
        if (mxfp4) {
          score = IndexScoreMxfp4(pk, sk, q2, qfac, w);
        } else {
          float k[kIndexDim];
          DecodeIndexKey(pk, sk, k);
          score = IndexScore(k, qf.data(), w);
        }
        keys[i] = IndexRankKey(score);
        // larger composite = better: key first, then the lower index
        cand.push_back((static_cast<uint64_t>(keys[i]) << 32) |
                       (0xffffffffu - static_cast<uint32_t>(i)));
      }
    }
    const int64_t m = std::min<int64_t>(a.K, static_cast<int64_t>(cand.size()));
    std::partial_sort(cand.begin(), cand.begin() + m, cand.end(), std::greater<uint64_t>());
    for (int64_t r = 0; r < m; ++r)
      a.indices[t * a.K + r] = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(cand[r]));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(IndexerTopkCpu, IndexerTopkImpl, BindIndexerTopk(ffi::Ffi::Bind()));

}  // namespace dsv4
