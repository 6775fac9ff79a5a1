// Shape and dtype checks shared by the CPU and CUDA handlers: each returns an
// ffi::Error naming the operand, the expected and the received value.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace dsv4 {

namespace ffi = xla::ffi;

inline std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << "]";
  return out.str();
}

// `expected` may hold -1 for "any size" along that axis.
inline ffi::Error CheckDims(const char* name, ffi::Span<const int64_t> dims,
                            std::vector<int64_t> expected) {
  bool ok = dims.size() == expected.size();
  for (size_t i = 0; ok && i < dims.size(); ++i)
    ok = expected[i] < 0 || expected[i] == dims[i];
  if (ok) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + ": expected shape " +
                                     DimsToString(expected) + ", got " + DimsToString(dims));
}

inline ffi::Error CheckType(const char* name, ffi::DataType got, ffi::DataType want) {
  if (got == want) return ffi::Error::Success();
  std::ostringstream out;
  out << name << ": expected dtype code " << static_cast<int>(want) << ", got "
      << static_cast<int>(got);
  return ffi::Error::InvalidArgument(out.str());
}

#define DSV4_RETURN_IF_ERROR(expr)        \
  do {                                    \
    ::xla::ffi::Error _err = (expr);      \
    if (_err.failure()) return _err;      \
  } while (0)

}  // namespace dsv4
