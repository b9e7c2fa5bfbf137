// Device helpers of the Hopper (sm_90a) attention kernel: wgmma.mma_async m64n128k16 with bf16
// operands and f32 accumulators, the shared-memory matrix descriptors it reads, the 128-byte
// swizzled tile layout those descriptors describe, the shared-memory barriers (mbarrier) that
// hand tiles between the loading warpgroup and the computing warpgroups, and the tensor memory
// accelerator's (TMA) tile copies that fill them. Included only by
// window_attention_hopper.cu, which is compiled for sm_90a alone (the instructions exist only
// there).
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstdint>

namespace tandem::gpu_worker::cuda_backend::hopper {

// A tile of kRows rows x 128 bf16 in shared memory, as two 64-column halves [2][kRows][64]: each
// row of a half is 128 bytes, and its 16-byte chunk c sits at chunk c ^ (row mod 8), the
// hardware's 128-byte swizzle (address bits 4-6 XOR bits 7-9, so the tile must be 1024-byte
// aligned). One layout serves both operand orientations wgmma reads: K-major (Q and K, rows =
// M or N, the 128 columns the reduction) and MN-major (V, rows = the reduction). A half is what
// a TMA box of 64 columns x kRows rows writes with CU_TENSOR_MAP_SWIZZLE_128B.
template <int kRows>
__device__ __forceinline__ int TileOffset(int row, int chunk) {  // elements; chunk in [0, 16)
  return ((chunk >> 3) * kRows + row) * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}
template <int kRows>
inline constexpr int kHalfBytes = kRows * 128;

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The 64-bit shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address,
// leading- and stride-dimension byte offsets (each >> 4 in 14 bits), 128-byte swizzle (mode 1 in
// bits 62-63), base offset 0 (atoms 1024-byte aligned).
__device__ __forceinline__ uint64_t Descriptor(uint32_t smem_addr, uint32_t leading_bytes,
                                               uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) |
         static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32 | uint64_t{1} << 62;
}
// K-major operand (rows x 16 reduction columns at the address): 8-row groups 1024 bytes apart;
// the leading offset is unused with this swizzle (1 by convention). Step along the reduction
// within a half by adding 32 bytes per 16 columns.
__device__ __forceinline__ uint64_t KMajorDescriptor(uint32_t smem_addr) {
  return Descriptor(smem_addr, 16, 1024);
}
// MN-major operand of a [2][kRows][64] tile (rows = 16 reduction steps at the address, the 128
// columns = N): the two 64-column halves kHalfBytes apart (leading), 8-row groups 1024 apart
// (stride). Step along the reduction by 16 rows = 2048 bytes.
template <int kRows>
__device__ __forceinline__ uint64_t MnMajorDescriptor(uint32_t smem_addr) {
  return Descriptor(smem_addr, kHalfBytes<kRows>, 1024);
}

// wgmma's ordering instructions: fence before the first wgmma that reads registers written by
// other instructions; commit the issued ones as a group; wait until at most kPending groups of
// this warpgroup are in flight.
__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Generic-proxy shared-memory writes (st.shared, cp.async) made visible to wgmma's async proxy;
// each writing thread runs it after its writes and before the barrier that publishes them.
__device__ __forceinline__ void FenceSharedForWgmma() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving reads or writes of accumulator registers across a wgmma wait:
// the hardware writes them asynchronously, which the asm statements' operands do not show.
template <int kN>
__device__ __forceinline__ void PinRegisters(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for A fragments a wgmma still reads: keeps them live (their registers not reused)
// until the wait that this follows.
template <int kN, int kM>
__device__ __forceinline__ void PinRegisters(uint32_t (&a)[kN][kM]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
#pragma unroll
    for (int j = 0; j < kM; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
  }
}

// d[64 x 128] (+)= a[64 x 16] · b[16 x 128] per warpgroup, a and b K-major in shared memory.
// accumulate = 0 overwrites d. Accumulator layout: warp w of the warpgroup holds rows 16w + lane/4
// (d[4n], d[4n + 1]) and 16w + lane/4 + 8 (d[4n + 2], d[4n + 3]) at columns 8n + 2(lane % 4)
// + {0, 1}, n in [0, 16).
__device__ __forceinline__ void WgmmaSharedShared(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                  int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// d[64 x 128] += a[64 x 16] · b[16 x 128], a in registers (the accumulator layout's rows, bf16
// pairs: a[0] row lane/4 columns 2(lane % 4) + {0, 1}, a[1] row + 8, a[2] and a[3] the same at
// columns + 8), b MN-major in shared memory.
__device__ __forceinline__ void WgmmaRegisterShared(float (&d)[64], const uint32_t (&a)[4],
                                                    uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// Moves registers between the warpgroups of a block: each thread of this warpgroup gets
// kRegisters (a multiple of 8 in [24, 256]); decrease in the warpgroups that need few so the
// others can increase.
template <int kRegisters, bool kIncrease>
__device__ __forceinline__ void SetMaxRegisters() {
  if constexpr (kIncrease) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
  }
}

// Barrier `id` (1-15; 0 is __syncthreads') of `threads` threads, a multiple of 32.
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrives on barrier `id` without waiting (the other threads of its count wait).
__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// A shared-memory barrier (8 bytes, 8-byte aligned) completing a phase when `count` threads
// have arrived and the bytes of bulk copies the phase expects (BarrierExpectBytes) have landed;
// phases alternate parity 0, 1, 0, ... Arrive releases the thread's prior writes, a completed
// wait acquires them.
__device__ __forceinline__ void BarrierInit(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddress(bar)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void BarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(SmemAddress(bar)) : "memory");
}
// Arrives on the barrier once all of this thread's earlier cp.async copies have landed (the
// arrival counts toward the barrier's count: .noinc).
__device__ __forceinline__ void CpAsyncArriveOnBarrier(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(SmemAddress(bar))
               : "memory");
}
// Adds `bytes` to the transactions the barrier's current phase waits for (no arrival): the phase
// completes once its arrivals are in and that many bytes of bulk copies (TmaLoad3d) have landed.
__device__ __forceinline__ void BarrierExpectBytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddress(bar)),
               "r"(bytes)
               : "memory");
}

// Brings the tensor map (a kernel parameter) into the cache before the first TmaLoad3d.
__device__ __forceinline__ void PrefetchTensorMap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// The tensor memory accelerator copies the box of `map` at coordinates (x, y, z) (innermost
// first, in elements) into shared memory at `dst` (laid out and swizzled as the map says) and
// counts its bytes on `bar` (BarrierExpectBytes) when they have landed. One thread issues it.
__device__ __forceinline__ void TmaLoad3d(const CUtensorMap* map, void* dst, uint64_t* bar, int x,
                                          int y, int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(SmemAddress(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(SmemAddress(bar))
      : "memory");
}

// Returns once the phase of parity `parity` has completed.
__device__ __forceinline__ void BarrierWait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nbarrier_wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra barrier_wait;\n}\n" ::"r"(SmemAddress(bar)),
      "r"(parity)
      : "memory");
}

}  // namespace tandem::gpu_worker::cuda_backend::hopper
