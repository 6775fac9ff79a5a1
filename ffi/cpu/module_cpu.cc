// nanobind module _dsv4_cpu: hands the CPU FFI handlers to Python as capsules.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include "cpu/handlers_cpu.h"
#include "dsv4/append.h"
#include "dsv4/apply_step.h"
#include "dsv4/attention.h"
#include "dsv4/copy_rows.h"
#include "dsv4/flush.h"
#include "dsv4/gather.h"
#include "dsv4/indexer_topk.h"
#include "dsv4/layout.h"
#include "dsv4/operands.h"
#include "dsv4/write_layer.h"

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
#define DSV4_OP(op, target, cpu, cuda, operands) targets[#target] = Capsule(dsv4::cpu);
#include "dsv4/ops.def"
#undef DSV4_OP
    return targets;
  });
  // Each target's operands as its handlers bind them: (role, name) in order
  // (dsv4/operands.h). The call sites find their aliases in it by name.
  m.def("operands", []() {
    nb::dict targets;
#define DSV4_OP(op, target, cpu, cuda, operands) \
  targets[#target] = nb::cast(DSV4_OPERAND_LIST(operands));
#include "dsv4/ops.def"
#undef DSV4_OP
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
