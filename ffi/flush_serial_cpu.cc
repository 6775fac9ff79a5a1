// Test-only CPU targets dsv4_flush_csa_serial / dsv4_flush_hca_serial:
// flush's operands and checks, with every request taken by the serial walk,
// so a test can hold the window plan of the real handlers against it bit for
// bit (the testing module registers them; the ops module never does).
#include "flush.h"
#include "host_writes.h"
#include "testing.h"

namespace dsv4 {
namespace {

ffi::Error FlushCsaSerialImpl(int64_t kv_format, int64_t max_context, ffi::AnyBuffer layer,
                              ffi::AnyBuffer token_slot, ffi::AnyBuffer token_pos,
                              ffi::AnyBuffer kv, ffi::AnyBuffer score, ffi::AnyBuffer ape,
                              ffi::AnyBuffer norm, ffi::AnyBuffer inv_freq,
                              ffi::AnyBuffer index_kv, ffi::AnyBuffer index_score,
                              ffi::AnyBuffer index_ape, ffi::AnyBuffer index_norm,
                              ffi::AnyBuffer index_inv_freq, ffi::AnyBuffer block_table,
                              ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> comp,
                              ffi::Result<ffi::AnyBuffer> icomp,
                              ffi::Result<ffi::AnyBuffer> packed,
                              ffi::Result<ffi::AnyBuffer> iscale,
                              ffi::Result<ffi::AnyBuffer> errors, ffi::RemainingRets entry_rets) {
  FlushArgs a;
  DSV4_RETURN_IF_ERROR(ValidateFlushCsa(
      kv_format, max_context, layer, token_slot, token_pos, kv, score, ape, norm, inv_freq,
      index_kv, index_score, index_ape, index_norm, index_inv_freq, block_table, rest, *comp,
      *icomp, *packed, *iscale, *errors, entry_rets, &a));
  int64_t l;
  if (HostLayerOk(a.layer, a.L, a.errors, &l)) WalkCsaOnHost(a, l);
  return ffi::Error::Success();
}

ffi::Error FlushHcaSerialImpl(int64_t kv_format, int64_t max_context, ffi::AnyBuffer layer,
                              ffi::AnyBuffer token_slot, ffi::AnyBuffer token_pos,
                              ffi::AnyBuffer kv, ffi::AnyBuffer score, ffi::AnyBuffer ape,
                              ffi::AnyBuffer norm, ffi::AnyBuffer inv_freq,
                              ffi::AnyBuffer block_table, ffi::RemainingArgs rest,
                              ffi::Result<ffi::AnyBuffer> comp,
                              ffi::Result<ffi::AnyBuffer> errors, ffi::RemainingRets entry_rets) {
  FlushArgs a;
  DSV4_RETURN_IF_ERROR(ValidateFlushHca(kv_format, max_context, layer, token_slot, token_pos, kv,
                                        score, ape, norm, inv_freq, block_table, rest, *comp,
                                        *errors, entry_rets, &a));
  int64_t l;
  if (HostLayerOk(a.layer, a.L, a.errors, &l)) WalkHcaOnHost(a, l);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushCsaSerialCpu, FlushCsaSerialImpl,
                              BindFlushCsa(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushHcaSerialCpu, FlushHcaSerialImpl,
                              BindFlushHca(ffi::Ffi::Bind()));

}  // namespace dsv4
