// nanobind module _dsv4_cuda: hands the CUDA FFI handlers to Python as capsules.
#include <nanobind/nanobind.h>

#include "handlers_cuda.h"

namespace nb = nanobind;

namespace dsv4 {
void BindNumericsProbe(nb::module_& m);  // numerics_probe_py.cc
}  // namespace dsv4

NB_MODULE(_dsv4_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["dsv4_apply_step"] = nb::capsule(reinterpret_cast<void*>(dsv4::ApplyStepCuda));
    targets["dsv4_indexer_topk"] = nb::capsule(reinterpret_cast<void*>(dsv4::IndexerTopkCuda));
    return targets;
  });
  dsv4::BindNumericsProbe(m);
}
