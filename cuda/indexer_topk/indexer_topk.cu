// CUDA handler of indexer_topk (operands in ffi/include/dsv4/indexer_topk.h, rules in
// dsv4_jax/ops/indexer.py, arithmetic order in dsv4/indexer.h). Its kernels
// are in cuda/indexer_topk/, their launch choices in launch_policy.h there.
//
// Their code has internal linkage (an unnamed namespace in each header; a
// kernel elsewhere that includes select.cuh for BlockTopK gets its own copy).
// That keeps the compiler's inlining as it was when the code was one file: a
// device function called once is inlined more readily with internal linkage,
// and with external linkage the mxfp4 score kernel built differently (8 more
// bytes of stack on sm_90a).
//
// Two launches on the handler's stream, no host sync, no allocation (the
// per-entry rank keys live in the op's `scratch` result):
//  1. the score kernel, grid (T, entry chunks), one rank key an entry (0 for
//     an entry of a missing block): for q_format "bf16" ScoreKernel, one
//     thread an entry, or ScoreKernelSplit, four lanes an entry, on small
//     grids (score_fp32.cuh); for "mxfp4" ScoreKernelMxfp4 (score_mxfp4.cuh):
//     each CTA rounds q to MXFP4 itself, int8 dot products on the tensor
//     cores, keys streamed through a cp.async ring. The mxfp4 kernel is
//     launched overlapped too, so its CTAs are in place when the kernel
//     ahead of it (the layer's write, say) ends; it reads nothing before
//     its wait. With rows_per_request G > 1, where a CTA a row would give each
//     warp at least 12 tiles (RowsPerCta), the grid is (ceil(T / G), entry
//     chunks) of ScoreKernelMxfp4Rows (score_mxfp4_rows.cuh): a CTA scores
//     G consecutive rows, each key tile of a request read once for its rows.
//  2. SelectKernel (select.cuh), one block of 1024 threads a token, or a
//     cluster of up to 8 past 16384 entries, launched so that it may start
//     while the score kernel finishes (cuda::LaunchOverlapped; the mxfp4
//     score kernel lets it launch at once, so its CTAs take multiprocessors
//     as score CTAs leave them).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/launch.cuh"
#include "dsv4/indexer_topk.h"
#include "handlers_cuda.h"
#include "indexer_topk/launch_policy.h"
#include "indexer_topk/score_fp32.cuh"
#include "indexer_topk/score_mxfp4.cuh"
#include "indexer_topk/score_mxfp4_rows.cuh"
#include "indexer_topk/select.cuh"

namespace dsv4 {
namespace {

using namespace indexer;

// Lets both instances of a kernel template take `bytes` of dynamic shared
// memory on the current device; the first error, if any.
template <auto kA, auto kB>
cudaError_t AllowDynamicShared(size_t bytes) {
  const cudaError_t e = cuda::AllowDynamicShared<kA>(static_cast<int>(bytes));
  return e != cudaSuccess ? e : cuda::AllowDynamicShared<kB>(static_cast<int>(bytes));
}

ffi::Error IndexerTopkImpl(cudaStream_t stream, DSV4_PARAMS(DSV4_INDEXER_TOPK_OPERANDS)) {
  IndexerTopkArgs a;
  DSV4_RETURN_IF_ERROR(ValidateIndexerTopk(DSV4_NAMES(DSV4_INDEXER_TOPK_OPERANDS), &a));
  if (a.K > kMaxK)
    return ffi::Error::InvalidArgument("indices (result): k must be at most " +
                                       std::to_string(kMaxK) + " on CUDA, got " +
                                       std::to_string(a.K));
  if (a.T > 0 && a.E > 0) {
    const int64_t chunks = (a.E + kScoreThreads - 1) / kScoreThreads;
    if (chunks > 65535 || a.T > 0x7fffffff)
      return ffi::Error::InvalidArgument("indexer_topk: too many tokens or entries for one grid");
    if (a.q_format == kQueryMxfp4) {
      // a CTA row a group of rows (one row: ScoreKernelMxfp4)
      const int64_t group =
          RowsPerCta(a.T, a.E, static_cast<int>(rows_per_request), cuda::SmCount());
      const int64_t cta_rows = (a.T + group - 1) / group;
      const int tpw = TilesPerWarp(cta_rows, a.E, cuda::SmCount());
      const bool pairs = group == 1 && PairWarps(cta_rows, a.E, tpw, cuda::SmCount());
      const int64_t span = static_cast<int64_t>(TileColumns(pairs)) * tpw * kTile;
      const int64_t ctas = (a.E + span - 1) / span;
      if (ctas > 65535)
        return ffi::Error::InvalidArgument("indexer_topk: too many entries for one grid");
      // static and dynamic shared memory together pass the default 48 KB
      const size_t bytes = group == 1 ? kRingBytes : RowsDynamicBytes(static_cast<int>(group));
      const cudaError_t opt_in =
          group == 1
              ? AllowDynamicShared<ScoreKernelMxfp4<false>, ScoreKernelMxfp4<true>>(kRingBytes)
              : cuda::AllowDynamicShared<ScoreKernelMxfp4Rows>(
                    static_cast<int>(RowsDynamicBytes(kMaxRowsPerCta)));
      if (opt_in != cudaSuccess)
        return ffi::Error::Internal(std::string("indexer_topk shared memory: ") +
                                    cudaGetErrorString(opt_in));
      const dim3 grid(static_cast<unsigned>(cta_rows), static_cast<unsigned>(ctas));
      const bool evict_first = KeysEvictFirst(cta_rows, a.E, cuda::L2Bytes());
      cudaError_t e;
      if (group == 1) {
        const auto kernel = pairs ? ScoreKernelMxfp4<true> : ScoreKernelMxfp4<false>;
        e = cuda::LaunchOverlapped(kernel, grid, dim3(kMmaThreads), bytes, 1u, stream, a, tpw,
                                   evict_first);
      } else {   // ScoreKernelMxfp4Rows has no pairs variant
        e = cuda::LaunchOverlapped(ScoreKernelMxfp4Rows, grid, dim3(kMmaThreads), bytes, 1u, stream,
                                   a, tpw, evict_first, static_cast<int>(group));
      }
      if (e != cudaSuccess)
        return ffi::Error::Internal(std::string("indexer_topk launch: ") + cudaGetErrorString(e));
    } else if (SplitScores(a.T, a.E)) {
      const int64_t groups = (a.E + kGroupEntries - 1) / kGroupEntries;
      if (groups > 65535)
        return ffi::Error::InvalidArgument("indexer_topk: too many entries for one grid");
      ScoreKernelSplit<<<dim3(static_cast<unsigned>(a.T), static_cast<unsigned>(groups)),
                         kScoreThreads, 0, stream>>>(a);
    } else {
      ScoreKernel<<<dim3(static_cast<unsigned>(a.T), static_cast<unsigned>(chunks)),
                    kScoreThreads, 0, stream>>>(a);
    }
  }
  int kp = 1;
  while (kp < a.K) kp <<= 1;
  const size_t sel_bytes = SelectDynamicBytes(kp);
  // both kernels' shared memory limit (once a device)
  const cudaError_t select_opt_in =
      AllowDynamicShared<SelectKernel<false>, SelectKernel<true>>(kSelectMaxDynamicBytes);
  if (select_opt_in != cudaSuccess)
    return ffi::Error::Internal(std::string("indexer_topk select shared memory: ") +
                                cudaGetErrorString(select_opt_in));
  const int ctas = a.T > 0 ? SelectCtas(a.E) : 1;
  if (a.T * ctas > 0x7fffffff)
    return ffi::Error::InvalidArgument("indexer_topk: too many tokens for one select grid");
  const unsigned grid = static_cast<unsigned>(a.T > 0 ? a.T * ctas : 1);
  const bool count_missing = a.q_format != kQueryMxfp4;
  cudaError_t err =
      ctas > 1 ? cuda::LaunchOverlapped(SelectKernel<true>, dim3(grid), dim3(kSelectThreads),
                                        sel_bytes, static_cast<unsigned>(ctas), stream, a, kp,
                                        count_missing, ctas)
               : cuda::LaunchOverlapped(SelectKernel<false>, dim3(grid), dim3(kSelectThreads),
                                        sel_bytes, 1u, stream, a, kp, count_missing, 1);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("indexer_topk launch: ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(IndexerTopkCuda, IndexerTopkImpl,
                              DSV4_BIND(DSV4_INDEXER_TOPK_OPERANDS, ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
