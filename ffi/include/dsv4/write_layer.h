// write_layer: append and flush of one CSA or HCA layer in one FFI call.
// Operands: DSV4_WRITE_LAYER_CSA_OPERANDS / _HCA_ below (dsv4/operands.h);
// what each holds and the rules: dsv4_jax/ops/write_layer.py
// ("dsv4_write_layer_csa", "dsv4_write_layer_hca"). The operands are
// append's followed by flush's, each checked by that op's own validation, so
// a bad operand is reported as append or flush reports it (projections named
// comp_kv / comp_score here).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "dsv4/append.h"
#include "dsv4/flush.h"

namespace dsv4 {

struct WriteLayerArgs {
  AppendArgs append;
  FlushArgs flush;
};

// The handlers' operands (dsv4/operands.h): append's and flush's, their one
// attribute struct, the aliased buffers as one remaining group.
#define DSV4_WRITE_LAYER_CSA_OPERANDS(ATTR, ATTRS, ARG, ARGS, RET, RETS)                    \
  ATTRS(WriteAttrs, DSV4_WRITE_ATTRS) ARG(ffi::AnyBuffer, window_layer)                    \
  ARG(ffi::AnyBuffer, layer) ARG(ffi::AnyBuffer, meta) ARG(ffi::AnyBuffer, kv)              \
  DSV4_COMPRESSOR_OPERANDS(ARG, comp_kv, comp_score) DSV4_INDEX_COMPRESSOR_OPERANDS(ARG)   \
  ARG(ffi::AnyBuffer, block_table) ARGS(aliased_in) RETS(aliased)
#define DSV4_WRITE_LAYER_HCA_OPERANDS(ATTR, ATTRS, ARG, ARGS, RET, RETS)                    \
  ATTRS(WriteAttrs, DSV4_WRITE_ATTRS) ARG(ffi::AnyBuffer, window_layer)                    \
  ARG(ffi::AnyBuffer, layer) ARG(ffi::AnyBuffer, meta) ARG(ffi::AnyBuffer, kv)              \
  DSV4_COMPRESSOR_OPERANDS(ARG, comp_kv, comp_score) ARG(ffi::AnyBuffer, block_table)      \
  ARGS(aliased_in) RETS(aliased)

// flush's aliased results in a write_layer call: its fixed buffers (errors
// the last) and its pool's entry leaves.
struct FlushAliased {
  std::vector<ffi::AnyBuffer> fixed, leaves;
};

// The aliased operands of a write_layer call are swa.pos, the window's entry
// leaves, then flush's `flush_fixed` buffers (errors last) and its pool's
// entry leaves, as many as the window's (one kv_format). Counts them, checks
// the append part (into out->append) and returns flush's part.
inline ffi::Error ValidateWriteLayerWindow(const std::string& what, const WriteAttrs& attrs,
                                           ffi::AnyBuffer window_layer, ffi::AnyBuffer meta,
                                           ffi::AnyBuffer kv, size_t flush_fixed,
                                           const ffi::RemainingArgs& args,
                                           const ffi::RemainingRets& rets, WriteLayerArgs* out,
                                           FlushAliased* flush) {
  DSV4_RETURN_IF_ERROR(CheckWriteAttrs(attrs));
  const size_t n = EntryLeafCount(attrs.kv_format);
  const size_t want = 1 + n + flush_fixed + n;
  if (args.size() != want || rets.size() != want)
    return ffi::Error::InvalidArgument(
        what + ": expected " + std::to_string(want) + " aliased buffers for kv_format " +
        std::to_string(attrs.kv_format) + " (swa.pos, " + std::to_string(n) +
        " swa.kv leaves, " + std::to_string(flush_fixed) + " of flush's, " + std::to_string(n) +
        " pool leaves), got " + std::to_string(args.size()) + " inputs and " +
        std::to_string(rets.size()) + " results");
  std::vector<ffi::AnyBuffer> ins, outs;
  DSV4_RETURN_IF_ERROR(CollectLeaves(args, &ins));
  DSV4_RETURN_IF_ERROR(CollectLeaves(rets, &outs));
  const size_t f = 1 + n, err = f + flush_fixed - 1;
  const auto part = [&](size_t from, size_t count) {
    return std::vector<ffi::AnyBuffer>(outs.begin() + from, outs.begin() + from + count);
  };
  flush->fixed = part(f, flush_fixed);
  flush->leaves = part(f + flush_fixed, n);
  return ValidateAppend(attrs, window_layer, meta, kv, ins[0], ins[err], n, outs[0], outs[err],
                        part(1, n), &out->append);
}

// Append's T is the rows of kv and flush's those of comp_kv: one step's
// rows, so they must agree.
inline ffi::Error CheckSameRows(const WriteLayerArgs& a) {
  if (a.flush.T == a.append.T) return ffi::Error::Success();
  return ffi::Error::InvalidArgument("comp_kv: expected " + std::to_string(a.append.T) +
                                     " rows (as kv), got " + std::to_string(a.flush.T));
}

inline ffi::Error ValidateWriteLayerCsa(DSV4_PARAMS(DSV4_WRITE_LAYER_CSA_OPERANDS),
                                        WriteLayerArgs* out) {
  FlushAliased fa;  // comp, icomp, index.packed, index.scale, errors
  DSV4_RETURN_IF_ERROR(ValidateWriteLayerWindow("write_layer_csa", attrs, window_layer, meta,
                                                kv, 5, aliased_in, aliased, out, &fa));
  DSV4_RETURN_IF_ERROR(ValidateFlushCsa(attrs, layer, meta, comp_kv, comp_score, ape, norm,
                                        inv_freq, index_kv, index_score, index_ape, index_norm,
                                        index_inv_freq, block_table, 5 + fa.leaves.size(),
                                        fa.fixed[0], fa.fixed[1], fa.fixed[2], fa.fixed[3],
                                        fa.fixed[4], fa.leaves, &out->flush, "comp_"));
  return CheckSameRows(*out);
}

inline ffi::Error ValidateWriteLayerHca(DSV4_PARAMS(DSV4_WRITE_LAYER_HCA_OPERANDS),
                                        WriteLayerArgs* out) {
  FlushAliased fa;  // comp, errors
  DSV4_RETURN_IF_ERROR(ValidateWriteLayerWindow("write_layer_hca", attrs, window_layer, meta,
                                                kv, 2, aliased_in, aliased, out, &fa));
  DSV4_RETURN_IF_ERROR(ValidateFlushHca(attrs, layer, meta, comp_kv, comp_score, ape, norm,
                                        inv_freq, block_table, 2 + fa.leaves.size(), fa.fixed[0],
                                        fa.fixed[1], fa.leaves, &out->flush, "comp_"));
  return CheckSameRows(*out);
}

}  // namespace dsv4
