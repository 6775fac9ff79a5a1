// CUDA handlers of write_layer (operands in ffi/include/dsv4/write_layer.h, rules in
// dsv4_jax/ops/write_layer.py): append and flush of one layer in ONE kernel
// launch. The grid is the append role's blocks (in clusters, as the append
// kernel launches them) followed by the flush role's; each block takes its
// role from blockIdx.x and runs that op's block code (cuda/append/append_block.cuh,
// cuda/flush/flush_block.cuh) with its index within the role. The two roles write
// disjoint buffers (the window; the layer's accumulators, pool entries and
// indexer keys), read only inputs and add into `errors` with atomics, so
// the result and the counts are those of the append kernel followed by the
// flush kernel. A prefill-sized call (flush_kernel::UseWindowPlan) runs the
// append role alone in that launch, then flush's window-plan kernel
// (cuda/flush/flush_windows.cuh) in a second one. A decode-sized call's append
// role is a scan grid (a warp a token) spread over the multiprocessors the
// flush role leaves, so both roles run side by side in one wave. On a CSA
// layer, where it still fits that wave, the flush role is twice as many
// blocks: a request's main entry in one, its indexer key in another
// (FlushLayout::kSplit), so neither waits on the other's arithmetic.
#include <cuda_runtime.h>

#include "append/append_block.cuh"
#include "common/launch.cuh"
#include "dsv4/write_layer.h"
#include "flush/flush_block.cuh"
#include "flush/flush_windows.cuh"
#include "handlers_cuda.h"

namespace dsv4 {
namespace {

constexpr int kThreads = append_kernel::kThreads;
static_assert(kThreads == flush_kernel::kThreads, "both roles run 512-thread blocks");
constexpr int kScanTokensPerWarp = 4;
constexpr int kScanTokensPerBlock = kScanTokensPerWarp * append_kernel::kWarps;

// How the flush role's blocks divide a request's work.
enum class FlushLayout : int {
  kWhole,  // a block a request, the main entry and the indexer key together
  kSplit,  // CSA: the main entries' blocks, then as many for the indexer keys
};

template <bool kCsa, FlushLayout kLayout>
__global__ void __launch_bounds__(kThreads, 1)
    WriteLayerKernel(AppendArgs a, append_kernel::AppendPlan plan, FlushArgs f) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ append_kernel::AppendShared append_sh;
  __shared__ flush_kernel::FlushShared flush_sh;
  if (blockIdx.x < plan.blocks) {
    append_kernel::AppendBlock(a, plan, blockIdx.x, smem, append_sh);
    return;
  }
  const unsigned block = blockIdx.x - plan.blocks, blocks = gridDim.x - plan.blocks;
  if constexpr (kLayout == FlushLayout::kSplit) {
    // both halves walk the same requests; each stores its own accumulators
    const unsigned half = blocks / 2;
    if (block < half)
      flush_kernel::FlushBlock<kCsa, flush_kernel::Part::kMain>(f, block, half, flush_sh);
    else
      flush_kernel::FlushBlock<kCsa, flush_kernel::Part::kIndex>(f, block - half, half,
                                                                 flush_sh);
  } else {
    flush_kernel::FlushBlock<kCsa, flush_kernel::Part::kAll>(f, block, blocks, flush_sh);
  }
}

// Scan blocks a call of T rows needs at least: its warps take at most
// kScanTokensPerWarp tokens each.
inline int64_t LeastScanBlocks(int64_t T) {
  return (T + kScanTokensPerBlock - 1) / kScanTokensPerBlock;
}

// Whether a CSA call's flush role splits each request's walk (FlushLayout::
// kSplit): at decode sizes where twice the role's blocks and the scan role
// still run in one wave. Then a request's chain is its main entry's, as on an
// HCA layer, with the indexer key's shorter one on a multiprocessor beside it.
inline bool SplitFits(const FlushArgs& f, int64_t append_rows) {
  if (flush_kernel::UseWindowPlan(f)) return false;
  return 2 * int64_t{flush_kernel::FlushGrid(f.T, cuda::SmCount())} +
             LeastScanBlocks(append_rows) <=
         cuda::SmCount();
}

template <bool kCsa, FlushLayout kLayout>
ffi::Error LaunchWriteLayer(cudaStream_t stream, const WriteLayerArgs& w, const char* what) {
  const bool prefill = flush_kernel::UseWindowPlan(w.flush);
  const int64_t parts = kLayout == FlushLayout::kSplit ? 2 : 1;
  const int64_t least = LeastScanBlocks(w.append.T);
  // a decode-sized flush keeps to the multiprocessors the scan role leaves
  // (one block a multiprocessor), so a verify or commit step's hundreds of
  // rows still run in one wave
  const int64_t per_part =
      prefill ? 0 : flush_kernel::FlushGrid(w.flush.T, (cuda::SmCount() - least) / parts);
  // a scan role takes the multiprocessors the flush role leaves, so that
  // both run in one wave (one block a multiprocessor: the flush role's
  // registers allow no more), unless its warps would then take more than
  // kScanTokensPerWarp tokens each
  const int64_t spare = cuda::SmCount() - parts * per_part;
  const append_kernel::AppendPlan plan =
      append_kernel::FitAppendPlan<WriteLayerKernel<kCsa, kLayout>, 1>(
          w.append.T, w.append.R, spare > least ? spare : least);
  const unsigned k = plan.cluster;
  // each part's flush blocks rounded up to whole clusters (the extra ones
  // share the rows); none in a prefill call, whose flush is the second launch
  const unsigned flush_blocks = static_cast<unsigned>(parts * ((per_part + k - 1) / k * k));
  const cudaError_t err =
      cuda::LaunchOverlapped(WriteLayerKernel<kCsa, kLayout>, dim3(plan.blocks + flush_blocks),
                             dim3(kThreads), plan.smem, k, stream, w.append, plan, w.flush);
  if (err != cudaSuccess || !prefill) return cuda::LaunchResult(err, what);
  return cuda::LaunchResult(flush_kernel::LaunchFlushPlan<kCsa>(stream, w.flush), what);
}

// The layout by shape: a CSA call splits its requests where that fits one
// wave (SplitFits); larger calls, prefill and HCA layers walk whole requests.
template <bool kCsa>
ffi::Error LaunchChosen(cudaStream_t stream, const WriteLayerArgs& w, const char* what) {
  if constexpr (kCsa) {
    if (SplitFits(w.flush, w.append.T))
      return LaunchWriteLayer<true, FlushLayout::kSplit>(stream, w, what);
  }
  return LaunchWriteLayer<kCsa, FlushLayout::kWhole>(stream, w, what);
}

ffi::Error WriteLayerCsaImpl(cudaStream_t stream, DSV4_PARAMS(DSV4_WRITE_LAYER_CSA_OPERANDS)) {
  WriteLayerArgs w;
  DSV4_RETURN_IF_ERROR(ValidateWriteLayerCsa(DSV4_NAMES(DSV4_WRITE_LAYER_CSA_OPERANDS), &w));
  return LaunchChosen<true>(stream, w, "write_layer_csa");
}

ffi::Error WriteLayerHcaImpl(cudaStream_t stream, DSV4_PARAMS(DSV4_WRITE_LAYER_HCA_OPERANDS)) {
  WriteLayerArgs w;
  DSV4_RETURN_IF_ERROR(ValidateWriteLayerHca(DSV4_NAMES(DSV4_WRITE_LAYER_HCA_OPERANDS), &w));
  return LaunchChosen<false>(stream, w, "write_layer_hca");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    WriteLayerCsaCuda, WriteLayerCsaImpl,
    DSV4_BIND(DSV4_WRITE_LAYER_CSA_OPERANDS, ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    WriteLayerHcaCuda, WriteLayerHcaImpl,
    DSV4_BIND(DSV4_WRITE_LAYER_HCA_OPERANDS, ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
