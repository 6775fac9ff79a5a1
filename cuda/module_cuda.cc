// nanobind module _dsv4_cuda: hands the CUDA FFI handlers to Python as capsules.
#include <nanobind/nanobind.h>

#include "handlers_cuda.h"

namespace nb = nanobind;

namespace {
template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

// The targets in the order of ffi/include/dsv4/ops.def, as _dsv4_cpu's.
NB_MODULE(_dsv4_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
#define DSV4_OP(op, target, cpu, cuda, operands) targets[#target] = Capsule(dsv4::cuda);
#include "dsv4/ops.def"
#undef DSV4_OP
    return targets;
  });
}
