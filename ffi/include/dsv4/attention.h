// dsv4_attention: operands, binding and validation shared by the CPU and CUDA
// handlers. Operands: DSV4_ATTENTION_OPERANDS below (dsv4/operands.h); what
// each holds and the rules: dsv4_jax/ops/attention.py, docs/design/operations.md
// (`attention`); the kernel attribute's values: attention_rules.h AttnKernel.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "dsv4/attention_rules.h"
#include "dsv4/attrs.h"
#include "dsv4/entry_checks.h"
#include "dsv4/ffi_checks.h"
#include "dsv4/layout.h"
#include "dsv4/operands.h"

namespace dsv4 {

struct AttentionArgs {
  int64_t T = 0, H = 0, K = 0, R = 0, MB = 0, L = 0, Lk = 0, N = 0, per_block = 0;
  int kind = kAttnSwa;
  int kernel = kAttnKernelAuto;
  bool has_chunk = false;
  const int32_t* layer = nullptr;
  const int32_t* comp_layer = nullptr;
  const uint16_t* q = nullptr;         // bf16 bits [T, H, 512]
  const int32_t* slot = nullptr;
  const int32_t* pos = nullptr;
  const int32_t* topk = nullptr;       // [T, K]
  const uint16_t* chunk_kv = nullptr;  // bf16 bits [T, 512] when has_chunk
  const float* sink = nullptr;         // [H]
  const float* inv_freq = nullptr;     // [32] or null: no inverse RoPE
  const int32_t* block_table = nullptr;
  const int32_t* swa_pos = nullptr;    // [L, R, 128]
  EntryPool ring;                      // swa.kv
  EntryPool pool;                      // csa.kv or hca.kv (unused for SWA)
  uint16_t* out = nullptr;             // bf16 bits [T, H, 512]
  float* lse = nullptr;                // [T, H]
  ErrorCounts errors;
  uint8_t* scratch = nullptr;          // chunk rows encoded (CUDA, prefill), or null
  int64_t scratch_bytes = 0;
  EntryPool chunk;                     // the encoded chunk rows (CUDA, prefill)
  const uint8_t* chunk_finite = nullptr;   // per chunk row: 1 if finite (else unseen)
  uint16_t* chunk_rows = nullptr;      // bf16 [T, 512]: each chunk entry decoded (CUDA, prefill)
};

// Carves the scratch of a prefill call (T * kAttnChunkScratchRow bytes) into
// a pool of T entries in the call's format (NoPE, then RoPE, then scales),
// the rows' finite flags and the entries decoded to bf16 rows. False when
// there is no chunk or too little scratch.
inline bool AttnBindChunkScratch(AttentionArgs* a) {
  if (!a->has_chunk || a->scratch_bytes < a->T * kAttnChunkScratchRow) return false;
  a->chunk.fmt = a->ring.fmt;
  a->chunk.nope = a->scratch;
  a->chunk.rope = reinterpret_cast<uint16_t*>(a->scratch + a->T * 2 * kNopeDim);
  a->chunk.scale = a->scratch + a->T * (2 * kNopeDim + 2 * kRopeDim);
  a->chunk_finite = a->scratch + a->T * (2 * kNopeDim + 2 * kRopeDim + 8);
  a->chunk_rows = reinterpret_cast<uint16_t*>(a->scratch + a->T * kAttnChunkEncodedRow);
  return true;
}

// The handlers' operands (dsv4/operands.h): the remaining arguments are
// swa.kv's entry leaves, then the pool's (none for SWA).
#define DSV4_ATTENTION_OPERANDS(ATTR, ATTRS, ARG, ARGS, RET, RETS)                          \
  ATTR(KvFormat, kv_format) ATTR(int64_t, kind) ATTR(int64_t, kernel)                       \
  ARG(ffi::AnyBuffer, layer) ARG(ffi::AnyBuffer, comp_layer) ARG(ffi::AnyBuffer, q)         \
  ARG(ffi::AnyBuffer, token_slot) ARG(ffi::AnyBuffer, token_pos) ARG(ffi::AnyBuffer, topk)  \
  ARG(ffi::AnyBuffer, chunk_kv) ARG(ffi::AnyBuffer, sink) ARG(ffi::AnyBuffer, inv_freq)     \
  ARG(ffi::AnyBuffer, block_table) ARG(ffi::AnyBuffer, swa_pos) ARG(ffi::AnyBuffer, errors_in) \
  ARGS(entries) RET(ffi::AnyBuffer, out) RET(ffi::AnyBuffer, lse) RET(ffi::AnyBuffer, errors) \
  RET(ffi::AnyBuffer, scratch)

// The ring entry of window position w for slot s of global layer l (seen
// when swa.pos holds w there).
DSV4_HD int64_t AttnRingEntry(const AttentionArgs& a, int64_t l, int64_t s, int64_t w) {
  return (l * a.R + s) * kWindow + w % kWindow;
}

// Compressed item j of token t (slot s, position p) of a CSA or HCA layer
// (kind index lk): CSA the pick topk[t, j], HCA entry j. True with *e its
// pool entry when it is seen; false for a skipped pick (-1) and for one that
// counts (BAD_INDEX: < -1 or not visible; MISSING_BLOCK), which it hands to
// `count`. `load` reads an int32 operand (the kernels through the read-only
// cache). Both handlers decide with it (docs/design/operations.md).
template <typename Load, typename Count>
DSV4_HD bool AttnCompressedItem(const AttentionArgs& a, int64_t lk, int64_t t, int64_t s,
                                int64_t p, int64_t j, Load load, Count count, int64_t* e) {
  int err = -1;
  int64_t block = -1, row = 0;
  if (a.kind == kAttnCsa) {
    const int64_t i = load(a.topk + t * a.K + j);
    if (i == -1) return false;
    if (i < -1 || i >= IndexVisible(p, a.MB * a.per_block)) {
      err = kBadIndex;
    } else {
      block = load(a.block_table + s * a.MB + i / a.per_block);
      row = i % a.per_block;
    }
  } else {
    block = load(a.block_table + s * a.MB + j);
  }
  if (err < 0 && (block < 0 || block >= a.N)) err = kMissingBlock;
  if (err >= 0) {
    count(err);
    return false;
  }
  *e = (lk * a.N + block) * a.per_block + row;
  return true;
}

inline ffi::Error ValidateAttention(DSV4_PARAMS(DSV4_ATTENTION_OPERANDS), AttentionArgs* result) {
  AttentionArgs a;
  DSV4_RETURN_IF_ERROR(CheckKvFormat(kv_format));
  if (kind != kAttnSwa && kind != kAttnCsa && kind != kAttnHca)
    return ffi::Error::InvalidArgument("kind: expected 0 (SWA), 1 (CSA) or 2 (HCA), got " +
                                       std::to_string(kind));
  a.kind = static_cast<int>(kind);
  if (kernel != kAttnKernelAuto && kernel != kAttnKernelMmaSync)
    return ffi::Error::InvalidArgument("kernel: expected 0 (auto) or 1 (mma.sync), got " +
                                       std::to_string(kernel));
  a.kernel = static_cast<int>(kernel);
  DSV4_RETURN_IF_ERROR(CheckScalarS32("layer", layer));
  DSV4_RETURN_IF_ERROR(CheckScalarS32("comp_layer", comp_layer));
  DSV4_RETURN_IF_ERROR(CheckBuffer("q", q, ffi::DataType::BF16, {-1, -1, kHeadDim}));
  a.T = q.dimensions()[0];
  a.H = q.dimensions()[1];
  if (a.H < 1) return ffi::Error::InvalidArgument("q: expected at least one head, got 0");
  DSV4_RETURN_IF_ERROR(CheckBuffer("token_slot", token_slot, ffi::DataType::S32, {a.T}));
  DSV4_RETURN_IF_ERROR(CheckBuffer("token_pos", token_pos, ffi::DataType::S32, {a.T}));
  DSV4_RETURN_IF_ERROR(CheckBuffer("topk", topk, ffi::DataType::S32, {a.T, -1}));
  a.K = topk.dimensions()[1];
  if ((a.kind == kAttnCsa) != (a.K > 0))
    return ffi::Error::InvalidArgument("topk: expected k >= 1 columns on a CSA layer and 0 "
                                       "otherwise, got k = " + std::to_string(a.K) +
                                       " for kind " + std::to_string(kind));
  DSV4_RETURN_IF_ERROR(CheckBuffer("chunk_kv", chunk_kv, ffi::DataType::BF16, {-1, kHeadDim}));
  const int64_t chunk_rows = chunk_kv.dimensions()[0];
  if (chunk_rows != 0 && chunk_rows != a.T)
    return ffi::Error::InvalidArgument("chunk_kv: expected " + std::to_string(a.T) +
                                       " rows (a prefill chunk) or 0 (decode), got " +
                                       std::to_string(chunk_rows));
  a.has_chunk = chunk_rows == a.T && a.T > 0;
  DSV4_RETURN_IF_ERROR(CheckBuffer("sink", sink, ffi::DataType::F32, {a.H}));
  DSV4_RETURN_IF_ERROR(CheckBuffer("inv_freq", inv_freq, ffi::DataType::F32, {-1}));
  const int64_t nfreq = inv_freq.dimensions()[0];
  if (nfreq != 0 && nfreq != kRopeDim / 2)
    return ffi::Error::InvalidArgument("inv_freq: expected 32 frequencies or none, got " +
                                       std::to_string(nfreq));
  DSV4_RETURN_IF_ERROR(CheckBuffer("block_table", block_table, ffi::DataType::S32, {-1, -1}));
  a.R = block_table.dimensions()[0];
  a.MB = block_table.dimensions()[1];
  DSV4_RETURN_IF_ERROR(CheckBuffer("swa.pos", swa_pos, ffi::DataType::S32, {-1, a.R, kWindow}));
  a.L = swa_pos.dimensions()[0];
  DSV4_RETURN_IF_ERROR(BindErrors(errors_in, *errors, &a.errors));
  std::vector<ffi::AnyBuffer> leaves;
  DSV4_RETURN_IF_ERROR(CollectLeaves(entries, &leaves));
  const size_t per = EntryLeafCount(kv_format);
  const size_t want = a.kind == kAttnSwa ? per : 2 * per;
  if (leaves.size() != want)
    return ffi::Error::InvalidArgument("entries: expected " + std::to_string(want) +
                                       " entry buffers (swa.kv" +
                                       (a.kind == kAttnSwa ? "" : " and the pool's") +
                                       "), got " + std::to_string(leaves.size()));
  std::vector<ffi::AnyBuffer> ring(leaves.begin(), leaves.begin() + per);
  std::vector<int64_t> lead = {a.L, a.R, kWindow};
  DSV4_RETURN_IF_ERROR(BindEntryLeaves("swa.kv", kv_format, ring, &lead, &a.ring));
  if (a.kind != kAttnSwa) {
    a.per_block = kBlockTokens / (a.kind == kAttnCsa ? kCsaRatio : kHcaRatio);
    std::vector<ffi::AnyBuffer> pool(leaves.begin() + per, leaves.end());
    std::vector<int64_t> plead = {-1, -1, a.per_block};
    DSV4_RETURN_IF_ERROR(BindEntryLeaves(a.kind == kAttnCsa ? "csa.kv" : "hca.kv", kv_format,
                                         pool, &plead, &a.pool));
    a.Lk = plead[0];
    a.N = plead[1];
  }
  DSV4_RETURN_IF_ERROR(CheckBuffer("out (result)", *out, ffi::DataType::BF16, {a.T, a.H, kHeadDim}));
  DSV4_RETURN_IF_ERROR(CheckBuffer("lse (result)", *lse, ffi::DataType::F32, {a.T, a.H}));
  DSV4_RETURN_IF_ERROR(CheckBuffer("scratch (result)", *scratch, ffi::DataType::U8, {-1}));
  a.scratch_bytes = scratch->dimensions()[0];
  a.scratch = a.scratch_bytes > 0 ? static_cast<uint8_t*>(scratch->untyped_data()) : nullptr;
  a.layer = static_cast<const int32_t*>(layer.untyped_data());
  a.comp_layer = static_cast<const int32_t*>(comp_layer.untyped_data());
  a.q = static_cast<const uint16_t*>(q.untyped_data());
  a.slot = static_cast<const int32_t*>(token_slot.untyped_data());
  a.pos = static_cast<const int32_t*>(token_pos.untyped_data());
  a.topk = static_cast<const int32_t*>(topk.untyped_data());
  a.chunk_kv = a.has_chunk ? static_cast<const uint16_t*>(chunk_kv.untyped_data()) : nullptr;
  a.sink = static_cast<const float*>(sink.untyped_data());
  a.inv_freq = nfreq ? static_cast<const float*>(inv_freq.untyped_data()) : nullptr;
  a.block_table = static_cast<const int32_t*>(block_table.untyped_data());
  a.swa_pos = static_cast<const int32_t*>(swa_pos.untyped_data());
  a.out = static_cast<uint16_t*>(out->untyped_data());
  a.lse = static_cast<float*>(lse->untyped_data());
  *result = a;
  return ffi::Error::Success();
}

}  // namespace dsv4
