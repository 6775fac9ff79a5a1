// The CPU FFI handlers, one symbol per target of dsv4/ops.def (defined in
// ffi/cpu/<op>_cpu.cc).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace dsv4 {
#define DSV4_OP(op, target, cpu, cuda, operands) XLA_FFI_DECLARE_HANDLER_SYMBOL(cpu);
#include "dsv4/ops.def"
#undef DSV4_OP
// Test-only (the testing module registers them, the ops module does not):
// flush with every request on the serial walk, the window plan's oracle.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlushCsaSerialCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FlushHcaSerialCpu);
}  // namespace dsv4
