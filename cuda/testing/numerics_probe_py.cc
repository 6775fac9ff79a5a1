// _dsv4_testing_cuda.numerics: the device versions of
// _dsv4_testing_cpu.numerics (same names and arguments), for tests comparing
// the bits of host and device.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <stdexcept>
#include <string>

#include "testing/numerics_probe.h"
#include "testing/testing.h"

namespace nb = nanobind;

namespace dsv4 {
namespace {

template <typename T>
using NIn = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;
template <typename T>
using NOut = nb::ndarray<T, nb::c_contig, nb::device::cpu>;

template <typename T>
probe::In I(const NIn<T>& a) {
  return {a.data(), a.size() * sizeof(T)};
}
template <typename T>
probe::Out O(NOut<T>& a) {
  return {a.data(), a.size() * sizeof(T)};
}

void Check(const std::string& err) {
  if (!err.empty()) throw std::runtime_error(err);
}

void Require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}

template <typename A, typename B>
void Elementwise(nb::module_& m, const char* name, probe::Op op) {
  m.def(name, [op, name](NIn<A> x, NOut<B> out) {
    Require(x.size() == out.size(), name);
    Check(probe::Run(op, I(x), {}, {}, {}, O(out), {}, static_cast<int64_t>(x.size()), 1));
  });
}

}  // namespace

void BindNumericsProbe(nb::module_& parent) {
  nb::module_ m = parent.def_submodule("numerics", "numerics.h run on the GPU, for tests");
  Elementwise<float, uint16_t>(m, "bf16_bits", probe::Op::kBf16Bits);
  m.def("e4m3_pair_sweep", [] {
    uint64_t count = 0;
    uint32_t first = 0;
    Check(probe::SweepE4m3Pair(&count, &first));
    return nb::make_tuple(count, first);
  }, "(mismatches, first pattern) of F32PairToE4m3 against F32ToE4m3 over all fp32");
  Elementwise<float, uint8_t>(m, "e4m3_encode", probe::Op::kE4m3Encode);
  Elementwise<uint8_t, float>(m, "e4m3_decode", probe::Op::kE4m3Decode);
  Elementwise<float, uint8_t>(m, "e8m0_pow2ceil", probe::Op::kE8m0Pow2Ceil);
  Elementwise<uint8_t, float>(m, "e8m0_decode", probe::Op::kE8m0Decode);
  Elementwise<float, uint8_t>(m, "e2m1_encode", probe::Op::kE2m1Encode);
  Elementwise<uint8_t, float>(m, "e2m1_decode", probe::Op::kE2m1Decode);
  Elementwise<float, int8_t>(m, "index_query_operand", probe::Op::kIndexQueryOperand);
  auto blocks = [&m](const char* name, probe::Op op, int64_t width, auto scale_tag) {
    using S = decltype(scale_tag);
    m.def(name, [=](NIn<float> x, NOut<uint8_t> codes, NOut<S> scales) {
      Require(x.size() % width == 0 && codes.size() == x.size() &&
                  scales.size() == x.size() / width, name);
      Check(probe::Run(op, I(x), {}, {}, {}, O(codes), O(scales),
                       static_cast<int64_t>(x.size() / width), width));
    });
  };
  blocks("ds_fp8_tiles", probe::Op::kDsFp8Tiles, 64, uint8_t{});
  blocks("fp8_token", probe::Op::kFp8Token, 448, float{});
  blocks("mxfp4_blocks", probe::Op::kMxfp4Blocks, 32, uint8_t{});
  m.def("index_keys", [](NIn<float> x, NOut<uint8_t> packed, NOut<uint8_t> scales) {
    int64_t n = static_cast<int64_t>(x.size() / 128);
    Require(x.size() % 128 == 0 && packed.size() == 64 * x.size() / 128 &&
                scales.size() == 4 * x.size() / 128, "index_keys");
    Check(probe::Run(probe::Op::kIndexKeys, I(x), {}, {}, {}, O(packed), O(scales), n, 128));
  });
  m.def("softmax_merge", [](NIn<float> a, NIn<float> b, NOut<float> out) {
    Require(a.size() % 3 == 0 && b.size() == a.size() && out.size() == a.size(), "softmax_merge");
    Check(probe::Run(probe::Op::kSoftmaxMerge, I(a), I(b), {}, {}, O(out), {},
                     static_cast<int64_t>(a.size() / 3), 3));
  });
  m.def("rmsnorm", [](NIn<float> x, NIn<float> w, NOut<float> out) {
    int64_t d = static_cast<int64_t>(w.size());
    Require(d % 32 == 0 && x.size() % d == 0 && out.size() == x.size(), "rmsnorm");
    Check(probe::Run(probe::Op::kRmsNorm, I(x), I(w), {}, {}, O(out), {},
                     static_cast<int64_t>(x.size()) / d, d));
  });
  m.def("rope", [](NIn<float> x, NIn<int64_t> pos, NIn<float> inv_freq, NOut<float> out) {
    int64_t w = 2 * static_cast<int64_t>(inv_freq.size());
    Require(x.size() % w == 0 && pos.size() == x.size() / w && out.size() == x.size(), "rope");
    Check(probe::Run(probe::Op::kRope, I(x), I(pos), I(inv_freq), {}, O(out), {},
                     static_cast<int64_t>(x.size()) / w, w));
  });
  m.def("hadamard128", [](NIn<float> x, NOut<float> out) {
    Require(x.size() % 128 == 0 && out.size() == x.size(), "hadamard128");
    Check(probe::Run(probe::Op::kHadamard128, I(x), {}, {}, {}, O(out), {},
                     static_cast<int64_t>(x.size() / 128), 128));
  });
  m.def("epilogue", [](NIn<float> x, NIn<float> norm, NIn<float> inv_freq, NIn<int64_t> pos,
                       NOut<float> out, bool index) {
    int64_t d = static_cast<int64_t>(norm.size());
    Require(x.size() % d == 0 && pos.size() == x.size() / d && inv_freq.size() == 32 &&
                out.size() == x.size() && (!index || d == 128), "epilogue");
    Check(probe::Run(index ? probe::Op::kIndexEpilogue : probe::Op::kEpilogue, I(x), I(norm),
                     I(inv_freq), I(pos), O(out), {}, static_cast<int64_t>(x.size()) / d, d));
  });
}

}  // namespace dsv4
