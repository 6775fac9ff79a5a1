// CUDA handler of append (operands in ffi/include/dsv4/append.h, rules in
// dsv4_jax/ops/append.py). One launch of the block code of
// cuda/append/append_block.cuh (how it finds each cell's winner and why that is
// exact: its header): a scan grid of small blocks (a warp a token) for
// decode-sized calls, else blocks of 512 threads in clusters of up to 8;
// launched so that it may start under its predecessor's tail.
#include <cuda_runtime.h>

#include "append/append_block.cuh"
#include "common/launch.cuh"
#include "dsv4/append.h"
#include "handlers_cuda.h"

namespace dsv4 {
namespace {

using append_kernel::AppendPlan;
using append_kernel::kThreads;

constexpr int kBlocksPerSm = 2;

__global__ void __launch_bounds__(kThreads, kBlocksPerSm) AppendKernel(AppendArgs a,
                                                                       AppendPlan plan) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ append_kernel::AppendShared sh;
  append_kernel::AppendBlock(a, plan, blockIdx.x, smem, sh);
}

ffi::Error AppendImpl(cudaStream_t stream, DSV4_PARAMS(DSV4_APPEND_OPERANDS)) {
  AppendArgs a;
  DSV4_RETURN_IF_ERROR(ValidateAppend(DSV4_NAMES(DSV4_APPEND_OPERANDS), &a));
  // a scan grid: one block a multiprocessor, only as wide as its tokens, its
  // warps sharing the block's staged copy of the call (past kGlobalScanCall rows)
  const AppendPlan plan =
      append_kernel::FitAppendPlan<AppendKernel, kBlocksPerSm>(a.T, a.R, cuda::SmCount());
  const unsigned threads = plan.mode == append_kernel::AppendMode::kScan
                               ? 32u * static_cast<unsigned>(plan.block_tokens)
                               : static_cast<unsigned>(kThreads);
  return cuda::LaunchResult(
      cuda::LaunchOverlapped(AppendKernel, dim3(plan.blocks), dim3(threads), plan.smem,
                             plan.cluster, stream, a, plan),
      "append");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AppendCuda, AppendImpl,
                              DSV4_BIND(DSV4_APPEND_OPERANDS, ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
