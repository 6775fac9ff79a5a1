// dsv4_take_rows / dsv4_put_rows: the rows `ids` of several state leaves at
// once, copied as bytes (operands and rules in dsv4_jax/ops/copy_rows.py).
// A leaf of shape [A..., rows, B...] (row axis given by the attribute
// row_axes) is seen as [outer, rows, row_bytes]; its flat counterpart is
// [outer, n, row_bytes]. The CPU handler and the CUDA kernel share the
// segment table built here, one segment per leaf.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dsv4/ffi_checks.h"

namespace dsv4 {

// Leaves of one call: the snapshot / restore of a slot moves 8 (window
// entries and positions, three accumulators, the block-table row), a block
// move 8 (CSA entries and indexer keys, HCA entries). Passed by value to the
// kernel, so the table has a fixed size.
constexpr int kMaxRowSegments = 16;

struct RowSegment {
  char* state = nullptr;   // the leaf: [outer, rows, row_bytes]
  char* flat = nullptr;    // its rows: [outer, n, row_bytes]
  int64_t outer = 0;       // product of the axes before the row axis
  int64_t rows = 0;        // the row axis' size: ids outside [0, rows) are skipped
  int64_t row_bytes = 0;   // bytes after the row axis
  int vec_shift = 0;       // log2 of the widest copy (<= 16 bytes) that divides
                           // row_bytes and both addresses
};

struct CopyRowsArgs {
  RowSegment seg[kMaxRowSegments];
  int num_segments = 0;
  const int32_t* ids = nullptr;
  int64_t n = 0;
};

inline int VecShift(int64_t row_bytes, const void* a, const void* b) {
  int shift = 4;
  const uint64_t bits = static_cast<uint64_t>(row_bytes) | reinterpret_cast<uintptr_t>(a) |
                        reinterpret_cast<uintptr_t>(b);
  while (shift > 0 && (bits & ((uint64_t{1} << shift) - 1))) --shift;
  return shift;
}

// take: args ids s32[n], leaves...; rets flat leaves...
// put:  args ids s32[n], leaves..., flat leaves...; rets leaves... (aliased)
template <typename Binding>
auto BindCopyRows(Binding binding) {
  return std::move(binding)
      .template Attr<ffi::Span<const int64_t>>("row_axes")
      .template Arg<ffi::AnyBuffer>()  // ids
      .RemainingArgs()                 // leaves (put: then their flat rows)
      .RemainingRets();                // flat rows (take) or the leaves (put)
}

// Checks one (leaf, flat) pair and fills its segment.
inline ffi::Error BindRowSegment(int k, int64_t axis, int64_t n, const ffi::AnyBuffer& leaf,
                                 const ffi::AnyBuffer& flat, RowSegment* s) {
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
  std::vector<int64_t> want(dims.begin(), dims.end());
  want[axis] = n;
  DSV4_RETURN_IF_ERROR(CheckDims((name + " rows").c_str(), fdims, want));
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < axis; ++i) outer *= dims[i];
  for (int64_t i = axis + 1; i < static_cast<int64_t>(dims.size()); ++i) inner *= dims[i];
  s->state = static_cast<char*>(leaf.untyped_data());
  s->flat = static_cast<char*>(flat.untyped_data());
  s->outer = outer;
  s->rows = dims[axis];
  s->row_bytes = inner * static_cast<int64_t>(ffi::ByteWidth(leaf.element_type()));
  s->vec_shift = VecShift(s->row_bytes, s->state, s->flat);
  return ffi::Error::Success();
}

// `to_flat`: take (state -> flat); else put (flat -> the aliased leaves).
inline ffi::Error ValidateCopyRows(bool to_flat, ffi::Span<const int64_t> row_axes,
                                   const ffi::AnyBuffer& ids, const ffi::RemainingArgs& args,
                                   const ffi::RemainingRets& rets, CopyRowsArgs* out) {
  CopyRowsArgs a;
  DSV4_RETURN_IF_ERROR(CheckBuffer("ids", ids, ffi::DataType::S32, {-1}));
  a.ids = static_cast<const int32_t*>(ids.untyped_data());
  a.n = ids.dimensions()[0];
  const int64_t k = static_cast<int64_t>(rets.size());
  const int64_t want_args = to_flat ? k : 2 * k;
  if (static_cast<int64_t>(args.size()) != want_args ||
      static_cast<int64_t>(row_axes.size()) != k)
    return ffi::Error::InvalidArgument(
        "copy_rows: " + std::to_string(k) + " results need " + std::to_string(want_args) +
        " leaf operands and " + std::to_string(k) + " row axes, got " +
        std::to_string(args.size()) + " and " + std::to_string(row_axes.size()));
  if (k > kMaxRowSegments)
    return ffi::Error::InvalidArgument("copy_rows: at most " + std::to_string(kMaxRowSegments) +
                                       " leaves a call, got " + std::to_string(k));
  for (int64_t i = 0; i < k; ++i) {
    auto ret = rets.get<ffi::AnyBuffer>(i);
    if (ret.has_error()) return ret.error();
    if (to_flat) {
      auto leaf = args.get<ffi::AnyBuffer>(i);
      if (leaf.has_error()) return leaf.error();
      DSV4_RETURN_IF_ERROR(BindRowSegment(static_cast<int>(i), row_axes[i], a.n, *leaf,
                                          **ret, &a.seg[i]));
    } else {
      auto leaf = args.get<ffi::AnyBuffer>(i);
      auto flat = args.get<ffi::AnyBuffer>(k + i);
      if (leaf.has_error()) return leaf.error();
      if (flat.has_error()) return flat.error();
      auto dims = leaf->dimensions();
      DSV4_RETURN_IF_ERROR(CheckDims("leaf (result)", (*ret)->dimensions(),
                                     std::vector<int64_t>(dims.begin(), dims.end())));
      // The result aliases the leaf: write into it, read the flat rows.
      DSV4_RETURN_IF_ERROR(BindRowSegment(static_cast<int>(i), row_axes[i], a.n, **ret,
                                          *flat, &a.seg[i]));
    }
  }
  a.num_segments = static_cast<int>(k);
  *out = a;
  return ffi::Error::Success();
}

}  // namespace dsv4
