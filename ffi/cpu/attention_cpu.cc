// CPU handler of attention (operands in attention.h, rules in docs/design/operations.md
// and dsv4_jax/ops/attention.py). Per token: the rows it sees are collected as
// bf16 values in a fixed order — the window by position (t-127 .. t: the ring
// before the chunk, then the chunk's rows), then the CSA picks in column order
// or the HCA entries in index order — and each head runs the two-pass softmax
// of the contract over them. Walking the window by position makes a prefill
// chunk sum in the order that decoding its tokens one by one does, so the two
// give the same bits.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu/handlers_cpu.h"
#include "dsv4/attention.h"

namespace dsv4 {
namespace {

constexpr float kNegInf = -INFINITY;

// What append stores for the chunk's rows, read back as bf16 values (fp32),
// and for each slot its usable rows sorted by (position, row).
struct ChunkView {
  std::vector<float> values;                                   // [T, 512]
  std::vector<std::vector<std::pair<int32_t, int64_t>>> by_slot;  // slot -> (pos, row)
  std::vector<int64_t> first_pos;                              // p0 per slot
};

bool RowOk(const AttentionArgs& a, int64_t t) {
  const int64_t s = a.slot[t];
  return s >= 0 && s < a.R && QueryPositionOk(a.pos[t], a.MB);
}

ChunkView ViewChunk(const AttentionArgs& a, int fmt) {
  ChunkView v;
  v.values.assign(static_cast<size_t>(a.T) * kHeadDim, 0.f);
  v.by_slot.resize(static_cast<size_t>(a.R));
  v.first_pos.assign(static_cast<size_t>(a.R), INT64_MAX);
  // one-entry pool in the call's format: encode, then decode, as append + a read do
  alignas(4) uint8_t nope[kNopeDim * 2];
  alignas(4) uint16_t rope[kRopeDim];
  float scale[kNopeTiles];
  EntryPool one;
  one.fmt = fmt;
  one.nope = nope;
  one.rope = rope;
  one.scale = reinterpret_cast<uint8_t*>(scale);
  float row[kHeadDim];
  uint16_t back[kHeadDim];
  for (int64_t r = 0; r < a.T; ++r) {
    if (!RowOk(a, r)) continue;
    const int64_t s = a.slot[r];
    v.first_pos[s] = std::min<int64_t>(v.first_pos[s], a.pos[r]);
    const uint16_t* x = a.chunk_kv + r * kHeadDim;
    if (!num::RowIsFinite(x, kHeadDim)) continue;   // append drops it
    for (int c = 0; c < kHeadDim; ++c) row[c] = num::Bf16ToF32(x[c]);
    EncodeEntry(one, 0, row);
    DecodeEntry(one, 0, back);
    for (int c = 0; c < kHeadDim; ++c) v.values[r * kHeadDim + c] = num::Bf16ToF32(back[c]);
    v.by_slot[s].emplace_back(a.pos[r], r);
  }
  for (auto& rows : v.by_slot) std::sort(rows.begin(), rows.end());
  return v;
}

// Appends the pool's entry e (bf16 values as fp32) to `rows`.
void AddEntry(const EntryPool& pool, int64_t e, std::vector<float>* rows) {
  uint16_t bits[kHeadDim];
  DecodeEntry(pool, e, bits);
  for (int c = 0; c < kHeadDim; ++c) rows->push_back(num::Bf16ToF32(bits[c]));
}

// An int32 operand read as it is, and a dropped item counted
// (AttnCompressedItem's load and count on the host).
struct LoadPlain {
  int32_t operator()(const int32_t* p) const { return *p; }
};
struct CountOnHost {
  ErrorCounts errors;
  int64_t t;  // the query's row
  void operator()(int err) const { CountError(errors, err, t); }
};

// The rows token t (slot s, position p) sees, in the handler's fixed order.
void CollectRows(const AttentionArgs& a, int64_t l, int64_t lk, const ChunkView* chunk,
                 int64_t t, std::vector<float>* rows) {
  const int64_t s = a.slot[t], p = a.pos[t];
  const int64_t p0 = chunk ? chunk->first_pos[s] : INT64_MAX;
  const int64_t lo = std::max<int64_t>(0, p - kWindow + 1);
  for (int64_t w = lo; w <= p && w < p0; ++w) {           // the ring
    const int64_t e = AttnRingEntry(a, l, s, w);
    if (a.swa_pos[e] == w) AddEntry(a.ring, e, rows);
    else CountError(a.errors, kStaleWindow, t);                       // overwritten, a gap or a rewind
  }
  if (chunk) {                                            // the chunk's rows, by position
    const auto& mine = chunk->by_slot[s];
    auto it = std::lower_bound(mine.begin(), mine.end(),
                               std::make_pair(static_cast<int32_t>(std::max(lo, p0)), int64_t{0}));
    for (; it != mine.end() && it->first <= p; ++it) {
      const float* v = chunk->values.data() + it->second * kHeadDim;
      rows->insert(rows->end(), v, v + kHeadDim);
    }
  }
  if (a.kind != kAttnSwa) {                     // the picks or the HCA entries, in order
    const int64_t n = a.kind == kAttnCsa ? a.K : HcaVisible(p, a.MB);
    for (int64_t j = 0; j < n; ++j) {
      int64_t e = 0;
      if (AttnCompressedItem(a, lk, t, s, p, j, LoadPlain(), CountOnHost{a.errors, t}, &e))
        AddEntry(a.pool, e, rows);
    }
  }
}

// One head over `n` rows: the contract's steps 1-7 (two passes).
void AttendHead(const float* q, const float* rows, int64_t n, float sink, int64_t t,
                const float* inv_freq, std::vector<float>* logits, uint16_t* out, float* lse) {
  float m = sink;
  for (int64_t j = 0; j < n; ++j) {
    const float* v = rows + j * kHeadDim;
    float dot = 0.f;
    for (int c = 0; c < kHeadDim; ++c) dot = dot + q[c] * v[c];
    (*logits)[j] = dot * AttnScale();
    m = num::MaxF(m, (*logits)[j]);
  }
  if (m == kNegInf) {                      // no row and a -inf sink: nothing to attend
    std::memset(out, 0, kHeadDim * sizeof(uint16_t));
    *lse = kNegInf;
    return;
  }
  float acc[kHeadDim] = {0.f};
  float denom = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float e = expf((*logits)[j] - m);
    denom = denom + e;
    const float w = num::RoundBf16(e);
    const float* v = rows + j * kHeadDim;
    for (int c = 0; c < kHeadDim; ++c) acc[c] = acc[c] + w * v[c];
  }
  denom = denom + expf(sink - m);
  AttnFinishHead(acc, denom, t, inv_freq, out);
  *lse = m + logf(denom);
}

ffi::Error AttentionImpl(DSV4_PARAMS(DSV4_ATTENTION_OPERANDS)) {
  AttentionArgs a;
  DSV4_RETURN_IF_ERROR(ValidateAttention(DSV4_NAMES(DSV4_ATTENTION_OPERANDS), &a));
  const int64_t heads = a.T * a.H;
  std::memset(a.out, 0, static_cast<size_t>(heads) * kHeadDim * sizeof(uint16_t));
  for (int64_t i = 0; i < heads; ++i) a.lse[i] = kNegInf;
  int64_t l, lk = 0;
  if (!HostLayerOk(a.layer, a.L, a.errors, &l)) return ffi::Error::Success();
  if (a.kind != kAttnSwa && !HostLayerOk(a.comp_layer, a.Lk, a.errors, &lk))
    return ffi::Error::Success();
  ChunkView chunk;
  if (a.has_chunk) chunk = ViewChunk(a, a.ring.fmt);
  std::vector<float> rows, qf(kHeadDim * a.H), logits;
  for (int64_t t = 0; t < a.T; ++t) {
    const int64_t s = a.slot[t];
    if (s == -1) continue;
    if (s < 0 || s >= a.R) {
      CountError(a.errors, kBadSlot, t);
      continue;
    }
    if (!QueryPositionOk(a.pos[t], a.MB)) {
      CountError(a.errors, kBadPosition, t);
      continue;
    }
    const uint16_t* qt = a.q + t * a.H * kHeadDim;
    if (!num::RowIsFinite(qt, a.H * kHeadDim)) {
      CountError(a.errors, kNonfinite, t);
      continue;
    }
    rows.clear();
    CollectRows(a, l, lk, a.has_chunk ? &chunk : nullptr, t, &rows);
    const int64_t n = static_cast<int64_t>(rows.size()) / kHeadDim;
    logits.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < a.H * kHeadDim; ++i) qf[i] = num::Bf16ToF32(qt[i]);
    for (int64_t h = 0; h < a.H; ++h)
      AttendHead(qf.data() + h * kHeadDim, rows.data(), n, a.sink[h], a.pos[t], a.inv_freq,
                 &logits, a.out + (t * a.H + h) * kHeadDim, a.lse + t * a.H + h);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionCpu, AttentionImpl, DSV4_BIND(DSV4_ATTENTION_OPERANDS, ffi::Ffi::Bind()));

}  // namespace dsv4
