// How the CUDA handlers launch their kernels: the device's properties read
// once per device (grid sizes come from them, never from constants), the
// dynamic shared-memory opt-in, clusters the device holds at once, the
// overlapped (programmatic dependent) launch and its two device-side calls,
// and a launch's status as an FFI error.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "dsv4/ffi_checks.h"

namespace dsv4 {
namespace cuda {

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

// Sets attribute `kAttr` of kernel `kKernel` to `value`. Attributes of a
// kernel are per device, so each is set once per device (a process that
// drives several GPUs launches on each), not at every launch: the call is
// host time on every launch path. Each instantiation sets one value.
template <auto kKernel, cudaFuncAttribute kAttr>
cudaError_t SetKernelAttributeOnce(int value) {
  static std::atomic<bool> done[64];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const bool cached = dev >= 0 && dev < 64;
  if (cached && done[dev].load(std::memory_order_acquire)) return cudaSuccess;
  e = cudaFuncSetAttribute(kKernel, kAttr, value);
  if (e == cudaSuccess && cached) done[dev].store(true, std::memory_order_release);
  return e;
}

// Lets kernel `kKernel` take up to `bytes` of dynamic shared memory (past
// the default 48 KB).
template <auto kKernel>
cudaError_t AllowDynamicShared(int bytes) {
  return SetKernelAttributeOnce<kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize>(bytes);
}

// Lets kernel `kKernel` run in clusters past the portable 8 blocks.
template <auto kKernel>
cudaError_t AllowLargeClusters() {
  return SetKernelAttributeOnce<kKernel, cudaFuncAttributeNonPortableClusterSizeAllowed>(1);
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

// Blocks of `kKernel` (`threads` threads, no dynamic shared memory) a
// multiprocessor of the current device holds at once, asked once per device;
// 1 where the query fails.
template <auto kKernel>
int BlocksPerSm(int threads) {
  static std::atomic<int> cached[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 1;
  int n = cached[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, threads, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      n = 1;
    }
    n = n < 1 ? 1 : n;
    cached[dev].store(n, std::memory_order_relaxed);
  }
  return n;
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


inline ffi::Error LaunchStatus(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + " launch: " + cudaGetErrorString(err));
}


// The status of a launch: its own error, else any error it left behind.
inline ffi::Error LaunchResult(cudaError_t err, const char* what) {
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + " launch: " + cudaGetErrorString(err));
}

}  // namespace cuda
}  // namespace dsv4
