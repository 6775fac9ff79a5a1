// CPU handler of gather_window (operands in gather.h, rules in dsv4_jax/ops/gather.py).
#include <cstring>

#include "cpu/handlers_cpu.h"
#include "dsv4/gather.h"

namespace dsv4 {
namespace {

ffi::Error GatherWindowImpl(DSV4_PARAMS(DSV4_GATHER_WINDOW_OPERANDS)) {
  GatherWindowArgs a;
  DSV4_RETURN_IF_ERROR(ValidateGatherWindow(DSV4_NAMES(DSV4_GATHER_WINDOW_OPERANDS), &a));
  const int64_t rows = a.B * kWindow;
  std::memset(a.out_kv, 0, static_cast<size_t>(rows) * kHeadDim * sizeof(uint16_t));
  for (int64_t i = 0; i < rows; ++i) a.out_pos[i] = -1;
  int64_t l;
  if (!HostLayerOk(a.layer, a.L, a.errors, &l)) return ffi::Error::Success();
  for (int64_t b = 0; b < a.B; ++b) {
    int64_t s = a.slots[b];
    if (s == -1) continue;
    if (s < 0 || s >= a.R) {
      CountError(a.errors, kBadSlot, b);
      continue;
    }
    for (int64_t r = 0; r < kWindow; ++r) {
      int64_t e = (l * a.R + s) * kWindow + r;
      int32_t p = a.swa_pos[e];
      if (p < 0) continue;
      a.out_pos[b * kWindow + r] = p;
      DecodeEntry(a.pool, e, a.out_kv + (b * kWindow + r) * kHeadDim);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherWindowCpu, GatherWindowImpl,
                              DSV4_BIND(DSV4_GATHER_WINDOW_OPERANDS, ffi::Ffi::Bind()));

}  // namespace dsv4
