// CPU handler of indexer_topk (operands in indexer_topk.h, rules in
// dsv4_jax/ops/indexer.py). Per token: rank keys of the visible entries into
// the scratch row, then the k largest (key descending, index ascending).
#include <algorithm>
#include <functional>
#include <vector>

#include "cpu/handlers_cpu.h"
#include "dsv4/indexer_topk.h"

namespace dsv4 {
namespace {

ffi::Error IndexerTopkImpl(DSV4_PARAMS(DSV4_INDEXER_TOPK_OPERANDS)) {
  IndexerTopkArgs a;
  DSV4_RETURN_IF_ERROR(ValidateIndexerTopk(DSV4_NAMES(DSV4_INDEXER_TOPK_OPERANDS), &a));
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
      CountError(a.errors, kBadSlot, t);
      continue;
    }
    if (!QueryPositionOk(p, a.MB)) {
      CountError(a.errors, kBadPosition, t);
      continue;
    }
    const uint16_t* qt = a.q + t * kIndexHeads * kIndexDim;
    const float* w = a.weights + t * kIndexHeads;
    if (!num::RowIsFinite(qt, kIndexHeads * kIndexDim) || !num::RowIsFinite(w, kIndexHeads)) {
      CountError(a.errors, kNonfinite, t);
      continue;
    }
    const int64_t n = IndexVisible(p, a.E);
    // mxfp4: the token's rounded query in qscratch, in both forms
    int8_t *q2 = nullptr, *q2s = nullptr;
    float *qfac = nullptr, *wq = nullptr;
    bool fast_token = mxfp4;   // every head within the fast form's guards
    if (mxfp4) {
      uint8_t* qs = a.qscratch + t * kQueryScratchBytes;
      q2 = reinterpret_cast<int8_t*>(qs);
      qfac = reinterpret_cast<float*>(qs + kQueryFactorOffset);
      q2s = reinterpret_cast<int8_t*>(qs + kQueryShiftedOffset);
      wq = reinterpret_cast<float*>(qs + kQueryWqOffset);
      for (int h = 0; h < kIndexHeads; ++h) {
        uint8_t eq[kIndexScales];
        for (int b = 0; b < kIndexScales; ++b) {
          float x[kMxfp4Block];
          for (int j = 0; j < kMxfp4Block; ++j)
            x[j] = num::Bf16ToF32(qt[h * kIndexDim + b * kMxfp4Block + j]);
          eq[b] = QuantizeIndexQueryBlock(x, q2 + h * kIndexDim + b * kMxfp4Block);
          qfac[b * kIndexHeads + h] = IndexQueryFactor(eq[b]);
        }
        const uint8_t mq = std::min(std::min(eq[0], eq[1]), std::min(eq[2], eq[3]));
        const uint8_t maxq = std::max(std::max(eq[0], eq[1]), std::max(eq[2], eq[3]));
        wq[h] = IndexQueryFastWeight(mq, maxq, w[h]);
        fast_token = fast_token && !num::IsNan(wq[h]);
        for (int c = 0; c < kIndexDim; ++c)
          q2s[h * kIndexDim + c] = static_cast<int8_t>(
              q2[h * kIndexDim + c] * (num::IsNan(wq[h]) ? 1 : 1 << (eq[c / kMxfp4Block] - mq)));
      }
    } else {
      for (int64_t c = 0; c < kIndexHeads * kIndexDim; ++c) qf[c] = num::Bf16ToF32(qt[c]);
    }
    uint32_t* keys = a.scratch + t * a.E;
    cand.clear();
    for (int64_t j = 0; j * per_block < n; ++j) {
      const int64_t block = a.block_table[s * a.MB + j];
      const int64_t end = std::min(n, (j + 1) * per_block);
      if (block < 0 || block >= a.N) {
        CountError(a.errors, kMissingBlock, t);
        for (int64_t i = j * per_block; i < end; ++i) keys[i] = 0;
        continue;
      }
      for (int64_t i = j * per_block; i < end; ++i) {
        const int64_t row = (l * a.N + block) * per_block + i % per_block;
        const uint8_t* pk = a.packed + row * kIndexPacked;
        const uint8_t* sk = a.scale + row * kIndexScales;
        float score;
        if (mxfp4) {
          uint32_t shifts;
          float kf;
          const uint32_t sword = sk[0] | sk[1] << 8 | sk[2] << 16 | static_cast<uint32_t>(sk[3]) << 24;
          score = fast_token && IndexKeyFast(sword, &shifts, &kf)
                      ? IndexScoreMxfp4Fast(pk, shifts, kf, q2s, wq)
                      : IndexScoreMxfp4(pk, sk, q2, qfac, w);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(IndexerTopkCpu, IndexerTopkImpl, DSV4_BIND(DSV4_INDEXER_TOPK_OPERANDS, ffi::Ffi::Bind()));

}  // namespace dsv4
