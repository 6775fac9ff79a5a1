// Hopper warpgroup MMA (wgmma, sm_90a) as the attention kernel uses it:
// shared-memory matrix descriptors for 128-byte-swizzled bf16 tiles, and the
// two shapes it issues (S = Q.K^T, 64 x 32, and O += P.V, 64 x 256, every
// operand in shared memory, V read N-major). Only sm_90a has these
// instructions: elsewhere the wrappers compile to a trap and the host never
// launches a kernel that calls them (cuda::ComputeMajor() != 9).
//
// Tile layout every operand here uses ("slabs"): a [rows x 512] bf16 matrix is
// 8 slabs of 64 channels; slab k holds rows r at byte r * 128, its 16-byte
// chunk c at ((c ^ (r % 8)) * 16): the 128-byte swizzle, 1024-byte aligned.
#pragma once

#include <cstdint>

#include "common/cp_async.cuh"

namespace dsv4 {
namespace cuda {
namespace wgmma {

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DSV4_HAS_WGMMA 1
#else
#define DSV4_HAS_WGMMA 0
#endif

constexpr int kSlabRows = 64;                       // rows of a tile
constexpr int kSlabBytes = kSlabRows * 128;         // one 64-channel slab

// Byte offset of chunk `c` (0..63, 8 channels each) of row `r` in a tile.
__host__ __device__ constexpr uint32_t ChunkOffset(int r, int c) {
  return static_cast<uint32_t>((c >> 3) * kSlabBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// A shared-memory matrix descriptor: start address, leading and stride byte
// offsets (all >> 4), 128-byte swizzle (mode 1 in bits 62-63).
__device__ __forceinline__ uint64_t Descriptor(const void* smem, uint32_t lead, uint32_t stride) {
  const uint32_t addr = SharedAddress(smem);
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lead >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((stride >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// K-major operand (rows along M or N, the 512 channels along K): the 16
// channels of k-step `k` (0..31) of a tile; 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t KMajor(const uint8_t* tile, int k) {
  return Descriptor(tile + (k >> 2) * kSlabBytes + (k & 3) * 32, 16, 1024);
}

// N-major B operand (K = the tile's rows, N = channels): rows 16k..16k+15,
// channels from slab `slab` on (64 per slab, slabs kSlabBytes apart).
__device__ __forceinline__ uint64_t NMajor(const uint8_t* tile, int slab, int k) {
  return Descriptor(tile + slab * kSlabBytes + k * 16 * 128, kSlabBytes, 1024);
}

__device__ __forceinline__ void Fence() {
#if DSV4_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void Commit() {
#if DSV4_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void WaitAll() {
#if DSV4_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}

// Makes this thread's generic-proxy writes to shared memory visible to wgmma
// (the async proxy) before the barrier that hands the tile over.
__device__ __forceinline__ void FenceSharedForAsync() {
#if DSV4_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// d[64 x 32] (+)= A[64 x 16] . B[16 x 32]^T, both K-major in shared memory
// d is the m64nNk16 fragment: d[4j + 2i + b] = row 16 * warp + lane / 4 + 8 i,
// column 8 j + 2 (lane % 4) + b (j = 0..3): S of one consumer's half tile.
__device__ __forceinline__ void MmaSS32(float (&d)[16], uint64_t a, uint64_t b, bool accumulate) {
#if DSV4_HAS_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)));
#else
  __trap();
#endif
}

// d[64 x 256] += A[64 x 16] . B[16 x 256]: A K-major in shared memory (P,
// written by both consumers), B N-major in shared memory (V).
__device__ __forceinline__ void MmaSS256(float (&d)[128], uint64_t a, uint64_t b) {
#if DSV4_HAS_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11,"
      "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23,"
      "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35,"
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59,"
      "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71,"
      "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83,"
      "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107,"
      "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119,"
      "%120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
        "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
        "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
        "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),
        "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
        "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]),
        "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]),
        "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]),
        "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),
        "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
        "+f"(d[126]), "+f"(d[127])
      : "l"(a), "l"(b), "r"(1));
#else
  __trap();
#endif
}

// The attention kernel's two products of a consumer warpgroup (see
// warp_mma::Products for the same on mma.sync): S of its half tile, then
// O += P.V issued asynchronously and waited for before the next tile.
struct Products {
  // S[64 x 32] = Q . K^T, `rows` the half tile's first row (K-major)
  __device__ static void Scores(float (&d)[16], const uint8_t* q, const uint8_t* rows, int) {
    Fence();
#pragma unroll
    for (int k = 0; k < 32; ++k) MmaSS32(d, KMajor(q, k), KMajor(rows, k), k > 0);
    Commit();
    WaitAll();
  }
  // O[64 x 256] += P . V over output channels 256c .. 256c + 255
  __device__ static void IssuePV(float (&o)[128], const uint8_t* p, const uint8_t* tile, int c,
                                 int) {
    Fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) MmaSS256(o, KMajor(p, kk), NMajor(tile, 4 * c, kk));
    Commit();
  }
  __device__ static void WaitPV() { WaitAll(); }
  // shared-memory writes the products read next (the async proxy's view)
  __device__ static void FenceShared() { FenceSharedForAsync(); }
};

}  // namespace wgmma
}  // namespace cuda
}  // namespace dsv4
