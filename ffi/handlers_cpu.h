// The CPU FFI handlers, one symbol per op (defined in ffi/<op>_cpu.cc).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace dsv4 {
XLA_FFI_DECLARE_HANDLER_SYMBOL(ApplyStepCpu);
}  // namespace dsv4
