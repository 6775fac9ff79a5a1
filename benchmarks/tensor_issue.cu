// What the int8 tensor-core instructions cost a Hopper scheduler, alone and
// with integer work between them: the question behind the indexer score
// loop's speed (benchmarks/RESULTS-indexer.md, run 21). Standalone; no JAX.
//
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 \
//        benchmarks/tensor_issue.cu -o /tmp/tensor_issue && /tmp/tensor_issue
//
// Every kernel runs one 512-thread CTA on each multiprocessor, four warps a
// scheduler, as the score kernel does. Operand values do not matter here.
//  - mma.sync: each warp issues 8 independent mma.m16n8k32.u8.s8 a turn, with
//    kPrmt byte permutes (the integer pipe, as the key decode) and kFfma
//    fmas (the fp32 pipe, as the head tree) after each. Reported: cycles a
//    scheduler spends per mma.
//  - wgmma: each warpgroup issues 4 wgmma.m64n64k32.u8.s8 (A from registers,
//    B from shared memory) a turn, then kPrmt permutes a thread, then waits
//    for its group. Reported: cycles a turn, against the permutes' own time
//    (4 warps a scheduler, 2 cycles a permute: the integer pipe is half rate;
//    the "none" rows time the permutes alone).
//  - wgmma with A from shared memory too, the permutes during the wgmmas or,
//    "A stored first", before them, with A written, fenced and a warpgroup
//    barrier in between (a decode feeding the tensor cores through shared
//    memory).
#include <cuda_runtime.h>

#include <cstdio>

namespace {

__device__ __forceinline__ void Prmt(unsigned& x, unsigned y) {
  asm volatile("prmt.b32 %0, %0, %1, 0x3210;" : "+r"(x) : "r"(y));
}

// What every kernel leaves: a value of its registers (so the timed work is
// not dropped) and each CTA's cycles of its timed loop.
__device__ __forceinline__ void Report(unsigned value, long long loop_cycles, unsigned* sink,
                                       long long* cycles) {
  sink[blockIdx.x * blockDim.x + threadIdx.x] = value;
  if (threadIdx.x == 0) cycles[blockIdx.x] = loop_cycles;
}

// The sum of a wgmma kernel's accumulators and permuted words.
__device__ __forceinline__ unsigned WgmmaSum(const unsigned (&d)[32], const unsigned (&x)[8]) {
  unsigned s = 0;
  for (int i = 0; i < 32; ++i) s += d[i];
  for (int i = 0; i < 8; ++i) s += x[i];
  return s;
}

template <int kPrmt, int kFfma, bool kDistinct>
__global__ void __launch_bounds__(512, 1) MmaSync(int turns, unsigned* sink, long long* cycles) {
  unsigned a[2][4], b[8][2], acc[8][4], x[8];
  float f[8];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) a[i][j] = threadIdx.x * (i + 3) + j;
  for (int i = 0; i < 8; ++i) {
    b[i][0] = threadIdx.x ^ (0x1234u + i), b[i][1] = threadIdx.x * (i + 9);
    for (int j = 0; j < 4; ++j) acc[i][j] = i + j;
    x[i] = threadIdx.x + i, f[i] = threadIdx.x * 0.5f + i;
  }
  const long long t0 = clock64();
  for (int turn = 0; turn < turns; ++turn) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      // kDistinct: the A and B registers change from mma to mma, as in the
      // score loop; else one A and one B for all (the register reuse cache)
      const unsigned(&ai)[4] = a[kDistinct ? i & 1 : 0];
      const unsigned(&bi)[2] = b[kDistinct ? i / 2 : 0];
      asm volatile(
          "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
          "{%8,%9}, {%0,%1,%2,%3};"
          : "+r"(acc[i][0]), "+r"(acc[i][1]), "+r"(acc[i][2]), "+r"(acc[i][3])
          : "r"(ai[0]), "r"(ai[1]), "r"(ai[2]), "r"(ai[3]), "r"(bi[0]), "r"(bi[1]));
#pragma unroll
      for (int k = 0; k < kPrmt; ++k) Prmt(x[k % 8], turn);
#pragma unroll
      for (int k = 0; k < kFfma; ++k)
        asm volatile("fma.rn.f32 %0, %0, %1, %1;" : "+f"(f[k % 8]) : "f"(1.0001f));
    }
  }
  const long long t1 = clock64();
  unsigned s = 0;
  for (int i = 0; i < 8; ++i) s += acc[i][0] + acc[i][1] + acc[i][2] + acc[i][3] + x[i] + __float_as_uint(f[i]);
  Report(s, t1 - t0, sink, cycles);
}

// A shared-memory matrix descriptor without swizzle (the values read do not
// matter, only that the address is valid).
__device__ __forceinline__ unsigned long long Descriptor(unsigned addr) {
  return static_cast<unsigned long long>((addr >> 4) & 0x3fff) | (128ull >> 4) << 16 |
         (256ull >> 4) << 32;
}

// One wgmma.m64n64k32.u8.s8 adding into a thread's 32 accumulators d, B
// from shared memory; A from registers (a) or shared memory (a_desc).
#define DSV4_WGMMA_ACC                                                                         \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24," \
  "%25,%26,%27,%28,%29,%30,%31}"
#define DSV4_WGMMA_ACC_OPERANDS(d)                                                             \
  "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), \
      "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]),   \
      "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), \
      "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), \
      "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
#define DSV4_WGMMA_HEAD "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n64k32.s32.u8.s8 "

__device__ __forceinline__ void WgmmaRegsA(unsigned (&d)[32], const unsigned (&a)[4],
                                           unsigned long long b_desc) {
  asm volatile(DSV4_WGMMA_HEAD DSV4_WGMMA_ACC ", {%32,%33,%34,%35}, %36, p;\n}\n"
               : DSV4_WGMMA_ACC_OPERANDS(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
}

__device__ __forceinline__ void WgmmaSharedA(unsigned (&d)[32], unsigned long long a_desc,
                                             unsigned long long b_desc) {
  asm volatile(DSV4_WGMMA_HEAD DSV4_WGMMA_ACC ", %32, %33, p;\n}\n"
               : DSV4_WGMMA_ACC_OPERANDS(d)
               : "l"(a_desc), "l"(b_desc));
}

template <int kPrmt>
__global__ void __launch_bounds__(512, 1) Wgmma(int turns, unsigned* sink, long long* cycles) {
  __shared__ __align__(128) unsigned char b_s[4][4 * 2048];   // a warpgroup's 4 k-steps of B
  for (int i = threadIdx.x; i < 4 * 2048; i += blockDim.x) reinterpret_cast<unsigned*>(b_s)[i] = i * 2654435761u;
  __syncthreads();
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(&b_s[threadIdx.x / 128][0]));
  unsigned a[4] = {threadIdx.x * 3u + 1, threadIdx.x ^ 0x5555u, threadIdx.x + 77, threadIdx.x * 5u};
  unsigned d[32], x[8];
  for (int i = 0; i < 32; ++i) d[i] = i;
  for (int i = 0; i < 8; ++i) x[i] = threadIdx.x + i;
  const long long t0 = clock64();
  for (int turn = 0; turn < turns; ++turn) {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int k = 0; k < 4; ++k) WgmmaRegsA(d, a, Descriptor(base + k * 2048));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#pragma unroll
    for (int k = 0; k < kPrmt; ++k) Prmt(x[k % 8], turn);
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  }
  const long long t1 = clock64();
  Report(WgmmaSum(d, x), t1 - t0, sink, cycles);
}

// Both operands from shared memory (wgmma "ss"): the tensor core then reads
// no registers but its accumulators. kStore: each turn first writes its A
// (64 bytes a thread, as a key decode would) after the permutes, fences it
// to the async proxy and meets its warpgroup on a named barrier, so the
// wgmmas wait for the work before them and only other warpgroups' work can
// overlap them; else the permutes run while the turn's wgmmas do.
template <int kPrmt, bool kStore>
__global__ void __launch_bounds__(512, 1) WgmmaSs(int turns, unsigned* sink, long long* cycles) {
  __shared__ __align__(128) unsigned char b_s[4 * 2048];      // B, shared by the warpgroups
  __shared__ __align__(128) unsigned char a_s[4][4 * 2048];   // a warpgroup's 4 k-steps of A
  for (int i = threadIdx.x; i < 4 * 2048 / 4; i += blockDim.x) reinterpret_cast<unsigned*>(b_s)[i] = i * 2654435761u;
  for (int i = threadIdx.x; i < 4 * 4 * 2048 / 4; i += blockDim.x) reinterpret_cast<unsigned*>(a_s)[i] = i * 40503u;
  __syncthreads();
  const int wg = threadIdx.x / 128;
  const unsigned a_base = static_cast<unsigned>(__cvta_generic_to_shared(&a_s[wg][0]));
  const unsigned b_base = static_cast<unsigned>(__cvta_generic_to_shared(&b_s[0]));
  uint4* a_mine = reinterpret_cast<uint4*>(&a_s[wg][0]) + threadIdx.x % 128;
  unsigned d[32], x[8];
  for (int i = 0; i < 32; ++i) d[i] = i;
  for (int i = 0; i < 8; ++i) x[i] = threadIdx.x + i;
  const long long t0 = clock64();
  for (int turn = 0; turn < turns; ++turn) {
    if (kStore) {
#pragma unroll
      for (int k = 0; k < kPrmt; ++k) Prmt(x[k % 8], turn);
#pragma unroll
      for (int k = 0; k < 4; ++k) a_mine[128 * k] = make_uint4(x[(2 * k) % 8], x[(2 * k + 1) % 8], x[k], turn);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory");
    }
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int k = 0; k < 4; ++k)
      WgmmaSharedA(d, Descriptor(a_base + k * 2048), Descriptor(b_base + k * 2048));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    if (!kStore) {
#pragma unroll
      for (int k = 0; k < kPrmt; ++k) Prmt(x[k % 8], turn);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  }
  const long long t1 = clock64();
  Report(WgmmaSum(d, x), t1 - t0, sink, cycles);
}

// The permutes alone, as the wgmma rows issue them: what "permutes alone"
// there assumes (2 cycles a warp's permute, four warps a scheduler).
template <int kPrmt>
__global__ void __launch_bounds__(512, 1) PermutesOnly(int turns, unsigned* sink, long long* cycles) {
  unsigned x[8];
  for (int i = 0; i < 8; ++i) x[i] = threadIdx.x + i;
  const long long t0 = clock64();
  for (int turn = 0; turn < turns; ++turn) {
#pragma unroll
    for (int k = 0; k < kPrmt; ++k) Prmt(x[k % 8], turn);
  }
  const long long t1 = clock64();
  unsigned s = 0;
  for (int i = 0; i < 8; ++i) s += x[i];
  Report(s, t1 - t0, sink, cycles);
}

int g_sms = 0;
unsigned* g_sink = nullptr;
long long* g_cycles = nullptr;
bool g_failed = false;   // any CUDA error: the exit status says so

// Cycles of CTA 0's timed loop, from a second launch (the first warms up).
template <typename Kernel>
double TurnCycles(Kernel kernel, int turns) {
  for (int rep = 0; rep < 2; ++rep) kernel<<<g_sms, 512>>>(turns, g_sink, g_cycles);
  long long c = 0;
  cudaMemcpy(&c, g_cycles, sizeof(c), cudaMemcpyDeviceToHost);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    std::printf("error: %s\n", cudaGetErrorString(e));
    g_failed = true;
  }
  return static_cast<double>(c) / turns;
}

template <int kPrmt, int kFfma, bool kDistinct>
void MmaRow() {
  const double per_mma = TurnCycles(MmaSync<kPrmt, kFfma, kDistinct>, 2000) / (8 * 4);  // 4 warps a scheduler
  std::printf("| mma.sync | %s | %2d | %d | %6.2f a mma | %5.1f |\n", kDistinct ? "changing" : "reused  ",
              kPrmt, kFfma, per_mma, 4096.0 / per_mma);
}

template <int kPrmt>
void WgmmaRow() {
  const double per_turn = TurnCycles(Wgmma<kPrmt>, 1000);
  const double macs = 4.0 * 4 * 64 * 64 * 32 / 4;   // a turn's MACs per scheduler
  std::printf("| wgmma | A regs, B shared | %3d | 0 | %7.1f a turn (permutes alone %d) | %5.1f |\n", kPrmt,
              per_turn, 4 * kPrmt * 2, macs / per_turn);
}

template <int kPrmt, bool kStore>
void WgmmaSsRow() {
  const double per_turn = TurnCycles(WgmmaSs<kPrmt, kStore>, 1000);
  const double macs = 4.0 * 4 * 64 * 64 * 32 / 4;
  std::printf("| wgmma | A, B shared%s | %3d | 0 | %7.1f a turn (permutes alone %d) | %5.1f |\n",
              kStore ? ", A stored first" : "", kPrmt, per_turn, 4 * kPrmt * 2, macs / per_turn);
}

template <int kPrmt>
void PermutesRow() {
  std::printf("| none | | %3d | 0 | %7.1f a turn (permutes alone %d) | |\n", kPrmt,
              TurnCycles(PermutesOnly<kPrmt>, 1000), 4 * kPrmt * 2);
}

}  // namespace

int main() {
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess || p.major != 9) {
    std::printf("tensor_issue needs a Hopper GPU (compute capability 9.x)\n");
    return 1;
  }
  g_sms = p.multiProcessorCount;
  if (cudaMalloc(&g_sink, g_sms * 512 * sizeof(unsigned)) != cudaSuccess ||
      cudaMalloc(&g_cycles, g_sms * sizeof(long long)) != cudaSuccess) {
    std::printf("tensor_issue: cannot allocate its buffers\n");
    return 1;
  }
  std::printf("%s, %d multiprocessors; cycles are SM clocks of one scheduler\n\n", p.name, g_sms);
  std::printf("| instruction | operands | permutes | fmas | cycles | MACs a cycle a scheduler |\n");
  std::printf("|---|---|--:|--:|--:|--:|\n");
  MmaRow<0, 0, false>();
  MmaRow<0, 0, true>();
  MmaRow<0, 2, false>();
  MmaRow<4, 0, false>();
  MmaRow<4, 2, false>();
  MmaRow<4, 2, true>();
  MmaRow<8, 0, false>();
  MmaRow<8, 4, false>();
  MmaRow<16, 0, false>();
  WgmmaRow<0>();
  WgmmaRow<32>();
  WgmmaRow<64>();
  WgmmaRow<128>();
  WgmmaRow<256>();
  PermutesRow<128>();
  PermutesRow<256>();
  WgmmaSsRow<0, false>();
  WgmmaSsRow<64, false>();
  WgmmaSsRow<128, false>();
  WgmmaSsRow<256, false>();
  WgmmaSsRow<0, true>();
  WgmmaSsRow<64, true>();
  WgmmaSsRow<128, true>();
  WgmmaSsRow<256, true>();
  cudaFree(g_sink);
  cudaFree(g_cycles);
  return g_failed ? 1 : 0;
}
