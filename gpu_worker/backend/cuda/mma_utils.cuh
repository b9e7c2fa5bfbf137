// Device helpers of the tensor-core attention kernels: cp.async copies, ldmatrix, the
// mma.sync m16n8k16 bf16 instruction, the hi + lo bf16 split of f32 operands, the swizzled
// layout of K/V tiles in shared memory, and the online softmax's step on an accumulator's rows.
// Included only by .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "device_utils.cuh"  // kFullMask

namespace tandem::gpu_worker::cuda_backend {

// Element offset of chunk c of tile row r. The chunk index is XORed with r mod 8 so that the 8
// rows one ldmatrix phase reads (or one cp.async phase writes) fall in 8 distinct bank groups.
// Rows of kD bf16 (kD a multiple of 64).
template <int kD>
__device__ __forceinline__ int SwizzledOffset(int r, int c) {
  return r * kD + ((c ^ (r & 7)) << 3);
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; !valid writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }

__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c[16x8] += a[16x16] · b[16x8], bf16 operands in the mma.sync fragment layouts, f32 c.
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t Bits(__nv_bfloat162 x) {
  return *reinterpret_cast<const uint32_t*>(&x);
}

// (x, y) = hi + lo + O(2^-17·|x|): hi the bf16 pair nearest (x, y), lo the bf16 pair nearest
// the remainders. Both are multiplied, so an f32 operand keeps ~16 of its 24 bits.
__device__ __forceinline__ void SplitBf16(float x, float y, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  const float2 hf = __bfloat1622float2(h);
  hi = Bits(h);
  lo = Bits(__floats2bfloat162_rn(x - hf.x, y - hf.y));
}

// 4 bytes global -> shared, asynchronously; !valid writes zeros and reads nothing.
__device__ __forceinline__ void CpAsync4(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// 2^x for x <= 0 (softmax weights), one MUFU op; results below 2^-126 flush to 0.
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// One tile's step of the online softmax (log2 units) for the two rows a lane holds of an
// mma.sync or wgmma accumulator (row a = lane / 4 of its 16, row b = row a + 8).
struct SoftmaxStep {
  float base_a, base_b;  // the tile's weights are 2^(s - base): the new max, or 0 where a row
                         // has seen nothing yet (all -inf; no -inf - -inf = NaN)
  float corr_a, corr_b;  // the old sums and outputs are scaled by 2^(old max - base) (0 while
                         // the old max is -inf: they are still 0)
};
// tile_max_a / tile_max_b: this lane's maxima of the tile's scores in rows a and b; reduced over
// the row's 4 lanes. *m_a and *m_b, the running maxima, move to the new ones.
__device__ __forceinline__ SoftmaxStep OnlineSoftmaxStep(float tile_max_a, float tile_max_b,
                                                         float* m_a, float* m_b) {
  tile_max_a = fmaxf(tile_max_a, __shfl_xor_sync(kFullMask, tile_max_a, 1));
  tile_max_a = fmaxf(tile_max_a, __shfl_xor_sync(kFullMask, tile_max_a, 2));
  tile_max_b = fmaxf(tile_max_b, __shfl_xor_sync(kFullMask, tile_max_b, 1));
  tile_max_b = fmaxf(tile_max_b, __shfl_xor_sync(kFullMask, tile_max_b, 2));
  const float new_a = fmaxf(*m_a, tile_max_a);
  const float new_b = fmaxf(*m_b, tile_max_b);
  SoftmaxStep step;
  step.base_a = new_a == -INFINITY ? 0.0f : new_a;
  step.base_b = new_b == -INFINITY ? 0.0f : new_b;
  step.corr_a = Exp2(*m_a - step.base_a);
  step.corr_b = Exp2(*m_b - step.base_b);
  *m_a = new_a;
  *m_b = new_b;
  return step;
}

}  // namespace tandem::gpu_worker::cuda_backend
