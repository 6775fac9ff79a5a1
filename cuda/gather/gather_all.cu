// CUDA handler of gather_all (operands in ffi/include/dsv4/gather.h, rules in
// dsv4_jax/ops/gather.py). One launch; one warp per output row (b, entry),
// two rows in flight per warp (cuda::GatherRows). Per-request outcomes (count, bad slot, bad length) are
// written and counted by the warp of entry 0 only.
#include <cuda_runtime.h>

#include "common/launch.cuh"
#include "common/layer_checks.cuh"
#include "dsv4/gather.h"
#include "gather/gather_rows.cuh"
#include "handlers_cuda.h"

namespace dsv4 {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) GatherAllKernel(GatherAllArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t l = __ldg(a.layer);
  const bool layer_ok = l >= 0 && l < a.L;
  if (!layer_ok && blockIdx.x == 0 && threadIdx.x == 0) cuda::CountErrorAtomic(a.errors, kBadLayer, kNoRow);
  cuda::GatherRows(a.pool, a.out_kv, a.B * a.E, [&](int64_t row) -> int64_t {
    const int64_t b = row / a.E, i = row % a.E;
    int64_t e = -1, n = 0;
    int err = -1;
    if (layer_ok) {
      const int64_t s = __ldg(a.slots + b), len = __ldg(a.lengths + b);
      if (s == -1) {
      } else if (s < 0 || s >= a.R) {
        if (i == 0) err = kBadSlot;
      } else if (len < 0 || len > a.max_context || len / kHcaRatio > a.E) {
        if (i == 0) err = kBadLength;
      } else {
        n = len / kHcaRatio;
        if (i < n) {
          const int64_t block = i < a.MB ? __ldg(a.block_table + s * a.MB + i) : -1;
          if (block < 0 || block >= a.N) err = kMissingBlock;
          else e = l * a.N + block;
        }
      }
    }
    if (lane == 0) {
      if (err >= 0) cuda::CountErrorAtomic(a.errors, err, b);
      if (i == 0) a.count[b] = static_cast<int32_t>(n);
    }
    return e;
  });
}

ffi::Error GatherAllImpl(cudaStream_t stream, DSV4_PARAMS(DSV4_GATHER_ALL_OPERANDS)) {
  GatherAllArgs a;
  DSV4_RETURN_IF_ERROR(ValidateGatherAll(DSV4_NAMES(DSV4_GATHER_ALL_OPERANDS), &a));
  unsigned grid = cuda::GridFor(a.B * a.E, kThreads / 32, 8);
  GatherAllKernel<<<grid, kThreads, 0, stream>>>(a);
  return cuda::LaunchStatus("gather_all");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherAllCuda, GatherAllImpl,
                              DSV4_BIND(DSV4_GATHER_ALL_OPERANDS, ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
