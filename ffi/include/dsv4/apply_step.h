// apply_step: start of a step. Resets the slots of newly admitted requests and
// writes new block-table entries; blocks handed out are scrubbed to blank so a
// block's next owner never reads the previous owner's entries.
// Operands: DSV4_APPLY_STEP_OPERANDS below (dsv4/operands.h); what each holds
// and the rules: dsv4_jax/ops/apply_step.py (target "dsv4_apply_step").
#pragma once

#include <cstdint>
#include <utility>

#include "dsv4/ffi_checks.h"
#include "dsv4/layout.h"
#include "dsv4/operands.h"

namespace dsv4 {

struct ApplyStepDims {
  int64_t R = 0, MB = 0, N = 0, L = 0, Lc = 0, Lh = 0, NB = 0, NR = 0;
};

// The pools `apply_step` scrubs, reduced to what scrubbing needs.
constexpr int kMaxScrubPools = 8;
struct ScrubPools {
  int count = 0;
  uint8_t* data[kMaxScrubPools] = {};
  int64_t layers[kMaxScrubPools] = {};          // leading axis
  int64_t bytes_per_block[kMaxScrubPools] = {};  // one layer's slice of one block
  uint8_t fill[kMaxScrubPools] = {};
};

// The handlers' operands (dsv4/operands.h); typed buffers, the types named
// so they pass through the macro.
using S32Rank1 = ffi::Buffer<ffi::S32, 1>;
using S32Rank2 = ffi::Buffer<ffi::S32, 2>;
using S32Rank3 = ffi::Buffer<ffi::S32, 3>;
using F32Buffer = ffi::Buffer<ffi::F32>;
#define DSV4_APPLY_STEP_OPERANDS(ATTR, ATTRS, ARG, ARGS, RET, RETS)                         \
  ATTR(int64_t, num_blocks) ARG(S32Rank2, new_blocks) ARG(S32Rank1, reset_slots)            \
  ARG(S32Rank2, block_table_in) ARG(S32Rank3, swa_pos_in) ARG(F32Buffer, csa_comp_in)       \
  ARG(F32Buffer, csa_icomp_in) ARG(F32Buffer, hca_comp_in) ARG(S32Rank1, errors_in)         \
  ARGS(pools_in) RET(S32Rank2, block_table) RET(S32Rank3, swa_pos) RET(F32Buffer, csa_comp) \
  RET(F32Buffer, csa_icomp) RET(F32Buffer, hca_comp) RET(S32Rank1, errors) RETS(pools)

// Checks every operand and fills `dims` and `scrub` (from the results,
// which alias the arguments).
inline ffi::Error ValidateApplyStep(DSV4_PARAMS(DSV4_APPLY_STEP_OPERANDS), ApplyStepDims* dims,
                                    ScrubPools* scrub) {
  ApplyStepDims d;
  d.R = block_table->dimensions()[0];
  d.MB = block_table->dimensions()[1];
  d.N = num_blocks;
  d.L = swa_pos->dimensions()[0];
  d.NB = new_blocks.dimensions()[0];
  d.NR = reset_slots.dimensions()[0];
  DSV4_RETURN_IF_ERROR(CheckDims("new_blocks", new_blocks.dimensions(), {-1, 3}));
  DSV4_RETURN_IF_ERROR(CheckDims("swa.pos", swa_pos->dimensions(), {-1, d.R, kWindow}));
  if (csa_comp->dimensions().size() != 5)
    return ffi::Error::InvalidArgument("csa.comp: expected rank 5, got " +
                                       DimsToString(csa_comp->dimensions()));
  if (hca_comp->dimensions().size() != 5)
    return ffi::Error::InvalidArgument("hca.comp: expected rank 5, got " +
                                       DimsToString(hca_comp->dimensions()));
  d.Lc = csa_comp->dimensions()[0];
  d.Lh = hca_comp->dimensions()[0];
  DSV4_RETURN_IF_ERROR(CheckDims("csa.comp", csa_comp->dimensions(), {d.Lc, d.R, 2, 3, kHeadDim}));
  DSV4_RETURN_IF_ERROR(
      CheckDims("csa.icomp", csa_icomp->dimensions(), {d.Lc, d.R, 2, 3, kIndexDim}));
  DSV4_RETURN_IF_ERROR(CheckDims("hca.comp", hca_comp->dimensions(), {d.Lh, d.R, 1, 3, kHeadDim}));
  DSV4_RETURN_IF_ERROR(CheckErrorsDims("errors", errors->dimensions()));
  if (pools.size() > static_cast<size_t>(kMaxScrubPools))
    return ffi::Error::InvalidArgument("pools: at most 8 pool buffers, got " +
                                       std::to_string(pools.size()));
  scrub->count = static_cast<int>(pools.size());
  for (size_t i = 0; i < pools.size(); ++i) {
    auto pool = pools.get<ffi::AnyBuffer>(i);
    if (pool.has_error()) return pool.error();
    auto pdims = pool.value()->dimensions();
    if (pdims.size() < 2 || pdims[1] != d.N)
      return ffi::Error::InvalidArgument("pool " + std::to_string(i) +
                                         ": expected dims [layers, num_blocks=" +
                                         std::to_string(d.N) + ", ...], got " +
                                         DimsToString(pdims));
    int64_t layers = pdims[0];
    scrub->data[i] = static_cast<uint8_t*>(pool.value()->untyped_data());
    scrub->layers[i] = layers;
    scrub->bytes_per_block[i] =
        layers * d.N == 0 ? 0 : static_cast<int64_t>(pool.value()->size_bytes()) / (layers * d.N);
    scrub->fill[i] =
        pool.value()->element_type() == ffi::DataType::F8E8M0FNU ? kBlankScaleE8m0 : 0;
  }
  *dims = d;
  return ffi::Error::Success();
}

}  // namespace dsv4
