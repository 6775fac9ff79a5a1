// Shape and dtype checks shared by the CPU and CUDA handlers: each returns an
// ffi::Error naming the operand, the expected and the received value.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "dsv4/error_counts.h"
#include "dsv4/layout.h"
#include "xla/ffi/api/ffi.h"

namespace dsv4 {

namespace ffi = xla::ffi;

#define DSV4_RETURN_IF_ERROR(expr)        \
  do {                                    \
    ::xla::ffi::Error _err = (expr);      \
    if (_err.failure()) return _err;      \
  } while (0)

inline std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << "]";
  return out.str();
}

// An expected shape, "*" for an axis of any size.
inline std::string ExpectedToString(const std::vector<int64_t>& dims) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    out << (i ? ", " : "");
    if (dims[i] < 0) out << "*"; else out << dims[i];
  }
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
                                     ExpectedToString(expected) + ", got " + DimsToString(dims));
}

inline std::string DataTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E8M0FNU: return "float8_e8m0fnu";
    default: return "dtype code " + std::to_string(static_cast<int>(t));
  }
}

inline ffi::Error CheckType(const char* name, ffi::DataType got, ffi::DataType want) {
  if (got == want) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + ": expected dtype " +
                                     DataTypeName(want) + ", got " + DataTypeName(got));
}

// Both dtype and shape of an untyped buffer.
inline ffi::Error CheckBuffer(const char* name, const ffi::AnyBuffer& b, ffi::DataType want,
                              std::vector<int64_t> expected) {
  ffi::Error e = CheckType(name, b.element_type(), want);
  if (e.failure()) return e;
  return CheckDims(name, b.dimensions(), std::move(expected));
}

// The write ops' token rows: `meta` is the step's packed metadata whole
// (StepMeta.data, dsv4_jax/meta.py), whose first T int32s are token_slot and
// the next T token_pos. The ops take it whole rather than the two fields:
// a slice handed to a custom call is a buffer of its own, which XLA fills
// with a copy before every call (two copy kernels a layer on the GPU).
inline ffi::Error BindTokenRows(const ffi::AnyBuffer& meta, int64_t T, const int32_t** slot,
                                const int32_t** pos) {
  ffi::Error e = CheckBuffer("meta", meta, ffi::DataType::S32, {-1});
  if (e.failure()) return e;
  if (meta.dimensions()[0] < 2 * T)
    return ffi::Error::InvalidArgument(
        "meta: expected at least 2 * T = " + std::to_string(2 * T) +
        " int32s (token_slot, then token_pos, of T = " + std::to_string(T) + " rows), got " +
        std::to_string(meta.dimensions()[0]));
  *slot = static_cast<const int32_t*>(meta.untyped_data());
  *pos = *slot + T;
  return ffi::Error::Success();
}

// The errors operand and its result: s32[kNumErrorKinds], or with error
// detail one shard's whole row (s32[kNumErrorKinds * (1 + kErrorDetailFields)],
// of which the handler writes the counters and first_row). `out` is what the
// handler counts into (the result, aliased to `in` when the state is kept).
constexpr int64_t kErrorsWithDetail = kNumErrorKinds * (1 + kErrorDetailFields);

inline ffi::Error CheckErrorsDims(const char* name, ffi::Span<const int64_t> dims) {
  if (dims.size() == 1 && (dims[0] == kNumErrorKinds || dims[0] == kErrorsWithDetail))
    return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + ": expected shape [" +
                                     std::to_string(kNumErrorKinds) + "] or, with error " +
                                     "detail, [" + std::to_string(kErrorsWithDetail) +
                                     "], got " + DimsToString(dims));
}

// The counters at `data` of a checked errors operand of `size` words.
inline ErrorCounts ErrorCountsAt(int32_t* data, int64_t size) {
  return {data, size == kErrorsWithDetail ? data + kNumErrorKinds : nullptr};
}

inline ffi::Error BindErrors(const ffi::AnyBuffer& in, const ffi::AnyBuffer& out,
                             ErrorCounts* e) {
  for (const auto* b : {&in, &out}) {
    const char* name = b == &in ? "errors" : "errors (result)";
    DSV4_RETURN_IF_ERROR(CheckType(name, b->element_type(), ffi::DataType::S32));
    DSV4_RETURN_IF_ERROR(CheckErrorsDims(name, b->dimensions()));
  }
  if (in.dimensions()[0] != out.dimensions()[0])
    return ffi::Error::InvalidArgument("errors (result): expected the shape of errors " +
                                       DimsToString(in.dimensions()) + ", got " +
                                       DimsToString(out.dimensions()));
  *e = ErrorCountsAt(static_cast<int32_t*>(out.untyped_data()), out.dimensions()[0]);
  return ffi::Error::Success();
}

// CPU handlers: the layer operand (-1 or out of range = a bad traced layer)
// counts BAD_LAYER once and the call then changes nothing else.
inline bool HostLayerOk(const int32_t* layer, int64_t num_layers, const ErrorCounts& errors,
                        int64_t* l) {
  *l = *layer;
  if (*l >= 0 && *l < num_layers) return true;
  CountError(errors, kBadLayer, kNoRow);
  return false;
}


}  // namespace dsv4
