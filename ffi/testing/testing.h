// What the test-only modules _dsv4_testing_cpu and _dsv4_testing_cuda hold
// (built with -DDSV4_BUILD_TESTING=ON, never in the default wheel): the
// numerics header exposed to Python, an FFI target that does nothing, and
// (CPU) flush on the serial walk alone (declared in handlers_cpu.h).
#pragma once

#include <nanobind/nanobind.h>

#include "xla/ffi/api/ffi.h"

namespace dsv4 {

// dsv4_noop: its operand aliased to its result, no work. The benchmarks time
// it as the floor of any handler's cost (dispatch, launch). ffi/testing/noop.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(Noop);
// The module's registrations(): {"dsv4_noop": capsule}. ffi/testing/noop.cc
nanobind::dict TestingTargets();

// Submodule `numerics` of the module: ffi/include/dsv4/numerics.h on the host
// (ffi/testing/numerics_py.cc) or run on the GPU (cuda/testing/numerics_probe_py.cc), with the
// same names and arguments.
void BindNumerics(nanobind::module_& m);
void BindNumericsProbe(nanobind::module_& m);

}  // namespace dsv4
