// CPU handlers of flush for CSA and HCA layers (operands and semantics in
// flush.h), and the serial walk: one pass over the rows in row order; each
// request keeps a row counter, which gives every row its expected position
// (flush.h), so a request's tokens fold in row order and its windows close at
// their expected last positions, dropped or not. The handlers run the window
// plan for regular requests and this walk for the others (flush_plan_cpu.cc).
#include <vector>

#include "cpu/flush_host.h"
#include "cpu/handlers_cpu.h"
#include "cpu/host_writes.h"
#include "dsv4/flush.h"

namespace dsv4 {
namespace {

using host_flush::AccRow;
using host_flush::Finalize;
using host_flush::Fold;
using host_flush::SetEmpty;
using host_flush::TokenInputsFinite;

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
    CountError(a.errors, kBadSlot, t);
    return r;
  }
  r.ep = expected.Next(s, p);
  if (!Gates(r.ep, limit)) {
    CountError(a.errors, kBadPosition, t);
    return r;
  }
  r.s = s;
  r.closes = r.ep % m == m - 1;
  const int64_t block = a.block_table[s * a.MB + r.ep / kBlockTokens];
  int err = GatedRowError(p, r.ep, block, a.N);
  if (err < 0 && !(TokenInputsFinite(a.main, t) && (!a.csa || TokenInputsFinite(a.index, t))))
    err = kNonfinite;
  if (err >= 0) CountError(a.errors, err, t);
  r.fold = err < 0;
  r.block = block >= 0 && block < a.N ? block : -1;
  return r;
}

}  // namespace

void WalkCsaOnHost(const FlushArgs& a, int64_t l) {
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
    host_flush::StoreCsaEntry(a, host_flush::EntryIndex(a, l, r.block, w), w, pooled, ikey);
  }
}

void WalkHcaOnHost(const FlushArgs& a, int64_t l) {
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
    host_flush::StoreHcaEntry(a, host_flush::EntryIndex(a, l, r.block, w), w, pooled);
  }
}

namespace {

// The handlers' bodies: `kFlush` is FlushCsaOnHost / FlushHcaOnHost (the
// ops) or the serial walk alone (the testing module's targets).
using HostFlush = void (*)(const FlushArgs&, int64_t);

template <HostFlush kFlush>
ffi::Error FlushCsaImpl(DSV4_PARAMS(DSV4_FLUSH_CSA_OPERANDS)) {
  FlushArgs a;
  DSV4_RETURN_IF_ERROR(ValidateFlushCsa(DSV4_NAMES(DSV4_FLUSH_CSA_OPERANDS), &a));
  int64_t l;
  if (!HostLayerOk(a.layer, a.L, a.errors, &l)) return ffi::Error::Success();
  kFlush(a, l);
  return ffi::Error::Success();
}

template <HostFlush kFlush>
ffi::Error FlushHcaImpl(DSV4_PARAMS(DSV4_FLUSH_HCA_OPERANDS)) {
  FlushArgs a;
  DSV4_RETURN_IF_ERROR(ValidateFlushHca(DSV4_NAMES(DSV4_FLUSH_HCA_OPERANDS), &a));
  int64_t l;
  if (!HostLayerOk(a.layer, a.L, a.errors, &l)) return ffi::Error::Success();
  kFlush(a, l);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushCsaCpu, FlushCsaImpl<FlushCsaOnHost>,
                              DSV4_BIND(DSV4_FLUSH_CSA_OPERANDS, ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushHcaCpu, FlushHcaImpl<FlushHcaOnHost>,
                              DSV4_BIND(DSV4_FLUSH_HCA_OPERANDS, ffi::Ffi::Bind()));
// Registered by the testing module only: every request on the serial walk,
// the oracle of the window plan's bits.
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushCsaSerialCpu, FlushCsaImpl<WalkCsaOnHost>,
                              DSV4_BIND(DSV4_FLUSH_CSA_OPERANDS, ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlushHcaSerialCpu, FlushHcaImpl<WalkHcaOnHost>,
                              DSV4_BIND(DSV4_FLUSH_HCA_OPERANDS, ffi::Ffi::Bind()));

}  // namespace dsv4
