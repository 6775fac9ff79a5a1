// CPU handler of apply_step (semantics in apply_step.h).
#include <cstring>
#include <limits>

#include "cpu/handlers_cpu.h"
#include "dsv4/apply_step.h"

namespace dsv4 {
namespace {

void ResetSlot(const ApplyStepDims& d, int64_t s, int32_t* block_table, int32_t* swa_pos,
               float* csa_comp, float* csa_icomp, float* hca_comp) {
  for (int64_t j = 0; j < d.MB; ++j) block_table[s * d.MB + j] = -1;
  for (int64_t l = 0; l < d.L; ++l)
    for (int64_t w = 0; w < kWindow; ++w) swa_pos[(l * d.R + s) * kWindow + w] = -1;
  // Accumulator groups of (max, sum, kv) rows of `width` floats each.
  auto reset = [&](float* comp, int64_t layers, int64_t accs, int64_t width) {
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t a = 0; a < accs; ++a) {
        float* acc = comp + ((l * d.R + s) * accs + a) * 3 * width;
        for (int64_t c = 0; c < width; ++c) {
          acc[kAccMax * width + c] = -std::numeric_limits<float>::infinity();
          acc[kAccSum * width + c] = 0.f;
          acc[kAccKv * width + c] = 0.f;
        }
      }
  };
  reset(csa_comp, d.Lc, 2, kHeadDim);
  reset(csa_icomp, d.Lc, 2, kIndexDim);
  reset(hca_comp, d.Lh, 1, kHeadDim);
}

ffi::Error ApplyStepImpl(int64_t num_blocks, ffi::Buffer<ffi::S32, 2> new_blocks,
                         ffi::Buffer<ffi::S32, 1> reset_slots, ffi::Buffer<ffi::S32, 2>,
                         ffi::Buffer<ffi::S32, 3>, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>,
                         ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::S32, 1>, ffi::RemainingArgs,
                         ffi::Result<ffi::Buffer<ffi::S32, 2>> block_table,
                         ffi::Result<ffi::Buffer<ffi::S32, 3>> swa_pos,
                         ffi::Result<ffi::Buffer<ffi::F32>> csa_comp,
                         ffi::Result<ffi::Buffer<ffi::F32>> csa_icomp,
                         ffi::Result<ffi::Buffer<ffi::F32>> hca_comp,
                         ffi::Result<ffi::Buffer<ffi::S32, 1>> errors_ret,
                         ffi::RemainingRets pool_rets) {
  ApplyStepDims d;
  ScrubPools pools;
  DSV4_RETURN_IF_ERROR(ValidateApplyStep(num_blocks, new_blocks, reset_slots, *block_table,
                                         *swa_pos, *csa_comp, *csa_icomp, *hca_comp,
                                         *errors_ret, pool_rets, &d, &pools));
  int32_t* bt = block_table->typed_data();
  const ErrorCounts errors =
      ErrorCountsAt(errors_ret->typed_data(), errors_ret->dimensions()[0]);
  const int32_t* resets = reset_slots.typed_data();
  for (int64_t i = 0; i < d.NR; ++i) {
    int64_t s = resets[i];
    if (s == -1) continue;
    if (s < 0 || s >= d.R) {
      CountError(errors, kBadSlot, i);
      continue;
    }
    ResetSlot(d, s, bt, swa_pos->typed_data(), csa_comp->typed_data(), csa_icomp->typed_data(),
              hca_comp->typed_data());
  }
  const int32_t* rows = new_blocks.typed_data();
  for (int64_t i = 0; i < d.NB; ++i) {
    int64_t s = rows[3 * i], logical = rows[3 * i + 1], physical = rows[3 * i + 2];
    if (s == -1) continue;
    if (s < 0 || s >= d.R) {
      CountError(errors, kBadSlot, d.NR + i);  // error rows: the resets, then the new blocks
      continue;
    }
    if (logical < 0 || logical >= d.MB || physical < 0 || physical >= d.N) {
      CountError(errors, kBadBlockAssignment, d.NR + i);
      continue;
    }
    bt[s * d.MB + logical] = static_cast<int32_t>(physical);
    for (int p = 0; p < pools.count; ++p)
      for (int64_t l = 0; l < pools.layers[p]; ++l)
        std::memset(pools.data[p] + (l * d.N + physical) * pools.bytes_per_block[p], pools.fill[p],
                    pools.bytes_per_block[p]);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ApplyStepCpu, ApplyStepImpl, BindApplyStep(ffi::Ffi::Bind()));

}  // namespace dsv4
