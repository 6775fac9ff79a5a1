// CUDA handlers of flush for CSA and HCA layers (operands and semantics in
// ffi/include/dsv4/flush.h, per-token rules in dsv4_jax/ops/flush.py). Prefill-sized
// calls run the window plan in parallel over (request, entry)
// (cuda/flush/flush_windows.cuh); decode-sized ones the serial block code of
// cuda/flush/flush_block.cuh over the whole grid. Either is launched so that it
// may start under its predecessor's tail (it waits before reading).
#include <cuda_runtime.h>

#include "common/launch.cuh"
#include "dsv4/flush.h"
#include "flush/flush_block.cuh"
#include "flush/flush_windows.cuh"
#include "handlers_cuda.h"

namespace dsv4 {
namespace {

using flush_kernel::kThreads;

template <bool kCsa>
__global__ void __launch_bounds__(kThreads) FlushKernel(FlushArgs a) {
  __shared__ flush_kernel::FlushShared sh;
  flush_kernel::FlushBlock<kCsa>(a, blockIdx.x, gridDim.x, sh);
}

template <bool kCsa>
ffi::Error LaunchFlush(cudaStream_t stream, const FlushArgs& a, const char* what) {
  if (flush_kernel::UseWindowPlan(a))
    return cuda::LaunchResult(flush_kernel::LaunchFlushPlan<kCsa>(stream, a), what);
  const int64_t wave = int64_t{cuda::BlocksPerSm<FlushKernel<kCsa>>(kThreads)} * cuda::SmCount();
  return cuda::LaunchResult(
      cuda::LaunchOverlapped(FlushKernel<kCsa>, dim3(flush_kernel::FlushGrid(a.T, wave)),
                             dim3(kThreads), 0, 1u, stream, a),
      what);
}

ffi::Error FlushCsaImpl(cudaStream_t stream, DSV4_PARAMS(DSV4_FLUSH_CSA_OPERANDS)) {
  FlushArgs a;
  DSV4_RETURN_IF_ERROR(ValidateFlushCsa(DSV4_NAMES(DSV4_FLUSH_CSA_OPERANDS), &a));
  return LaunchFlush<true>(stream, a, "flush_csa");
}

ffi::Error FlushHcaImpl(cudaStream_t stream, DSV4_PARAMS(DSV4_FLUSH_HCA_OPERANDS)) {
  FlushArgs a;
  DSV4_RETURN_IF_ERROR(ValidateFlushHca(DSV4_NAMES(DSV4_FLUSH_HCA_OPERANDS), &a));
  return LaunchFlush<false>(stream, a, "flush_hca");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushCsaCuda, FlushCsaImpl,
                              DSV4_BIND(DSV4_FLUSH_CSA_OPERANDS, ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushHcaCuda, FlushHcaImpl,
                              DSV4_BIND(DSV4_FLUSH_HCA_OPERANDS, ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
