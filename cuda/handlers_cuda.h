// The CUDA FFI handlers, one symbol per target of dsv4/ops.def (defined in
// cuda/<op>/*.cu).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace dsv4 {
#define DSV4_OP(op, target, cpu, cuda, operands) XLA_FFI_DECLARE_HANDLER_SYMBOL(cuda);
#include "dsv4/ops.def"
#undef DSV4_OP
}  // namespace dsv4
