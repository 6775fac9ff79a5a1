// dsv4_indexer_topk: operands, binding and validation shared by the CPU and
// CUDA handlers. Operands: DSV4_INDEXER_TOPK_OPERANDS below (dsv4/operands.h);
// what each holds, the rules and the arithmetic: dsv4_jax/ops/indexer.py and
// dsv4/indexer.h.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "dsv4/entry_checks.h"
#include "dsv4/ffi_checks.h"
#include "dsv4/indexer.h"
#include "dsv4/layout.h"
#include "dsv4/operands.h"

namespace dsv4 {

// rows_per_request's largest value: the CUDA score kernel keeps that many
// rounded queries in shared memory beside its key rings (about 18.6 KB a row;
// 8 of them and the rings fill the 227 KB a CTA may take on sm_90 and sm_100).
constexpr int64_t kMaxRowsPerRequest = 8;

struct IndexerTopkArgs {
  int64_t T = 0, K = 0, R = 0, MB = 0, L = 0, N = 0, E = 0;  // E = MB * 32
  int64_t q_format = kQueryBf16;
  const int32_t* layer = nullptr;
  const int32_t* slot = nullptr;
  const int32_t* pos = nullptr;
  const uint16_t* q = nullptr;      // bf16 bits
  const float* weights = nullptr;
  const int32_t* block_table = nullptr;
  const uint8_t* packed = nullptr;  // [L, N, 32, 64]
  const uint8_t* scale = nullptr;   // [L, N, 32, 4]
  int32_t* indices = nullptr;
  uint32_t* scratch = nullptr;      // [T, E]
  uint8_t* qscratch = nullptr;      // [T, kQueryScratchBytes] (q_format 1)
  ErrorCounts errors;
};

// The handlers' operands (dsv4/operands.h).
#define DSV4_INDEXER_TOPK_OPERANDS(ATTR, ATTRS, ARG, ARGS, RET, RETS)                       \
  ARG(ffi::AnyBuffer, layer) ARG(ffi::AnyBuffer, token_slot) ARG(ffi::AnyBuffer, token_pos) \
  ARG(ffi::AnyBuffer, q) ARG(ffi::AnyBuffer, weights) ARG(ffi::AnyBuffer, block_table)      \
  ARG(ffi::AnyBuffer, errors_in) ARG(ffi::AnyBuffer, csa_index_packed)                      \
  ARG(ffi::AnyBuffer, csa_index_scale) RET(ffi::AnyBuffer, indices)                         \
  RET(ffi::AnyBuffer, scratch) RET(ffi::AnyBuffer, qscratch) RET(ffi::AnyBuffer, errors)    \
  ATTR(int64_t, q_format) ATTR(int64_t, rows_per_request)

inline ffi::Error ValidateIndexerTopk(DSV4_PARAMS(DSV4_INDEXER_TOPK_OPERANDS),
                                      IndexerTopkArgs* out) {
  IndexerTopkArgs a;
  if (q_format != kQueryBf16 && q_format != kQueryMxfp4)
    return ffi::Error::InvalidArgument("q_format: expected 0 (bf16) or 1 (mxfp4), got " +
                                       std::to_string(q_format));
  a.q_format = q_format;
  // a schedule hint of the CUDA score kernel; validated everywhere alike
  if (rows_per_request < 1 || rows_per_request > kMaxRowsPerRequest)
    return ffi::Error::InvalidArgument("rows_per_request: expected an int in [1, " +
                                       std::to_string(kMaxRowsPerRequest) + "], got " +
                                       std::to_string(rows_per_request));
  DSV4_RETURN_IF_ERROR(CheckScalarS32("layer", layer));
  DSV4_RETURN_IF_ERROR(CheckBuffer("token_slot", token_slot, ffi::DataType::S32, {-1}));
  a.T = token_slot.dimensions()[0];
  DSV4_RETURN_IF_ERROR(CheckBuffer("token_pos", token_pos, ffi::DataType::S32, {a.T}));
  DSV4_RETURN_IF_ERROR(
      CheckBuffer("q", q, ffi::DataType::BF16, {a.T, kIndexHeads, kIndexDim}));
  DSV4_RETURN_IF_ERROR(
      CheckBuffer("weights", weights, ffi::DataType::F32, {a.T, kIndexHeads}));
  DSV4_RETURN_IF_ERROR(CheckBuffer("block_table", block_table, ffi::DataType::S32, {-1, -1}));
  a.R = block_table.dimensions()[0];
  a.MB = block_table.dimensions()[1];
  a.E = a.MB * (kBlockTokens / kCsaRatio);
  DSV4_RETURN_IF_ERROR(BindErrors(errors_in, *errors, &a.errors));
  DSV4_RETURN_IF_ERROR(CheckBuffer("csa.index.packed", csa_index_packed, ffi::DataType::U8,
                                   {-1, -1, kBlockTokens / kCsaRatio, kIndexPacked}));
  a.L = csa_index_packed.dimensions()[0];
  a.N = csa_index_packed.dimensions()[1];
  DSV4_RETURN_IF_ERROR(CheckBuffer("csa.index.scale", csa_index_scale, ffi::DataType::F8E8M0FNU,
                                   {a.L, a.N, kBlockTokens / kCsaRatio, kIndexScales}));
  DSV4_RETURN_IF_ERROR(CheckBuffer("indices (result)", *indices, ffi::DataType::S32, {a.T, -1}));
  a.K = indices->dimensions()[1];
  if (a.K < 1) return ffi::Error::InvalidArgument("indices (result): k must be at least 1");
  DSV4_RETURN_IF_ERROR(CheckBuffer("scratch (result)", *scratch, ffi::DataType::U32, {a.T, a.E}));
  DSV4_RETURN_IF_ERROR(CheckBuffer("qscratch (result)", *qscratch, ffi::DataType::U8,
                                   {a.T, q_format == kQueryMxfp4 ? kQueryScratchBytes : 0}));
  a.layer = static_cast<const int32_t*>(layer.untyped_data());
  a.slot = static_cast<const int32_t*>(token_slot.untyped_data());
  a.pos = static_cast<const int32_t*>(token_pos.untyped_data());
  a.q = static_cast<const uint16_t*>(q.untyped_data());
  a.weights = static_cast<const float*>(weights.untyped_data());
  a.block_table = static_cast<const int32_t*>(block_table.untyped_data());
  a.packed = static_cast<const uint8_t*>(csa_index_packed.untyped_data());
  a.scale = static_cast<const uint8_t*>(csa_index_scale.untyped_data());
  a.indices = static_cast<int32_t*>(indices->untyped_data());
  a.scratch = static_cast<uint32_t*>(scratch->untyped_data());
  a.qscratch = static_cast<uint8_t*>(qscratch->untyped_data());
  *out = a;
  return ffi::Error::Success();
}

}  // namespace dsv4
