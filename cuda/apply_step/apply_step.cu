// CUDA handler of apply_step (semantics in ffi/include/dsv4/apply_step.h).
//
// Two launches on the handler's stream, no host sync, no allocation:
//  1. one block: resets of block-table rows, then new-block rows (a later row
//     for the same (slot, logical) wins), counting bad rows;
//  2. a grid: per reset slot, window positions and accumulators; per valid
//     new block, the scrub of that block in every pool.
#include <cuda_runtime.h>

#include <cmath>

#include "common/layer_checks.cuh"
#include "dsv4/apply_step.h"
#include "handlers_cuda.h"

namespace dsv4 {
namespace {

constexpr int kTableThreads = 256;

__device__ bool ValidRow(const int32_t* rows, int64_t i, const ApplyStepDims& d) {
  int64_t s = rows[3 * i], logical = rows[3 * i + 1], physical = rows[3 * i + 2];
  return s >= 0 && s < d.R && logical >= 0 && logical < d.MB && physical >= 0 &&
         physical < d.N;
}

__global__ void BlockTableKernel(ApplyStepDims d, const int32_t* __restrict__ rows,
                                 const int32_t* __restrict__ resets, int32_t* block_table,
                                 ErrorCounts errors) {
  for (int64_t i = threadIdx.x; i < d.NR; i += blockDim.x) {
    int64_t s = resets[i];
    if (s == -1) continue;
    if (s < 0 || s >= d.R) {
      cuda::CountErrorAtomic(errors, kBadSlot, i);
      continue;
    }
    for (int64_t j = 0; j < d.MB; ++j) block_table[s * d.MB + j] = -1;
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < d.NB; i += blockDim.x) {
    int64_t s = rows[3 * i];
    if (s == -1) continue;
    if (s < 0 || s >= d.R) {
      cuda::CountErrorAtomic(errors, kBadSlot, d.NR + i);  // error rows: the resets, then the new blocks
      continue;
    }
    if (!ValidRow(rows, i, d)) {
      cuda::CountErrorAtomic(errors, kBadBlockAssignment, d.NR + i);
      continue;
    }
    int64_t logical = rows[3 * i + 1];
    bool superseded = false;  // a later valid row writes the same cell
    for (int64_t j = i + 1; j < d.NB && !superseded; ++j)
      superseded = rows[3 * j] == s && rows[3 * j + 1] == logical && ValidRow(rows, j, d);
    if (!superseded) block_table[s * d.MB + logical] = rows[3 * i + 2];
  }
}

// blockIdx.y: one meta entry (reset slots first, then new-block rows);
// blockIdx.x/threadIdx.x stride over that entry's elements.
__global__ void ResetAndScrubKernel(ApplyStepDims d, const int32_t* __restrict__ rows,
                                    const int32_t* __restrict__ resets, int32_t* swa_pos,
                                    float* csa_comp, float* csa_icomp, float* hca_comp,
                                    ScrubPools pools) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t entry = blockIdx.y;
  if (entry < d.NR) {
    int64_t s = resets[entry];
    if (s < 0 || s >= d.R) return;
    for (int64_t e = first; e < d.L * kWindow; e += stride)
      swa_pos[((e / kWindow) * d.R + s) * kWindow + e % kWindow] = -1;
    auto reset = [&](float* comp, int64_t layers, int64_t accs, int64_t width) {
      int64_t per_slot = accs * 3 * width;
      for (int64_t e = first; e < layers * per_slot; e += stride) {
        int64_t l = e / per_slot, within = e % per_slot;
        int64_t row = (within / width) % 3;
        comp[(l * d.R + s) * per_slot + within] = row == kAccMax ? -INFINITY : 0.f;
      }
    };
    reset(csa_comp, d.Lc, 2, kHeadDim);
    reset(csa_icomp, d.Lc, 2, kIndexDim);
    reset(hca_comp, d.Lh, 1, kHeadDim);
    return;
  }
  int64_t i = entry - d.NR;
  if (!ValidRow(rows, i, d)) return;
  int64_t physical = rows[3 * i + 2];
  for (int p = 0; p < pools.count; ++p) {
    int64_t bytes = pools.bytes_per_block[p];
    for (int64_t e = first; e < pools.layers[p] * bytes; e += stride) {
      int64_t l = e / bytes;
      pools.data[p][(l * d.N + physical) * bytes + e % bytes] = pools.fill[p];
    }
  }
}

ffi::Error ApplyStepImpl(cudaStream_t stream, DSV4_PARAMS(DSV4_APPLY_STEP_OPERANDS)) {
  ApplyStepDims d;
  ScrubPools scrub;
  DSV4_RETURN_IF_ERROR(ValidateApplyStep(DSV4_NAMES(DSV4_APPLY_STEP_OPERANDS), &d, &scrub));
  if (d.NR + d.NB == 0) return ffi::Error::Success();
  BlockTableKernel<<<1, kTableThreads, 0, stream>>>(d, new_blocks.typed_data(),
                                                    reset_slots.typed_data(),
                                                    block_table->typed_data(),
                                                    ErrorCountsAt(errors->typed_data(),
                                                                  errors->dimensions()[0]));
  dim3 grid(32, static_cast<unsigned>(d.NR + d.NB));
  ResetAndScrubKernel<<<grid, 256, 0, stream>>>(
      d, new_blocks.typed_data(), reset_slots.typed_data(), swa_pos->typed_data(),
      csa_comp->typed_data(), csa_icomp->typed_data(), hca_comp->typed_data(), scrub);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("apply_step launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ApplyStepCuda, ApplyStepImpl,
                              DSV4_BIND(DSV4_APPLY_STEP_OPERANDS, ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
