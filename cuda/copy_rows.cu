// CUDA handlers of take_rows / put_rows (segment table in ffi/copy_rows.h,
// rules in dsv4_jax/ops/copy_rows.py). One launch for every leaf of a call.
//
// A segment's flat rows are one contiguous run of vectors (16 bytes where the
// row size and both base addresses allow); the run is cut into pieces of
// 32 lanes x kVecsPerLane vectors, the pieces of all segments numbered one
// after another and dealt to the grid's warps round robin, so small leaves
// and leaves of short rows (a 7-byte scale row) spread over the warps like
// the big ones. A lane finds each of its vectors' row (two 32-bit divisions)
// and issues all its loads before its stores, so every warp keeps
// kVecsPerLane x 512 bytes in flight. The grid is one wave of the blocks a
// multiprocessor is guaranteed to hold (the launch bounds), sized down to the
// pieces there are: a 3.7 MB slot is about 1,900 pieces, one each for that
// many warps.
#include <cuda_runtime.h>

#include <cstdint>

#include "copy_rows.h"
#include "handlers_cuda.h"
#include "kernels.cuh"

namespace dsv4 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMinBlocksPerSm = 4;                  // 64 registers a thread at most
constexpr int kVecsPerLane = 4;                     // loads in flight per lane
constexpr int64_t kPieceVecs = 32 * kVecsPerLane;

__host__ __device__ inline int64_t PiecesOf(const RowSegment& s) {
  const int64_t vecs = s.outer * s.n * (s.row_bytes >> s.vec_shift);   // SegmentVectors
  return (vecs + kPieceVecs - 1) / kPieceVecs;
}

// The pieces of segment `s` that warp `warp` owns: global piece numbers
// begin + p congruent to `warp` modulo `warps`.
// kToFlat: take (state -> flat); else put (flat -> state).
template <bool kToFlat, typename V>
__device__ void CopySegment(const RowSegment& s, int64_t begin, int64_t warp, int64_t warps,
                            int lane) {
  const uint32_t per_row = static_cast<uint32_t>(s.row_bytes / static_cast<int64_t>(sizeof(V)));
  const int64_t vecs = s.outer * s.n * per_row;   // < 2^32 (checked on the host)
  const int64_t pieces = (vecs + kPieceVecs - 1) / kPieceVecs;
  const uint32_t n = static_cast<uint32_t>(s.n);
  V* __restrict__ flat = reinterpret_cast<V*>(s.flat);
  V* __restrict__ state = reinterpret_cast<V*>(s.state);
  for (int64_t p = (warp - begin % warps + warps) % warps; p < pieces; p += warps) {
    int64_t at[kVecsPerLane];   // the state's vector; -1: a skipped id, -2: past the run
    V buf[kVecsPerLane];
#pragma unroll
    for (int u = 0; u < kVecsPerLane; ++u) {
      const int64_t v = p * kPieceVecs + lane + 32 * u;
      at[u] = -2;
      if (v < vecs) {
        const uint32_t q = static_cast<uint32_t>(v) / per_row;   // o * n + j
        const uint32_t c = static_cast<uint32_t>(v) - q * per_row;
        const uint32_t o = q / n, j = q - o * n;
        const int64_t id = __ldg(s.ids + j);
        at[u] = id >= 0 && id < s.rows ? (o * s.rows + id) * per_row + c : -1;
      }
    }
#pragma unroll
    for (int u = 0; u < kVecsPerLane; ++u) {
      const int64_t v = p * kPieceVecs + lane + 32 * u;
      buf[u] = V{};
      if (at[u] >= 0) buf[u] = __ldg(kToFlat ? state + at[u] : flat + v);
    }
#pragma unroll
    for (int u = 0; u < kVecsPerLane; ++u) {
      const int64_t v = p * kPieceVecs + lane + 32 * u;
      if (kToFlat && at[u] != -2) flat[v] = buf[u];           // a skipped id: zero bytes
      if (!kToFlat && at[u] >= 0) state[at[u]] = buf[u];      // a skipped id writes nothing
    }
  }
}

// __grid_constant__: the segment table is read where the launch put it, not
// copied per thread (it is indexed by a runtime segment number).
template <bool kToFlat>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    CopyRowsKernel(const __grid_constant__ CopyRowsArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  int64_t begin = 0;
  for (int k = 0; k < a.num_segments; ++k) {
    const RowSegment& s = a.seg[k];
    switch (s.vec_shift) {
      case 4: CopySegment<kToFlat, uint4>(s, begin, warp, warps, lane); break;
      case 3: CopySegment<kToFlat, uint2>(s, begin, warp, warps, lane); break;
      case 2: CopySegment<kToFlat, unsigned int>(s, begin, warp, warps, lane); break;
      case 1: CopySegment<kToFlat, unsigned short>(s, begin, warp, warps, lane); break;
      default: CopySegment<kToFlat, unsigned char>(s, begin, warp, warps, lane); break;
    }
    begin += PiecesOf(s);
  }
}

template <bool kToFlat>
ffi::Error Launch(cudaStream_t stream, const CopyRowsArgs& a) {
  int64_t pieces = 0;
  for (int k = 0; k < a.num_segments; ++k) pieces += PiecesOf(a.seg[k]);
  if (pieces == 0) return ffi::Error::Success();
  CopyRowsKernel<kToFlat><<<cuda::GridFor(pieces, kWarps, kMinBlocksPerSm), kThreads, 0,
                             stream>>>(a);
  return cuda::LaunchStatus(kToFlat ? "take_rows" : "put_rows");
}

// kToFlat: take (leaves -> flat rows); else put (flat rows -> the aliased leaves).
template <bool kToFlat>
ffi::Error CopyRowsImpl(cudaStream_t stream, ffi::Span<const int64_t> row_axes,
                        ffi::Span<const int64_t> id_starts, ffi::AnyBuffer ids,
                        ffi::RemainingArgs args, ffi::RemainingRets rets) {
  CopyRowsArgs a;
  DSV4_RETURN_IF_ERROR(ValidateCopyRows(kToFlat, row_axes, id_starts, ids, args, rets, &a));
  return Launch<kToFlat>(stream, a);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TakeRowsCuda, CopyRowsImpl<true>,
                              BindCopyRows(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(PutRowsCuda, CopyRowsImpl<false>,
                              BindCopyRows(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
