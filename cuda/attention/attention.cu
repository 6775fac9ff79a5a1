// CUDA handler of attention (operands in ffi/include/dsv4/attention.h, rules in
// docs/design/operations.md and dsv4_jax/ops/attention.py). A prefill call first
// encodes its chunk rows once and decodes them to bf16 (attention_chunk.cuh). Then the tensor-core
// kernel (attention_tensor_core.cuh) runs with each token's items split over
// a cluster of CTAs that merge in distributed shared memory
// (attention_finish.cuh): on wgmma where the device has it (sm_90, Hopper),
// on warp-level mma.sync elsewhere (sm_100, Blackwell) or when the call asks
// for it (attr `kernel` 1, how the tests run that path on a Hopper).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "attention/attention_chunk.cuh"
#include "attention/attention_tensor_core.cuh"
#include "common/launch.cuh"
#include "handlers_cuda.h"

namespace dsv4 {
namespace {

namespace tc = cuda::tc;

// Candidate items of one query (attention_items.cuh AttnCandidates at its
// largest): the window, the chunk's rows, the CSA picks or the HCA entries.
int64_t MaxCandidates(const AttentionArgs& a) {
  const int64_t extra = a.kind == kAttnCsa ? a.K : a.kind == kAttnHca ? a.MB : 0;
  return kWindow + (a.has_chunk ? a.T : 0) + extra;
}

template <class Products>
constexpr auto kKernel = tc::AttentionKernel<Products>;

// Clusters of `splits` CTAs of the kernel the device holds at once (cached
// per device and kernel; 0: that cluster size cannot run).
template <class Products>
int ActiveClusters(int splits) {
  static std::atomic<int> cache[64][tc::kMaxSplits + 1];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  int n = cache[dev][splits].load(std::memory_order_relaxed);
  if (n == 0) {
    n = cuda::MaxActiveClusters(kKernel<Products>, tc::kThreads, tc::kSharedBytes,
                                static_cast<unsigned>(splits));
    cache[dev][splits].store(n > 0 ? n : -1, std::memory_order_relaxed);
  }
  return n > 0 ? n : 0;
}

// How many CTAs (one cluster) share each (token, head group)'s items: as many
// as keep the whole grid in one wave of the device (its multiprocessors and
// the clusters it can hold at once), never more than the 64-row tiles a
// token has, so the splits' partials are merged on chip.
template <class Products>
int SplitsFor(const AttentionArgs& a) {
  const int64_t groups = a.T * ((a.H + tc::kHeads - 1) / tc::kHeads);
  if (groups <= 0) return 1;
  const int64_t tiles = (MaxCandidates(a) + tc::kTileRows - 1) / tc::kTileRows;
  int64_t want = std::min<int64_t>({tiles, tc::kMaxSplits, cuda::SmCount() / groups});
  for (int s = static_cast<int>(want); s >= 2; --s)
    if (ActiveClusters<Products>(s) >= groups) return s;
  return 1;
}

template <class Products>
ffi::Error LaunchTensorCores(const AttentionArgs& a, cudaStream_t stream) {
  const auto kernel = kKernel<Products>;
  cudaError_t e = cuda::AllowDynamicShared<kKernel<Products>>(static_cast<int>(tc::kSharedBytes));
  if (e == cudaSuccess) e = cuda::AllowLargeClusters<kKernel<Products>>();
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("attention: kernel attributes: ") +
                                cudaGetErrorString(e));
  const int splits = SplitsFor<Products>(a);
  const dim3 grid(static_cast<unsigned>((a.T > 0 ? a.T : 1) * splits),
                  static_cast<unsigned>((a.H + tc::kHeads - 1) / tc::kHeads));
  return cuda::LaunchResult(
      cuda::LaunchOverlapped(kernel, grid, dim3(tc::kThreads), tc::kSharedBytes,
                             static_cast<unsigned>(splits), stream, a, splits),
      "attention");
}

ffi::Error AttentionImpl(cudaStream_t stream, DSV4_PARAMS(DSV4_ATTENTION_OPERANDS)) {
  AttentionArgs a;
  DSV4_RETURN_IF_ERROR(ValidateAttention(DSV4_NAMES(DSV4_ATTENTION_OPERANDS), &a));
  if (a.has_chunk) {
    if (!AttnBindChunkScratch(&a))
      return ffi::Error::InvalidArgument(
          "scratch (result): a prefill chunk of " + std::to_string(a.T) + " rows needs " +
          std::to_string(a.T * kAttnChunkScratchRow) + " bytes, got " +
          std::to_string(a.scratch_bytes));
    const unsigned blocks = cuda::GridFor(a.T, 8, 4);
    DSV4_RETURN_IF_ERROR(cuda::LaunchResult(
        cuda::LaunchOverlapped(cuda::AttentionChunkEncodeKernel, dim3(blocks), dim3(256), 0, 1,
                               stream, a),
        "attention (chunk encoding)"));
    DSV4_RETURN_IF_ERROR(cuda::LaunchResult(
        cuda::LaunchOverlapped(cuda::AttentionChunkDecodeKernel, dim3(blocks), dim3(256), 0, 1,
                               stream, a),
        "attention (chunk decoding)"));
  }
  if (a.kernel == kAttnKernelAuto && cuda::ComputeMajor() == 9)
    return LaunchTensorCores<cuda::wgmma::Products>(a, stream);
  return LaunchTensorCores<cuda::warp_mma::Products>(a, stream);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCuda, AttentionImpl,
                              DSV4_BIND(DSV4_ATTENTION_OPERANDS, ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
