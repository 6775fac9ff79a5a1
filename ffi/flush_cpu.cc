// CPU handlers of flush for CSA and HCA layers (operands and semantics in
// flush.h). One pass over the rows in row order; each request keeps a row
// counter, which gives every row its expected position (flush.h), so a
// request's tokens fold in row order and its windows close at their expected
// last positions, dropped or not.
#include <vector>

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

// CSA: b half of token t (if it is folded) into current, a half into next.
void FoldCsa(const CompressorView& v, int64_t R, int64_t l, int64_t s, int64_t t, int64_t p) {
  Fold(AccRow(v, R, l, s, 0), v, t, p, v.d);
  Fold(AccRow(v, R, l, s, 1), v, t, p, 0);
}

// CSA window close: current becomes the pooled entry, next moves up.
void CloseCsa(const CompressorView& v, int64_t R, int64_t l, int64_t s, float* pooled) {
  float* cur = AccRow(v, R, l, s, 0);
  float* next = AccRow(v, R, l, s, 1);
  Finalize(cur, v.d, pooled);
  for (int64_t i = 0; i < 3 * int64_t{v.d}; ++i) cur[i] = next[i];
  SetEmpty(next, v.d);
}

bool TokenInputsFinite(const CompressorView& v, int64_t t) {
  const int64_t w = int64_t{v.coff} * v.d;
  return num::RowIsFinite(v.kv + t * w, w) && num::RowIsFinite(v.score + t * w, w);
}

// One row of a request at its expected position: what the walk does with it.
struct RowStep {
  int64_t s = -1, ep = 0;
  bool fold = false;    // the row's inputs are folded
  bool closes = false;  // its expected position ends window ep / m
  int64_t block = -1;   // block of window ep / m, -1 when missing
};

// Per-request row counters of one call: the expected position of each row.
class ExpectedPositions {
 public:
  explicit ExpectedPositions(int64_t R) : rows_(R, 0), p0_(R, 0) {}
  int64_t Next(int64_t s, int64_t pos) {
    if (rows_[s] == 0) p0_[s] = pos;
    return p0_[s] + rows_[s]++;
  }

 private:
  std::vector<int64_t> rows_, p0_;
};

// Applies the per-row rules of flush.h to row t, counting a dropped row once.
RowStep StepRow(const FlushArgs& a, ExpectedPositions& expected, int64_t limit, int64_t m,
                int64_t t) {
  RowStep r;
  const int64_t s = a.slot[t], p = a.pos[t];
  if (s == -1) return r;
  if (s < 0 || s >= a.R) {
    ++a.errors[kBadSlot];
    return r;
  }
  r.ep = expected.Next(s, p);
  if (!Gates(r.ep, limit)) {
    ++a.errors[kBadPosition];
    return r;
  }
  r.s = s;
  r.closes = r.ep % m == m - 1;
  const int64_t block = a.block_table[s * a.MB + r.ep / kBlockTokens];
  int err = GatedRowError(p, r.ep, block, a.N);
  if (err < 0 && !(TokenInputsFinite(a.main, t) && (!a.csa || TokenInputsFinite(a.index, t))))
    err = kNonfinite;
  if (err >= 0) ++a.errors[err];
  r.fold = err < 0;
  r.block = block >= 0 && block < a.N ? block : -1;
  return r;
}

}  // namespace

void FlushCsaOnHost(const FlushArgs& a, int64_t l) {
  float pooled[kHeadDim], ikey[kIndexDim];
  ExpectedPositions expected(a.R);
  const int64_t limit = GatingLimit(a.max_context, a.MB);
  for (int64_t t = 0; t < a.T; ++t) {
    const RowStep r = StepRow(a, expected, limit, kCsaRatio, t);
    if (r.s < 0) continue;
    if (r.fold) {
      FoldCsa(a.main, a.R, l, r.s, t, r.ep);
      FoldCsa(a.index, a.R, l, r.s, t, r.ep);
    }
    if (!r.closes) continue;
    CloseCsa(a.main, a.R, l, r.s, pooled);
    CloseCsa(a.index, a.R, l, r.s, ikey);
    if (r.block < 0) continue;
    const int64_t w = r.ep / kCsaRatio;
    // The window's positions all lie in `block` (m divides the block size).
    const int64_t e = (l * a.N + r.block) * a.per_block + w % a.per_block;
    EntryEpilogue(pooled, kHeadDim, a.main.norm, a.main.inv_freq, w * kCsaRatio);
    EncodeEntry(a.pool, e, pooled);
    IndexKeyEpilogue(ikey, a.index.norm, a.index.inv_freq, w * kCsaRatio);
    EncodeIndexKey(ikey, a.index_packed + e * kIndexPacked, a.index_scale + e * kIndexScales);
  }
}

void FlushHcaOnHost(const FlushArgs& a, int64_t l) {
  float pooled[kHeadDim];
  ExpectedPositions expected(a.R);
  const int64_t limit = GatingLimit(a.max_context, a.MB);
  for (int64_t t = 0; t < a.T; ++t) {
    const RowStep r = StepRow(a, expected, limit, kHcaRatio, t);
    if (r.s < 0) continue;
    float* acc = AccRow(a.main, a.R, l, r.s, 0);
    if (r.fold) Fold(acc, a.main, t, r.ep, 0);
    if (!r.closes) continue;
    Finalize(acc, kHeadDim, pooled);
    SetEmpty(acc, kHeadDim);
    if (r.block < 0) continue;
    const int64_t w = r.ep / kHcaRatio;
    EntryEpilogue(pooled, kHeadDim, a.main.norm, a.main.inv_freq, w * kHcaRatio);
    EncodeEntry(a.pool, (l * a.N + r.block) * a.per_block, pooled);
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
