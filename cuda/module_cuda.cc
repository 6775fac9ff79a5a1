// nanobind module _dsv4_cuda: hands the CUDA FFI handlers to Python as capsules.
#include <nanobind/nanobind.h>

#include "handlers_cuda.h"

namespace nb = nanobind;

NB_MODULE(_dsv4_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["dsv4_apply_step"] = nb::capsule(reinterpret_cast<void*>(dsv4::ApplyStepCuda));
    return targets;
  });
}
