// The numerics header exposed to Python (_dsv4_testing_cpu.numerics) so tests
// can check it bit for bit against ml_dtypes / numpy. Debug use only: every
// function writes into caller-provided C-contiguous numpy outputs.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "dsv4/entries.h"
#include "dsv4/flush.h"
#include "dsv4/indexer.h"
#include "dsv4/numerics.h"
#include "testing/testing.h"

namespace nb = nanobind;

namespace dsv4 {
namespace {

template <typename T>
using In = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;
template <typename T>
using Out = nb::ndarray<T, nb::c_contig, nb::device::cpu>;

void Require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

template <typename A, typename B>
void SameSize(const A& a, const B& b, const char* name) {
  Require(a.size() == b.size(), std::string(name) + ": input and output sizes differ");
}

// Rows of `width` values; returns the row count.
template <typename A>
size_t Rows(const A& a, size_t width, const char* name) {
  Require(a.size() % width == 0, std::string(name) + ": size not a multiple of " +
                                     std::to_string(width));
  return a.size() / width;
}

}  // namespace

void BindNumerics(nb::module_& parent) {
  nb::module_ m = parent.def_submodule("numerics", "ffi/include/dsv4/numerics.h, for tests");
  m.def("bf16_bits", [](In<float> x, Out<uint16_t> out) {
    SameSize(x, out, "bf16_bits");
    for (size_t i = 0; i < x.size(); ++i) out.data()[i] = num::F32ToBf16(x.data()[i]);
  });
  m.def("e4m3_encode", [](In<float> x, Out<uint8_t> out) {
    SameSize(x, out, "e4m3_encode");
    for (size_t i = 0; i < x.size(); ++i) out.data()[i] = num::F32ToE4m3(x.data()[i]);
  });
  m.def("e4m3_decode", [](In<uint8_t> c, Out<float> out) {
    SameSize(c, out, "e4m3_decode");
    for (size_t i = 0; i < c.size(); ++i) out.data()[i] = num::E4m3ToF32(c.data()[i]);
  });
  m.def("e8m0_pow2ceil", [](In<float> x, Out<uint8_t> out) {
    SameSize(x, out, "e8m0_pow2ceil");
    for (size_t i = 0; i < x.size(); ++i) out.data()[i] = num::Pow2CeilE8m0(x.data()[i]);
  });
  m.def("e8m0_decode", [](In<uint8_t> c, Out<float> out) {
    SameSize(c, out, "e8m0_decode");
    for (size_t i = 0; i < c.size(); ++i) out.data()[i] = num::E8m0ToF32(c.data()[i]);
  });
  m.def("e2m1_encode", [](In<float> x, Out<uint8_t> out) {
    SameSize(x, out, "e2m1_encode");
    for (size_t i = 0; i < x.size(); ++i) out.data()[i] = num::F32ToE2m1(x.data()[i]);
  });
  m.def("e2m1_decode", [](In<uint8_t> c, Out<float> out) {
    SameSize(c, out, "e2m1_decode");
    for (size_t i = 0; i < c.size(); ++i) out.data()[i] = num::E2m1ToF32(c.data()[i]);
  });
  m.def("index_query_operand", [](In<float> y, Out<int8_t> out) {
    SameSize(y, out, "index_query_operand");
    for (size_t i = 0; i < y.size(); ++i) out.data()[i] = static_cast<int8_t>(E2m1TwiceRounded(y.data()[i]));
  });
  m.def("ds_fp8_tiles", [](In<float> x, Out<uint8_t> codes, Out<uint8_t> scales) {
    size_t n = Rows(x, kNopeTile, "ds_fp8_tiles");
    SameSize(x, codes, "ds_fp8_tiles");
    Require(scales.size() == n, "ds_fp8_tiles: one scale per tile");
    for (size_t r = 0; r < n; ++r)
      scales.data()[r] = num::QuantizeDsFp8Tile(x.data() + r * kNopeTile, kNopeTile,
                                                codes.data() + r * kNopeTile);
  });
  m.def("fp8_token", [](In<float> x, Out<uint8_t> codes, Out<float> scales) {
    size_t n = Rows(x, kNopeDim, "fp8_token");
    SameSize(x, codes, "fp8_token");
    Require(scales.size() == n, "fp8_token: one scale per row");
    for (size_t r = 0; r < n; ++r)
      scales.data()[r] = num::QuantizeFp8Token(x.data() + r * kNopeDim, kNopeDim,
                                               codes.data() + r * kNopeDim);
  });
  m.def("mxfp4_blocks", [](In<float> x, Out<uint8_t> codes, Out<uint8_t> scales) {
    size_t n = Rows(x, 32, "mxfp4_blocks");
    SameSize(x, codes, "mxfp4_blocks");
    Require(scales.size() == n, "mxfp4_blocks: one scale per block");
    for (size_t r = 0; r < n; ++r)
      scales.data()[r] = num::QuantizeMxfp4Block(x.data() + r * 32, 32, codes.data() + r * 32);
  });
  m.def("index_keys", [](In<float> x, Out<uint8_t> packed, Out<uint8_t> scales) {
    size_t n = Rows(x, kIndexDim, "index_keys");
    Require(packed.size() == n * kIndexPacked && scales.size() == n * kIndexScales,
            "index_keys: outputs [n, 64] and [n, 4]");
    for (size_t r = 0; r < n; ++r)
      EncodeIndexKey(x.data() + r * kIndexDim, packed.data() + r * kIndexPacked,
                     scales.data() + r * kIndexScales);
  });
  // a, b, out: [n, 3] rows (max, sum, kv)
  m.def("softmax_merge", [](In<float> a, In<float> b, Out<float> out) {
    size_t n = Rows(a, 3, "softmax_merge");
    SameSize(a, b, "softmax_merge");
    SameSize(a, out, "softmax_merge");
    for (size_t i = 0; i < n; ++i) {
      const float* p = a.data() + 3 * i;
      const float* q = b.data() + 3 * i;
      num::SoftmaxAcc r = num::MergeAcc({p[0], p[1], p[2]}, {q[0], q[1], q[2]});
      out.data()[3 * i] = r.m;
      out.data()[3 * i + 1] = r.s;
      out.data()[3 * i + 2] = r.kv;
    }
  });
  m.def("softmax_finalize", [](In<float> a, Out<float> out) {
    size_t n = Rows(a, 3, "softmax_finalize");
    Require(out.size() == n, "softmax_finalize: one output per row");
    for (size_t i = 0; i < n; ++i) {
      const float* p = a.data() + 3 * i;
      out.data()[i] = num::FinalizeAcc({p[0], p[1], p[2]});
    }
  });
  m.def("rmsnorm", [](In<float> x, In<float> w, Out<float> out) {
    size_t d = w.size();
    Require(d % num::kSumLanes == 0, "rmsnorm: width a multiple of 32");
    size_t n = Rows(x, d, "rmsnorm");
    SameSize(x, out, "rmsnorm");
    for (size_t r = 0; r < n; ++r)
      num::RmsNorm(x.data() + r * d, w.data(), static_cast<int>(d), out.data() + r * d);
  });
  m.def("rope", [](In<float> x, In<int64_t> pos, In<float> inv_freq, Out<float> out) {
    size_t pairs = inv_freq.size();
    size_t n = Rows(x, 2 * pairs, "rope");
    Require(pos.size() == n, "rope: one position per row");
    SameSize(x, out, "rope");
    for (size_t i = 0; i < x.size(); ++i) out.data()[i] = x.data()[i];
    for (size_t r = 0; r < n; ++r)
      num::RopeInterleaved(out.data() + r * 2 * pairs, static_cast<int>(pairs), pos.data()[r],
                           inv_freq.data());
  });
  m.def("hadamard128", [](In<float> x, Out<float> out) {
    size_t n = Rows(x, num::kHadamardN, "hadamard128");
    SameSize(x, out, "hadamard128");
    for (size_t i = 0; i < x.size(); ++i) out.data()[i] = x.data()[i];
    for (size_t r = 0; r < n; ++r) num::Hadamard128(out.data() + r * num::kHadamardN);
  });
  // pooled rows [n, d] -> the stored bf16-valued rows; index=True: the indexer
  // key path (d = 128, Hadamard included).
  m.def("epilogue", [](In<float> x, In<float> norm, In<float> inv_freq, In<int64_t> pos,
                       Out<float> out, bool index) {
    size_t d = norm.size();
    size_t n = Rows(x, d, "epilogue");
    Require(pos.size() == n && inv_freq.size() == kRopeDim / 2, "epilogue: bad pos/inv_freq");
    Require(!index || d == kIndexDim, "epilogue: the index path has d = 128");
    SameSize(x, out, "epilogue");
    for (size_t i = 0; i < x.size(); ++i) out.data()[i] = x.data()[i];
    for (size_t r = 0; r < n; ++r) {
      float* row = out.data() + r * d;
      if (index)
        IndexKeyEpilogue(row, norm.data(), inv_freq.data(), pos.data()[r]);
      else
        EntryEpilogue(row, static_cast<int>(d), norm.data(), inv_freq.data(), pos.data()[r]);
    }
  });
}

}  // namespace dsv4
