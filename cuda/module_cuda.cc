// nanobind module _dsv4_cuda: hands the CUDA FFI handlers to Python as capsules.
#include <nanobind/nanobind.h>

#include "handlers_cuda.h"

namespace nb = nanobind;

NB_MODULE(_dsv4_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["dsv4_apply_step"] = nb::capsule(reinterpret_cast<void*>(dsv4::ApplyStepCuda));
    targets["dsv4_indexer_topk"] = nb::capsule(reinterpret_cast<void*>(dsv4::IndexerTopkCuda));
    targets["dsv4_append"] = nb::capsule(reinterpret_cast<void*>(dsv4::AppendCuda));
    targets["dsv4_flush_csa"] = nb::capsule(reinterpret_cast<void*>(dsv4::FlushCsaCuda));
    targets["dsv4_flush_hca"] = nb::capsule(reinterpret_cast<void*>(dsv4::FlushHcaCuda));
    targets["dsv4_write_layer_csa"] =
        nb::capsule(reinterpret_cast<void*>(dsv4::WriteLayerCsaCuda));
    targets["dsv4_write_layer_hca"] =
        nb::capsule(reinterpret_cast<void*>(dsv4::WriteLayerHcaCuda));
    targets["dsv4_gather_window"] = nb::capsule(reinterpret_cast<void*>(dsv4::GatherWindowCuda));
    targets["dsv4_gather_topk"] = nb::capsule(reinterpret_cast<void*>(dsv4::GatherTopkCuda));
    targets["dsv4_gather_all"] = nb::capsule(reinterpret_cast<void*>(dsv4::GatherAllCuda));
    targets["dsv4_attention"] = nb::capsule(reinterpret_cast<void*>(dsv4::AttentionCuda));
    targets["dsv4_take_rows"] = nb::capsule(reinterpret_cast<void*>(dsv4::TakeRowsCuda));
    targets["dsv4_put_rows"] = nb::capsule(reinterpret_cast<void*>(dsv4::PutRowsCuda));
    return targets;
  });
}
