// append: the step's tokens into the sliding window of one layer.
// Operands and per-token rules: dsv4_jax/ops/append.py (target "dsv4_append").
//   attrs kv_format, max_context
//   args  layer s32[], meta s32[>= 2T] (token_slot, then token_pos: the step's
//         packed metadata whole), kv bf16[T,512],
//         swa.pos s32[L,R,128], errors s32[9] (54 with detail), entry leaves [L,R,128,...]
//   rets  swa.pos, errors, entry leaves (aliased, same order)
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "dsv4/entry_checks.h"
#include "dsv4/ffi_checks.h"
#include "dsv4/layout.h"

namespace dsv4 {

struct AppendArgs {
  int64_t T = 0, L = 0, R = 0, max_context = 0;
  const int32_t* layer = nullptr;  // device scalar on CUDA
  const int32_t* slot = nullptr;
  const int32_t* pos = nullptr;
  const uint16_t* kv = nullptr;    // bf16 bits [T, 512]
  int32_t* swa_pos = nullptr;      // [L, R, 128]
  ErrorCounts errors;
  EntryPool pool;                  // [L, R, 128] entries
};

template <typename Binding>
auto BindAppend(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("kv_format")
      .template Attr<int64_t>("max_context")
      .template Arg<ffi::AnyBuffer>()  // layer
      .template Arg<ffi::AnyBuffer>()  // meta (token_slot, token_pos)
      .template Arg<ffi::AnyBuffer>()  // kv
      .template Arg<ffi::AnyBuffer>()  // swa.pos
      .template Arg<ffi::AnyBuffer>()  // errors
      .RemainingArgs()                 // entry leaves
      .template Ret<ffi::AnyBuffer>()  // swa.pos
      .template Ret<ffi::AnyBuffer>()  // errors
      .RemainingRets();                // entry leaves
}

// `num_entry_args`: how many entry leaves came as inputs; `leaves`: the
// entry results (aliased to them), which the handler writes.
inline ffi::Error ValidateAppend(int64_t kv_format, int64_t max_context, ffi::AnyBuffer layer,
                                 ffi::AnyBuffer meta, ffi::AnyBuffer kv, ffi::AnyBuffer swa_pos_in,
                                 ffi::AnyBuffer errors_in, size_t num_entry_args,
                                 ffi::AnyBuffer swa_pos, ffi::AnyBuffer errors,
                                 const std::vector<ffi::AnyBuffer>& leaves, AppendArgs* out) {
  AppendArgs a;
  DSV4_RETURN_IF_ERROR(CheckKvFormat(kv_format));
  DSV4_RETURN_IF_ERROR(CheckMaxContext(max_context));
  DSV4_RETURN_IF_ERROR(CheckScalarS32("layer", layer));
  DSV4_RETURN_IF_ERROR(CheckBuffer("kv", kv, ffi::DataType::BF16, {-1, kHeadDim}));
  a.T = kv.dimensions()[0];
  DSV4_RETURN_IF_ERROR(BindTokenRows(meta, a.T, &a.slot, &a.pos));
  DSV4_RETURN_IF_ERROR(CheckBuffer("swa.pos", swa_pos_in, ffi::DataType::S32, {-1, -1, kWindow}));
  a.L = swa_pos_in.dimensions()[0];
  a.R = swa_pos_in.dimensions()[1];
  DSV4_RETURN_IF_ERROR(CheckBuffer("swa.pos (result)", swa_pos, ffi::DataType::S32, {a.L, a.R, kWindow}));
  DSV4_RETURN_IF_ERROR(BindErrors(errors_in, errors, &a.errors));
  if (num_entry_args != leaves.size())
    return ffi::Error::InvalidArgument("swa.kv: " + std::to_string(num_entry_args) +
                                       " entry inputs but " + std::to_string(leaves.size()) +
                                       " entry results");
  std::vector<int64_t> lead = {a.L, a.R, kWindow};
  DSV4_RETURN_IF_ERROR(BindEntryLeaves("swa.kv", kv_format, leaves, &lead, &a.pool));
  a.max_context = max_context;
  a.layer = static_cast<const int32_t*>(layer.untyped_data());
  a.kv = static_cast<const uint16_t*>(kv.untyped_data());
  a.swa_pos = static_cast<int32_t*>(swa_pos.untyped_data());
  *out = a;
  return ffi::Error::Success();
}

// The same, for append's own handlers (entry leaves as remaining operands).
inline ffi::Error ValidateAppend(int64_t kv_format, int64_t max_context, ffi::AnyBuffer layer,
                                 ffi::AnyBuffer meta, ffi::AnyBuffer kv, ffi::AnyBuffer swa_pos_in,
                                 ffi::AnyBuffer errors_in, const ffi::RemainingArgs& entry_args,
                                 ffi::AnyBuffer swa_pos, ffi::AnyBuffer errors,
                                 const ffi::RemainingRets& entry_rets, AppendArgs* out) {
  std::vector<ffi::AnyBuffer> leaves;
  DSV4_RETURN_IF_ERROR(CollectLeaves(entry_rets, &leaves));
  return ValidateAppend(kv_format, max_context, layer, meta, kv, swa_pos_in,
                        errors_in, entry_args.size(), swa_pos, errors, leaves, out);
}

}  // namespace dsv4
