// CUDA handlers of take_rows / put_rows (segment table in ffi/copy_rows.h,
// rules in dsv4_jax/ops/copy_rows.py). One launch for every leaf of a call:
// the rows are cut into pieces of at most kPieceVecs vectors (16 bytes where
// the row and both addresses allow), pieces of all segments numbered one
// after another and dealt to warps round robin, so a small leaf does not
// leave the first warps with more work than the rest.
#include <cuda_runtime.h>

#include <cstdint>

#include "copy_rows.h"
#include "handlers_cuda.h"
#include "kernels.cuh"

namespace dsv4 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVecsPerLane = 4;                   // loads in flight per lane
constexpr int64_t kPieceVecs = 32 * kVecsPerLane;  // 2 KB of 16-byte vectors

__host__ __device__ inline int64_t PiecesOf(const RowSegment& s, int64_t n) {
  const int64_t per_row = s.row_bytes >> s.vec_shift;
  return s.outer * n * ((per_row + kPieceVecs - 1) / kPieceVecs);
}

// The pieces of segment `s` that warp `warp` owns: global piece numbers
// begin + p congruent to `warp` modulo `warps`.
template <typename V>
__device__ void CopySegment(const RowSegment& s, const int32_t* __restrict__ ids, int64_t n,
                            bool to_flat, int64_t begin, int64_t warp, int64_t warps, int lane) {
  const int64_t per_row = s.row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t pieces_per_row = (per_row + kPieceVecs - 1) / kPieceVecs;
  const int64_t pieces = s.outer * n * pieces_per_row;
  int64_t p = (warp - begin % warps + warps) % warps;
  for (; p < pieces; p += warps) {
    const int64_t row = p / pieces_per_row;
    const int64_t first = (p - row * pieces_per_row) * kPieceVecs;
    const int64_t o = row / n, j = row - o * n;
    const int64_t id = __ldg(ids + j);
    const bool ok = id >= 0 && id < s.rows;
    if (!ok && !to_flat) continue;   // put: a skipped id writes nothing
    V* flat = reinterpret_cast<V*>(s.flat + (o * n + j) * s.row_bytes);
    V* st = ok ? reinterpret_cast<V*>(s.state + (o * s.rows + id) * s.row_bytes) : nullptr;
    const V* __restrict__ src = to_flat ? st : flat;
    V* __restrict__ dst = to_flat ? flat : st;
    V buf[kVecsPerLane];
#pragma unroll
    for (int u = 0; u < kVecsPerLane; ++u) {
      const int64_t v = first + lane + 32 * u;
      buf[u] = V{};
      if (v < per_row && src != nullptr) buf[u] = src[v];
    }
#pragma unroll
    for (int u = 0; u < kVecsPerLane; ++u) {
      const int64_t v = first + lane + 32 * u;
      if (v < per_row) dst[v] = buf[u];
    }
  }
}

__global__ void __launch_bounds__(kThreads) CopyRowsKernel(CopyRowsArgs a, bool to_flat) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  int64_t begin = 0;
  for (int k = 0; k < a.num_segments; ++k) {
    const RowSegment& s = a.seg[k];
    switch (s.vec_shift) {
      case 4: CopySegment<uint4>(s, a.ids, a.n, to_flat, begin, warp, warps, lane); break;
      case 3: CopySegment<uint2>(s, a.ids, a.n, to_flat, begin, warp, warps, lane); break;
      case 2: CopySegment<uint32_t>(s, a.ids, a.n, to_flat, begin, warp, warps, lane); break;
      case 1: CopySegment<uint16_t>(s, a.ids, a.n, to_flat, begin, warp, warps, lane); break;
      default: CopySegment<uint8_t>(s, a.ids, a.n, to_flat, begin, warp, warps, lane); break;
    }
    begin += PiecesOf(s, a.n);
  }
}

ffi::Error Launch(cudaStream_t stream, const CopyRowsArgs& a, bool to_flat, const char* what) {
  int64_t pieces = 0;
  for (int k = 0; k < a.num_segments; ++k) pieces += PiecesOf(a.seg[k], a.n);
  if (pieces == 0) return ffi::Error::Success();
  CopyRowsKernel<<<cuda::GridFor(pieces, kWarps, 16), kThreads, 0, stream>>>(a, to_flat);
  return cuda::LaunchStatus(what);
}

// kToFlat: take (leaves -> flat rows); else put (flat rows -> the aliased leaves).
template <bool kToFlat>
ffi::Error CopyRowsImpl(cudaStream_t stream, ffi::Span<const int64_t> row_axes,
                        ffi::AnyBuffer ids, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  CopyRowsArgs a;
  DSV4_RETURN_IF_ERROR(ValidateCopyRows(kToFlat, row_axes, ids, args, rets, &a));
  return Launch(stream, a, kToFlat, kToFlat ? "take_rows" : "put_rows");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TakeRowsCuda, CopyRowsImpl<true>,
                              BindCopyRows(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(PutRowsCuda, CopyRowsImpl<false>,
                              BindCopyRows(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
