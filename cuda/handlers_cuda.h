// The CUDA FFI handlers, one symbol per op (defined in cuda/<op>.cu).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace dsv4 {
XLA_FFI_DECLARE_HANDLER_SYMBOL(ApplyStepCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IndexerTopkCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AppendCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlushCsaCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlushHcaCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(WriteLayerCsaCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(WriteLayerHcaCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatherWindowCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatherTopkCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatherAllCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionCuda);
}  // namespace dsv4
