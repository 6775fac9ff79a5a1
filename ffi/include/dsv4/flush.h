// flush: fold a step's compressor projections into the online-softmax
// accumulators of a CSA or HCA layer and write the entries the step closes.
// Operands and per-token rules: dsv4_jax/ops/flush.py ("dsv4_flush_csa",
// "dsv4_flush_hca"); semantics docs/design/semantics.md and
// docs/design/state.md.
//
// Accumulators: comp[L, R, A, 3, d] with rows (max, sum, kv) per channel. CSA
// has A = 2: index 0 = current (entry w: a halves of window w-1, b halves of
// window w so far), index 1 = next (entry w+1: a halves of window w). HCA has
// A = 1. A token at position p (window w = p / m) adds, per channel c,
//   CSA: (z[d + c], kv[d + c]) to current and (z[c], kv[c]) to next,
//   HCA: (z[c], kv[c]) to its accumulator,
// with z = score + ape[p mod m].
//
// Gating (docs/design/semantics.md, "Order of a request's tokens"): the k-th row of
// request s in the call (k = 0, 1, ...; rows of other requests may sit in
// between) has the expected position ep = p0 + k, p0 the position of its
// first row. A row is dropped if its position is not ep (BAD_POSITION), and
// the window w closes at the row whose ep is (w+1)m - 1 (in [0, max_context))
// whether or not that row is dropped: current is finalized into entry w
// (0 if empty), then current <- next, next <- empty. So a dropped token
// removes only its own contribution.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dsv4/attrs.h"
#include "dsv4/entry_checks.h"
#include "dsv4/ffi_checks.h"
#include "dsv4/layout.h"
#include "dsv4/numerics.h"
#include "dsv4/operands.h"

namespace dsv4 {

// ---- epilogue (shared with the CUDA kernels) -------------------------------------
// x[d]: the pooled fp32 value on entry; on return the bf16-valued row to store:
// bf16 -> RMSNorm (fp32) -> bf16 -> RoPE of the trailing 64 channels at `pos` -> bf16.
DSV4_HD void EntryEpilogue(float* x, int d, const float* norm, const float* inv_freq,
                           int64_t pos) {
  for (int c = 0; c < d; ++c) x[c] = num::RoundBf16(x[c]);
  num::RmsNorm(x, norm, d, x);
  for (int c = 0; c < d; ++c) x[c] = num::RoundBf16(x[c]);
  num::RopeInterleaved(x + d - kRopeDim, kRopeDim / 2, pos, inv_freq);
  for (int c = d - kRopeDim; c < d; ++c) x[c] = num::RoundBf16(x[c]);
}

// Indexer key: the epilogue at d = 128, then Hadamard (fp32, from the bf16
// key) rounded to bf16; MXFP4 quantization follows (EncodeIndexKey).
DSV4_HD void IndexKeyEpilogue(float* x, const float* norm, const float* inv_freq, int64_t pos) {
  EntryEpilogue(x, kIndexDim, norm, inv_freq, pos);
  num::Hadamard128(x);
  for (int c = 0; c < kIndexDim; ++c) x[c] = num::RoundBf16(x[c]);
}

// ---- the per-row rule of one request (shared with the CUDA kernels) ---------------
// Positions a window can close at: [0, max_context), and never past the block
// table (a handler may be given a max_context beyond MB blocks).
DSV4_HD int64_t GatingLimit(int64_t max_context, int64_t MB) {
  return max_context < MB * kBlockTokens ? max_context : MB * kBlockTokens;
}

// Whether expected position ep gates its window (closes it at its end, folds
// the row if the row is good). A row at an expected position outside it is
// BAD_POSITION whatever its own position.
DSV4_HD bool Gates(int64_t ep, int64_t limit) { return ep >= 0 && ep < limit; }

// The drop verdict of a row at a gating expected position ep, before its
// inputs are read: BAD_POSITION if its position is not ep, MISSING_BLOCK if
// `block` (block_table[s, ep / 128], also the block its window is stored in)
// is outside [0, N), else -1 (NONFINITE is decided on the inputs).
DSV4_HD int GatedRowError(int64_t pos, int64_t ep, int64_t block, int64_t N) {
  if (pos != ep) return kBadPosition;
  if (block < 0 || block >= N) return kMissingBlock;
  return -1;
}

// ---- operands ------------------------------------------------------------------------
// One compressor's read-only inputs and its accumulators.
struct CompressorView {
  int d = 0, coff = 0, m = 0;
  const float* kv = nullptr;     // [T, coff*d]
  const float* score = nullptr;  // [T, coff*d]
  const float* ape = nullptr;    // [m, coff*d]
  const float* norm = nullptr;   // [d]
  const float* inv_freq = nullptr;  // [32]
  float* comp = nullptr;         // [L, R, coff, 3, d]
};

struct FlushArgs {
  bool csa = false;
  int64_t T = 0, L = 0, R = 0, MB = 0, N = 0, per_block = 0, max_context = 0;
  // The caller's static bound on any slot's rows in the call (0: none): a
  // hint for the kernel's choice only, never a reason for another result.
  int64_t max_rows_per_slot = 0;
  const int32_t* layer = nullptr;
  const int32_t* slot = nullptr;
  const int32_t* pos = nullptr;
  const int32_t* block_table = nullptr;
  CompressorView main, index;       // index: CSA only
  uint8_t* index_packed = nullptr;  // [L, N, 32, 64]
  uint8_t* index_scale = nullptr;   // [L, N, 32, 4]
  ErrorCounts errors;
  EntryPool pool;                   // [L, N, per_block]
};

// The handlers' operands (dsv4/operands.h). A compressor's inputs, in
// flush's order (write_layer's too; `kv_name` and `score_name` name its
// projections), then the indexer's five (CSA).
#define DSV4_COMPRESSOR_OPERANDS(ARG, kv_name, score_name)                                  \
  ARG(ffi::AnyBuffer, kv_name) ARG(ffi::AnyBuffer, score_name) ARG(ffi::AnyBuffer, ape)     \
  ARG(ffi::AnyBuffer, norm) ARG(ffi::AnyBuffer, inv_freq)
#define DSV4_INDEX_COMPRESSOR_OPERANDS(ARG)                                                 \
  ARG(ffi::AnyBuffer, index_kv) ARG(ffi::AnyBuffer, index_score)                            \
  ARG(ffi::AnyBuffer, index_ape) ARG(ffi::AnyBuffer, index_norm)                            \
  ARG(ffi::AnyBuffer, index_inv_freq)
// The attributes are one struct (dsv4/attrs.h); the aliased arguments come as
// one remaining group (the buffers the results name, then the pool's entry
// leaves); the results name them.
#define DSV4_FLUSH_CSA_OPERANDS(ATTR, ATTRS, ARG, ARGS, RET, RETS)                          \
  ATTRS(WriteAttrs, DSV4_WRITE_ATTRS) ARG(ffi::AnyBuffer, layer) ARG(ffi::AnyBuffer, meta) \
  DSV4_COMPRESSOR_OPERANDS(ARG, kv, score) DSV4_INDEX_COMPRESSOR_OPERANDS(ARG)             \
  ARG(ffi::AnyBuffer, block_table) ARGS(aliased_in) RET(ffi::AnyBuffer, csa_comp)          \
  RET(ffi::AnyBuffer, csa_icomp) RET(ffi::AnyBuffer, csa_index_packed)                     \
  RET(ffi::AnyBuffer, csa_index_scale) RET(ffi::AnyBuffer, errors) RETS(csa_kv)
#define DSV4_FLUSH_HCA_OPERANDS(ATTR, ATTRS, ARG, ARGS, RET, RETS)                          \
  ATTRS(WriteAttrs, DSV4_WRITE_ATTRS) ARG(ffi::AnyBuffer, layer) ARG(ffi::AnyBuffer, meta) \
  DSV4_COMPRESSOR_OPERANDS(ARG, kv, score) ARG(ffi::AnyBuffer, block_table)                \
  ARGS(aliased_in) RET(ffi::AnyBuffer, hca_comp) RET(ffi::AnyBuffer, errors) RETS(hca_kv)

// Checks one compressor's inputs ([T, coff*d] projections, ape, norm,
// inv_freq) under the names `prefix`kv, `prefix`score, `pprefix`ape, ... and
// fills `v`.
inline ffi::Error BindCompressorInputs(const std::string& prefix, const std::string& pprefix,
                                       int64_t T, int d, int coff, int m, ffi::AnyBuffer kv,
                                       ffi::AnyBuffer score, ffi::AnyBuffer ape,
                                       ffi::AnyBuffer norm, ffi::AnyBuffer inv_freq,
                                       CompressorView* v) {
  const auto F32 = ffi::DataType::F32;
  const int64_t w = int64_t{coff} * d;
  DSV4_RETURN_IF_ERROR(CheckBuffer((prefix + "kv").c_str(), kv, F32, {T, w}));
  DSV4_RETURN_IF_ERROR(CheckBuffer((prefix + "score").c_str(), score, F32, {T, w}));
  DSV4_RETURN_IF_ERROR(CheckBuffer((pprefix + "ape").c_str(), ape, F32, {m, w}));
  DSV4_RETURN_IF_ERROR(CheckBuffer((pprefix + "norm").c_str(), norm, F32, {d}));
  DSV4_RETURN_IF_ERROR(CheckBuffer((pprefix + "inv_freq").c_str(), inv_freq, F32, {kRopeDim / 2}));
  v->d = d;
  v->coff = coff;
  v->m = m;
  v->kv = static_cast<const float*>(kv.untyped_data());
  v->score = static_cast<const float*>(score.untyped_data());
  v->ape = static_cast<const float*>(ape.untyped_data());
  v->norm = static_cast<const float*>(norm.untyped_data());
  v->inv_freq = static_cast<const float*>(inv_freq.untyped_data());
  return ffi::Error::Success();
}

// The checks common to both kinds: attributes, layer, token rows (T: the
// rows of the projections `kv`, checked in full by BindCompressorInputs),
// block table.
inline ffi::Error BindFlushCommon(const WriteAttrs& attrs, ffi::AnyBuffer layer,
                                  ffi::AnyBuffer meta, const std::string& kv_name,
                                  ffi::AnyBuffer kv, ffi::AnyBuffer block_table, FlushArgs* a) {
  DSV4_RETURN_IF_ERROR(CheckWriteAttrs(attrs));
  DSV4_RETURN_IF_ERROR(CheckScalarS32("layer", layer));
  DSV4_RETURN_IF_ERROR(CheckBuffer(kv_name.c_str(), kv, ffi::DataType::F32, {-1, -1}));
  a->T = kv.dimensions()[0];
  DSV4_RETURN_IF_ERROR(BindTokenRows(meta, a->T, &a->slot, &a->pos));
  DSV4_RETURN_IF_ERROR(CheckBuffer("block_table", block_table, ffi::DataType::S32, {-1, -1}));
  a->R = block_table.dimensions()[0];
  a->MB = block_table.dimensions()[1];
  a->max_context = attrs.max_context;
  a->max_rows_per_slot = attrs.max_rows_per_slot;
  a->layer = static_cast<const int32_t*>(layer.untyped_data());
  a->block_table = static_cast<const int32_t*>(block_table.untyped_data());
  return ffi::Error::Success();
}

// The aliased operands arrive twice (arguments, then results); the results
// are what the handler writes, the arguments must match them.
inline ffi::Error CheckAliasedCounts(const char* what, size_t args, size_t rets) {
  if (args == rets) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(what) + ": " + std::to_string(args) +
                                     " aliased inputs but " + std::to_string(rets) +
                                     " results");
}

inline ffi::Error ValidateFlushCsa(
    const WriteAttrs& attrs, ffi::AnyBuffer layer, ffi::AnyBuffer meta, ffi::AnyBuffer kv,
    ffi::AnyBuffer score, ffi::AnyBuffer ape, ffi::AnyBuffer norm, ffi::AnyBuffer inv_freq,
    ffi::AnyBuffer index_kv, ffi::AnyBuffer index_score, ffi::AnyBuffer index_ape,
    ffi::AnyBuffer index_norm, ffi::AnyBuffer index_inv_freq, ffi::AnyBuffer block_table,
    size_t num_aliased_args,
    ffi::AnyBuffer comp, ffi::AnyBuffer icomp, ffi::AnyBuffer packed, ffi::AnyBuffer iscale,
    ffi::AnyBuffer errors, const std::vector<ffi::AnyBuffer>& leaves, FlushArgs* out,
    const std::string& kv_prefix = "") {
  FlushArgs a;
  a.csa = true;
  DSV4_RETURN_IF_ERROR(
      BindFlushCommon(attrs, layer, meta, kv_prefix + "kv", kv, block_table, &a));
  DSV4_RETURN_IF_ERROR(BindCompressorInputs(kv_prefix, "params.", a.T, kHeadDim, 2, kCsaRatio, kv, score,
                                            ape, norm, inv_freq, &a.main));
  DSV4_RETURN_IF_ERROR(BindCompressorInputs("index_", "params.index.", a.T, kIndexDim, 2,
                                            kCsaRatio, index_kv, index_score, index_ape,
                                            index_norm, index_inv_freq, &a.index));
  DSV4_RETURN_IF_ERROR(CheckAliasedCounts("flush_csa", num_aliased_args, 5 + leaves.size()));
  const auto F32 = ffi::DataType::F32;
  DSV4_RETURN_IF_ERROR(CheckBuffer("csa.comp", comp, F32, {-1, a.R, 2, 3, kHeadDim}));
  a.L = comp.dimensions()[0];
  DSV4_RETURN_IF_ERROR(CheckBuffer("csa.icomp", icomp, F32, {a.L, a.R, 2, 3, kIndexDim}));
  a.per_block = kBlockTokens / kCsaRatio;
  DSV4_RETURN_IF_ERROR(
      CheckBuffer("csa.index.packed", packed, ffi::DataType::U8, {a.L, -1, a.per_block, kIndexPacked}));
  a.N = packed.dimensions()[1];
  DSV4_RETURN_IF_ERROR(CheckBuffer("csa.index.scale", iscale, ffi::DataType::F8E8M0FNU,
                                   {a.L, a.N, a.per_block, kIndexScales}));
  DSV4_RETURN_IF_ERROR(BindErrors(errors, errors, &a.errors));
  std::vector<int64_t> lead = {a.L, a.N, a.per_block};
  DSV4_RETURN_IF_ERROR(BindEntryLeaves("csa.kv", attrs.kv_format, leaves, &lead, &a.pool));
  a.main.comp = static_cast<float*>(comp.untyped_data());
  a.index.comp = static_cast<float*>(icomp.untyped_data());
  a.index_packed = static_cast<uint8_t*>(packed.untyped_data());
  a.index_scale = static_cast<uint8_t*>(iscale.untyped_data());
  *out = a;
  return ffi::Error::Success();
}

inline ffi::Error ValidateFlushHca(const WriteAttrs& attrs, ffi::AnyBuffer layer,
                                   ffi::AnyBuffer meta, ffi::AnyBuffer kv, ffi::AnyBuffer score,
                                   ffi::AnyBuffer ape, ffi::AnyBuffer norm, ffi::AnyBuffer inv_freq,
                                   ffi::AnyBuffer block_table, size_t num_aliased_args,
                                   ffi::AnyBuffer comp, ffi::AnyBuffer errors,
                                   const std::vector<ffi::AnyBuffer>& leaves, FlushArgs* out,
                                   const std::string& kv_prefix = "") {
  FlushArgs a;
  a.csa = false;
  DSV4_RETURN_IF_ERROR(
      BindFlushCommon(attrs, layer, meta, kv_prefix + "kv", kv, block_table, &a));
  DSV4_RETURN_IF_ERROR(BindCompressorInputs(kv_prefix, "params.", a.T, kHeadDim, 1, kHcaRatio, kv, score,
                                            ape, norm, inv_freq, &a.main));
  DSV4_RETURN_IF_ERROR(CheckAliasedCounts("flush_hca", num_aliased_args, 2 + leaves.size()));
  DSV4_RETURN_IF_ERROR(CheckBuffer("hca.comp", comp, ffi::DataType::F32, {-1, a.R, 1, 3, kHeadDim}));
  a.L = comp.dimensions()[0];
  DSV4_RETURN_IF_ERROR(BindErrors(errors, errors, &a.errors));
  a.per_block = kBlockTokens / kHcaRatio;
  std::vector<int64_t> lead = {a.L, -1, a.per_block};
  DSV4_RETURN_IF_ERROR(BindEntryLeaves("hca.kv", attrs.kv_format, leaves, &lead, &a.pool));
  a.N = lead[1];
  a.main.comp = static_cast<float*>(comp.untyped_data());
  *out = a;
  return ffi::Error::Success();
}

// The same two, for flush's own handlers.
inline ffi::Error ValidateFlushCsa(DSV4_PARAMS(DSV4_FLUSH_CSA_OPERANDS), FlushArgs* out) {
  std::vector<ffi::AnyBuffer> leaves;
  DSV4_RETURN_IF_ERROR(CollectLeaves(csa_kv, &leaves));
  return ValidateFlushCsa(attrs, layer, meta, kv, score, ape, norm, inv_freq, index_kv,
                          index_score, index_ape, index_norm, index_inv_freq, block_table,
                          aliased_in.size(), *csa_comp, *csa_icomp, *csa_index_packed,
                          *csa_index_scale, *errors, leaves, out);
}

inline ffi::Error ValidateFlushHca(DSV4_PARAMS(DSV4_FLUSH_HCA_OPERANDS), FlushArgs* out) {
  std::vector<ffi::AnyBuffer> leaves;
  DSV4_RETURN_IF_ERROR(CollectLeaves(hca_kv, &leaves));
  return ValidateFlushHca(attrs, layer, meta, kv, score, ape, norm, inv_freq, block_table,
                          aliased_in.size(), *hca_comp, *errors, leaves, out);
}

}  // namespace dsv4
