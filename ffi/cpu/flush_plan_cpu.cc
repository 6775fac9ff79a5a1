// The CPU flush of a call (FlushCsaOnHost, FlushHcaOnHost): every regular
// request (dsv4/flush_windows.h) runs the window plan, entry after entry,
// each folded in row order from its carried accumulator or from empty; the
// other requests (and bad slots) take the serial walk of flush_cpu.cc. Both
// fold with the same functions (flush_host.h), so a regular request gives
// the bits of the serial walk, and the CUDA kernel runs the same plan.
#include <vector>

#include "cpu/flush_host.h"
#include "cpu/host_writes.h"
#include "dsv4/flush.h"
#include "dsv4/flush_windows.h"

namespace dsv4 {
namespace {

using host_flush::AccRow;

// The rows of one request slot in a call; regular: one contiguous run of
// consecutive positions, every one inside the block table.
struct RequestRows {
  int64_t t0 = -1, n = 0;
  bool regular = true;
};

std::vector<RequestRows> ClassifyRequests(const FlushArgs& a) {
  std::vector<RequestRows> req(a.R);
  for (int64_t t = 0; t < a.T; ++t) {
    const int64_t s = a.slot[t];
    if (s < 0 || s >= a.R) continue;
    RequestRows& r = req[s];
    if (!PositionInTable(a.pos[t], a.max_context, a.MB)) r.regular = false;
    if (r.n == 0) r.t0 = t;
    else if (t != r.t0 + r.n || int64_t{a.pos[t]} != int64_t{a.pos[t - 1]} + 1) r.regular = false;
    ++r.n;
  }
  return req;
}

// Which rows of regular request s are kept (the others counted once each:
// MISSING_BLOCK, then NONFINITE).
std::vector<char> KeptRows(const FlushArgs& a, int64_t s, const RequestRows& r) {
  std::vector<char> keep(r.n, 0);
  for (int64_t k = 0; k < r.n; ++k) {
    const int64_t t = r.t0 + k;
    const int64_t block = a.block_table[s * a.MB + a.pos[t] / kBlockTokens];
    if (block < 0 || block >= a.N) {
      CountError(a.errors, kMissingBlock, t);
    } else if (!host_flush::TokenInputsFinite(a.main, t) ||
               (a.csa && !host_flush::TokenInputsFinite(a.index, t))) {
      CountError(a.errors, kNonfinite, t);
    } else {
      keep[k] = 1;
    }
  }
  return keep;
}

// One entry's accumulator of one compressor, folded as its job says.
void FoldEntry(const CompressorView& v, const FlushArgs& a, int64_t l, int64_t s,
               const RequestRows& r, const std::vector<char>& keep, int64_t p0,
               const EntryJob& job, float* acc) {
  const int64_t n = 3 * int64_t{v.d};
  if (job.carried >= 0) {
    const float* carried = AccRow(v, a.R, l, s, static_cast<int>(job.carried));
    for (int64_t i = 0; i < n; ++i) acc[i] = carried[i];
  } else {
    host_flush::SetEmpty(acc, v.d);
  }
  const int b_src = v.coff == 2 ? v.d : 0;  // CSA: a halves [0, d), b halves [d, 2d)
  for (int64_t q = job.rows.lo; q <= job.rows.hi; ++q)
    if (keep[q - p0]) host_flush::Fold(acc, v, r.t0 + (q - p0), q, q < job.b_from ? 0 : b_src);
}

void StoreAcc(const CompressorView& v, const FlushArgs& a, int64_t l, int64_t s, int64_t row,
              const float* acc) {
  float* dst = AccRow(v, a.R, l, s, static_cast<int>(row));
  for (int64_t i = 0; i < 3 * int64_t{v.d}; ++i) dst[i] = acc[i];
}

// The plan of regular request s: its entries in increasing order (the
// order the plan needs for the accumulators it reads and writes).
template <bool kCsa>
void FlushRegular(const FlushArgs& a, int64_t l, int64_t s, const RequestRows& r) {
  const std::vector<char> keep = KeptRows(a, s, r);
  const WindowPlan w = PlanWindows(kCsa, a.pos[r.t0], r.n);
  std::vector<float> acc(3 * kHeadDim), iacc(3 * kIndexDim);
  float pooled[kHeadDim], ikey[kIndexDim];
  for (int64_t e = w.w0; e <= w.last(); ++e) {
    const EntryJob job = w.Job(e);
    FoldEntry(a.main, a, l, s, r, keep, w.p0, job, acc.data());
    if (kCsa) FoldEntry(a.index, a, l, s, r, keep, w.p0, job, iacc.data());
    if (job.acc >= 0) {
      StoreAcc(a.main, a, l, s, job.acc, acc.data());
      if (kCsa) StoreAcc(a.index, a, l, s, job.acc, iacc.data());
      continue;
    }
    const int64_t block = a.block_table[s * a.MB + e * w.m / kBlockTokens];
    if (block < 0 || block >= a.N) continue;  // its rows were counted MISSING_BLOCK
    const int64_t idx = host_flush::EntryIndex(a, l, block, e);
    host_flush::Finalize(acc.data(), kHeadDim, pooled);
    if (kCsa) {
      host_flush::Finalize(iacc.data(), kIndexDim, ikey);
      host_flush::StoreCsaEntry(a, idx, e, pooled, ikey);
    } else {
      host_flush::StoreHcaEntry(a, idx, e, pooled);
    }
  }
}

template <bool kCsa>
void FlushOnHost(const FlushArgs& a, int64_t l, void (*walk)(const FlushArgs&, int64_t)) {
  const std::vector<RequestRows> req = ClassifyRequests(a);
  for (int64_t s = 0; s < a.R; ++s)
    if (req[s].n > 0 && req[s].regular) FlushRegular<kCsa>(a, l, s, req[s]);
  // the rest walks serially: regular requests' rows become padding
  std::vector<int32_t> rest(a.slot, a.slot + a.T);
  bool any = false;
  for (int64_t t = 0; t < a.T; ++t) {
    const int64_t s = rest[t];
    if (s >= 0 && s < a.R && req[s].regular) rest[t] = -1;
    any = any || rest[t] != -1;
  }
  if (!any) return;
  FlushArgs b = a;
  b.slot = rest.data();
  walk(b, l);
}

}  // namespace

void FlushCsaOnHost(const FlushArgs& a, int64_t l) { FlushOnHost<true>(a, l, WalkCsaOnHost); }
void FlushHcaOnHost(const FlushArgs& a, int64_t l) { FlushOnHost<false>(a, l, WalkHcaOnHost); }

}  // namespace dsv4
