// A query token of indexer_topk as each of its kernels reads it: slot and visible entries.
#pragma once

#include <cstdint>

#include "indexer_topk.h"

namespace dsv4 {
namespace indexer {
namespace {  // internal linkage: see cuda/indexer_topk.cu

struct TokenInfo {
  bool ok;       // a good token of a good layer
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

}  // namespace
}  // namespace indexer
}  // namespace dsv4
