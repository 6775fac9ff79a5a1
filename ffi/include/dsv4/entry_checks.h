// Binding of the entry leaves (nope, rope[, scale]) that reach a handler as
// RemainingArgs / RemainingRets: count against kv_format, dtypes, shapes.
#pragma once

#include <string>
#include <vector>

#include "dsv4/entries.h"
#include "dsv4/ffi_checks.h"
#include "dsv4/layout.h"

namespace dsv4 {

inline ffi::Error CheckKvFormat(KvFormat fmt) {
  if (fmt == kDsFp8 || fmt == kFp8Token || fmt == kBf16) return ffi::Error::Success();
  return ffi::Error::InvalidArgument("kv_format: expected 0 (ds_fp8), 1 (fp8_token) or 2 (bf16), got " +
                                     std::to_string(fmt));
}

inline ffi::Error CheckMaxContext(int64_t max_context) {
  if (max_context > 0 && max_context % kBlockTokens == 0) return ffi::Error::Success();
  return ffi::Error::InvalidArgument("max_context: expected a positive multiple of " +
                                     std::to_string(kBlockTokens) + ", got " +
                                     std::to_string(max_context));
}

inline size_t EntryLeafCount(KvFormat fmt) { return fmt == kBf16 ? 2 : 3; }

inline ffi::Error CollectLeaves(const ffi::RemainingArgs& args, std::vector<ffi::AnyBuffer>* out) {
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    out->push_back(b.value());
  }
  return ffi::Error::Success();
}

inline ffi::Error CollectLeaves(const ffi::RemainingRets& rets, std::vector<ffi::AnyBuffer>* out) {
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    out->push_back(*b.value());
  }
  return ffi::Error::Success();
}

// `lead` are the expected leading dims (-1 = any); on success `lead` holds the
// actual ones and `pool` the base pointers.
inline ffi::Error BindEntryLeaves(const std::string& name, KvFormat fmt,
                                  const std::vector<ffi::AnyBuffer>& leaves,
                                  std::vector<int64_t>* lead, EntryPool* pool) {
  DSV4_RETURN_IF_ERROR(CheckKvFormat(fmt));
  size_t want = EntryLeafCount(fmt);
  if (leaves.size() != want)
    return ffi::Error::InvalidArgument(
        name + ": expected " + std::to_string(want) + " entry buffers (nope, rope" +
        (want == 3 ? ", scale" : "") + ") for kv_format " + std::to_string(fmt) + ", got " +
        std::to_string(leaves.size()));
  // Leading dims are read off nope, then every leaf must agree.
  auto nd = leaves[0].dimensions();
  if (nd.size() != lead->size() + 1)
    return ffi::Error::InvalidArgument(name + ".nope: expected rank " +
                                       std::to_string(lead->size() + 1) + ", got shape " +
                                       DimsToString(nd));
  std::vector<int64_t> dims(lead->size() + 1);
  for (size_t i = 0; i < lead->size(); ++i) {
    int64_t e = (*lead)[i];
    dims[i] = e < 0 ? nd[i] : e;
  }
  auto leaf = [&](size_t i, const char* what, ffi::DataType t, int64_t last) {
    dims.back() = last;
    return CheckBuffer((name + "." + what).c_str(), leaves[i], t, dims);
  };
  DSV4_RETURN_IF_ERROR(leaf(0, "nope", fmt == kBf16 ? ffi::DataType::BF16 : ffi::DataType::F8E4M3FN,
                            kNopeDim));
  DSV4_RETURN_IF_ERROR(leaf(1, "rope", ffi::DataType::BF16, kRopeDim));
  if (fmt == kDsFp8) DSV4_RETURN_IF_ERROR(leaf(2, "scale", ffi::DataType::F8E8M0FNU, kNopeTiles));
  if (fmt == kFp8Token) DSV4_RETURN_IF_ERROR(leaf(2, "scale", ffi::DataType::F32, 1));
  dims.pop_back();
  *lead = dims;
  pool->fmt = static_cast<int>(fmt);
  pool->nope = static_cast<uint8_t*>(leaves[0].untyped_data());
  pool->rope = static_cast<uint16_t*>(leaves[1].untyped_data());
  pool->scale = want == 3 ? static_cast<uint8_t*>(leaves[2].untyped_data()) : nullptr;
  return ffi::Error::Success();
}

// A scalar i32 operand (the layer).
inline ffi::Error CheckScalarS32(const char* name, const ffi::AnyBuffer& b) {
  return CheckBuffer(name, b, ffi::DataType::S32, {});
}

}  // namespace dsv4
