// Host entry points that run the shared numerics (ffi/include/dsv4/numerics.h)
// on the GPU, one thread per element or row, for tests comparing device bits
// with the CPU's (tests/numerics/test_numerics_gpu.py). Debug use only: they allocate
// and synchronize. Pointers are host memory; each returns "" or an error.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dsv4 {
namespace probe {

struct In {
  const void* data = nullptr;
  size_t bytes = 0;
};
struct Out {
  void* data = nullptr;
  size_t bytes = 0;
};

enum class Op {
  kBf16Bits, kE4m3Encode, kE4m3Decode, kE8m0Pow2Ceil, kE8m0Decode, kE2m1Encode, kE2m1Decode,
  kDsFp8Tiles, kFp8Token, kMxfp4Blocks, kIndexKeys, kSoftmaxMerge, kRmsNorm, kRope,
  kHadamard128, kEpilogue, kIndexEpilogue, kIndexQueryOperand,
};

// x: the main input; aux: up to three more inputs; out: up to two outputs.
// `rows` threads each handle one row of `width` values of x (width 1 for
// elementwise ops).
std::string Run(Op op, In x, In aux0, In aux1, In aux2, Out out0, Out out1, int64_t rows,
                int64_t width);

// Sweeps every fp32 pattern through num::F32PairToE4m3 against
// num::F32ToE4m3 (NaN inputs excluded): the mismatch count and the smallest
// mismatching pattern (0xffffffff if none).
std::string SweepE4m3Pair(uint64_t* mismatches, uint32_t* first);

}  // namespace probe
}  // namespace dsv4
