// How a handler counts a dropped row into state.errors (docs/design/bad-input.md):
// the kind's counter, and with error detail the smallest input row of the call
// that kind dropped (dsv4_jax/error_detail.py turns it into a slot and a
// position). The CPU handlers count with CountError here, the CUDA kernels
// with cuda::CountErrorAtomic (cuda/common/layer_checks.cuh): one rule, atomics there.
#pragma once

#include <cstdint>

#include "dsv4/layout.h"

namespace dsv4 {

struct ErrorCounts {
  int32_t* counts = nullptr;     // [kNumErrorKinds]
  int32_t* first_row = nullptr;  // [kNumErrorKinds] with error detail, else null
};

// `n` drops of `kind`, the smallest of them at input row `row` (kNoRow: a
// count not tied to a row, e.g. BAD_LAYER).
inline void CountError(const ErrorCounts& e, int kind, int64_t row, int32_t n = 1) {
  e.counts[kind] += n;
  if (e.first_row != nullptr && row < e.first_row[kind])
    e.first_row[kind] = static_cast<int32_t>(row);
}

}  // namespace dsv4
