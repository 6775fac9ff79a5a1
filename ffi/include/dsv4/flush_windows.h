// The window plan of flush for one *regular* request of a call: its rows
// form one contiguous run t0 .. t0+n-1 whose positions are p0 .. p0+n-1, all
// inside [0, max_context) and the block table (docs/design/state.md). Then each
// row's expected position (flush.h) is its own, the gating range is
// [p0, p0+n-1], and every entry the call touches depends only on the rows of
// its own window (CSA: and of the window before) plus, for the first one or
// two entries, the carried accumulators, so entries can be folded
// independently, each in row order, with the bits of the serial walk. The
// CPU handler and the CUDA kernel both run this plan.
//
// Dropped rows (MISSING_BLOCK, NONFINITE; a regular request has no
// BAD_POSITION) are left out of the folds and nothing else: the windows
// they would close still close, from what else they hold (pooled 0 if their
// accumulator is empty), and are stored iff their block exists — the rule
// of flush.h.
//
// Entries touched by the call, e = w0 .. last(), w0 = p0 / m:
//   CSA entry e folds the a halves of the rows of window e-1, then the b halves
//   of the rows of window e; HCA entry e the rows of window e.
//   It starts from carried accumulator e - w0 when e - w0 < A (A = 2 CSA,
//   1 HCA), else empty.
//   It closes (epilogue, stored in the pool) iff its window's last position
//   (e+1)m - 1 is in the call, dropped row or not: e < wl, wl = (L+1) / m,
//   L = p0 + n - 1.
//   Otherwise it is accumulator e - wl after the call (entries wl .. wl+A-1).
// Entries that read or write the accumulators are the request's *edge*
// entries; in increasing e an edge entry never reads an accumulator row an
// earlier one wrote (it writes row e - wl <= e - w0, the row it would read),
// so one worker running them in that order needs no other ordering. Every
// other entry (a *middle* entry) reads only the call's rows.
#pragma once

#include <cstdint>

#include "dsv4/numerics.h"

namespace dsv4 {

// Positions [lo, hi] (empty when lo > hi).
struct PosRange {
  int64_t lo, hi;
  DSV4_HD bool empty() const { return lo > hi; }
};

// One entry's work: fold the rows of positions rows.lo .. rows.hi in row
// order, a halves (CSA) below b_from, b halves (HCA: whole rows) from b_from
// on, starting from carried accumulator `carried` (-1: empty); then store it
// as accumulator `acc`, or close it when acc is -1.
struct EntryJob {
  int64_t e;
  PosRange rows;
  int64_t b_from, carried, acc;
};

struct WindowPlan {
  int64_t m = 1;   // window length: 4 (CSA) or 128 (HCA)
  int64_t A = 1;   // accumulators of a request: 2 (CSA) or 1 (HCA)
  int64_t p0 = 0, L = 0;  // first and last position of the call's rows
  int64_t w0 = 0, wl = 0;  // entry of carried accumulator 0; of accumulator 0 after the call

  DSV4_HD int64_t last() const { return wl + A - 1; }
  DSV4_HD bool closes(int64_t e) const { return e < wl; }
  // carried accumulator row entry e starts from, or -1 (empty start)
  DSV4_HD int64_t carried_row(int64_t e) const { return e - w0 < A ? e - w0 : -1; }
  // accumulator row entry e is stored into after the call, or -1 (it closes)
  DSV4_HD int64_t acc_row(int64_t e) const { return e >= wl ? e - wl : -1; }
  DSV4_HD bool edge(int64_t e) const { return carried_row(e) >= 0 || acc_row(e) >= 0; }
  // The edge entry after e (the middle entries are w0 + A .. wl - 1).
  DSV4_HD int64_t next_edge(int64_t e) const { return e + 1 >= w0 + A && e + 1 < wl ? wl : e + 1; }
  // The call's positions whose a halves (CSA) fold into entry e; HCA: none.
  DSV4_HD PosRange a_half(int64_t e) const {
    if (A == 1) return PosRange{1, 0};
    return Clip((e - 1) * m, e * m - 1);
  }
  // The call's positions whose b halves (CSA) or whole rows (HCA) fold into e.
  DSV4_HD PosRange b_half(int64_t e) const { return Clip(e * m, e * m + m - 1); }
  DSV4_HD PosRange Clip(int64_t lo, int64_t hi) const {
    return PosRange{lo > p0 ? lo : p0, hi < L ? hi : L};
  }
  // Entry e's job. Its a and b ranges are adjacent when both are non-empty
  // (the call's positions are contiguous), so its rows are one range.
  DSV4_HD EntryJob Job(int64_t e) const {
    const PosRange a = a_half(e), b = b_half(e);
    const PosRange rows = a.empty() ? b : b.empty() ? a : PosRange{a.lo, b.hi};
    return EntryJob{e, rows, e * m, carried_row(e), acc_row(e)};
  }
};

// The job of middle entry e (see MiddleCheckBack): whole windows, from
// empty, closing. What WindowPlan::Job gives for it, without the plan.
DSV4_HD EntryJob MiddleJob(bool csa, int64_t e) {
  const int64_t m = csa ? 4 : 128;
  return EntryJob{e, PosRange{csa ? (e - 1) * m : e * m, e * m + m - 1}, e * m, -1, -1};
}

// Whether position p may be a regular request's: inside [0, max_context) and
// its block inside the block table (mb blocks a request). A row outside is
// BAD_POSITION, and its request takes the serial walk.
DSV4_HD bool PositionInTable(int64_t p, int64_t max_context, int64_t mb) {
  return p >= 0 && p < max_context && p / 128 < mb;
}

// The plan of a regular request whose n >= 1 rows hold positions p0 .. p0+n-1.
DSV4_HD WindowPlan PlanWindows(bool csa, int64_t p0, int64_t n) {
  WindowPlan w;
  w.m = csa ? 4 : 128;
  w.A = csa ? 2 : 1;
  w.p0 = p0;
  w.L = p0 + n - 1;
  w.w0 = p0 / w.m;
  w.wl = (w.L + 1) / w.m;
  return w;
}

// For a worker that meets a regular request at one of its rows rather than
// at its first: the row at position p (p % m == 0, not the request's first
// row) starts entry e = p / m's window. That entry is a middle entry iff the
// rows at positions p - (A-1)m - 1 (then e - w0 >= A) and p + m - 1 (then e
// closes) belong to the request. These are the two row offsets to check.
DSV4_HD int64_t MiddleCheckBack(bool csa) { return csa ? 5 : 1; }
DSV4_HD int64_t MiddleCheckAhead(bool csa) { return csa ? 3 : 127; }

}  // namespace dsv4
