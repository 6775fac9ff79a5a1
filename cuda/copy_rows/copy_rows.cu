// CUDA handlers of take_rows / put_rows (segment table in ffi/include/dsv4/copy_rows.h,
// rules in dsv4_jax/ops/copy_rows.py). One launch for every leaf of a call.
//
// A segment's flat rows are one contiguous run of vectors (16 bytes where the
// row size and both base addresses allow); the run is cut into pieces of
// 32 lanes x kVecsPerLane vectors and the pieces of all segments are numbered
// one after another. Warp w copies pieces w, w + warps, ...; the host passes
// where each segment's pieces begin, so a warp finds a piece's segment by
// comparisons, without a division (a 64-bit modulo per segment walked cost a
// slot move more than its copy: docs/perf/request-state.md). Small leaves and
// leaves of short rows (a 7-byte scale row) spread over the warps like the big ones. A
// lane finds each of its vectors' row (two 32-bit divisions) and issues all
// its loads before its stores. The grid is one wave of the blocks a
// multiprocessor is guaranteed to hold (the launch bounds), sized down to the
// pieces there are: a 3.7 MB slot is about 3,600 pieces, one for nearly
// every warp.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/launch.cuh"
#include "dsv4/copy_rows.h"
#include "handlers_cuda.h"

namespace dsv4 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMinBlocksPerSm = 4;                  // 64 registers a thread at most
// Vectors a lane loads before it stores. Two: a short move (a 3.7 MB slot) is
// spread over every warp of the wave, and its time is one load and one
// store round trip; four or eight made fewer, longer pieces and slower
// slot moves (docs/perf/request-state.md).
constexpr int kVecsPerLane = 2;
constexpr int64_t kPieceVecs = 32 * kVecsPerLane;

inline int64_t PiecesOf(const RowSegment& s) {
  return (SegmentVectors(s) + kPieceVecs - 1) / kPieceVecs;
}

// The segment table and where each segment's pieces begin in the numbering
// of all pieces (first_piece[num_segments]: the total), so a warp finds the
// segment of a piece by comparisons, without a division.
struct CopyRowsLaunch {
  CopyRowsArgs a;
  int64_t first_piece[kMaxRowSegments + 1];
};

// Piece `p` of segment `s`. kToFlat: take (state -> flat); else put.
template <bool kToFlat, typename V>
__device__ __forceinline__ void CopyPiece(const RowSegment& s, int64_t p, int lane) {
  const uint32_t per_row = static_cast<uint32_t>(s.row_bytes / static_cast<int64_t>(sizeof(V)));
  const int64_t vecs = s.outer * s.n * per_row;   // < 2^32 (checked on the host)
  const uint32_t n = static_cast<uint32_t>(s.n);
  V* __restrict__ flat = reinterpret_cast<V*>(s.flat);
  V* __restrict__ state = reinterpret_cast<V*>(s.state);
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

// __grid_constant__: the table is read where the launch put it, not copied
// per thread (it is indexed by a runtime segment number).
template <bool kToFlat>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    CopyRowsKernel(const __grid_constant__ CopyRowsLaunch l) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t total = l.first_piece[l.a.num_segments];
  int k = 0;
  for (int64_t g = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5; g < total;
       g += warps) {
    while (g >= l.first_piece[k + 1]) ++k;         // pieces only grow: k never goes back
    const RowSegment& s = l.a.seg[k];
    const int64_t p = g - l.first_piece[k];
    switch (s.vec_shift) {
      case 4: CopyPiece<kToFlat, uint4>(s, p, lane); break;
      case 3: CopyPiece<kToFlat, uint2>(s, p, lane); break;
      case 2: CopyPiece<kToFlat, unsigned int>(s, p, lane); break;
      case 1: CopyPiece<kToFlat, unsigned short>(s, p, lane); break;
      default: CopyPiece<kToFlat, unsigned char>(s, p, lane); break;
    }
  }
}

template <bool kToFlat>
ffi::Error Launch(cudaStream_t stream, const CopyRowsArgs& a) {
  CopyRowsLaunch l;
  l.a = a;
  l.first_piece[0] = 0;
  for (int k = 0; k < a.num_segments; ++k)
    l.first_piece[k + 1] = l.first_piece[k] + PiecesOf(a.seg[k]);
  const int64_t pieces = l.first_piece[a.num_segments];
  if (pieces == 0) return ffi::Error::Success();
  CopyRowsKernel<kToFlat>
      <<<cuda::GridFor(pieces, kWarps, kMinBlocksPerSm), kThreads, 0, stream>>>(l);
  return cuda::LaunchStatus(kToFlat ? "take_rows" : "put_rows");
}

// kToFlat: take (leaves -> flat rows); else put (flat rows -> the aliased leaves).
template <bool kToFlat>
ffi::Error CopyRowsImpl(cudaStream_t stream, DSV4_PARAMS(DSV4_COPY_ROWS_OPERANDS)) {
  CopyRowsArgs a;
  DSV4_RETURN_IF_ERROR(ValidateCopyRows(kToFlat, DSV4_NAMES(DSV4_COPY_ROWS_OPERANDS), &a));
  return Launch<kToFlat>(stream, a);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TakeRowsCuda, CopyRowsImpl<true>,
                              DSV4_BIND(DSV4_COPY_ROWS_OPERANDS, ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(PutRowsCuda, CopyRowsImpl<false>,
                              DSV4_BIND(DSV4_COPY_ROWS_OPERANDS, ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
