// CPU handlers of flush for CSA and HCA layers (operands and semantics in
// flush.h), and the serial walk: tokens folded one at a time in row order,
// which is the order of each request's positions. The handlers run the
// window plan for regular requests and this walk for the others
// (flush_plan_cpu.cc).
#include "flush.h"
#include "flush_host.h"
#include "handlers_cpu.h"
#include "host_writes.h"

namespace dsv4 {
namespace {

using host_flush::AccRow;
using host_flush::Finalize;
using host_flush::Fold;
using host_flush::SetEmpty;
using host_flush::TokenInputsFinite;

// CSA: b half into current, a half into next; at the window's last token the
// current accumulator becomes entry w and next moves up. Returns whether the
// window closed; the pooled value is then in `pooled`.
bool FoldCsa(const CompressorView& v, int64_t R, int64_t l, int64_t s, int64_t t, int64_t p,
             float* pooled) {
  float* cur = AccRow(v, R, l, s, 0);
  float* next = AccRow(v, R, l, s, 1);
  Fold(cur, v, t, p, v.d);
  Fold(next, v, t, p, 0);
  if (p % v.m != v.m - 1) return false;
  Finalize(cur, v.d, pooled);
  for (int64_t i = 0; i < 3 * int64_t{v.d}; ++i) cur[i] = next[i];
  SetEmpty(next, v.d);
  return true;
}

// Drops a bad token (counting it); returns the physical block of its position.
int64_t TokenBlock(const FlushArgs& a, int64_t t) {
  int64_t s = a.slot[t], p = a.pos[t];
  if (s == -1) return -1;
  if (s < 0 || s >= a.R) {
    ++a.errors[kBadSlot];
    return -1;
  }
  if (p < 0 || p >= a.max_context || p / kBlockTokens >= a.MB) {
    ++a.errors[kBadPosition];
    return -1;
  }
  int64_t block = a.block_table[s * a.MB + p / kBlockTokens];
  if (block < 0 || block >= a.N) {
    ++a.errors[kMissingBlock];
    return -1;
  }
  if (!TokenInputsFinite(a.main, t) || (a.csa && !TokenInputsFinite(a.index, t))) {
    ++a.errors[kNonfinite];
    return -1;
  }
  return block;
}

}  // namespace

void WalkCsaOnHost(const FlushArgs& a, int64_t l) {
  float pooled[kHeadDim], ikey[kIndexDim];
  for (int64_t t = 0; t < a.T; ++t) {
    int64_t block = TokenBlock(a, t);
    if (block < 0) continue;
    int64_t s = a.slot[t], p = a.pos[t];
    bool closed = FoldCsa(a.main, a.R, l, s, t, p, pooled);
    FoldCsa(a.index, a.R, l, s, t, p, ikey);
    if (!closed) continue;
    int64_t w = p / kCsaRatio;
    host_flush::StoreCsaEntry(a, host_flush::EntryIndex(a, l, block, w), w, pooled, ikey);
  }
}

void WalkHcaOnHost(const FlushArgs& a, int64_t l) {
  float pooled[kHeadDim];
  for (int64_t t = 0; t < a.T; ++t) {
    int64_t block = TokenBlock(a, t);
    if (block < 0) continue;
    int64_t s = a.slot[t], p = a.pos[t];
    float* acc = AccRow(a.main, a.R, l, s, 0);
    Fold(acc, a.main, t, p, 0);
    if (p % kHcaRatio != kHcaRatio - 1) continue;
    Finalize(acc, kHeadDim, pooled);
    SetEmpty(acc, kHeadDim);
    int64_t w = p / kHcaRatio;
    host_flush::StoreHcaEntry(a, host_flush::EntryIndex(a, l, block, w), w, pooled);
  }
}

namespace {

// The handlers' bodies: `kFlush` is FlushCsaOnHost / FlushHcaOnHost (the
// ops) or the serial walk alone (the testing module's targets).
using HostFlush = void (*)(const FlushArgs&, int64_t);

template <HostFlush kFlush>
ffi::Error FlushCsaImpl(int64_t kv_format, int64_t max_context, ffi::AnyBuffer layer,
                        ffi::AnyBuffer token_slot, ffi::AnyBuffer token_pos, ffi::AnyBuffer kv,
                        ffi::AnyBuffer score, ffi::AnyBuffer ape, ffi::AnyBuffer norm,
                        ffi::AnyBuffer inv_freq, ffi::AnyBuffer index_kv,
                        ffi::AnyBuffer index_score, ffi::AnyBuffer index_ape,
                        ffi::AnyBuffer index_norm, ffi::AnyBuffer index_inv_freq,
                        ffi::AnyBuffer block_table, ffi::RemainingArgs rest,
                        ffi::Result<ffi::AnyBuffer> comp, ffi::Result<ffi::AnyBuffer> icomp,
                        ffi::Result<ffi::AnyBuffer> packed, ffi::Result<ffi::AnyBuffer> iscale,
                        ffi::Result<ffi::AnyBuffer> errors, ffi::RemainingRets entry_rets) {
  FlushArgs a;
  DSV4_RETURN_IF_ERROR(ValidateFlushCsa(
      kv_format, max_context, layer, token_slot, token_pos, kv, score, ape, norm, inv_freq,
      index_kv, index_score, index_ape, index_norm, index_inv_freq, block_table, rest, *comp,
      *icomp, *packed, *iscale, *errors, entry_rets, &a));
  int64_t l;
  if (!HostLayerOk(a.layer, a.L, a.errors, &l)) return ffi::Error::Success();
  kFlush(a, l);
  return ffi::Error::Success();
}

template <HostFlush kFlush>
ffi::Error FlushHcaImpl(int64_t kv_format, int64_t max_context, ffi::AnyBuffer layer,
                        ffi::AnyBuffer token_slot, ffi::AnyBuffer token_pos, ffi::AnyBuffer kv,
                        ffi::AnyBuffer score, ffi::AnyBuffer ape, ffi::AnyBuffer norm,
                        ffi::AnyBuffer inv_freq, ffi::AnyBuffer block_table,
                        ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> comp,
                        ffi::Result<ffi::AnyBuffer> errors, ffi::RemainingRets entry_rets) {
  FlushArgs a;
  DSV4_RETURN_IF_ERROR(ValidateFlushHca(kv_format, max_context, layer, token_slot, token_pos, kv,
                                        score, ape, norm, inv_freq, block_table, rest, *comp,
                                        *errors, entry_rets, &a));
  int64_t l;
  if (!HostLayerOk(a.layer, a.L, a.errors, &l)) return ffi::Error::Success();
  kFlush(a, l);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushCsaCpu, FlushCsaImpl<FlushCsaOnHost>,
                              BindFlushCsa(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushHcaCpu, FlushHcaImpl<FlushHcaOnHost>,
                              BindFlushHca(ffi::Ffi::Bind()));
// Registered by the testing module only: every request on the serial walk,
// the oracle of the window plan's bits.
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushCsaSerialCpu, FlushCsaImpl<WalkCsaOnHost>,
                              BindFlushCsa(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushHcaSerialCpu, FlushHcaImpl<WalkHcaOnHost>,
                              BindFlushHca(ffi::Ffi::Bind()));

}  // namespace dsv4
