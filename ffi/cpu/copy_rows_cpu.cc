// CPU handlers of take_rows / put_rows (segment table in copy_rows.h, rules
// in dsv4_jax/ops/copy_rows.py): one memcpy per (leaf, outer index, id).
#include <cstring>

#include "cpu/handlers_cpu.h"
#include "dsv4/copy_rows.h"

namespace dsv4 {
namespace {

void CopyRowsHost(const CopyRowsArgs& a, bool to_flat) {
  for (int k = 0; k < a.num_segments; ++k) {
    const RowSegment& s = a.seg[k];
    const size_t bytes = static_cast<size_t>(s.row_bytes);
    for (int64_t o = 0; o < s.outer; ++o) {
      for (int64_t j = 0; j < s.n; ++j) {
        const int64_t id = s.ids[j];
        char* flat = s.flat + (o * s.n + j) * s.row_bytes;
        const bool ok = id >= 0 && id < s.rows;
        char* row = ok ? s.state + (o * s.rows + id) * s.row_bytes : nullptr;
        if (to_flat) {
          if (ok) std::memcpy(flat, row, bytes); else std::memset(flat, 0, bytes);
        } else if (ok) {
          std::memcpy(row, flat, bytes);
        }
      }
    }
  }
}

// kToFlat: take (leaves -> flat rows); else put (flat rows -> the aliased leaves).
template <bool kToFlat>
ffi::Error CopyRowsImpl(DSV4_PARAMS(DSV4_COPY_ROWS_OPERANDS)) {
  CopyRowsArgs a;
  DSV4_RETURN_IF_ERROR(ValidateCopyRows(kToFlat, DSV4_NAMES(DSV4_COPY_ROWS_OPERANDS), &a));
  CopyRowsHost(a, kToFlat);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TakeRowsCpu, CopyRowsImpl<true>, DSV4_BIND(DSV4_COPY_ROWS_OPERANDS, ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PutRowsCpu, CopyRowsImpl<false>, DSV4_BIND(DSV4_COPY_ROWS_OPERANDS, ffi::Ffi::Bind()));

}  // namespace dsv4
