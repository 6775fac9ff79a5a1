// CPU handler of append (operands in append.h, rules in dsv4_jax/ops/append.py).
#include <vector>

#include "cpu/handlers_cpu.h"
#include "cpu/host_writes.h"
#include "dsv4/append.h"

namespace dsv4 {

// Pass 1: the winning row of each (slot, ring slot): largest position, ties
// to the later row. Pass 2: write the winners.
void AppendOnHost(const AppendArgs& a, int64_t l) {
  std::vector<int64_t> winner(static_cast<size_t>(a.R) * kWindow, -1);
  for (int64_t t = 0; t < a.T; ++t) {
    int64_t s = a.slot[t], p = a.pos[t];
    if (s == -1) continue;
    if (s < 0 || s >= a.R) {
      CountError(a.errors, kBadSlot, t);
      continue;
    }
    if (p < 0 || p >= a.max_context) {
      CountError(a.errors, kBadPosition, t);
      continue;
    }
    if (!num::RowIsFinite(a.kv + t * kHeadDim, kHeadDim)) {
      CountError(a.errors, kNonfinite, t);
      continue;
    }
    int64_t& w = winner[static_cast<size_t>(s * kWindow + p % kWindow)];
    if (w < 0 || p >= a.pos[w]) w = t;
  }
  float row[kHeadDim];
  for (int64_t s = 0; s < a.R; ++s)
    for (int64_t r = 0; r < kWindow; ++r) {
      int64_t t = winner[static_cast<size_t>(s * kWindow + r)];
      if (t < 0) continue;
      for (int c = 0; c < kHeadDim; ++c) row[c] = num::Bf16ToF32(a.kv[t * kHeadDim + c]);
      int64_t e = (l * a.R + s) * kWindow + r;
      EncodeEntry(a.pool, e, row);
      a.swa_pos[e] = a.pos[t];
    }
}

namespace {

ffi::Error AppendImpl(DSV4_PARAMS(DSV4_APPEND_OPERANDS)) {
  AppendArgs a;
  DSV4_RETURN_IF_ERROR(ValidateAppend(DSV4_NAMES(DSV4_APPEND_OPERANDS), &a));
  int64_t l;
  if (HostLayerOk(a.layer, a.L, a.errors, &l)) AppendOnHost(a, l);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AppendCpu, AppendImpl, DSV4_BIND(DSV4_APPEND_OPERANDS, ffi::Ffi::Bind()));

}  // namespace dsv4
