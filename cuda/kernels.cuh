// Device building blocks of the CUDA handlers: grid sizing from the device,
// and the warp-wide encode / decode of one 512-channel entry in every
// kv_format. The arithmetic is the shared numerics of dsv4/numerics.h, so a
// warp produces the bytes EncodeEntry / DecodeEntry produce on the host.
//
// Warp layout of an entry: 64 chunks of 8 channels; lane L owns chunks L and
// L + 32 (channels 8L.. and 256 + 8L..). Chunks 0..55 are the 448 NoPE
// channels (ds_fp8 tile = 8 chunks), 56..63 the 64 RoPE channels. Each
// access of a warp is one contiguous run: 32 x 16 bytes of bf16, or 32 x 8
// bytes of fp8 codes, so loads and stores are coalesced and 8/16 bytes wide.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "dsv4/entries.h"
#include "dsv4/ffi_checks.h"
#include "dsv4/layout.h"
#include "dsv4/numerics.h"

namespace dsv4 {
namespace cuda {

constexpr int kChunk = 8;                       // channels per chunk
constexpr int kChunks = kHeadDim / kChunk;      // 64
constexpr int kNopeChunks = kNopeDim / kChunk;  // 56
constexpr unsigned kFull = 0xffffffffu;

// An attribute of the current device, read once per device (no allocation,
// no sync; cudaDeviceGetAttribute is a host query); `fallback` (an H100's)
// where it cannot be read.
template <cudaDeviceAttr kAttr>
inline int DeviceAttribute(int fallback) {
  static int cached[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return fallback;
  if (cached[dev] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, kAttr, dev) != cudaSuccess || n <= 0) n = fallback;
    cached[dev] = n;
  }
  return cached[dev];
}
inline int SmCount() { return DeviceAttribute<cudaDevAttrMultiProcessorCount>(132); }
inline int64_t L2Bytes() { return DeviceAttribute<cudaDevAttrL2CacheSize>(50 << 20); }
inline int ComputeMajor() { return DeviceAttribute<cudaDevAttrComputeCapabilityMajor>(9); }

// Lets kernel `kKernel` take up to `bytes` of dynamic shared memory (past
// the default 48 KB). The limit is an attribute of the kernel on each
// device, so it is set once per device, not once per process: a process that
// drives several GPUs launches on each.
template <auto kKernel>
cudaError_t AllowDynamicShared(int bytes) {
  static std::atomic<bool> done[64];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const bool cached = dev >= 0 && dev < 64;
  if (cached && done[dev].load(std::memory_order_acquire)) return cudaSuccess;
  e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess && cached) done[dev].store(true, std::memory_order_release);
  return e;
}

// Blocks for a grid-stride loop over `work` items of `per_block` each, at most
// `waves` blocks per multiprocessor, at least one block.
inline unsigned GridFor(int64_t work, int per_block, int waves) {
  int64_t want = (work + per_block - 1) / per_block;
  int64_t cap = static_cast<int64_t>(SmCount()) * waves;
  if (want > cap) want = cap;
  if (want < 1) want = 1;
  return static_cast<unsigned>(want);
}

// Clusters of `cluster_x` blocks of `kernel` the device holds at once (0 if
// the query fails). A grid of more clusters than that runs its last ones in a
// second wave: a cluster's blocks must share a GPC, so this is often fewer
// than blocks-a-multiprocessor x multiprocessors / cluster_x.
template <typename... Params>
int MaxActiveClusters(void (*kernel)(Params...), unsigned threads, size_t smem,
                      unsigned cluster_x) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(cluster_x);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster_x;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

// Launches `kernel` so that it may start while the kernel before it on the
// stream is still running (programmatic dependent launch, sm_90): its CTAs
// do what needs nothing of that kernel, then WaitForPrevious(). Without the
// feature (older devices, or a launch that refuses the attribute) it is an
// ordinary launch: WaitForPrevious() then returns at once.
// `cluster_x` > 1 groups that many consecutive CTAs (along x) into a
// thread-block cluster, with or without the overlap.
//
// The rules every kernel launched so follows:
//  - Before WaitForPrevious() it reads no operand. A handler cannot know
//    which kernel runs before it (any of the caller's, an XLA fusion that
//    computed its q or kv, our write of the same layer), so that is any
//    buffer at all; what is left is address arithmetic, shared memory and
//    registers. The one exception is a second kernel of the same FFI call
//    whose first kernel writes nothing it reads (the indexer's select reads
//    its token's q and position early: the score kernel before it writes
//    only the rank keys, and lets it start only after its own wait).
//  - Every CTA calls WaitForPrevious() before it exits, on every path: the
//    kernel must not end before the one ahead of it, whose writes a kernel
//    launched after it (overlapped or not) may read.
//  - LetNextStart() comes after WaitForPrevious(), so a kernel launched
//    overlapped behind this one finds everything before this one done.
// Inside an XLA command buffer each FFI call is captured as its own graph:
// the overlap holds between the kernels of one call and becomes a plain
// dependency between calls, which the rules above keep correct too.
template <typename... Params, typename... Args>
cudaError_t LaunchOverlapped(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                             unsigned cluster_x, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (cluster_x > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster_x;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  const int plain = n;                            // the attributes without the overlap
  attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[n].val.programmaticStreamSerializationAllowed = 1;
  ++n;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
  if (err == cudaSuccess) return err;
  (void)cudaGetLastError();                       // clear it, then without the overlap
  cfg.numAttrs = plain;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...);
}

// The overlapped kernel's side of LaunchOverlapped: waits until the kernel
// before it has finished and its writes are visible. A no-op where the
// launch did not overlap.
__device__ __forceinline__ void WaitForPrevious() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The earlier kernel's side: once every CTA of it has called this (or
// exited), the overlapped kernel after it is launched, and its CTAs take the
// multiprocessors this kernel's CTAs leave, each up to its WaitForPrevious().
// Call it only when every CTA of this kernel is resident or done by then
// (it is called by CTAs that run, so all have started): the later kernel
// never holds resources an earlier CTA waits for.
__device__ __forceinline__ void LetNextStart() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The layer operand (a device scalar) checked against [0, L). A bad layer is
// counted once, by thread 0 of block 0.
__device__ __forceinline__ bool LayerOk(const int32_t* layer, int64_t L, int32_t* errors,
                                        int64_t* l_out) {
  int64_t l = __ldg(layer);
  if (l < 0 || l >= L) {
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) atomicAdd(&errors[kBadLayer], 1);
    return false;
  }
  *l_out = l;
  return true;
}

// Adds `n` (per lane) to errors[kind] with one atomic per warp.
__device__ __forceinline__ void WarpCount(int32_t* errors, int kind, int n) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) n += __shfl_xor_sync(kFull, n, off);
  if ((threadIdx.x & 31) == 0 && n != 0) atomicAdd(&errors[kind], n);
}

// ---- bf16 chunk helpers ----------------------------------------------------------
__device__ __forceinline__ void UnpackBf16x8(uint4 u, float* x) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = num::Bf16ToF32(static_cast<uint16_t>(w[i] & 0xffffu));
    x[2 * i + 1] = num::Bf16ToF32(static_cast<uint16_t>(w[i] >> 16));
  }
}

__device__ __forceinline__ uint4 PackBf16x8(const float* x) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = static_cast<uint32_t>(num::F32ToBf16(x[2 * i])) |
           (static_cast<uint32_t>(num::F32ToBf16(x[2 * i + 1])) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// ---- encode ------------------------------------------------------------------------
// Stores entry e of `p` from the bf16-valued fp32 channels a lane owns:
// lo[8] = chunk lane, hi[8] = chunk lane + 32. All 32 lanes must call.
__device__ __forceinline__ void WarpEncodeEntry(const EntryPool& p, int64_t e, const float* lo,
                                                const float* hi) {
  const int lane = threadIdx.x & 31;
  const int jlo = lane, jhi = lane + 32;
  const bool hi_nope = jhi < kNopeChunks;
  uint16_t* rope = p.rope + e * kRopeDim;
  if (p.fmt == kBf16) {
    uint4* nope = reinterpret_cast<uint4*>(reinterpret_cast<uint16_t*>(p.nope) + e * kNopeDim);
    nope[jlo] = PackBf16x8(lo);
    if (hi_nope) nope[jhi] = PackBf16x8(hi);
    else reinterpret_cast<uint4*>(rope)[jhi - kNopeChunks] = PackBf16x8(hi);
    return;
  }
  // amax of each half's chunk (the floor enters every max, as on the host).
  float alo = num::kDsFp8AmaxFloor, ahi = num::kDsFp8AmaxFloor;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    alo = num::MaxF(alo, num::AbsF(lo[i]));
    ahi = num::MaxF(ahi, num::AbsF(hi[i]));
  }
  if (!hi_nope) ahi = num::kDsFp8AmaxFloor;  // RoPE channels are not quantized
  // x / s for the codes: ds_fp8's scales are powers of two, so a multiply by
  // the exact inverse gives the quotient's bits; fp8_token's need the division.
  float slo, shi, mlo = 1.f, mhi = 1.f;
  uint8_t blo = 0, bhi = 0;
  if (p.fmt == kDsFp8) {
    // tile = 8 consecutive lanes of one half
#pragma unroll
    for (int off = 1; off < 8; off <<= 1) {
      alo = num::MaxF(alo, __shfl_xor_sync(kFull, alo, off));
      ahi = num::MaxF(ahi, __shfl_xor_sync(kFull, ahi, off));
    }
    blo = num::Pow2CeilE8m0(alo / num::kE4m3Max);
    bhi = num::Pow2CeilE8m0(ahi / num::kE4m3Max);
    slo = num::E8m0ToF32(blo);
    shi = num::E8m0ToF32(bhi);
    mlo = num::E8m0Inverse(blo);
    mhi = num::E8m0Inverse(bhi);
  } else {  // fp8_token: one scale over the 448 NoPE channels
    float a = num::MaxF(alo, ahi);
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) a = num::MaxF(a, __shfl_xor_sync(kFull, a, off));
    slo = shi = a / num::kE4m3Max;
  }
  // e4m3 saturates at +-448 as the host's clamp does; the pair instruction
  // gives F32ToE4m3's code for every value but NaN (append's rows are finite;
  // only an entry that overflowed in flush could hold one, and then its code
  // may lose the NaN's sign)
  const bool pow2 = p.fmt == kDsFp8;
  auto codes8 = [pow2](const float* x, float s, float inv_s) {
    uint32_t w[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) q[i] = pow2 ? x[4 * h + i] * inv_s : x[4 * h + i] / s;
      w[h] = static_cast<uint32_t>(num::F32PairToE4m3(q[0], q[1])) |
             (static_cast<uint32_t>(num::F32PairToE4m3(q[2], q[3])) << 16);
    }
    return make_uint2(w[0], w[1]);
  };
  uint2* nope = reinterpret_cast<uint2*>(p.nope + e * kNopeDim);
  nope[jlo] = codes8(lo, slo, mlo);
  if (hi_nope) nope[jhi] = codes8(hi, shi, mhi);
  else reinterpret_cast<uint4*>(rope)[jhi - kNopeChunks] = PackBf16x8(hi);
  if (p.fmt == kDsFp8) {
    if ((lane & 7) == 0) {
      p.scale[e * kNopeTiles + (lane >> 3)] = blo;
      if (hi_nope) p.scale[e * kNopeTiles + 4 + (lane >> 3)] = bhi;
    }
  } else if (lane == 0) {
    reinterpret_cast<float*>(p.scale)[e] = slo;
  }
}

// Whether 8 bf16 hold no NaN or Inf (exponent bits not all ones).
__device__ __forceinline__ bool Bf16x8Finite(uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  bool ok = true;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    ok = ok && (w[i] & 0x7f80u) != 0x7f80u && (w[i] & 0x7f800000u) != 0x7f800000u;
  return ok;
}

// ---- decode ------------------------------------------------------------------------
// The bf16 bits of code * s (exactly num::F32ToBf16(num::E4m3ToF32(c) * s)),
// for one code; the NaN cases follow the host, where a NaN operand of the
// product is returned as it is.
__device__ __forceinline__ uint16_t DequantOne(uint8_t c, float s) {
  if ((c & 0x7fu) == 0x7fu) return num::F32ToBf16(num::E4m3ToF32(c));
  if (num::IsNan(s)) return num::F32ToBf16(s);
  return num::F32ToBf16(num::E4m3ToF32(c) * s);
}

// 8 e4m3 codes times s as 8 bf16. Fast path: the hardware conversions
// (e4m3 -> f16 is exact, the product is one IEEE multiply, f32 -> bf16 is
// round-to-nearest-even like F32ToBf16); NaN codes or a NaN scale take the
// scalar path so that their bits match the host.
__device__ __forceinline__ uint4 DequantChunk(uint2 codes, float s) {
  const uint64_t c = (static_cast<uint64_t>(codes.y) << 32) | codes.x;
  const uint64_t t = (c & 0x7f7f7f7f7f7f7f7full) ^ 0x7f7f7f7f7f7f7f7full;
  const bool nan_code = ((t - 0x0101010101010101ull) & ~t & 0x8080808080808080ull) != 0;
  uint32_t w[4];
  if (nan_code || num::IsNan(s)) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint8_t c0 = static_cast<uint8_t>(c >> (16 * i)), c1 = static_cast<uint8_t>(c >> (16 * i + 8));
      w[i] = static_cast<uint32_t>(DequantOne(c0, s)) |
             (static_cast<uint32_t>(DequantOne(c1, s)) << 16);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>((c >> (16 * i)) & 0xffffu), __NV_E4M3);
      float2 f = __half22float2(*reinterpret_cast<__half2*>(&h));
      __nv_bfloat162 b = __floats2bfloat162_rn(__fmul_rn(f.x, s), __fmul_rn(f.y, s));
      w[i] = *reinterpret_cast<uint32_t*>(&b);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The raw bytes of one entry a lane needs (its two chunks and their
// scales): loading is split from decoding so that a warp can have several
// entries in flight before its first store.
struct EntryRegs {
  uint4 lo, hi;  // fp8: codes in .x/.y (hi: RoPE bf16 in all four for lanes 24..31)
  float slo, shi;
};

// A load through the read-only cache (global memory that no thread of the
// kernel writes), or a plain one (`kReadOnly` false: shared memory, where
// __ldg is not allowed).
template <bool kReadOnly, typename T>
__device__ __forceinline__ T LoadEntryPart(const T* ptr) {
  if constexpr (kReadOnly) return __ldg(ptr);
  else return *ptr;
}

template <bool kReadOnly = true>
__device__ __forceinline__ EntryRegs WarpLoadEntry(const EntryPool& p, int64_t e) {
  const int lane = threadIdx.x & 31;
  const int jlo = lane, jhi = lane + 32;
  const bool hi_nope = jhi < kNopeChunks;
  const uint4* rope = reinterpret_cast<const uint4*>(p.rope + e * kRopeDim);
  EntryRegs r;
  r.slo = r.shi = 1.f;
  if (p.fmt == kBf16) {
    const uint4* nope =
        reinterpret_cast<const uint4*>(reinterpret_cast<const uint16_t*>(p.nope) + e * kNopeDim);
    r.lo = LoadEntryPart<kReadOnly>(nope + jlo);
    r.hi = hi_nope ? LoadEntryPart<kReadOnly>(nope + jhi)
                   : LoadEntryPart<kReadOnly>(rope + (jhi - kNopeChunks));
    return r;
  }
  const uint2* nope = reinterpret_cast<const uint2*>(p.nope + e * kNopeDim);
  const uint2 clo = LoadEntryPart<kReadOnly>(nope + jlo);
  r.lo = make_uint4(clo.x, clo.y, 0, 0);
  if (hi_nope) {
    const uint2 chi = LoadEntryPart<kReadOnly>(nope + jhi);
    r.hi = make_uint4(chi.x, chi.y, 0, 0);
  } else {
    r.hi = LoadEntryPart<kReadOnly>(rope + (jhi - kNopeChunks));
  }
  if (p.fmt == kDsFp8) {
    r.slo = num::E8m0ToF32(LoadEntryPart<kReadOnly>(p.scale + e * kNopeTiles + (jlo >> 3)));
    if (hi_nope)
      r.shi = num::E8m0ToF32(LoadEntryPart<kReadOnly>(p.scale + e * kNopeTiles + (jhi >> 3)));
  } else {
    r.slo = r.shi = LoadEntryPart<kReadOnly>(reinterpret_cast<const float*>(p.scale) + e);
  }
  return r;
}

// Decodes loaded entry bytes to bf16: the lane's chunk `lane` to *lo and its
// chunk `lane + 32` to *hi (16-byte aligned each; a row in shared memory may
// place its chunks anywhere, e.g. swizzled for the tensor cores).
__device__ __forceinline__ void WarpStoreEntryChunks(int fmt, const EntryRegs& r, uint4* lo,
                                                     uint4* hi) {
  const int jhi = (threadIdx.x & 31) + 32;
  if (fmt == kBf16) {
    *lo = r.lo;
    *hi = r.hi;
    return;
  }
  *lo = DequantChunk(make_uint2(r.lo.x, r.lo.y), r.slo);
  *hi = jhi < kNopeChunks ? DequantChunk(make_uint2(r.hi.x, r.hi.y), r.shi) : r.hi;
}

// Decodes loaded entry bytes to 512 bf16 at `out` (16-byte aligned).
__device__ __forceinline__ void WarpStoreEntry(int fmt, const EntryRegs& r, uint16_t* out) {
  const int lane = threadIdx.x & 31;
  uint4* dst = reinterpret_cast<uint4*>(out);
  WarpStoreEntryChunks(fmt, r, dst + lane, dst + lane + 32);
}

// Writes entry e of `p` as 512 bf16 to `out` (16-byte aligned). All 32 lanes
// call. `kReadOnly` false for a pool in shared memory (see LoadEntryPart).
template <bool kReadOnly = true>
__device__ __forceinline__ void WarpDecodeEntry(const EntryPool& p, int64_t e, uint16_t* out) {
  WarpStoreEntry(p.fmt, WarpLoadEntry<kReadOnly>(p, e), out);
}

// A zero row of 512 bf16.
__device__ __forceinline__ void WarpZeroRow(uint16_t* out) {
  const int lane = threadIdx.x & 31;
  uint4* dst = reinterpret_cast<uint4*>(out);
  dst[lane] = make_uint4(0, 0, 0, 0);
  dst[lane + 32] = make_uint4(0, 0, 0, 0);
}

// The gathers' loop: one warp per output row, grid-stride, two rows per
// iteration with both rows' loads issued before either store. row_entry(row)
// is called once per row; it does the row's side outputs (errors, positions,
// flags) and returns the entry to decode, or -1 for a zero row.
template <typename RowEntry>
__device__ __forceinline__ void GatherRows(const EntryPool& pool, uint16_t* out_kv, int64_t rows,
                                           RowEntry row_entry) {
  const int64_t wpb = blockDim.x >> 5;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * wpb;
  for (int64_t r0 = static_cast<int64_t>(blockIdx.x) * wpb + (threadIdx.x >> 5); r0 < rows;
       r0 += 2 * warps) {
    const int64_t r1 = r0 + warps;
    const int64_t e0 = row_entry(r0);
    const int64_t e1 = r1 < rows ? row_entry(r1) : -1;
    EntryRegs x0, x1;
    if (e0 >= 0) x0 = WarpLoadEntry(pool, e0);
    if (e1 >= 0) x1 = WarpLoadEntry(pool, e1);
    if (e0 >= 0) WarpStoreEntry(pool.fmt, x0, out_kv + r0 * kHeadDim);
    else WarpZeroRow(out_kv + r0 * kHeadDim);
    if (r1 < rows) {
      if (e1 >= 0) WarpStoreEntry(pool.fmt, x1, out_kv + r1 * kHeadDim);
      else WarpZeroRow(out_kv + r1 * kHeadDim);
    }
  }
}

inline ffi::Error LaunchStatus(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + " launch: " + cudaGetErrorString(err));
}

}  // namespace cuda
}  // namespace dsv4

namespace dsv4 {
namespace cuda {

// LayerOk for a kernel whose blocks take several roles: `counts` names the
// block (its thread 0) that counts a bad layer for this role.
__device__ __forceinline__ bool LayerOkCountedBy(bool counts, const int32_t* layer, int64_t L,
                                                 int32_t* errors, int64_t* l_out) {
  const int64_t l = __ldg(layer);
  if (l < 0 || l >= L) {
    if (counts && threadIdx.x == 0) atomicAdd(&errors[kBadLayer], 1);
    return false;
  }
  *l_out = l;
  return true;
}

// The status of a launch: its own error, else any error it left behind.
inline ffi::Error LaunchResult(cudaError_t err, const char* what) {
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + " launch: " + cudaGetErrorString(err));
}

}  // namespace cuda
}  // namespace dsv4
