// The CUDA FFI handlers, one symbol per op (defined in cuda/<op>.cu).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace dsv4 {
XLA_FFI_DECLARE_HANDLER_SYMBOL(ApplyStepCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(IndexerTopkCuda);
}  // namespace dsv4
