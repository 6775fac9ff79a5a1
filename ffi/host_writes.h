// The CPU bodies of the write ops, called by their own handlers and by
// write_layer's (which runs append's, then flush's, in one FFI call).
// `l` is the layer index already checked by HostLayerOk.
#pragma once

#include <cstdint>

#include "append.h"
#include "flush.h"

namespace dsv4 {

void AppendOnHost(const AppendArgs& a, int64_t l);    // append_cpu.cc
void FlushCsaOnHost(const FlushArgs& a, int64_t l);   // flush_cpu.cc
void FlushHcaOnHost(const FlushArgs& a, int64_t l);   // flush_cpu.cc

}  // namespace dsv4
