// dsv4_take_rows / dsv4_put_rows: rows of several state leaves at once,
// copied as bytes (operands and rules in dsv4_jax/ops/copy_rows.py).
// A leaf of shape [A..., rows, B...] (row axis given by the attribute
// row_axes) is seen as [outer, rows, row_bytes]; its flat counterpart is
// [outer, n, row_bytes], with the n ids at ids[id_starts[k] ...] (several
// leaves may read different spans of one ids array, so a request's slot and
// its blocks travel in one call). The CPU handler and the CUDA kernel share
// the segment table built here, one segment per leaf.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dsv4/ffi_checks.h"
#include "dsv4/operands.h"

namespace dsv4 {

// Leaves of one call. A whole request moves 16 in ds_fp8 (window entries,
// positions, three accumulators, the block-table row; CSA entries, indexer
// keys and HCA entries); the table is passed to the kernel by value, so it
// has a fixed size, with room to spare.
constexpr int kMaxRowSegments = 24;

struct RowSegment {
  char* state = nullptr;          // the leaf: [outer, rows, row_bytes]
  char* flat = nullptr;           // its rows: [outer, n, row_bytes], contiguous
  const int32_t* ids = nullptr;   // the segment's n ids
  int64_t outer = 0;              // product of the axes before the row axis
  int64_t rows = 0;               // the row axis' size: ids outside [0, rows) are skipped
  int64_t row_bytes = 0;          // bytes after the row axis
  int64_t n = 0;                  // rows copied
  int vec_shift = 0;              // log2 of the widest copy (<= 16 bytes) that divides
                                  // row_bytes and both base addresses
};

struct CopyRowsArgs {
  RowSegment seg[kMaxRowSegments];
  int num_segments = 0;
};

inline int VecShift(int64_t row_bytes, const void* a, const void* b) {
  int shift = 4;
  const uint64_t bits = static_cast<uint64_t>(row_bytes) | reinterpret_cast<uintptr_t>(a) |
                        reinterpret_cast<uintptr_t>(b);
  while (shift > 0 && (bits & ((uint64_t{1} << shift) - 1))) --shift;
  return shift;
}

// Vectors of one segment's flat rows (the kernel counts them in 32 bits).
inline int64_t SegmentVectors(const RowSegment& s) {
  return s.outer * s.n * (s.row_bytes >> s.vec_shift);
}

// The handlers' operands (dsv4/operands.h), one list for both targets: take's
// leaves are the leaves and its results their flat rows; put's leaves are the
// leaves then their flat rows, its results the leaves (aliased).
#define DSV4_COPY_ROWS_OPERANDS(ATTR, ATTRS, ARG, ARGS, RET, RETS)                          \
  ATTR(ffi::Span<const int64_t>, row_axes) ATTR(ffi::Span<const int64_t>, id_starts)        \
  ARG(ffi::AnyBuffer, ids) ARGS(leaves) RETS(results)

// The flat leaf's row count: its dims are the leaf's with the row axis of
// size n, or (n = 1) without the row axis. -1 if neither.
inline int64_t FlatRows(ffi::Span<const int64_t> dims, ffi::Span<const int64_t> fdims,
                        int64_t axis) {
  const size_t rank = dims.size();
  if (fdims.size() == rank) {
    for (size_t i = 0; i < rank; ++i)
      if (static_cast<int64_t>(i) != axis && fdims[i] != dims[i]) return -1;
    return fdims[axis];
  }
  if (fdims.size() + 1 != rank) return -1;
  for (size_t i = 0, f = 0; i < rank; ++i) {
    if (static_cast<int64_t>(i) == axis) continue;
    if (fdims[f++] != dims[i]) return -1;
  }
  return 1;
}

// Checks one (leaf, flat) pair against the ids and fills its segment.
inline ffi::Error BindRowSegment(int k, int64_t axis, int64_t id_start, const ffi::AnyBuffer& ids,
                                 const ffi::AnyBuffer& leaf, const ffi::AnyBuffer& flat,
                                 RowSegment* s) {
  const std::string name = "leaf " + std::to_string(k);
  auto dims = leaf.dimensions();
  auto fdims = flat.dimensions();
  if (axis < 0 || axis >= static_cast<int64_t>(dims.size()))
    return ffi::Error::InvalidArgument(name + ": row axis " + std::to_string(axis) +
                                       " outside its shape " + DimsToString(dims));
  if (leaf.element_type() != flat.element_type())
    return ffi::Error::InvalidArgument(name + ": rows of dtype " +
                                       DataTypeName(flat.element_type()) + ", leaf of " +
                                       DataTypeName(leaf.element_type()));
  const int64_t n = FlatRows(dims, fdims, axis);
  if (n < 0)
    return ffi::Error::InvalidArgument(name + ": rows of shape " + DimsToString(fdims) +
                                       " for a leaf of shape " + DimsToString(dims) +
                                       " and row axis " + std::to_string(axis));
  const int64_t num_ids = ids.dimensions()[0];
  if (id_start < 0 || id_start + n > num_ids)
    return ffi::Error::InvalidArgument(name + ": ids [" + std::to_string(id_start) + ", " +
                                       std::to_string(id_start + n) + ") outside the " +
                                       std::to_string(num_ids) + " ids");
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < axis; ++i) outer *= dims[i];
  for (int64_t i = axis + 1; i < static_cast<int64_t>(dims.size()); ++i) inner *= dims[i];
  s->state = static_cast<char*>(leaf.untyped_data());
  s->flat = static_cast<char*>(flat.untyped_data());
  s->ids = static_cast<const int32_t*>(ids.untyped_data()) + id_start;
  s->outer = outer;
  s->rows = dims[axis];
  s->n = n;
  s->row_bytes = inner * static_cast<int64_t>(ffi::ByteWidth(leaf.element_type()));
  s->vec_shift = VecShift(s->row_bytes, s->state, s->flat);
  if (SegmentVectors(*s) > int64_t{0xFFFFFFFF})
    return ffi::Error::InvalidArgument(name + ": " + std::to_string(outer * n * s->row_bytes) +
                                       " bytes of rows, more than 2^32 copies of " +
                                       std::to_string(1 << s->vec_shift) + " bytes in one call");
  return ffi::Error::Success();
}

// `to_flat`: take (state -> flat); else put (flat -> the aliased leaves).
inline ffi::Error ValidateCopyRows(bool to_flat, DSV4_PARAMS(DSV4_COPY_ROWS_OPERANDS),
                                   CopyRowsArgs* out) {
  CopyRowsArgs a;
  DSV4_RETURN_IF_ERROR(CheckBuffer("ids", ids, ffi::DataType::S32, {-1}));
  const int64_t k = static_cast<int64_t>(results.size());
  const int64_t want_args = to_flat ? k : 2 * k;
  if (static_cast<int64_t>(leaves.size()) != want_args ||
      static_cast<int64_t>(row_axes.size()) != k || static_cast<int64_t>(id_starts.size()) != k)
    return ffi::Error::InvalidArgument(
        "copy_rows: " + std::to_string(k) + " results need " + std::to_string(want_args) +
        " leaf operands, " + std::to_string(k) + " row axes and id starts, got " +
        std::to_string(leaves.size()) + ", " + std::to_string(row_axes.size()) + " and " +
        std::to_string(id_starts.size()));
  if (k > kMaxRowSegments)
    return ffi::Error::InvalidArgument("copy_rows: at most " + std::to_string(kMaxRowSegments) +
                                       " leaves a call, got " + std::to_string(k));
  for (int64_t i = 0; i < k; ++i) {
    auto ret = results.get<ffi::AnyBuffer>(i);
    if (ret.has_error()) return ret.error();
    auto leaf = leaves.get<ffi::AnyBuffer>(i);
    if (leaf.has_error()) return leaf.error();
    if (to_flat) {
      DSV4_RETURN_IF_ERROR(BindRowSegment(static_cast<int>(i), row_axes[i], id_starts[i], ids,
                                          *leaf, **ret, &a.seg[i]));
      continue;
    }
    auto flat = leaves.get<ffi::AnyBuffer>(k + i);
    if (flat.has_error()) return flat.error();
    auto dims = leaf->dimensions();
    if ((*ret)->element_type() != leaf->element_type())
      return ffi::Error::InvalidArgument("leaf " + std::to_string(i) +
                                         ": result of another dtype than the leaf");
    DSV4_RETURN_IF_ERROR(CheckDims("leaf (result)", (*ret)->dimensions(),
                                   std::vector<int64_t>(dims.begin(), dims.end())));
    // The result aliases the leaf: write into it, read the flat rows.
    DSV4_RETURN_IF_ERROR(BindRowSegment(static_cast<int>(i), row_axes[i], id_starts[i], ids,
                                        **ret, *flat, &a.seg[i]));
  }
  a.num_segments = static_cast<int>(k);
  *out = a;
  return ffi::Error::Success();
}

}  // namespace dsv4
