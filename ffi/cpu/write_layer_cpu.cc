// CPU handlers of write_layer (operands in write_layer.h): append's body,
// then flush's, each behind its own layer check, exactly as the two calls.
#include "cpu/handlers_cpu.h"
#include "cpu/host_writes.h"
#include "dsv4/write_layer.h"

namespace dsv4 {
namespace {

// Each part counts a bad layer of its own, as append and flush would.
void WriteLayerOnHost(const WriteLayerArgs& w, void (*flush)(const FlushArgs&, int64_t)) {
  int64_t l;
  if (HostLayerOk(w.append.layer, w.append.L, w.append.errors, &l)) AppendOnHost(w.append, l);
  if (HostLayerOk(w.flush.layer, w.flush.L, w.flush.errors, &l)) flush(w.flush, l);
}

ffi::Error WriteLayerCsaImpl(int64_t kv_format, int64_t max_context, int64_t max_rows_per_slot,
                             ffi::AnyBuffer window_layer, ffi::AnyBuffer layer,
                             ffi::AnyBuffer meta, ffi::AnyBuffer kv, ffi::AnyBuffer comp_kv,
                             ffi::AnyBuffer comp_score, ffi::AnyBuffer ape, ffi::AnyBuffer norm,
                             ffi::AnyBuffer inv_freq, ffi::AnyBuffer index_kv,
                             ffi::AnyBuffer index_score, ffi::AnyBuffer index_ape,
                             ffi::AnyBuffer index_norm, ffi::AnyBuffer index_inv_freq,
                             ffi::AnyBuffer block_table, ffi::RemainingArgs args,
                             ffi::RemainingRets rets) {
  WriteLayerArgs w;
  DSV4_RETURN_IF_ERROR(ValidateWriteLayerCsa(kv_format, max_context, max_rows_per_slot,
                                             window_layer, layer, meta, kv,
                                             comp_kv, comp_score, ape, norm, inv_freq, index_kv,
                                             index_score, index_ape, index_norm, index_inv_freq,
                                             block_table, args, rets, &w));
  WriteLayerOnHost(w, FlushCsaOnHost);
  return ffi::Error::Success();
}

ffi::Error WriteLayerHcaImpl(int64_t kv_format, int64_t max_context, int64_t max_rows_per_slot,
                             ffi::AnyBuffer window_layer, ffi::AnyBuffer layer,
                             ffi::AnyBuffer meta, ffi::AnyBuffer kv, ffi::AnyBuffer comp_kv,
                             ffi::AnyBuffer comp_score, ffi::AnyBuffer ape, ffi::AnyBuffer norm,
                             ffi::AnyBuffer inv_freq, ffi::AnyBuffer block_table,
                             ffi::RemainingArgs args, ffi::RemainingRets rets) {
  WriteLayerArgs w;
  DSV4_RETURN_IF_ERROR(ValidateWriteLayerHca(kv_format, max_context, max_rows_per_slot,
                                             window_layer, layer, meta, kv,
                                             comp_kv, comp_score, ape, norm, inv_freq, block_table,
                                             args, rets, &w));
  WriteLayerOnHost(w, FlushHcaOnHost);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WriteLayerCsaCpu, WriteLayerCsaImpl,
                              BindWriteLayer<true>(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(WriteLayerHcaCpu, WriteLayerHcaImpl,
                              BindWriteLayer<false>(ffi::Ffi::Bind()));

}  // namespace dsv4
