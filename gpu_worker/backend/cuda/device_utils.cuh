// Device helpers shared by the cuda backend's kernels: element conversion, warp and block
// reductions, and grid sizing for grid-stride loops. Included only by .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace tandem::gpu_worker::cuda_backend {

inline constexpr int kWarpSize = 32;
inline constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }

// Round-to-nearest-even conversions from f32 (the host's FloatToBf16 rounds the same way).
template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}
// e4m3: nearest even, finite values beyond ±448 saturated (FloatToF8E4M3's rule).
template <>
__device__ __forceinline__ __nv_fp8_e4m3 FromFloat<__nv_fp8_e4m3>(float x) {
  __nv_fp8_e4m3 out;
  out.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  return out;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

// Sum / max over the whole block, returned to every thread. blockDim.x must be a multiple of
// 32; `scratch` is shared memory of 32 floats. Safe to call repeatedly with the same scratch.
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  v = WarpSum(v);
  __syncthreads();  // a previous reduction may still be reading scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return WarpSum(lane < num_warps ? scratch[lane] : 0.0f);
}

__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return WarpMax(lane < num_warps ? scratch[lane] : -INFINITY);
}

// Programmatic dependent launch (sm_90): a kernel launched by LaunchAfterPrevious may be
// scheduled while the previous kernel of the stream still runs (hiding the launch gap of the
// small kernels that follow attention, and letting a GEMV start reading its weights); it must
// call WaitForPreviousKernel() before it reads anything the previous kernel wrote and before it
// writes anything. AllowDependentLaunch() in the previous kernel lets the next one be scheduled
// as soon as every block of this one has started. Both are no-ops before sm_90.
__device__ __forceinline__ void WaitForPreviousKernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void AllowDependentLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
template <typename... Params, typename... Args>
cudaError_t LaunchAfterPrevious(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

// Blocks for a grid-stride loop over `n` elements with `threads` per block: enough to fill any
// GPU, never zero (callers launch only for n > 0).
inline unsigned GridStrideBlocks(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, 65536));
}

// Threads for a one-block-per-row kernel over rows of `cols` elements: a multiple of 32, at
// most `max_threads`.
inline int RowBlockThreads(int64_t cols, int max_threads) {
  const int64_t rounded = (cols + kWarpSize - 1) / kWarpSize * kWarpSize;
  return static_cast<int>(std::clamp<int64_t>(rounded, kWarpSize, max_threads));
}

}  // namespace tandem::gpu_worker::cuda_backend
