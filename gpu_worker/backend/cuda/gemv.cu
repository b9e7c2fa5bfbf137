// Decode GEMV (gemv.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device_utils.cuh"
#include "gemv.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kWarps = 8;  // output columns per block
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kUnroll = 4;  // 16-byte weight loads in flight per lane

// Unpacks 8 weights of a 16-byte chunk to f32.
__device__ __forceinline__ void Unpack(const uint4& v, __nv_bfloat16, float* out) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void Unpack(const uint4& v, __half, float* out) {
  const auto* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// x rounded to the weight dtype and back (round to nearest even, as LaunchConvertFromF32).
__device__ __forceinline__ float Round(float x, __nv_bfloat16) {
  return __bfloat162float(__float2bfloat16_rn(x));
}
__device__ __forceinline__ float Round(float x, __half) { return __half2float(__float2half_rn(x)); }

// grid: [ceil(n / kWarps)], kThreads threads. Warp w of block b computes column j = b·kWarps + w
// for the kM rows: lane l takes the 8-element chunks l, l + 32, ... of w[j, :] (kUnroll loads
// issued before their products), then the warp sums its lanes.
template <typename T, int kM>
__global__ void __launch_bounds__(kThreads) GemvKernel(GemvArgs a) {
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (j >= a.n) return;
  const int64_t chunks = a.k / 8;
  const uint4* w = reinterpret_cast<const uint4*>(static_cast<const T*>(a.w) + j * a.k);
  float acc[kM];
#pragma unroll
  for (int r = 0; r < kM; ++r) acc[r] = 0.0f;
  for (int64_t c0 = lane; c0 < chunks; c0 += kUnroll * kWarpSize) {
    uint4 wv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * kWarpSize;
      wv[u] = c < chunks ? __ldg(w + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + u * kWarpSize;
      if (c >= chunks) break;
      float wf[8];
      Unpack(wv[u], T(), wf);
#pragma unroll
      for (int r = 0; r < kM; ++r) {
        const float4* xr = reinterpret_cast<const float4*>(a.x + r * a.k) + 2 * c;
        const float4 x0 = __ldg(xr);
        const float4 x1 = __ldg(xr + 1);
        float s = acc[r];
        s = fmaf(Round(x0.x, T()), wf[0], s);
        s = fmaf(Round(x0.y, T()), wf[1], s);
        s = fmaf(Round(x0.z, T()), wf[2], s);
        s = fmaf(Round(x0.w, T()), wf[3], s);
        s = fmaf(Round(x1.x, T()), wf[4], s);
        s = fmaf(Round(x1.y, T()), wf[5], s);
        s = fmaf(Round(x1.z, T()), wf[6], s);
        s = fmaf(Round(x1.w, T()), wf[7], s);
        acc[r] = s;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kM; ++r) acc[r] = WarpSum(acc[r]);
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < kM; ++r) {
    float* y = a.y + r * a.n + j;
    float v = acc[r];
    if (a.accumulate) v += *y;  // cuBLAS's beta = 1, then the bias (LaunchAddBias) as before
    if (a.bias != nullptr) v += a.bias[j];
    *y = v;
  }
}

template <typename T>
cudaError_t LaunchAs(const GemvArgs& a, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((a.n + kWarps - 1) / kWarps);
  if (a.m == 1) {
    GemvKernel<T, 1><<<blocks, kThreads, 0, stream>>>(a);
  } else {
    GemvKernel<T, 2><<<blocks, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace

bool GemvSupports(const GemvArgs& a) {
  static_assert(kGemvMaxRows == 2, "LaunchAs instantiates m = 1 and 2");
  return a.m >= 1 && a.m <= kGemvMaxRows && a.n >= 1 && a.k >= 8 && a.k % 8 == 0 &&
         a.k <= kGemvMaxK &&
         (a.w_dtype == DType::kBF16 || a.w_dtype == DType::kF16) && a.x != nullptr &&
         a.w != nullptr && a.y != nullptr && reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(a.w) % 16 == 0 && (a.n + kWarps - 1) / kWarps <= INT32_MAX;
}

cudaError_t LaunchGemv(const GemvArgs& a, cudaStream_t stream) {
  if (!GemvSupports(a)) return cudaErrorInvalidValue;
  return a.w_dtype == DType::kBF16 ? LaunchAs<__nv_bfloat16>(a, stream)
                                   : LaunchAs<__half>(a, stream);
}

}  // namespace tandem::gpu_worker::cuda_backend
