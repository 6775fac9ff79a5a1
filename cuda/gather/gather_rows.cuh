// The gathers' loop over output rows: a warp a row, grid-stride, two rows'
// loads in flight before either store.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/entry_warp.cuh"

namespace dsv4 {
namespace cuda {

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

}  // namespace cuda
}  // namespace dsv4
