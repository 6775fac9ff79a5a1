// apply_step: start of a step. Resets the slots of newly admitted requests and
// writes new block-table entries; blocks handed out are scrubbed to blank so a
// block's next owner never reads the previous owner's entries.
//
// Operands (one FFI binding for CPU and CUDA):
//   args: new_blocks s32[NB,3] (slot, logical, physical; slot -1 = padding),
//         reset_slots s32[NR] (-1 = padding), then the aliased state leaves
//         block_table s32[R,MB], swa_pos s32[L,R,128], csa_comp f32[Lc,R,2,3,512],
//         csa_icomp f32[Lc,R,2,3,128], hca_comp f32[Lh,R,1,3,512], errors s32[9] (54 with detail),
//         and the pools to scrub (any dtype, dims [L?, N, ...]).
//   rets: the aliased leaves again, in the same order.
// Semantics: resets first (in order), then new-block rows in order, so a later
// row for the same (slot, logical) wins. Bad rows are dropped and counted.
#pragma once

#include <cstdint>
#include <utility>

#include "dsv4/ffi_checks.h"
#include "dsv4/layout.h"

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

template <typename Binding>
auto BindApplyStep(Binding binding) {
  return std::move(binding).template Attr<int64_t>("num_blocks")
      .template Arg<ffi::Buffer<ffi::S32, 2>>()   // new_blocks
      .template Arg<ffi::Buffer<ffi::S32, 1>>()   // reset_slots
      .template Arg<ffi::Buffer<ffi::S32, 2>>()   // block_table
      .template Arg<ffi::Buffer<ffi::S32, 3>>()   // swa_pos
      .template Arg<ffi::Buffer<ffi::F32>>()      // csa_comp
      .template Arg<ffi::Buffer<ffi::F32>>()      // csa_icomp
      .template Arg<ffi::Buffer<ffi::F32>>()      // hca_comp
      .template Arg<ffi::Buffer<ffi::S32, 1>>()   // errors
      .RemainingArgs()                            // pools
      .template Ret<ffi::Buffer<ffi::S32, 2>>()
      .template Ret<ffi::Buffer<ffi::S32, 3>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::S32, 1>>()
      .RemainingRets();
}

// Checks every operand and fills `dims` and `pools` (from the result buffers,
// which alias the inputs).
inline ffi::Error ValidateApplyStep(int64_t num_blocks, ffi::Buffer<ffi::S32, 2> new_blocks,
                                    ffi::Buffer<ffi::S32, 1> reset_slots,
                                    ffi::Buffer<ffi::S32, 2> block_table,
                                    ffi::Buffer<ffi::S32, 3> swa_pos,
                                    ffi::Buffer<ffi::F32> csa_comp,
                                    ffi::Buffer<ffi::F32> csa_icomp,
                                    ffi::Buffer<ffi::F32> hca_comp,
                                    ffi::Buffer<ffi::S32, 1> errors,
                                    ffi::RemainingRets pool_rets, ApplyStepDims* dims,
                                    ScrubPools* pools) {
  ApplyStepDims d;
  d.R = block_table.dimensions()[0];
  d.MB = block_table.dimensions()[1];
  d.N = num_blocks;
  d.L = swa_pos.dimensions()[0];
  d.NB = new_blocks.dimensions()[0];
  d.NR = reset_slots.dimensions()[0];
  DSV4_RETURN_IF_ERROR(CheckDims("new_blocks", new_blocks.dimensions(), {-1, 3}));
  DSV4_RETURN_IF_ERROR(CheckDims("swa.pos", swa_pos.dimensions(), {-1, d.R, kWindow}));
  if (csa_comp.dimensions().size() != 5)
    return ffi::Error::InvalidArgument("csa.comp: expected rank 5, got " +
                                       DimsToString(csa_comp.dimensions()));
  if (hca_comp.dimensions().size() != 5)
    return ffi::Error::InvalidArgument("hca.comp: expected rank 5, got " +
                                       DimsToString(hca_comp.dimensions()));
  d.Lc = csa_comp.dimensions()[0];
  d.Lh = hca_comp.dimensions()[0];
  DSV4_RETURN_IF_ERROR(CheckDims("csa.comp", csa_comp.dimensions(), {d.Lc, d.R, 2, 3, kHeadDim}));
  DSV4_RETURN_IF_ERROR(
      CheckDims("csa.icomp", csa_icomp.dimensions(), {d.Lc, d.R, 2, 3, kIndexDim}));
  DSV4_RETURN_IF_ERROR(CheckDims("hca.comp", hca_comp.dimensions(), {d.Lh, d.R, 1, 3, kHeadDim}));
  DSV4_RETURN_IF_ERROR(CheckErrorsDims("errors", errors.dimensions()));
  if (pool_rets.size() > static_cast<size_t>(kMaxScrubPools))
    return ffi::Error::InvalidArgument("pools: at most 8 pool buffers, got " +
                                       std::to_string(pool_rets.size()));
  pools->count = static_cast<int>(pool_rets.size());
  for (size_t i = 0; i < pool_rets.size(); ++i) {
    auto pool = pool_rets.get<ffi::AnyBuffer>(i);
    if (pool.has_error()) return pool.error();
    auto pdims = pool.value()->dimensions();
    if (pdims.size() < 2 || pdims[1] != d.N)
      return ffi::Error::InvalidArgument("pool " + std::to_string(i) +
                                         ": expected dims [layers, num_blocks=" +
                                         std::to_string(d.N) + ", ...], got " +
                                         DimsToString(pdims));
    int64_t layers = pdims[0];
    pools->data[i] = static_cast<uint8_t*>(pool.value()->untyped_data());
    pools->layers[i] = layers;
    pools->bytes_per_block[i] =
        layers * d.N == 0 ? 0 : static_cast<int64_t>(pool.value()->size_bytes()) / (layers * d.N);
    pools->fill[i] =
        pool.value()->element_type() == ffi::DataType::F8E8M0FNU ? kBlankScaleE8m0 : 0;
  }
  *dims = d;
  return ffi::Error::Success();
}

}  // namespace dsv4
