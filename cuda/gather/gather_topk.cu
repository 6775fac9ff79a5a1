// CUDA handler of gather_topk (operands in ffi/include/dsv4/gather.h, rules in
// dsv4_jax/ops/gather.py). One launch; one warp per output row (token, j),
// two rows in flight per warp (cuda::GatherRows). Per-token errors (bad slot, bad position) are counted by the
// warp of j = 0 only, so each token counts once, as on the host.
#include <cuda_runtime.h>

#include "common/launch.cuh"
#include "common/layer_checks.cuh"
#include "dsv4/gather.h"
#include "gather/gather_rows.cuh"
#include "handlers_cuda.h"

namespace dsv4 {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) GatherTopkKernel(GatherTopkArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t l = __ldg(a.layer);
  const bool layer_ok = l >= 0 && l < a.L;
  if (!layer_ok && blockIdx.x == 0 && threadIdx.x == 0) cuda::CountErrorAtomic(a.errors, kBadLayer, kNoRow);
  cuda::GatherRows(a.pool, a.out_kv, a.T * a.K, [&](int64_t row) -> int64_t {
    const int64_t t = row / a.K, j = row % a.K;
    int64_t e = -1;
    int err = -1;
    if (layer_ok) {
      const int64_t s = __ldg(a.slot + t), p = __ldg(a.pos + t);
      if (s == -1) {
      } else if (s < 0 || s >= a.R) {
        if (j == 0) err = kBadSlot;
      } else if (!QueryPositionOk(p, a.MB)) {
        if (j == 0) err = kBadPosition;
      } else {
        const int64_t i = __ldg(a.indices + row);
        if (i == -1) {
        } else if (i < -1 || i >= IndexVisible(p, a.MB * a.per_block)) {
          err = kBadIndex;
        } else {
          const int64_t logical = i / a.per_block;
          const int64_t block = __ldg(a.block_table + s * a.MB + logical);
          if (block < 0 || block >= a.N) err = kMissingBlock;
          else e = (l * a.N + block) * a.per_block + i % a.per_block;
        }
      }
    }
    if (lane == 0) {
      if (err >= 0) cuda::CountErrorAtomic(a.errors, err, t);
      a.valid[row] = e >= 0;
    }
    return e;
  });
}

ffi::Error GatherTopkImpl(cudaStream_t stream, DSV4_PARAMS(DSV4_GATHER_TOPK_OPERANDS)) {
  GatherTopkArgs a;
  DSV4_RETURN_IF_ERROR(ValidateGatherTopk(DSV4_NAMES(DSV4_GATHER_TOPK_OPERANDS), &a));
  unsigned grid = cuda::GridFor(a.T * a.K, kThreads / 32, 8);
  GatherTopkKernel<<<grid, kThreads, 0, stream>>>(a);
  return cuda::LaunchStatus("gather_topk");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherTopkCuda, GatherTopkImpl,
                              DSV4_BIND(DSV4_GATHER_TOPK_OPERANDS, ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
