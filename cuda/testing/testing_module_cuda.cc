// nanobind module _dsv4_testing_cuda: the test-only pieces (ffi/testing/testing.h) for the
// GPU. Loaded by dsv4_jax/_ffi.py when a testing build installed it.
#include <nanobind/nanobind.h>

#include "testing/testing.h"

NB_MODULE(_dsv4_testing_cuda, m) {
  m.def("registrations", &dsv4::TestingTargets);
  dsv4::BindNumericsProbe(m);
}
