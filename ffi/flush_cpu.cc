// CPU handlers of flush for CSA and HCA layers (operands and semantics in
// flush.h). Tokens are folded one at a time in row order, which is the order
// of each request's positions (they come increasing and contiguous).
#include "flush.h"
#include "handlers_cpu.h"
#include "host_writes.h"

namespace dsv4 {
namespace {

// Accumulator `acc` (0 or 1) of request slot s in layer l: rows max, sum, kv.
float* AccRow(const CompressorView& v, int64_t R, int64_t l, int64_t s, int acc) {
  return v.comp + ((l * R + s) * v.coff + acc) * 3 * int64_t{v.d};
}

// Adds channels [src, src + d) of token t at position p to accumulator `acc`.
void Fold(float* acc, const CompressorView& v, int64_t t, int64_t p, int src) {
  const int64_t width = int64_t{v.coff} * v.d;
  const float* kv = v.kv + t * width + src;
  const float* score = v.score + t * width + src;
  const float* ape = v.ape + (p % v.m) * width + src;
  for (int c = 0; c < v.d; ++c) {
    num::SoftmaxAcc a{acc[c], acc[v.d + c], acc[2 * v.d + c]};
    a = num::AccumulateAcc(a, score[c] + ape[c], kv[c]);
    acc[c] = a.m;
    acc[v.d + c] = a.s;
    acc[2 * v.d + c] = a.kv;
  }
}

void Finalize(const float* acc, int d, float* out) {
  for (int c = 0; c < d; ++c)
    out[c] = num::FinalizeAcc(num::SoftmaxAcc{acc[c], acc[d + c], acc[2 * d + c]});
}

void SetEmpty(float* acc, int d) {
  for (int c = 0; c < d; ++c) {
    acc[c] = num::NegInf();
    acc[d + c] = 0.f;
    acc[2 * d + c] = 0.f;
  }
}

// CSA: b half into current, a half into next; at the window's last token the
// current accumulator becomes entry w and next moves up. Returns whether the
// window closed; the pooled value is then in `pooled`.
bool FoldCsa(const CompressorView& v, int64_t R, int64_t l, int64_t s, int64_t t, int64_t p,
             float* pooled) {
  float* cur = AccRow(v, R, l, s, 0);
  float* next = AccRow(v, R, l, s, 1);
  Fold(cur, v, t, p, v.d);
  Fold(next, v, t, p, 0);
  if (p % v.m != v.m - 1) return false;
  Finalize(cur, v.d, pooled);
  for (int64_t i = 0; i < 3 * int64_t{v.d}; ++i) cur[i] = next[i];
  SetEmpty(next, v.d);
  return true;
}

bool TokenInputsFinite(const CompressorView& v, int64_t t) {
  const int64_t w = int64_t{v.coff} * v.d;
  return num::RowIsFinite(v.kv + t * w, w) && num::RowIsFinite(v.score + t * w, w);
}

// Drops a bad token (counting it); returns the physical block of its position.
int64_t TokenBlock(const FlushArgs& a, int64_t t) {
  int64_t s = a.slot[t], p = a.pos[t];
  if (s == -1) return -1;
  if (s < 0 || s >= a.R) {
    ++a.errors[kBadSlot];
    return -1;
  }
  if (p < 0 || p >= a.max_context || p / kBlockTokens >= a.MB) {
    ++a.errors[kBadPosition];
    return -1;
  }
  int64_t block = a.block_table[s * a.MB + p / kBlockTokens];
  if (block < 0 || block >= a.N) {
    ++a.errors[kMissingBlock];
    return -1;
  }
  if (!TokenInputsFinite(a.main, t) || (a.csa && !TokenInputsFinite(a.index, t))) {
    ++a.errors[kNonfinite];
    return -1;
  }
  return block;
}

}  // namespace

void FlushCsaOnHost(const FlushArgs& a, int64_t l) {
  float pooled[kHeadDim], ikey[kIndexDim];
  for (int64_t t = 0; t < a.T; ++t) {
    int64_t block = TokenBlock(a, t);
    if (block < 0) continue;
    int64_t s = a.slot[t], p = a.pos[t];
    bool closed = FoldCsa(a.main, a.R, l, s, t, p, pooled);
    FoldCsa(a.index, a.R, l, s, t, p, ikey);
    if (!closed) continue;
    int64_t w = p / kCsaRatio;
    // The window's tokens all lie in `block` (m divides the block size).
    int64_t e = (l * a.N + block) * a.per_block + w % a.per_block;
    EntryEpilogue(pooled, kHeadDim, a.main.norm, a.main.inv_freq, w * kCsaRatio);
    EncodeEntry(a.pool, e, pooled);
    IndexKeyEpilogue(ikey, a.index.norm, a.index.inv_freq, w * kCsaRatio);
    EncodeIndexKey(ikey, a.index_packed + e * kIndexPacked, a.index_scale + e * kIndexScales);
  }
}

void FlushHcaOnHost(const FlushArgs& a, int64_t l) {
  float pooled[kHeadDim];
  for (int64_t t = 0; t < a.T; ++t) {
    int64_t block = TokenBlock(a, t);
    if (block < 0) continue;
    int64_t s = a.slot[t], p = a.pos[t];
    float* acc = AccRow(a.main, a.R, l, s, 0);
    Fold(acc, a.main, t, p, 0);
    if (p % kHcaRatio != kHcaRatio - 1) continue;
    Finalize(acc, kHeadDim, pooled);
    SetEmpty(acc, kHeadDim);
    int64_t w = p / kHcaRatio;
    EntryEpilogue(pooled, kHeadDim, a.main.norm, a.main.inv_freq, w * kHcaRatio);
    EncodeEntry(a.pool, (l * a.N + block) * a.per_block, pooled);
  }
}

namespace {

ffi::Error FlushCsaImpl(int64_t kv_format, int64_t max_context, ffi::AnyBuffer layer,
                        ffi::AnyBuffer token_slot, ffi::AnyBuffer token_pos, ffi::AnyBuffer kv,
                        ffi::AnyBuffer score, ffi::AnyBuffer ape, ffi::AnyBuffer norm,
                        ffi::AnyBuffer inv_freq, ffi::AnyBuffer index_kv,
                        ffi::AnyBuffer index_score, ffi::AnyBuffer index_ape,
                        ffi::AnyBuffer index_norm, ffi::AnyBuffer index_inv_freq,
                        ffi::AnyBuffer block_table, ffi::RemainingArgs rest,
                        ffi::Result<ffi::AnyBuffer> comp, ffi::Result<ffi::AnyBuffer> icomp,
                        ffi::Result<ffi::AnyBuffer> packed, ffi::Result<ffi::AnyBuffer> iscale,
                        ffi::Result<ffi::AnyBuffer> errors, ffi::RemainingRets entry_rets) {
  FlushArgs a;
  DSV4_RETURN_IF_ERROR(ValidateFlushCsa(
      kv_format, max_context, layer, token_slot, token_pos, kv, score, ape, norm, inv_freq,
      index_kv, index_score, index_ape, index_norm, index_inv_freq, block_table, rest, *comp,
      *icomp, *packed, *iscale, *errors, entry_rets, &a));
  int64_t l;
  if (!HostLayerOk(a.layer, a.L, a.errors, &l)) return ffi::Error::Success();
  FlushCsaOnHost(a, l);
  return ffi::Error::Success();
}

ffi::Error FlushHcaImpl(int64_t kv_format, int64_t max_context, ffi::AnyBuffer layer,
                        ffi::AnyBuffer token_slot, ffi::AnyBuffer token_pos, ffi::AnyBuffer kv,
                        ffi::AnyBuffer score, ffi::AnyBuffer ape, ffi::AnyBuffer norm,
                        ffi::AnyBuffer inv_freq, ffi::AnyBuffer block_table,
                        ffi::RemainingArgs rest, ffi::Result<ffi::AnyBuffer> comp,
                        ffi::Result<ffi::AnyBuffer> errors, ffi::RemainingRets entry_rets) {
  FlushArgs a;
  DSV4_RETURN_IF_ERROR(ValidateFlushHca(kv_format, max_context, layer, token_slot, token_pos, kv,
                                        score, ape, norm, inv_freq, block_table, rest, *comp,
                                        *errors, entry_rets, &a));
  int64_t l;
  if (!HostLayerOk(a.layer, a.L, a.errors, &l)) return ffi::Error::Success();
  FlushHcaOnHost(a, l);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushCsaCpu, FlushCsaImpl, BindFlushCsa(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushHcaCpu, FlushHcaImpl, BindFlushHca(ffi::Ffi::Bind()));

}  // namespace dsv4
