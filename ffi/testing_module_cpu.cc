// nanobind module _dsv4_testing_cpu: the test-only pieces (testing.h) for the
// CPU. Loaded by dsv4_jax/_ffi.py when a testing build installed it.
#include <nanobind/nanobind.h>

#include "testing.h"

NB_MODULE(_dsv4_testing_cpu, m) {
  m.def("registrations", &dsv4::TestingTargets);
  dsv4::BindNumerics(m);
}
