// write_layer: append and flush of one CSA or HCA layer in one FFI call.
// Operands and rules: dsv4_jax/ops/write_layer.py ("dsv4_write_layer_csa",
// "dsv4_write_layer_hca"). The operands are append's followed by flush's,
// each checked by that op's own validation, so a bad operand is reported as
// append or flush reports it (projections named comp_kv / comp_score here).
//   attrs kv_format, max_context
//   args  window_layer s32[], layer s32[], token_slot s32[T], token_pos s32[T],
//         kv bf16[T,512], comp_kv, comp_score, ape, norm, inv_freq,
//         [CSA: index_kv, index_score, index_ape, index_norm, index_inv_freq,]
//         block_table s32[R,MB],
//         then the aliased: swa.pos, swa.kv leaves, comp, [CSA: icomp,
//         index.packed, index.scale,] errors, pool entry leaves
//   rets  the aliased buffers, same order
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "append.h"
#include "flush.h"

namespace dsv4 {

struct WriteLayerArgs {
  AppendArgs append;
  FlushArgs flush;
};

template <typename Binding>
auto BindWriteLayerCsa(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("kv_format")
      .template Attr<int64_t>("max_context")
      .template Arg<ffi::AnyBuffer>()  // window_layer
      .template Arg<ffi::AnyBuffer>()  // layer
      .template Arg<ffi::AnyBuffer>()  // token_slot
      .template Arg<ffi::AnyBuffer>()  // token_pos
      .template Arg<ffi::AnyBuffer>()  // kv
      .template Arg<ffi::AnyBuffer>()  // comp_kv
      .template Arg<ffi::AnyBuffer>()  // comp_score
      .template Arg<ffi::AnyBuffer>()  // ape
      .template Arg<ffi::AnyBuffer>()  // norm
      .template Arg<ffi::AnyBuffer>()  // inv_freq
      .template Arg<ffi::AnyBuffer>()  // index_kv
      .template Arg<ffi::AnyBuffer>()  // index_score
      .template Arg<ffi::AnyBuffer>()  // index_ape
      .template Arg<ffi::AnyBuffer>()  // index_norm
      .template Arg<ffi::AnyBuffer>()  // index_inv_freq
      .template Arg<ffi::AnyBuffer>()  // block_table
      .RemainingArgs()                 // the aliased buffers
      .RemainingRets();                // the same, updated
}

template <typename Binding>
auto BindWriteLayerHca(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("kv_format")
      .template Attr<int64_t>("max_context")
      .template Arg<ffi::AnyBuffer>()  // window_layer
      .template Arg<ffi::AnyBuffer>()  // layer
      .template Arg<ffi::AnyBuffer>()  // token_slot
      .template Arg<ffi::AnyBuffer>()  // token_pos
      .template Arg<ffi::AnyBuffer>()  // kv
      .template Arg<ffi::AnyBuffer>()  // comp_kv
      .template Arg<ffi::AnyBuffer>()  // comp_score
      .template Arg<ffi::AnyBuffer>()  // ape
      .template Arg<ffi::AnyBuffer>()  // norm
      .template Arg<ffi::AnyBuffer>()  // inv_freq
      .template Arg<ffi::AnyBuffer>()  // block_table
      .RemainingArgs()                 // the aliased buffers
      .RemainingRets();                // the same, updated
}

// The aliased inputs and results of a write_layer call: swa.pos, the window's
// entry leaves, then flush's `flush_fixed` aliased buffers and its pool's
// entry leaves (as many as the window's: one kv_format).
inline ffi::Error CollectWriteLayerAliased(const std::string& what, int64_t kv_format,
                                           size_t flush_fixed, const ffi::RemainingArgs& args,
                                           const ffi::RemainingRets& rets,
                                           std::vector<ffi::AnyBuffer>* ins,
                                           std::vector<ffi::AnyBuffer>* outs) {
  DSV4_RETURN_IF_ERROR(CheckKvFormat(kv_format));
  const size_t n = EntryLeafCount(kv_format);
  const size_t want = 1 + n + flush_fixed + n;
  if (args.size() != want || rets.size() != want)
    return ffi::Error::InvalidArgument(
        what + ": expected " + std::to_string(want) + " aliased buffers for kv_format " +
        std::to_string(kv_format) + " (swa.pos, " + std::to_string(n) + " swa.kv leaves, " +
        std::to_string(flush_fixed) + " of flush's, " + std::to_string(n) +
        " pool leaves), got " + std::to_string(args.size()) + " inputs and " +
        std::to_string(rets.size()) + " results");
  DSV4_RETURN_IF_ERROR(CollectLeaves(args, ins));
  return CollectLeaves(rets, outs);
}

inline std::vector<ffi::AnyBuffer> Slice(const std::vector<ffi::AnyBuffer>& v, size_t from,
                                         size_t count) {
  return std::vector<ffi::AnyBuffer>(v.begin() + from, v.begin() + from + count);
}

inline ffi::Error ValidateWriteLayerCsa(
    int64_t kv_format, int64_t max_context, ffi::AnyBuffer window_layer, ffi::AnyBuffer layer,
    ffi::AnyBuffer token_slot, ffi::AnyBuffer token_pos, ffi::AnyBuffer kv,
    ffi::AnyBuffer comp_kv, ffi::AnyBuffer comp_score, ffi::AnyBuffer ape, ffi::AnyBuffer norm,
    ffi::AnyBuffer inv_freq, ffi::AnyBuffer index_kv, ffi::AnyBuffer index_score,
    ffi::AnyBuffer index_ape, ffi::AnyBuffer index_norm, ffi::AnyBuffer index_inv_freq,
    ffi::AnyBuffer block_table, const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
    WriteLayerArgs* out) {
  constexpr size_t kFixed = 5;  // comp, icomp, index.packed, index.scale, errors
  std::vector<ffi::AnyBuffer> ins, outs;
  DSV4_RETURN_IF_ERROR(
      CollectWriteLayerAliased("write_layer_csa", kv_format, kFixed, args, rets, &ins, &outs));
  const size_t n = EntryLeafCount(kv_format), f = 1 + n, err = f + kFixed - 1;
  DSV4_RETURN_IF_ERROR(ValidateAppend(kv_format, max_context, window_layer, token_slot,
                                      token_pos, kv, ins[0], ins[err], n, outs[0], outs[err],
                                      Slice(outs, 1, n), &out->append));
  return ValidateFlushCsa(kv_format, max_context, layer, token_slot, token_pos, comp_kv,
                          comp_score, ape, norm, inv_freq, index_kv, index_score, index_ape,
                          index_norm, index_inv_freq, block_table, kFixed + n, outs[f],
                          outs[f + 1], outs[f + 2], outs[f + 3], outs[err],
                          Slice(outs, f + kFixed, n), &out->flush, "comp_");
}

inline ffi::Error ValidateWriteLayerHca(
    int64_t kv_format, int64_t max_context, ffi::AnyBuffer window_layer, ffi::AnyBuffer layer,
    ffi::AnyBuffer token_slot, ffi::AnyBuffer token_pos, ffi::AnyBuffer kv,
    ffi::AnyBuffer comp_kv, ffi::AnyBuffer comp_score, ffi::AnyBuffer ape, ffi::AnyBuffer norm,
    ffi::AnyBuffer inv_freq, ffi::AnyBuffer block_table, const ffi::RemainingArgs& args,
    const ffi::RemainingRets& rets, WriteLayerArgs* out) {
  constexpr size_t kFixed = 2;  // comp, errors
  std::vector<ffi::AnyBuffer> ins, outs;
  DSV4_RETURN_IF_ERROR(
      CollectWriteLayerAliased("write_layer_hca", kv_format, kFixed, args, rets, &ins, &outs));
  const size_t n = EntryLeafCount(kv_format), f = 1 + n, err = f + kFixed - 1;
  DSV4_RETURN_IF_ERROR(ValidateAppend(kv_format, max_context, window_layer, token_slot,
                                      token_pos, kv, ins[0], ins[err], n, outs[0], outs[err],
                                      Slice(outs, 1, n), &out->append));
  return ValidateFlushHca(kv_format, max_context, layer, token_slot, token_pos, comp_kv,
                          comp_score, ape, norm, inv_freq, block_table, kFixed + n, outs[f],
                          outs[err], Slice(outs, f + kFixed, n), &out->flush, "comp_");
}

}  // namespace dsv4
