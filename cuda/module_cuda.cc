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

// The targets in the order of ffi/cpu/module_cpu.cc: every op's two handlers
// side by side.
NB_MODULE(_dsv4_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["dsv4_apply_step"] = Capsule(dsv4::ApplyStepCuda);
    targets["dsv4_append"] = Capsule(dsv4::AppendCuda);
    targets["dsv4_flush_csa"] = Capsule(dsv4::FlushCsaCuda);
    targets["dsv4_flush_hca"] = Capsule(dsv4::FlushHcaCuda);
    targets["dsv4_write_layer_csa"] = Capsule(dsv4::WriteLayerCsaCuda);
    targets["dsv4_write_layer_hca"] = Capsule(dsv4::WriteLayerHcaCuda);
    targets["dsv4_gather_window"] = Capsule(dsv4::GatherWindowCuda);
    targets["dsv4_gather_topk"] = Capsule(dsv4::GatherTopkCuda);
    targets["dsv4_gather_all"] = Capsule(dsv4::GatherAllCuda);
    targets["dsv4_indexer_topk"] = Capsule(dsv4::IndexerTopkCuda);
    targets["dsv4_attention"] = Capsule(dsv4::AttentionCuda);
    targets["dsv4_take_rows"] = Capsule(dsv4::TakeRowsCuda);
    targets["dsv4_put_rows"] = Capsule(dsv4::PutRowsCuda);
    return targets;
  });
}
