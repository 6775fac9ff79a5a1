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

ffi::Error ApplyStepImpl(DSV4_PARAMS(DSV4_APPLY_STEP_OPERANDS)) {
  ApplyStepDims d;
  ScrubPools scrub;
  DSV4_RETURN_IF_ERROR(ValidateApplyStep(DSV4_NAMES(DSV4_APPLY_STEP_OPERANDS), &d, &scrub));
  int32_t* bt = block_table->typed_data();
  const ErrorCounts counts =
      ErrorCountsAt(errors->typed_data(), errors->dimensions()[0]);
  const int32_t* resets = reset_slots.typed_data();
  for (int64_t i = 0; i < d.NR; ++i) {
    int64_t s = resets[i];
    if (s == -1) continue;
    if (s < 0 || s >= d.R) {
      CountError(counts, kBadSlot, i);
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
      CountError(counts, kBadSlot, d.NR + i);  // error rows: the resets, then the new blocks
      continue;
    }
    if (logical < 0 || logical >= d.MB || physical < 0 || physical >= d.N) {
      CountError(counts, kBadBlockAssignment, d.NR + i);
      continue;
    }
    bt[s * d.MB + logical] = static_cast<int32_t>(physical);
    for (int p = 0; p < scrub.count; ++p)
      for (int64_t l = 0; l < scrub.layers[p]; ++l)
        std::memset(scrub.data[p] + (l * d.N + physical) * scrub.bytes_per_block[p], scrub.fill[p],
                    scrub.bytes_per_block[p]);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ApplyStepCpu, ApplyStepImpl, DSV4_BIND(DSV4_APPLY_STEP_OPERANDS, ffi::Ffi::Bind()));

}  // namespace dsv4
