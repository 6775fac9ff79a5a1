// CPU handler of gather_all (operands in gather.h, rules in dsv4_jax/ops/gather.py).
#include <cstring>

#include "cpu/handlers_cpu.h"
#include "dsv4/gather.h"

namespace dsv4 {
namespace {

ffi::Error GatherAllImpl(DSV4_PARAMS(DSV4_GATHER_ALL_OPERANDS)) {
  GatherAllArgs a;
  DSV4_RETURN_IF_ERROR(ValidateGatherAll(DSV4_NAMES(DSV4_GATHER_ALL_OPERANDS), &a));
  std::memset(a.out_kv, 0, static_cast<size_t>(a.B * a.E) * kHeadDim * sizeof(uint16_t));
  for (int64_t b = 0; b < a.B; ++b) a.count[b] = 0;
  int64_t l;
  if (!HostLayerOk(a.layer, a.L, a.errors, &l)) return ffi::Error::Success();
  for (int64_t b = 0; b < a.B; ++b) {
    int64_t s = a.slots[b], len = a.lengths[b];
    if (s == -1) continue;
    if (s < 0 || s >= a.R) {
      CountError(a.errors, kBadSlot, b);
      continue;
    }
    int64_t n = len / kHcaRatio;
    if (len < 0 || len > a.max_context || n > a.E) {
      CountError(a.errors, kBadLength, b);
      continue;
    }
    a.count[b] = static_cast<int32_t>(n);
    for (int64_t i = 0; i < n; ++i) {
      // One HCA entry per block: entry i lives in logical block i.
      int64_t block = i < a.MB ? a.block_table[s * a.MB + i] : -1;
      if (block < 0 || block >= a.N) {
        CountError(a.errors, kMissingBlock, b);
        continue;
      }
      DecodeEntry(a.pool, l * a.N + block, a.out_kv + (b * a.E + i) * kHeadDim);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherAllCpu, GatherAllImpl, DSV4_BIND(DSV4_GATHER_ALL_OPERANDS, ffi::Ffi::Bind()));

}  // namespace dsv4
