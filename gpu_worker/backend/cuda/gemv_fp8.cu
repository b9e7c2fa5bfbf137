// FP8 decode GEMV (gemv_fp8.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "device_utils.cuh"
#include "gemv_fp8.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kCodesPerChunk = 16;  // one 16-byte load

// 16 codes -> f32 exactly, two at a time through half2 (the conversion unit).
__device__ __forceinline__ void UnpackCvt(const uint4& v, float* out) {
  const auto* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// grid: [ceil(n / kC)], kThreads threads. Block b computes columns j = b·kC + c, c < kC, for the
// kM rows: thread t takes the k-chunks t, t + kThreads, ... (16 codes each); its sums per
// (column, row) are added over the warp (shuffles), then over the kWarps warps in warp order
// (shared memory): a fixed order, so a result does not depend on the launch.
template <int kM, int kC>
__global__ void __launch_bounds__(kThreads) GemvFp8Kernel(GemvFp8Args a) {
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kC;
  const int64_t chunks = a.k / kCodesPerChunk;
  const uint4* w = static_cast<const uint4*>(a.w);
  float acc[kC][kM];
#pragma unroll
  for (int c = 0; c < kC; ++c) {
#pragma unroll
    for (int r = 0; r < kM; ++r) acc[c][r] = 0.0f;
  }
  // The first round's weights are read before the wait: launched after the previous kernel
  // (LaunchAfterPrevious), the block streams them while that kernel (the norm, the attention,
  // SwiGLU) finishes; x and y are touched only after it.
  uint4 wv[kC];
  auto load_weights = [&](int64_t chunk) {
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      // Columns past n read the last one (their sums are not written): no branch around it.
      const int64_t j = min(j0 + c, a.n - 1);
      wv[c] = __ldg(w + j * chunks + chunk);
    }
  };
  if (threadIdx.x < chunks) load_weights(threadIdx.x);
  WaitForPreviousKernel();
  for (int64_t chunk = threadIdx.x; chunk < chunks; chunk += kThreads) {
    if (chunk != threadIdx.x) load_weights(chunk);
    float xv[kM][kCodesPerChunk];
#pragma unroll
    for (int r = 0; r < kM; ++r) {
      const float4* xr = reinterpret_cast<const float4*>(a.x + (r < a.m ? r : 0) * a.k) +
                         chunk * (kCodesPerChunk / 4);
#pragma unroll
      for (int q = 0; q < kCodesPerChunk / 4; ++q) {
        const float4 f =
            xr[q];  // not __ldg: the previous kernel wrote x while this one was resident
        xv[r][4 * q + 0] = __bfloat162float(__float2bfloat16_rn(f.x));
        xv[r][4 * q + 1] = __bfloat162float(__float2bfloat16_rn(f.y));
        xv[r][4 * q + 2] = __bfloat162float(__float2bfloat16_rn(f.z));
        xv[r][4 * q + 3] = __bfloat162float(__float2bfloat16_rn(f.w));
      }
    }
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      float wf[kCodesPerChunk];
      UnpackCvt(wv[c], wf);
#pragma unroll
      for (int r = 0; r < kM; ++r) {
        float s = acc[c][r];
#pragma unroll
        for (int e = 0; e < kCodesPerChunk; ++e) s = fmaf(xv[r][e], wf[e], s);
        acc[c][r] = s;
      }
    }
  }
  __shared__ float partial[kWarps][kC * kM];
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int c = 0; c < kC; ++c) {
#pragma unroll
    for (int r = 0; r < kM; ++r) {
      const float s = WarpSum(acc[c][r]);
      if (lane == 0) partial[warp][c * kM + r] = s;
    }
  }
  __syncthreads();
  for (int slot = threadIdx.x; slot < kC * kM; slot += kThreads) {
    const int c = slot / kM;
    const int r = slot % kM;
    const int64_t j = j0 + c;
    if (r >= a.m || j >= a.n) continue;
    float s = 0.0f;
#pragma unroll
    for (int p = 0; p < kWarps; ++p) s += partial[p][slot];
    float* y = a.y + r * a.n + j;
    float v = s * a.w_scale[j];
    if (a.accumulate) v += *y;
    if (a.bias != nullptr) v += a.bias[j];
    *y = v;
  }
}

template <int kC>
cudaError_t LaunchColumns(const GemvFp8Args& a, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((a.n + kC - 1) / kC);
  switch (a.m) {
    case 1:
      return LaunchAfterPrevious(GemvFp8Kernel<1, kC>, dim3(blocks), dim3(kThreads), 0, stream, a);
    case 2:
      return LaunchAfterPrevious(GemvFp8Kernel<2, kC>, dim3(blocks), dim3(kThreads), 0, stream, a);
    default:  // 3 or 4 rows
      static_assert(kGemvFp8MaxRows == 4, "rows 3 and 4 share the 4-row kernel");
      return LaunchAfterPrevious(GemvFp8Kernel<4, kC>, dim3(blocks), dim3(kThreads), 0, stream, a);
  }
}

}  // namespace

bool GemvFp8Supports(const GemvFp8Args& a) {
  return a.m >= 1 && a.m <= kGemvFp8MaxRows && a.n >= 1 && a.k >= kCodesPerChunk &&
         a.k % kCodesPerChunk == 0 && a.x != nullptr && a.w != nullptr && a.w_scale != nullptr &&
         a.y != nullptr && reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(a.w) % 16 == 0 && a.n <= INT32_MAX;
}

GemvFp8Variant GemvFp8DefaultVariant(int64_t m, int64_t n) {
  if (m == 1) return {n <= kGemvFp8WideN ? 8 : 4};
  return {16};
}

bool GemvFp8Preferred(const GemvFp8Args& a) {
  return GemvFp8Supports(a) && (a.m <= 2 || a.n <= kGemvFp8GemmN);
}

cudaError_t LaunchGemvFp8(const GemvFp8Args& a, GemvFp8Variant v, cudaStream_t stream) {
  if (!GemvFp8Supports(a)) return cudaErrorInvalidValue;
  switch (v.columns) {
    case 4:
      return LaunchColumns<4>(a, stream);
    case 8:
      return LaunchColumns<8>(a, stream);
    case 16:
      return LaunchColumns<16>(a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchGemvFp8(const GemvFp8Args& a, cudaStream_t stream) {
  return LaunchGemvFp8(a, GemvFp8DefaultVariant(a.m, a.n), stream);
}

}  // namespace tandem::gpu_worker::cuda_backend
