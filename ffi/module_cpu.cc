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
    targets["dsv4_append"] = Capsule(dsv4::AppendCpu);
    targets["dsv4_flush_csa"] = Capsule(dsv4::FlushCsaCpu);
    targets["dsv4_flush_hca"] = Capsule(dsv4::FlushHcaCpu);
    targets["dsv4_write_layer_csa"] = Capsule(dsv4::WriteLayerCsaCpu);
    targets["dsv4_write_layer_hca"] = Capsule(dsv4::WriteLayerHcaCpu);
    targets["dsv4_gather_window"] = Capsule(dsv4::GatherWindowCpu);
    targets["dsv4_gather_topk"] = Capsule(dsv4::GatherTopkCpu);
    targets["dsv4_gather_all"] = Capsule(dsv4::GatherAllCpu);
    targets["dsv4_indexer_topk"] = Capsule(dsv4::IndexerTopkCpu);
    targets["dsv4_attention"] = Capsule(dsv4::AttentionCpu);
    targets["dsv4_take_rows"] = Capsule(dsv4::TakeRowsCpu);
    targets["dsv4_put_rows"] = Capsule(dsv4::PutRowsCpu);
    return targets;
  });
}
