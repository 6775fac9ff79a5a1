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

ffi::Error FlushCsaImpl(cudaStream_t stream, int64_t kv_format, int64_t max_context,
                        int64_t max_rows_per_slot,
                        ffi::AnyBuffer layer, ffi::AnyBuffer meta,
                        ffi::AnyBuffer kv, ffi::AnyBuffer score, ffi::AnyBuffer ape,
                        ffi::AnyBuffer norm, ffi::AnyBuffer inv_freq, ffi::AnyBuffer index_kv,
                        ffi::AnyBuffer index_score, ffi::AnyBuffer index_ape,
                        ffi::AnyBuffer index_norm, ffi::AnyBuffer index_inv_freq,
                        ffi::AnyBuffer block_table, ffi::RemainingArgs rest,
                        ffi::Result<ffi::AnyBuffer> comp, ffi::Result<ffi::AnyBuffer> icomp,
                        ffi::Result<ffi::AnyBuffer> packed, ffi::Result<ffi::AnyBuffer> iscale,
                        ffi::Result<ffi::AnyBuffer> errors, ffi::RemainingRets entry_rets) {
  FlushArgs a;
  DSV4_RETURN_IF_ERROR(ValidateFlushCsa(kv_format, max_context, max_rows_per_slot, layer,
                                        meta, kv, score, ape, norm, inv_freq,
                                        index_kv, index_score, index_ape, index_norm,
                                        index_inv_freq, block_table, rest, *comp, *icomp, *packed,
                                        *iscale, *errors, entry_rets, &a));
  return LaunchFlush<true>(stream, a, "flush_csa");
}

ffi::Error FlushHcaImpl(cudaStream_t stream, int64_t kv_format, int64_t max_context,
                        int64_t max_rows_per_slot,
                        ffi::AnyBuffer layer, ffi::AnyBuffer meta,
                        ffi::AnyBuffer kv, ffi::AnyBuffer score, ffi::AnyBuffer ape,
                        ffi::AnyBuffer norm, ffi::AnyBuffer inv_freq, ffi::AnyBuffer block_table,
                        ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> comp,
                        ffi::Result<ffi::AnyBuffer> errors, ffi::RemainingRets entry_rets) {
  FlushArgs a;
  DSV4_RETURN_IF_ERROR(ValidateFlushHca(kv_format, max_context, max_rows_per_slot, layer,
                                        meta, kv, score, ape, norm, inv_freq,
                                        block_table, rest, *comp, *errors, entry_rets, &a));
  return LaunchFlush<false>(stream, a, "flush_hca");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushCsaCuda, FlushCsaImpl,
                              BindFlushCsa(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushHcaCuda, FlushHcaImpl,
                              BindFlushHca(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
