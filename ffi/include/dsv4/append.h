// append: the step's tokens into the sliding window of one layer.
// Operands: DSV4_APPEND_OPERANDS below (dsv4/operands.h); what each holds and
// the per-token rules: dsv4_jax/ops/append.py (target "dsv4_append").
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "dsv4/attrs.h"
#include "dsv4/entry_checks.h"
#include "dsv4/ffi_checks.h"
#include "dsv4/layout.h"
#include "dsv4/operands.h"

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

// The handlers' operands (dsv4/operands.h).
#define DSV4_APPEND_OPERANDS(ATTR, ATTRS, ARG, ARGS, RET, RETS)                             \
  ATTRS(WriteAttrs, DSV4_WRITE_ATTRS) ARG(ffi::AnyBuffer, layer) ARG(ffi::AnyBuffer, meta)  \
  ARG(ffi::AnyBuffer, kv) ARG(ffi::AnyBuffer, swa_pos_in) ARG(ffi::AnyBuffer, errors_in)    \
  ARGS(swa_kv_in) RET(ffi::AnyBuffer, swa_pos) RET(ffi::AnyBuffer, errors) RETS(swa_kv)

// `num_entry_args`: how many entry leaves came as inputs; `leaves`: the
// entry results (aliased to them), which the handler writes.
inline ffi::Error ValidateAppend(const WriteAttrs& attrs, ffi::AnyBuffer layer,
                                 ffi::AnyBuffer meta, ffi::AnyBuffer kv, ffi::AnyBuffer swa_pos_in,
                                 ffi::AnyBuffer errors_in, size_t num_entry_args,
                                 ffi::AnyBuffer swa_pos, ffi::AnyBuffer errors,
                                 const std::vector<ffi::AnyBuffer>& leaves, AppendArgs* out) {
  AppendArgs a;
  DSV4_RETURN_IF_ERROR(CheckWriteAttrs(attrs));
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
  DSV4_RETURN_IF_ERROR(BindEntryLeaves("swa.kv", attrs.kv_format, leaves, &lead, &a.pool));
  a.max_context = attrs.max_context;
  a.layer = static_cast<const int32_t*>(layer.untyped_data());
  a.kv = static_cast<const uint16_t*>(kv.untyped_data());
  a.swa_pos = static_cast<int32_t*>(swa_pos.untyped_data());
  *out = a;
  return ffi::Error::Success();
}

// The same, for append's own handlers.
inline ffi::Error ValidateAppend(DSV4_PARAMS(DSV4_APPEND_OPERANDS), AppendArgs* out) {
  std::vector<ffi::AnyBuffer> leaves;
  DSV4_RETURN_IF_ERROR(CollectLeaves(swa_kv, &leaves));
  return ValidateAppend(attrs, layer, meta, kv, swa_pos_in, errors_in, swa_kv_in.size(),
                        *swa_pos, *errors, leaves, out);
}

}  // namespace dsv4
