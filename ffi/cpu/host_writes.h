// The CPU bodies of the write ops, called by their own handlers and by
// write_layer's (which runs append's, then flush's, in one FFI call).
// `l` is the layer index already checked by HostLayerOk.
#pragma once

#include <cstdint>

#include "dsv4/append.h"
#include "dsv4/flush.h"

namespace dsv4 {

void AppendOnHost(const AppendArgs& a, int64_t l);    // append_cpu.cc
// flush: the window plan for regular requests, the serial walk for the rest
void FlushCsaOnHost(const FlushArgs& a, int64_t l);   // flush_plan_cpu.cc
void FlushHcaOnHost(const FlushArgs& a, int64_t l);   // flush_plan_cpu.cc
// the serial walk of every row (what FlushCsaOnHost does with irregular
// requests; the testing module's dsv4_flush_*_serial call it on the whole call)
void WalkCsaOnHost(const FlushArgs& a, int64_t l);    // flush_cpu.cc
void WalkHcaOnHost(const FlushArgs& a, int64_t l);    // flush_cpu.cc

}  // namespace dsv4
