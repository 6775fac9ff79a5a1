// The shared numerics run on the device (see numerics_probe.h).
#include <cuda_runtime.h>

#include <vector>

#include "dsv4/entries.h"
#include "dsv4/flush.h"
#include "dsv4/indexer.h"
#include "dsv4/numerics.h"
#include "testing/numerics_probe.h"

namespace dsv4 {
namespace probe {
namespace {

struct Args {
  const void* x;
  const void* aux0;
  const void* aux1;
  const void* aux2;
  void* out0;
  void* out1;
  int64_t rows, width;
};

template <typename T>
__device__ const T* P(const void* p) {
  return static_cast<const T*>(p);
}
template <typename T>
__device__ T* M(void* p) {
  return static_cast<T*>(p);
}

__global__ void ProbeKernel(Op op, Args a) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= a.rows) return;
  const int64_t w = a.width;
  const float* xf = P<float>(a.x) + r * w;
  switch (op) {
    case Op::kBf16Bits: M<uint16_t>(a.out0)[r] = num::F32ToBf16(*xf); break;
    case Op::kE4m3Encode: M<uint8_t>(a.out0)[r] = num::F32ToE4m3(*xf); break;
    case Op::kE4m3Decode: M<float>(a.out0)[r] = num::E4m3ToF32(P<uint8_t>(a.x)[r]); break;
    case Op::kE8m0Pow2Ceil: M<uint8_t>(a.out0)[r] = num::Pow2CeilE8m0(*xf); break;
    case Op::kE8m0Decode: M<float>(a.out0)[r] = num::E8m0ToF32(P<uint8_t>(a.x)[r]); break;
    case Op::kE2m1Encode: M<uint8_t>(a.out0)[r] = num::F32ToE2m1(*xf); break;
    case Op::kE2m1Decode: M<float>(a.out0)[r] = num::E2m1ToF32(P<uint8_t>(a.x)[r]); break;
    case Op::kIndexQueryOperand: M<int8_t>(a.out0)[r] = static_cast<int8_t>(E2m1TwiceRounded(*xf)); break;
    case Op::kDsFp8Tiles:
      M<uint8_t>(a.out1)[r] = num::QuantizeDsFp8Tile(xf, static_cast<int>(w), M<uint8_t>(a.out0) + r * w);
      break;
    case Op::kFp8Token:
      M<float>(a.out1)[r] = num::QuantizeFp8Token(xf, static_cast<int>(w), M<uint8_t>(a.out0) + r * w);
      break;
    case Op::kMxfp4Blocks:
      M<uint8_t>(a.out1)[r] = num::QuantizeMxfp4Block(xf, static_cast<int>(w), M<uint8_t>(a.out0) + r * w);
      break;
    case Op::kIndexKeys:
      EncodeIndexKey(xf, M<uint8_t>(a.out0) + r * kIndexPacked, M<uint8_t>(a.out1) + r * kIndexScales);
      break;
    case Op::kSoftmaxMerge: {
      const float* b = P<float>(a.aux0) + r * 3;
      num::SoftmaxAcc m = num::MergeAcc({xf[0], xf[1], xf[2]}, {b[0], b[1], b[2]});
      float* o = M<float>(a.out0) + r * 3;
      o[0] = m.m;
      o[1] = m.s;
      o[2] = m.kv;
      break;
    }
    case Op::kRmsNorm:
      num::RmsNorm(xf, P<float>(a.aux0), static_cast<int>(w), M<float>(a.out0) + r * w);
      break;
    case Op::kRope: {
      float* o = M<float>(a.out0) + r * w;
      for (int64_t c = 0; c < w; ++c) o[c] = xf[c];
      num::RopeInterleaved(o, static_cast<int>(w / 2), P<int64_t>(a.aux0)[r], P<float>(a.aux1));
      break;
    }
    case Op::kHadamard128: {
      float* o = M<float>(a.out0) + r * w;
      for (int64_t c = 0; c < w; ++c) o[c] = xf[c];
      num::Hadamard128(o);
      break;
    }
    case Op::kEpilogue:
    case Op::kIndexEpilogue: {
      // aux0 = norm[w], aux1 = inv_freq[32], aux2 = pos i64[rows]
      float* o = M<float>(a.out0) + r * w;
      for (int64_t c = 0; c < w; ++c) o[c] = xf[c];
      if (op == Op::kIndexEpilogue)
        IndexKeyEpilogue(o, P<float>(a.aux0), P<float>(a.aux1), P<int64_t>(a.aux2)[r]);
      else
        EntryEpilogue(o, static_cast<int>(w), P<float>(a.aux0), P<float>(a.aux1), P<int64_t>(a.aux2)[r]);
      break;
    }
  }
}

// Every fp32 bit pattern u through F32PairToE4m3 (the instruction on sm_89+)
// against F32ToE4m3, u paired with ~u so both halves see every pattern:
// counts mismatches, NaN inputs apart, and keeps the smallest such u.
__global__ void E4m3PairSweepKernel(unsigned long long* mismatches, unsigned* first) {
  unsigned long long bad = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < (uint64_t{1} << 32); i += stride) {
    const uint32_t u = static_cast<uint32_t>(i), v = ~u;
    const float x0 = num::BitsFloat(u), x1 = num::BitsFloat(v);
    const bool nan0 = (u & 0x7fffffffu) > 0x7f800000u, nan1 = (v & 0x7fffffffu) > 0x7f800000u;
    const uint16_t got = num::F32PairToE4m3(x0, x1);
    const bool ok0 = nan0 || (got & 0xffu) == num::F32ToE4m3(x0);
    const bool ok1 = nan1 || (got >> 8) == num::F32ToE4m3(x1);
    if (!ok0 || !ok1) {
      ++bad;
      atomicMin(first, ok0 ? v : u);
    }
  }
  if (bad) atomicAdd(mismatches, bad);
}

// Device copies of the host buffers, freed on scope exit.
struct DeviceBuffers {
  std::vector<void*> ptrs;
  ~DeviceBuffers() {
    for (void* p : ptrs) cudaFree(p);
  }
  cudaError_t Upload(const void* host, size_t bytes, void** dev) {
    *dev = nullptr;
    if (bytes == 0) return cudaSuccess;
    cudaError_t e = cudaMalloc(dev, bytes);
    if (e != cudaSuccess) return e;
    ptrs.push_back(*dev);
    return host ? cudaMemcpy(*dev, host, bytes, cudaMemcpyHostToDevice) : cudaSuccess;
  }
};

}  // namespace

std::string Run(Op op, In x, In aux0, In aux1, In aux2, Out out0, Out out1, int64_t rows,
                int64_t width) {
  DeviceBuffers bufs;
  Args a{};
  void* d[6];
  cudaError_t e = cudaSuccess;
  const In ins[4] = {x, aux0, aux1, aux2};
  for (int i = 0; i < 4 && e == cudaSuccess; ++i) e = bufs.Upload(ins[i].data, ins[i].bytes, &d[i]);
  if (e == cudaSuccess) e = bufs.Upload(nullptr, out0.bytes, &d[4]);
  if (e == cudaSuccess) e = bufs.Upload(nullptr, out1.bytes, &d[5]);
  if (e != cudaSuccess) return std::string("probe upload: ") + cudaGetErrorString(e);
  a.x = d[0];
  a.aux0 = d[1];
  a.aux1 = d[2];
  a.aux2 = d[3];
  a.out0 = d[4];
  a.out1 = d[5];
  a.rows = rows;
  a.width = width;
  const int threads = 128;
  if (rows > 0) {
    unsigned blocks = static_cast<unsigned>((rows + threads - 1) / threads);
    ProbeKernel<<<blocks, threads>>>(op, a);
  }
  e = cudaGetLastError();
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e == cudaSuccess && out0.bytes) e = cudaMemcpy(out0.data, d[4], out0.bytes, cudaMemcpyDeviceToHost);
  if (e == cudaSuccess && out1.bytes) e = cudaMemcpy(out1.data, d[5], out1.bytes, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) return std::string("probe: ") + cudaGetErrorString(e);
  return "";
}

std::string SweepE4m3Pair(uint64_t* mismatches, uint32_t* first) {
  DeviceBuffers bufs;
  void *d_count, *d_first;
  cudaError_t e = bufs.Upload(nullptr, sizeof(unsigned long long), &d_count);
  if (e == cudaSuccess) e = bufs.Upload(nullptr, sizeof(unsigned), &d_first);
  if (e == cudaSuccess) e = cudaMemset(d_count, 0, sizeof(unsigned long long));
  if (e == cudaSuccess) e = cudaMemset(d_first, 0xff, sizeof(unsigned));
  if (e != cudaSuccess) return std::string("sweep upload: ") + cudaGetErrorString(e);
  E4m3PairSweepKernel<<<1024, 256>>>(static_cast<unsigned long long*>(d_count),
                                     static_cast<unsigned*>(d_first));
  e = cudaGetLastError();
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaMemcpy(mismatches, d_count, sizeof(uint64_t), cudaMemcpyDeviceToHost);
  if (e == cudaSuccess) e = cudaMemcpy(first, d_first, sizeof(uint32_t), cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) return std::string("sweep: ") + cudaGetErrorString(e);
  return "";
}

}  // namespace probe
}  // namespace dsv4
