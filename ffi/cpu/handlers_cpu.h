// The CPU FFI handlers, one symbol per op (defined in ffi/<op>_cpu.cc).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace dsv4 {
XLA_FFI_DECLARE_HANDLER_SYMBOL(ApplyStepCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AppendCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlushCsaCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlushHcaCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(WriteLayerCsaCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(WriteLayerHcaCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatherWindowCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatherTopkCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatherAllCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IndexerTopkCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TakeRowsCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PutRowsCpu);
// Test-only (the testing module registers them, the ops module does not):
// flush with every request on the serial walk, the window plan's oracle.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlushCsaSerialCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlushHcaSerialCpu);
}  // namespace dsv4
