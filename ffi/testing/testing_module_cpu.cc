// nanobind module _dsv4_testing_cpu: the test-only pieces (testing.h) for the
// CPU. Loaded by dsv4_jax/_ffi.py when a testing build installed it.
#include <nanobind/nanobind.h>

#include "cpu/handlers_cpu.h"
#include "testing/testing.h"

namespace {

nanobind::dict CpuTestingTargets() {
  nanobind::dict targets = dsv4::TestingTargets();
  targets["dsv4_flush_csa_serial"] =
      nanobind::capsule(reinterpret_cast<void*>(dsv4::FlushCsaSerialCpu));
  targets["dsv4_flush_hca_serial"] =
      nanobind::capsule(reinterpret_cast<void*>(dsv4::FlushHcaSerialCpu));
  return targets;
}

}  // namespace

NB_MODULE(_dsv4_testing_cpu, m) {
  m.def("registrations", &CpuTestingTargets);
  dsv4::BindNumerics(m);
}
