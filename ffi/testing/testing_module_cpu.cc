// nanobind module _dsv4_testing_cpu: the test-only pieces (testing.h) for the
// CPU. Loaded by dsv4_jax/_ffi.py when a testing build installed it.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include "cpu/handlers_cpu.h"
#include "dsv4/flush.h"
#include "dsv4/operands.h"
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
  // The serial walk's targets bind flush's operands (as _dsv4_cpu.operands()).
  m.def("operands", []() {
    nanobind::dict targets;
    targets["dsv4_flush_csa_serial"] = nanobind::cast(DSV4_OPERAND_LIST(DSV4_FLUSH_CSA_OPERANDS));
    targets["dsv4_flush_hca_serial"] = nanobind::cast(DSV4_OPERAND_LIST(DSV4_FLUSH_HCA_OPERANDS));
    return targets;
  });
  dsv4::BindNumerics(m);
}
