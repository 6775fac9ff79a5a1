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

ffi::Error WriteLayerCsaImpl(DSV4_PARAMS(DSV4_WRITE_LAYER_CSA_OPERANDS)) {
  WriteLayerArgs w;
  DSV4_RETURN_IF_ERROR(ValidateWriteLayerCsa(DSV4_NAMES(DSV4_WRITE_LAYER_CSA_OPERANDS), &w));
  WriteLayerOnHost(w, FlushCsaOnHost);
  return ffi::Error::Success();
}

ffi::Error WriteLayerHcaImpl(DSV4_PARAMS(DSV4_WRITE_LAYER_HCA_OPERANDS)) {
  WriteLayerArgs w;
  DSV4_RETURN_IF_ERROR(ValidateWriteLayerHca(DSV4_NAMES(DSV4_WRITE_LAYER_HCA_OPERANDS), &w));
  WriteLayerOnHost(w, FlushHcaOnHost);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(WriteLayerCsaCpu, WriteLayerCsaImpl,
                              DSV4_BIND(DSV4_WRITE_LAYER_CSA_OPERANDS, ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(WriteLayerHcaCpu, WriteLayerHcaImpl,
                              DSV4_BIND(DSV4_WRITE_LAYER_HCA_OPERANDS, ffi::Ffi::Bind()));

}  // namespace dsv4
