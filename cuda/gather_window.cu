// CUDA handler of gather_window (operands in ffi/gather.h, rules in
// dsv4_jax/ops/gather.py). One launch; one warp per output row (b, ring
// slot), grid-stride, decoding with 16-byte stores (kernels.cuh).
#include <cuda_runtime.h>

#include "gather.h"
#include "handlers_cuda.h"
#include "kernels.cuh"

namespace dsv4 {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) GatherWindowKernel(GatherWindowArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t l = __ldg(a.layer);
  const bool layer_ok = l >= 0 && l < a.L;
  if (!layer_ok && blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(&a.errors[kBadLayer], 1);
  const int64_t rows = a.B * kWindow;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       row < rows; row += warps) {
    const int64_t b = row / kWindow, r = row % kWindow;
    uint16_t* out = a.out_kv + row * kHeadDim;
    int64_t s = layer_ok ? __ldg(a.slots + b) : -1;
    int32_t p = -1;
    if (s != -1 && (s < 0 || s >= a.R)) {
      if (r == 0 && lane == 0) atomicAdd(&a.errors[kBadSlot], 1);
      s = -1;
    }
    int64_t e = 0;
    if (s >= 0) {
      e = (l * a.R + s) * kWindow + r;
      p = __ldg(a.swa_pos + e);
    }
    if (p < 0) {
      cuda::WarpZeroRow(out);
      p = -1;
    } else {
      cuda::WarpDecodeEntry(a.pool, e, out);
    }
    if (lane == 0) a.out_pos[row] = p;
  }
}

ffi::Error GatherWindowImpl(cudaStream_t stream, int64_t kv_format, ffi::AnyBuffer layer,
                            ffi::AnyBuffer slots, ffi::AnyBuffer swa_pos, ffi::AnyBuffer errors_in,
                            ffi::RemainingArgs entry_args, ffi::Result<ffi::AnyBuffer> out_kv,
                            ffi::Result<ffi::AnyBuffer> out_pos,
                            ffi::Result<ffi::AnyBuffer> errors) {
  GatherWindowArgs a;
  DSV4_RETURN_IF_ERROR(ValidateGatherWindow(kv_format, layer, slots, swa_pos, errors_in,
                                            entry_args, *out_kv, *out_pos, *errors, &a));
  unsigned grid = cuda::GridFor(a.B * kWindow, kThreads / 32, 8);
  GatherWindowKernel<<<grid, kThreads, 0, stream>>>(a);
  return cuda::LaunchStatus("gather_window");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherWindowCuda, GatherWindowImpl,
                              BindGatherWindow(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
