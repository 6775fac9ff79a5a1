// nanobind module _dsv4_cpu: hands the CPU FFI handlers to Python as capsules.
#include <nanobind/nanobind.h>

#include "cpu/handlers_cpu.h"
#include "dsv4/layout.h"

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
  // The layout constants as the C++ and CUDA code sees them, so that a test
  // holds dsv4_jax/config.py and errors.py to the same numbers.
  m.def("layout", []() {
    nb::dict c;
    c["HEAD_DIM"] = dsv4::kHeadDim;
    c["ROPE_DIM"] = dsv4::kRopeDim;
    c["NOPE_DIM"] = dsv4::kNopeDim;
    c["NOPE_TILE"] = dsv4::kNopeTile;
    c["NOPE_TILES"] = dsv4::kNopeTiles;
    c["WINDOW"] = dsv4::kWindow;
    c["CSA_RATIO"] = dsv4::kCsaRatio;
    c["HCA_RATIO"] = dsv4::kHcaRatio;
    c["BLOCK_TOKENS"] = dsv4::kBlockTokens;
    c["INDEX_DIM"] = dsv4::kIndexDim;
    c["INDEX_PACKED"] = dsv4::kIndexPacked;
    c["INDEX_SCALES"] = dsv4::kIndexScales;
    c["ATTN_CHUNK_SCRATCH_ROW"] = dsv4::kAttnChunkScratchRow;
    c["NUM_ERROR_KINDS"] = static_cast<int>(dsv4::kNumErrorKinds);
    c["DETAIL_FIELDS"] = dsv4::kErrorDetailFields;
    c["NO_ROW"] = dsv4::kNoRow;
    return c;
  });
}
