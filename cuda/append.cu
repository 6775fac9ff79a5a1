// CUDA handler of append (operands in ffi/append.h, rules in dsv4_jax/ops/append.py).
//
// One launch. Every (slot, ring slot) cell has one owning block: block
// (slot + ring) % G, with G >= 128 so that a block owns at most one ring slot
// of each request. Each block scans the call's token metadata and keeps, in
// shared memory, the winner of each cell it owns: the largest position, ties
// to the later row, as one 64-bit atomicMax of (pos << 32 | row + 1). The max
// does not depend on the order of arrival, so the winner is the host's. Then
// the block's warps encode the winning rows (one warp per entry, 16-byte
// loads and stores). Block 0 also counts the dropped tokens, once each.
// Requests beyond kMaxTableSlots are handled in further passes of the scan.
#include <cuda_runtime.h>

#include "append.h"
#include "handlers_cuda.h"
#include "kernels.cuh"

namespace dsv4 {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxTableSlots = 4096;  // 32 KiB of winners per pass

__global__ void __launch_bounds__(kThreads) AppendKernel(AppendArgs a) {
  extern __shared__ unsigned long long table[];
  int64_t l;
  if (!cuda::LayerOk(a.layer, a.L, a.errors, &l)) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int64_t G = gridDim.x, me = blockIdx.x;

  if (me == 0) {
    int bad_slot = 0, bad_pos = 0;
    for (int64_t t = tid; t < a.T; t += blockDim.x) {
      int64_t s = a.slot[t], p = a.pos[t];
      if (s == -1) continue;
      if (s < 0 || s >= a.R) ++bad_slot;
      else if (p < 0 || p >= a.max_context) ++bad_pos;
    }
    cuda::WarpCount(a.errors, kBadSlot, bad_slot);
    cuda::WarpCount(a.errors, kBadPosition, bad_pos);
  }

  const uint4* kv = reinterpret_cast<const uint4*>(a.kv);
  for (int64_t base = 0; base < a.R; base += kMaxTableSlots) {
    const int64_t nslots = a.R - base < kMaxTableSlots ? a.R - base : kMaxTableSlots;
    for (int64_t i = tid; i < nslots; i += blockDim.x) table[i] = 0ull;
    __syncthreads();
    for (int64_t t = tid; t < a.T; t += blockDim.x) {
      int64_t s = __ldg(a.slot + t), p = __ldg(a.pos + t);
      if (s < base || s >= base + nslots) continue;  // also padding and bad slots
      if (p < 0 || p >= a.max_context) continue;
      if ((s + p % kWindow) % G != me) continue;
      atomicMax(&table[s - base],
                (static_cast<unsigned long long>(p) << 32) | static_cast<unsigned long long>(t + 1));
    }
    __syncthreads();
    for (int64_t i = warp; i < nslots; i += nwarps) {
      unsigned long long key = table[i];
      if (key == 0ull) continue;
      const int64_t t = static_cast<int64_t>(key & 0xffffffffull) - 1;
      const int64_t p = static_cast<int64_t>(key >> 32);
      const int64_t e = (l * a.R + base + i) * kWindow + p % kWindow;
      float lo[8], hi[8];
      cuda::UnpackBf16x8(__ldg(kv + t * cuda::kChunks + lane), lo);
      cuda::UnpackBf16x8(__ldg(kv + t * cuda::kChunks + lane + 32), hi);
      cuda::WarpEncodeEntry(a.pool, e, lo, hi);
      if (lane == 0) a.swa_pos[e] = static_cast<int32_t>(p);
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
  // G >= 128 (one ring slot per request and block); more blocks only when
  // there are tokens to spread.
  int64_t sm2 = 2 * static_cast<int64_t>(cuda::SmCount());
  int64_t grid = a.T > 128 ? (sm2 > 128 ? sm2 : 128) : 128;
  size_t smem = static_cast<size_t>(a.R < kMaxTableSlots ? (a.R > 0 ? a.R : 1) : kMaxTableSlots) *
                sizeof(unsigned long long);
  AppendKernel<<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(a);
  return cuda::LaunchStatus("append");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AppendCuda, AppendImpl,
                              BindAppend(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace dsv4
