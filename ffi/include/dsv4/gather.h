// The three gathers: window, top-k (CSA) and all (HCA). Operands:
// DSV4_GATHER_<WINDOW|TOPK|ALL>_OPERANDS below (dsv4/operands.h); what each
// holds and the per-row rules: dsv4_jax/ops/gather.py. Each reads entry leaves
// (the remaining arguments, after `errors_in`) and writes dense bf16 rows;
// `errors_in` is aliased into the last result when the state is returned.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "dsv4/attrs.h"
#include "dsv4/entry_checks.h"
#include "dsv4/ffi_checks.h"
#include "dsv4/indexer.h"
#include "dsv4/layout.h"
#include "dsv4/operands.h"

namespace dsv4 {

// ---- dsv4_gather_window ---------------------------------------------------------
struct GatherWindowArgs {
  int64_t B = 0, L = 0, R = 0;
  const int32_t* layer = nullptr;
  const int32_t* slots = nullptr;
  const int32_t* swa_pos = nullptr;
  EntryPool pool;
  uint16_t* out_kv = nullptr;
  int32_t* out_pos = nullptr;
  ErrorCounts errors;
};

// The handlers' operands (dsv4/operands.h).
#define DSV4_GATHER_WINDOW_OPERANDS(ATTR, ATTRS, ARG, ARGS, RET, RETS)                      \
  ATTR(KvFormat, kv_format) ARG(ffi::AnyBuffer, layer) ARG(ffi::AnyBuffer, slots)           \
  ARG(ffi::AnyBuffer, swa_pos) ARG(ffi::AnyBuffer, errors_in) ARGS(swa_kv)                  \
  RET(ffi::AnyBuffer, kv) RET(ffi::AnyBuffer, pos) RET(ffi::AnyBuffer, errors)

// The operands the paged gathers (top-k, all) share: block_table s32[R, MB],
// errors in and out, and the pool's entry leaves [L, N, per_block, ...].
inline ffi::Error BindPagedPool(const char* pool_name, KvFormat kv_format, int64_t per_block,
                                const ffi::AnyBuffer& block_table, const ffi::AnyBuffer& errors_in,
                                const ffi::AnyBuffer& errors, const ffi::RemainingArgs& entry_args,
                                ErrorCounts* errors_out,
                                int64_t* R, int64_t* MB, int64_t* L, int64_t* N, EntryPool* pool) {
  DSV4_RETURN_IF_ERROR(CheckBuffer("block_table", block_table, ffi::DataType::S32, {-1, -1}));
  *R = block_table.dimensions()[0];
  *MB = block_table.dimensions()[1];
  DSV4_RETURN_IF_ERROR(BindErrors(errors_in, errors, errors_out));
  std::vector<ffi::AnyBuffer> leaves;
  DSV4_RETURN_IF_ERROR(CollectLeaves(entry_args, &leaves));
  std::vector<int64_t> lead = {-1, -1, per_block};
  DSV4_RETURN_IF_ERROR(BindEntryLeaves(pool_name, kv_format, leaves, &lead, pool));
  *L = lead[0];
  *N = lead[1];
  return ffi::Error::Success();
}

inline ffi::Error ValidateGatherWindow(DSV4_PARAMS(DSV4_GATHER_WINDOW_OPERANDS), GatherWindowArgs* out) {
  const ffi::AnyBuffer out_kv = *kv, out_pos = *pos;
  GatherWindowArgs a;
  DSV4_RETURN_IF_ERROR(CheckKvFormat(kv_format));
  DSV4_RETURN_IF_ERROR(CheckScalarS32("layer", layer));
  DSV4_RETURN_IF_ERROR(CheckBuffer("slots", slots, ffi::DataType::S32, {-1}));
  a.B = slots.dimensions()[0];
  DSV4_RETURN_IF_ERROR(CheckBuffer("swa.pos", swa_pos, ffi::DataType::S32, {-1, -1, kWindow}));
  a.L = swa_pos.dimensions()[0];
  a.R = swa_pos.dimensions()[1];
  DSV4_RETURN_IF_ERROR(BindErrors(errors_in, *errors, &a.errors));
  std::vector<ffi::AnyBuffer> leaves;
  DSV4_RETURN_IF_ERROR(CollectLeaves(swa_kv, &leaves));
  std::vector<int64_t> lead = {a.L, a.R, kWindow};
  DSV4_RETURN_IF_ERROR(BindEntryLeaves("swa.kv", kv_format, leaves, &lead, &a.pool));
  DSV4_RETURN_IF_ERROR(CheckBuffer("kv (result)", out_kv, ffi::DataType::BF16, {a.B, kWindow, kHeadDim}));
  DSV4_RETURN_IF_ERROR(CheckBuffer("pos (result)", out_pos, ffi::DataType::S32, {a.B, kWindow}));
  a.layer = static_cast<const int32_t*>(layer.untyped_data());
  a.slots = static_cast<const int32_t*>(slots.untyped_data());
  a.swa_pos = static_cast<const int32_t*>(swa_pos.untyped_data());
  a.out_kv = static_cast<uint16_t*>(out_kv.untyped_data());
  a.out_pos = static_cast<int32_t*>(out_pos.untyped_data());
  *out = a;
  return ffi::Error::Success();
}

// ---- dsv4_gather_topk -------------------------------------------------------------
struct GatherTopkArgs {
  int64_t T = 0, K = 0, R = 0, MB = 0, L = 0, N = 0, per_block = 0;
  const int32_t* layer = nullptr;
  const int32_t* slot = nullptr;
  const int32_t* pos = nullptr;
  const int32_t* indices = nullptr;
  const int32_t* block_table = nullptr;
  EntryPool pool;
  uint16_t* out_kv = nullptr;
  bool* valid = nullptr;
  ErrorCounts errors;
};

// The handlers' operands (dsv4/operands.h).
#define DSV4_GATHER_TOPK_OPERANDS(ATTR, ATTRS, ARG, ARGS, RET, RETS)                        \
  ATTR(KvFormat, kv_format) ARG(ffi::AnyBuffer, layer) ARG(ffi::AnyBuffer, token_slot)      \
  ARG(ffi::AnyBuffer, token_pos) ARG(ffi::AnyBuffer, indices) ARG(ffi::AnyBuffer, block_table) \
  ARG(ffi::AnyBuffer, errors_in) ARGS(csa_kv) RET(ffi::AnyBuffer, kv)                       \
  RET(ffi::AnyBuffer, valid) RET(ffi::AnyBuffer, errors)

inline ffi::Error ValidateGatherTopk(DSV4_PARAMS(DSV4_GATHER_TOPK_OPERANDS), GatherTopkArgs* out) {
  const ffi::AnyBuffer out_kv = *kv;
  GatherTopkArgs a;
  DSV4_RETURN_IF_ERROR(CheckKvFormat(kv_format));
  DSV4_RETURN_IF_ERROR(CheckScalarS32("layer", layer));
  DSV4_RETURN_IF_ERROR(CheckBuffer("token_slot", token_slot, ffi::DataType::S32, {-1}));
  a.T = token_slot.dimensions()[0];
  DSV4_RETURN_IF_ERROR(CheckBuffer("token_pos", token_pos, ffi::DataType::S32, {a.T}));
  DSV4_RETURN_IF_ERROR(CheckBuffer("indices", indices, ffi::DataType::S32, {a.T, -1}));
  a.K = indices.dimensions()[1];
  a.per_block = kBlockTokens / kCsaRatio;
  DSV4_RETURN_IF_ERROR(BindPagedPool("csa.kv", kv_format, a.per_block, block_table, errors_in,
                                     *errors, csa_kv, &a.errors, &a.R, &a.MB, &a.L, &a.N, &a.pool));
  DSV4_RETURN_IF_ERROR(CheckBuffer("kv (result)", out_kv, ffi::DataType::BF16, {a.T, a.K, kHeadDim}));
  DSV4_RETURN_IF_ERROR(CheckBuffer("valid (result)", *valid, ffi::DataType::PRED, {a.T, a.K}));
  a.layer = static_cast<const int32_t*>(layer.untyped_data());
  a.slot = static_cast<const int32_t*>(token_slot.untyped_data());
  a.pos = static_cast<const int32_t*>(token_pos.untyped_data());
  a.indices = static_cast<const int32_t*>(indices.untyped_data());
  a.block_table = static_cast<const int32_t*>(block_table.untyped_data());
  a.out_kv = static_cast<uint16_t*>(out_kv.untyped_data());
  a.valid = static_cast<bool*>(valid->untyped_data());
  *out = a;
  return ffi::Error::Success();
}

// ---- dsv4_gather_all ------------------------------------------------------------------
struct GatherAllArgs {
  int64_t B = 0, E = 0, R = 0, MB = 0, L = 0, N = 0, max_context = 0;
  const int32_t* layer = nullptr;
  const int32_t* slots = nullptr;
  const int32_t* lengths = nullptr;
  const int32_t* block_table = nullptr;
  EntryPool pool;
  uint16_t* out_kv = nullptr;
  int32_t* count = nullptr;
  ErrorCounts errors;
};

// The handlers' operands (dsv4/operands.h).
#define DSV4_GATHER_ALL_OPERANDS(ATTR, ATTRS, ARG, ARGS, RET, RETS)                         \
  ATTR(KvFormat, kv_format) ATTR(int64_t, max_context) ARG(ffi::AnyBuffer, layer)           \
  ARG(ffi::AnyBuffer, slots) ARG(ffi::AnyBuffer, lengths) ARG(ffi::AnyBuffer, block_table)  \
  ARG(ffi::AnyBuffer, errors_in) ARGS(hca_kv) RET(ffi::AnyBuffer, kv)                       \
  RET(ffi::AnyBuffer, count) RET(ffi::AnyBuffer, errors)

inline ffi::Error ValidateGatherAll(DSV4_PARAMS(DSV4_GATHER_ALL_OPERANDS), GatherAllArgs* out) {
  const ffi::AnyBuffer out_kv = *kv;
  GatherAllArgs a;
  DSV4_RETURN_IF_ERROR(CheckKvFormat(kv_format));
  DSV4_RETURN_IF_ERROR(CheckMaxContext(max_context));
  DSV4_RETURN_IF_ERROR(CheckScalarS32("layer", layer));
  DSV4_RETURN_IF_ERROR(CheckBuffer("slots", slots, ffi::DataType::S32, {-1}));
  a.B = slots.dimensions()[0];
  DSV4_RETURN_IF_ERROR(CheckBuffer("lengths", lengths, ffi::DataType::S32, {a.B}));
  DSV4_RETURN_IF_ERROR(BindPagedPool("hca.kv", kv_format, kBlockTokens / kHcaRatio, block_table,
                                     errors_in, *errors, hca_kv, &a.errors, &a.R, &a.MB, &a.L, &a.N,
                                     &a.pool));
  DSV4_RETURN_IF_ERROR(CheckBuffer("kv (result)", out_kv, ffi::DataType::BF16, {a.B, -1, kHeadDim}));
  a.E = out_kv.dimensions()[1];
  DSV4_RETURN_IF_ERROR(CheckBuffer("count (result)", *count, ffi::DataType::S32, {a.B}));
  a.max_context = max_context;
  a.layer = static_cast<const int32_t*>(layer.untyped_data());
  a.slots = static_cast<const int32_t*>(slots.untyped_data());
  a.lengths = static_cast<const int32_t*>(lengths.untyped_data());
  a.block_table = static_cast<const int32_t*>(block_table.untyped_data());
  a.out_kv = static_cast<uint16_t*>(out_kv.untyped_data());
  a.count = static_cast<int32_t*>(count->untyped_data());
  *out = a;
  return ffi::Error::Success();
}

}  // namespace dsv4
