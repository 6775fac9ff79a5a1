// nanobind module _dsv4_cpu: hands the CPU FFI handlers to Python as capsules.
#include <nanobind/nanobind.h>

#include "handlers_cpu.h"

namespace nb = nanobind;

namespace {
template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_dsv4_cpu, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["dsv4_apply_step"] = Capsule(dsv4::ApplyStepCpu);
    return targets;
  });
}
