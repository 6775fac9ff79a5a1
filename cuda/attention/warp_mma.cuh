// Warp-level tensor-core MMA (ldmatrix + mma.sync m16n8k16, bf16 in, fp32
// accumulators): the attention kernel's two products on devices without
// Hopper's wgmma (Blackwell runs mma.sync; so does the H100, where the tests
// cover this path). It reads the same 128-byte-swizzled slabs as wgmma
// (wgmma::ChunkOffset), and a warp's accumulators come out in the layout of
// its part of wgmma's m64nN fragment, so the kernel's softmax and finish
// serve both: element 4j + 2i + b of warp w, lane L is row 16w + L/4 + 8i,
// column 8j + 2(L % 4) + b.
#pragma once

#include <cstdint>

#include "attention/wgmma.cuh"
#include "common/cp_async.cuh"

namespace dsv4 {
namespace cuda {
namespace warp_mma {

// Four 8 x 8 bf16 matrices, lane L giving the row address of matrix L / 8;
// register k holds matrix k, lane L its row L / 4, columns 2 (L % 4) + {0, 1}
// (transposed: its column L / 4, rows 2 (L % 4) + {0, 1}). The memory
// clobber keeps the loads after the barriers that publish the tile.
__device__ __forceinline__ void LoadMatrices(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void LoadMatricesTransposed(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// d[16 x 8] += a[16 x 16] . b[16 x 8] (a row-major, b column-major fragments).
__device__ __forceinline__ void Mma(float* d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment of rows 16w..16w+15, channels 16k..16k+15 of a K-major
// tile (rows along M): matrices (rows 0-7 | 8-15) x (chunk 2k | 2k + 1).
__device__ __forceinline__ void LoadA(uint32_t (&a)[4], const uint8_t* tile, int w, int k) {
  const int lane = threadIdx.x & 31;
  LoadMatrices(a, SharedAddress(tile + wgmma::ChunkOffset(16 * w + (lane & 15),
                                                          2 * k + (lane >> 4))));
}

// S[16 x 32] = Q . K^T for warp w's heads 16w..16w+15 over rows 0..31 of
// `rows` (K-major: a row's 512 channels along K), `q` K-major too.
__device__ __forceinline__ void Scores(float (&d)[16], const uint8_t* q, const uint8_t* rows,
                                       int w) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < 16; ++i) d[i] = 0.f;
#pragma unroll 8
  for (int k = 0; k < 32; ++k) {
    uint32_t a[4];
    LoadA(a, q, w, k);
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      // B of row tiles 2jj, 2jj + 1: matrices (tile 2jj | 2jj + 1) x (chunk 2k | 2k + 1)
      uint32_t b[4];
      const int m = lane >> 3;
      LoadMatrices(b, SharedAddress(rows + wgmma::ChunkOffset(16 * jj + 8 * (m >> 1) + (lane & 7),
                                                              2 * k + (m & 1))));
      Mma(d + 8 * jj, a, b[0], b[1]);
      Mma(d + 8 * jj + 4, a, b[2], b[3]);
    }
  }
}

// O[16 x 256] += P . V for warp w's heads: P (heads x 64 tile rows, K-major,
// one slab), V the tile's rows (K = tile rows, N = channels 256c..256c+255,
// read transposed).
__device__ __forceinline__ void AccumulatePV(float (&o)[128], const uint8_t* p,
                                             const uint8_t* tile, int c, int w) {
  const int lane = threadIdx.x & 31, m = lane >> 3;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t a[4];
    LoadA(a, p, w, kk);
    const int row = 16 * kk + 8 * (m & 1) + (lane & 7);
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {
      // channel chunks 32c + 2jj, +1: matrices (rows +0-7 | +8-15) x (chunk | chunk + 1)
      uint32_t b[4];
      LoadMatricesTransposed(b, SharedAddress(tile + wgmma::ChunkOffset(row, 32 * c + 2 * jj +
                                                                             (m >> 1))));
      Mma(o + 8 * jj, a, b[0], b[1]);
      Mma(o + 8 * jj + 4, a, b[2], b[3]);
    }
  }
}

// The attention kernel's two products of a consumer warpgroup on mma.sync
// (warp w of the group: heads 16w .. 16w + 15), the interface of
// wgmma::Products. Synchronous, and ldmatrix reads shared memory as every
// other load does, so the fences have nothing to do.
struct Products {
  __device__ static void Scores(float (&d)[16], const uint8_t* q, const uint8_t* rows, int w) {
    warp_mma::Scores(d, q, rows, w);
  }
  __device__ static void IssuePV(float (&o)[128], const uint8_t* p, const uint8_t* tile, int c,
                                 int w) {
    AccumulatePV(o, p, tile, c, w);
  }
  __device__ static void WaitPV() {}
  __device__ static void FenceShared() {}
};

}  // namespace warp_mma
}  // namespace cuda
}  // namespace dsv4
