// CUDA handler of attention (operands in ffi/attention.h, rules in
// docs/design.md §6 and dsv4_jax/ops/attention.py). On Hopper (sm_90) the
// tensor-core kernel (attention_wgmma.cuh), its split partials merged by
// attention_combine.cuh; elsewhere the CUDA-core kernel (attention_simt.cuh),
// which ignores the workspace.
#include <cuda_runtime.h>

#include "attention_combine.cuh"
#include "attention_simt.cuh"
#include "attention_wgmma.cuh"
#include "handlers_cuda.h"
#include "kernels.cuh"

namespace dsv4 {
namespace {

ffi::Error LaunchTensorCores(const AttentionArgs& a, cudaStream_t stream) {
  namespace tc = cuda::tc;
  const cudaError_t e =
      cuda::AllowDynamicShared<tc::AttentionWgmmaKernel>(static_cast<int>(tc::kSharedBytes));
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("attention: shared memory: ") + cudaGetErrorString(e));
  const int splits = static_cast<int>(a.splits);
  dim3 grid(static_cast<unsigned>(a.T > 0 ? a.T : 1),
            static_cast<unsigned>((a.H + tc::kHeads - 1) / tc::kHeads),
            static_cast<unsigned>(splits));
  tc::AttentionWgmmaKernel<<<grid, tc::kThreads, tc::kSharedBytes, stream>>>(a, a.workspace,
                                                                            splits);
  if (splits > 1 && a.T > 0) {
    const int64_t rows = a.T * a.H;
    const unsigned blocks = static_cast<unsigned>((rows + tc::kCombineWarps - 1) / tc::kCombineWarps);
    tc::AttentionCombineKernel<<<blocks, tc::kCombineWarps * 32, 0, stream>>>(a, a.workspace,
                                                                             splits);
  }
  return cuda::LaunchStatus("attention");
}

ffi::Error AttentionImpl(cudaStream_t stream, int64_t kv_format, int64_t kind,
                         ffi::AnyBuffer layer, ffi::AnyBuffer comp_layer, ffi::AnyBuffer q,
                         ffi::AnyBuffer token_slot, ffi::AnyBuffer token_pos, ffi::AnyBuffer topk,
                         ffi::AnyBuffer chunk_kv, ffi::AnyBuffer sink, ffi::AnyBuffer inv_freq,
                         ffi::AnyBuffer block_table, ffi::AnyBuffer swa_pos,
                         ffi::AnyBuffer errors_in, ffi::RemainingArgs entry_args,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                         ffi::Result<ffi::AnyBuffer> errors,
                         ffi::Result<ffi::AnyBuffer> workspace) {
  AttentionArgs a;
  DSV4_RETURN_IF_ERROR(ValidateAttention(kv_format, kind, layer, comp_layer, q, token_slot,
                                         token_pos, topk, chunk_kv, sink, inv_freq, block_table,
                                         swa_pos, errors_in, entry_args, *out, *lse, *errors,
                                         *workspace, &a));
  if (cuda::ComputeMajor() == 9) return LaunchTensorCores(a, stream);
  cuda::simt::LaunchAttentionSimt(a, stream);
  return cuda::LaunchStatus("attention");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCuda, AttentionImpl,
                              BindAttention(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
