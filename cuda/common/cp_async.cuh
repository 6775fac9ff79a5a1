// cp.async (sm_80 and later): 16-byte copies from global to shared
// memory that a thread issues now and waits for later, by commit group. The
// attention kernel stages its raw rows and q with them, indexer_topk its key
// tiles.
#pragma once

#include <cstdint>

namespace dsv4 {
namespace cuda {

// A shared-memory pointer as the 32-bit shared-window address that cp.async,
// ldmatrix and wgmma's descriptors take.
__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared (both 16-byte aligned).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SharedAddress(smem)),
               "l"(gmem) : "memory");
}

// The same to a shared address, under an L2 eviction policy (createpolicy).
__device__ __forceinline__ void CpAsync16(uint32_t smem, const void* gmem, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(smem),
               "l"(gmem), "l"(policy) : "memory");
}

// Closes this thread's group of copies issued since the last commit.
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits for this thread's copy groups but the newest `kPending`.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace cuda
}  // namespace dsv4
