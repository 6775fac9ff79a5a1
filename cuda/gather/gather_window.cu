// CUDA handler of gather_window (operands in ffi/include/dsv4/gather.h, rules in
// dsv4_jax/ops/gather.py). One launch; one warp per output row (b, ring
// slot), two rows in flight per warp (cuda::GatherRows).
#include <cuda_runtime.h>

#include "common/launch.cuh"
#include "common/layer_checks.cuh"
#include "dsv4/gather.h"
#include "gather/gather_rows.cuh"
#include "handlers_cuda.h"

namespace dsv4 {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) GatherWindowKernel(GatherWindowArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t l = __ldg(a.layer);
  const bool layer_ok = l >= 0 && l < a.L;
  if (!layer_ok && blockIdx.x == 0 && threadIdx.x == 0) cuda::CountErrorAtomic(a.errors, kBadLayer, kNoRow);
  cuda::GatherRows(a.pool, a.out_kv, a.B * kWindow, [&](int64_t row) -> int64_t {
    const int64_t b = row / kWindow, r = row % kWindow;
    int64_t s = layer_ok ? __ldg(a.slots + b) : -1;
    if (s != -1 && (s < 0 || s >= a.R)) {
      if (r == 0 && lane == 0) cuda::CountErrorAtomic(a.errors, kBadSlot, b);
      s = -1;
    }
    int64_t e = -1;
    int32_t p = -1;
    if (s >= 0) {
      e = (l * a.R + s) * kWindow + r;
      p = __ldg(a.swa_pos + e);
      if (p < 0) {
        p = -1;
        e = -1;
      }
    }
    if (lane == 0) a.out_pos[row] = p;
    return e;
  });
}

ffi::Error GatherWindowImpl(cudaStream_t stream, DSV4_PARAMS(DSV4_GATHER_WINDOW_OPERANDS)) {
  GatherWindowArgs a;
  DSV4_RETURN_IF_ERROR(ValidateGatherWindow(DSV4_NAMES(DSV4_GATHER_WINDOW_OPERANDS), &a));
  unsigned grid = cuda::GridFor(a.B * kWindow, kThreads / 32, 8);
  GatherWindowKernel<<<grid, kThreads, 0, stream>>>(a);
  return cuda::LaunchStatus("gather_window");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherWindowCuda, GatherWindowImpl,
                              DSV4_BIND(DSV4_GATHER_WINDOW_OPERANDS, ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
