// CPU handler of gather_topk (operands in gather.h, rules in dsv4_jax/ops/gather.py).
#include <cstring>

#include "cpu/handlers_cpu.h"
#include "dsv4/gather.h"

namespace dsv4 {
namespace {

ffi::Error GatherTopkImpl(DSV4_PARAMS(DSV4_GATHER_TOPK_OPERANDS)) {
  GatherTopkArgs a;
  DSV4_RETURN_IF_ERROR(ValidateGatherTopk(DSV4_NAMES(DSV4_GATHER_TOPK_OPERANDS), &a));
  const int64_t rows = a.T * a.K;
  std::memset(a.out_kv, 0, static_cast<size_t>(rows) * kHeadDim * sizeof(uint16_t));
  for (int64_t i = 0; i < rows; ++i) a.valid[i] = false;
  int64_t l;
  if (!HostLayerOk(a.layer, a.L, a.errors, &l)) return ffi::Error::Success();
  for (int64_t t = 0; t < a.T; ++t) {
    int64_t s = a.slot[t], p = a.pos[t];
    if (s == -1) continue;
    if (s < 0 || s >= a.R) {
      CountError(a.errors, kBadSlot, t);
      continue;
    }
    if (!QueryPositionOk(p, a.MB)) {
      CountError(a.errors, kBadPosition, t);
      continue;
    }
    const int64_t visible = IndexVisible(p, a.MB * a.per_block);
    for (int64_t j = 0; j < a.K; ++j) {
      int64_t i = a.indices[t * a.K + j];
      if (i == -1) continue;
      if (i < -1 || i >= visible) {
        CountError(a.errors, kBadIndex, t);
        continue;
      }
      int64_t logical = i / a.per_block;
      int64_t block = a.block_table[s * a.MB + logical];
      if (block < 0 || block >= a.N) {
        CountError(a.errors, kMissingBlock, t);
        continue;
      }
      DecodeEntry(a.pool, (l * a.N + block) * a.per_block + i % a.per_block,
                  a.out_kv + (t * a.K + j) * kHeadDim);
      a.valid[t * a.K + j] = true;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherTopkCpu, GatherTopkImpl, DSV4_BIND(DSV4_GATHER_TOPK_OPERANDS, ffi::Ffi::Bind()));

}  // namespace dsv4
