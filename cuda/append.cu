// CUDA handler of append (operands in ffi/append.h, rules in dsv4_jax/ops/append.py).
//
// One launch. Every (slot, ring slot) cell has one owning block: block
// (slot + ring) mod G, with G >= 128 a power of two so that a block owns at most one ring slot
// of each request. Each block scans the call's token metadata and keeps, in
// shared memory, the winner of each cell it owns: the largest position, ties
// to the later row, as one 64-bit atomicMax of (pos << 32 | row + 1). The max
// does not depend on the order of arrival, so the winner is the host's. Then
// the block's warps encode the winning rows (one warp per entry, two
// entries in flight per warp, 16-byte loads and stores). Block 0 also counts the dropped tokens, once each;
// a row holding NaN/Inf is counted (NONFINITE) and skipped by its owning block.
// Requests beyond kMaxTableSlots are handled in further passes of the scan.
#include <cuda_runtime.h>

#include "append.h"
#include "handlers_cuda.h"
#include "kernels.cuh"

namespace dsv4 {
namespace {

constexpr int kThreads = 512;
constexpr int64_t kMaxTableSlots = 4096;  // 32 KiB of winners per pass

// One warp's load of a token's kv row: its two 16-byte chunks.
struct RowRegs {
  uint4 lo, hi;
};

__device__ __forceinline__ void EncodeWinner(const AppendArgs& a, int64_t l, int64_t slot,
                                             unsigned long long key, const RowRegs& row) {
  const int64_t p = static_cast<int64_t>(key >> 32);
  const int64_t e = (l * a.R + slot) * kWindow + (p & (kWindow - 1));
  float lo[8], hi[8];
  cuda::UnpackBf16x8(row.lo, lo);
  cuda::UnpackBf16x8(row.hi, hi);
  cuda::WarpEncodeEntry(a.pool, e, lo, hi);
  if ((threadIdx.x & 31) == 0) a.swa_pos[e] = static_cast<int32_t>(p);
}

__global__ void __launch_bounds__(kThreads) AppendKernel(AppendArgs a) {
  extern __shared__ unsigned long long table[];
  int64_t l;
  if (!cuda::LayerOk(a.layer, a.L, a.errors, &l)) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int32_t gmask = static_cast<int32_t>(gridDim.x) - 1;  // gridDim.x: a power of two
  const int32_t me = static_cast<int32_t>(blockIdx.x);
  const int32_t T = static_cast<int32_t>(a.T), R = static_cast<int32_t>(a.R);
  const int32_t max_context = static_cast<int32_t>(a.max_context);

  if (me == 0) {
    int bad_slot = 0, bad_pos = 0;
    for (int32_t t = tid; t < T; t += blockDim.x) {
      const int32_t s = __ldg(a.slot + t), p = __ldg(a.pos + t);
      if (s == -1) continue;
      if (s < 0 || s >= R) ++bad_slot;
      else if (p < 0 || p >= max_context) ++bad_pos;
    }
    cuda::WarpCount(a.errors, kBadSlot, bad_slot);
    cuda::WarpCount(a.errors, kBadPosition, bad_pos);
  }

  const uint4* kv = reinterpret_cast<const uint4*>(a.kv);
  for (int32_t base = 0; base < R; base += static_cast<int32_t>(kMaxTableSlots)) {
    const int32_t nslots = R - base < kMaxTableSlots ? R - base : kMaxTableSlots;
    for (int32_t i = tid; i < nslots; i += blockDim.x) table[i] = 0ull;
    __syncthreads();
    for (int32_t t = tid; t < T; t += blockDim.x) {
      const int32_t s = __ldg(a.slot + t), p = __ldg(a.pos + t);
      // padding and bad slots fall outside [base, base + nslots)
      if (static_cast<uint32_t>(s - base) >= static_cast<uint32_t>(nslots)) continue;
      if (p < 0 || p >= max_context) continue;
      if (((s + (p & (kWindow - 1))) & gmask) != me) continue;
      // Only the owning block reads the row, so each token is checked once.
      if (!cuda::RowIsFiniteBf16(kv + static_cast<int64_t>(t) * cuda::kChunks)) {
        atomicAdd(&a.errors[kNonfinite], 1);
        continue;
      }
      atomicMax(&table[s - base],
                (static_cast<unsigned long long>(p) << 32) | static_cast<unsigned long long>(t + 1));
    }
    __syncthreads();
    // two winners per warp in flight: both rows loaded before either is encoded
    for (int32_t i = warp; i < nslots; i += 2 * nwarps) {
      const int32_t i1 = i + nwarps;
      const unsigned long long k0 = table[i];
      const unsigned long long k1 = i1 < nslots ? table[i1] : 0ull;
      RowRegs r0, r1;
      if (k0 != 0ull) {
        const int64_t t = static_cast<int64_t>(k0 & 0xffffffffull) - 1;
        r0.lo = __ldg(kv + t * cuda::kChunks + lane);
        r0.hi = __ldg(kv + t * cuda::kChunks + lane + 32);
      }
      if (k1 != 0ull) {
        const int64_t t = static_cast<int64_t>(k1 & 0xffffffffull) - 1;
        r1.lo = __ldg(kv + t * cuda::kChunks + lane);
        r1.hi = __ldg(kv + t * cuda::kChunks + lane + 32);
      }
      if (k0 != 0ull) EncodeWinner(a, l, base + i, k0, r0);
      if (k1 != 0ull) EncodeWinner(a, l, base + i1, k1, r1);
    }
    __syncthreads();
  }
}

ffi::Error AppendImpl(cudaStream_t stream, int64_t kv_format, int64_t max_context,
                      ffi::AnyBuffer layer, ffi::AnyBuffer token_slot, ffi::AnyBuffer token_pos,
                      ffi::AnyBuffer kv, ffi::AnyBuffer swa_pos_in, ffi::AnyBuffer errors_in,
                      ffi::RemainingArgs entry_args, ffi::Result<ffi::AnyBuffer> swa_pos,
                      ffi::Result<ffi::AnyBuffer> errors, ffi::RemainingRets entry_rets) {
  AppendArgs a;
  DSV4_RETURN_IF_ERROR(ValidateAppend(kv_format, max_context, layer, token_slot, token_pos, kv,
                                      swa_pos_in, errors_in, entry_args, *swa_pos, *errors,
                                      entry_rets, &a));
  // G >= 128 (one ring slot per request and block) and a power of two (the
  // owner is a mask); 256 blocks of 512 threads fill an H100/B200 once there
  // are tokens to spread.
  const unsigned grid = a.T > 128 ? 256 : 128;
  size_t smem = static_cast<size_t>(a.R < kMaxTableSlots ? (a.R > 0 ? a.R : 1) : kMaxTableSlots) *
                sizeof(unsigned long long);
  AppendKernel<<<grid, kThreads, smem, stream>>>(a);
  return cuda::LaunchStatus("append");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AppendCuda, AppendImpl,
                              BindAppend(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
