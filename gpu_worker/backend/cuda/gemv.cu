// Decode GEMV (gemv.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device_utils.cuh"
#include "gemv.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kWarps = 8;  // warps per block (kWarps / warps_per_column output columns)
constexpr int kThreads = kWarps * kWarpSize;

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

// grid: [ceil(n / (kWarps / kSplit))], kThreads threads. The kSplit warps w = kSplit·c + p of
// block b compute column j = b·(kWarps / kSplit) + c for the kM rows: in each round of
// kUnroll·kSplit·32 chunks (16 bytes: kE = 8 elements) of w[j, :], warp p,
// lane l takes the chunks
// (u·kSplit + p)·32 + l, u < kUnroll (all its loads issued before their products); each warp sums
// its lanes, then warp p = 0 adds the kSplit warp sums in order p = 0, 1, ... (shared memory).
template <typename T, int kM, int kSplit, int kUnroll>
__global__ void __launch_bounds__(kThreads) GemvKernel(GemvArgs a) {
  static_assert(kWarps % kSplit == 0, "a block holds whole columns");
  constexpr int kE = 16 / sizeof(T);  // elements per 16-byte chunk
  constexpr int kColumns = kWarps / kSplit;
  constexpr int64_t kStride = int64_t{kUnroll} * kSplit * kWarpSize;  // chunks per round
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int part = warp % kSplit;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kColumns + warp / kSplit;
  const bool active = j < a.n;  // no early return: the block syncs below when kSplit > 1
  const int64_t chunks = a.k / kE;
  const uint4* w =
      reinterpret_cast<const uint4*>(static_cast<const T*>(a.w) + (active ? j : 0) * a.k);
  float acc[kM];
#pragma unroll
  for (int r = 0; r < kM; ++r) acc[r] = 0.0f;
  for (int64_t c0 = int64_t{part} * kWarpSize + lane; active && c0 < chunks; c0 += kStride) {
    uint4 wv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + int64_t{u} * kSplit * kWarpSize;
      wv[u] = c < chunks ? __ldg(w + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + int64_t{u} * kSplit * kWarpSize;
      if (c >= chunks) break;
      float wf[kE];
      Unpack(wv[u], T(), wf);
#pragma unroll
      for (int r = 0; r < kM; ++r) {  // kM == a.m (LaunchShape)
        float s = acc[r];
        const float4* xr = reinterpret_cast<const float4*>(a.x + r * a.k) + 2 * c;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const float4 xv = __ldg(xr + q);
          s = fmaf(Round(xv.x, T()), wf[4 * q], s);
          s = fmaf(Round(xv.y, T()), wf[4 * q + 1], s);
          s = fmaf(Round(xv.z, T()), wf[4 * q + 2], s);
          s = fmaf(Round(xv.w, T()), wf[4 * q + 3], s);
        }
        acc[r] = s;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kM; ++r) acc[r] = WarpSum(acc[r]);
  if constexpr (kSplit > 1) {
    __shared__ float partial[kWarps][kM];  // each warp's sums
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kM; ++r) partial[warp][r] = acc[r];
    }
    __syncthreads();
    if (part != 0) return;
#pragma unroll
    for (int r = 0; r < kM; ++r) {
      float s = partial[warp][r];
#pragma unroll
      for (int p = 1; p < kSplit; ++p) s += partial[warp + p][r];
      acc[r] = s;
    }
  }
  if (lane != 0 || !active) return;
#pragma unroll
  for (int r = 0; r < kM; ++r) {
    float* y = a.y + r * a.n + j;
    float v = acc[r];
    if (a.accumulate) v += *y;  // cuBLAS's beta = 1, then the bias (LaunchAddBias) as before
    if (a.bias != nullptr) v += a.bias[j];
    *y = v;
  }
}

template <typename T, int kSplit, int kUnroll>
cudaError_t LaunchShape(const GemvArgs& a, cudaStream_t stream) {
  constexpr int64_t kColumns = kWarps / kSplit;
  const unsigned blocks = static_cast<unsigned>((a.n + kColumns - 1) / kColumns);
  if (a.m == 1) {
    GemvKernel<T, 1, kSplit, kUnroll><<<blocks, kThreads, 0, stream>>>(a);
  } else if (a.m == 2) {
    GemvKernel<T, 2, kSplit, kUnroll><<<blocks, kThreads, 0, stream>>>(a);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchAs(const GemvArgs& a, GemvVariant v, cudaStream_t stream) {
  switch (v.warps_per_column * 16 + v.unroll) {
    case 1 * 16 + 4:
      return LaunchShape<T, 1, 4>(a, stream);
    case 1 * 16 + 8:
      return LaunchShape<T, 1, 8>(a, stream);
    case 2 * 16 + 4:
      return LaunchShape<T, 2, 4>(a, stream);
    case 2 * 16 + 8:
      return LaunchShape<T, 2, 8>(a, stream);
    case 4 * 16 + 4:
      return LaunchShape<T, 4, 4>(a, stream);
    case 4 * 16 + 8:
      return LaunchShape<T, 4, 8>(a, stream);
    case 8 * 16 + 4:
      return LaunchShape<T, 8, 4>(a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

bool GemvSupports(const GemvArgs& a) {
  static_assert(kGemvMaxRows == 2, "LaunchShape instantiates m = 1 and 2");
  // Blocks: n at the most (8 warps per column: one column per block).
  return a.m >= 1 && a.m <= kGemvMaxRows && a.n >= 1 && a.k >= 8 && a.k % 8 == 0 &&
         (a.w_dtype == DType::kBF16 || a.w_dtype == DType::kF16) && a.x != nullptr &&
         a.w != nullptr && a.y != nullptr && reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(a.w) % 16 == 0 && a.n <= INT32_MAX;
}

bool GemvPreferred(const GemvArgs& a) {
  return GemvSupports(a) && a.m <= kGemvPreferredMaxRows && a.k <= kGemvMaxK;
}

bool GemvVariantValid(GemvVariant v) {
  for (const GemvVariant& known : kGemvVariants) {
    if (known.warps_per_column == v.warps_per_column && known.unroll == v.unroll) return true;
  }
  return false;
}

GemvVariant GemvDefaultVariant(int64_t n) {
  static_assert(kWarps % 8 == 0, "kGemvVariants split a column over up to 8 warps");
  return n <= kGemvNarrowN ? kGemvNarrowVariant : kGemvWideVariant;
}

cudaError_t LaunchGemv(const GemvArgs& a, GemvVariant v, cudaStream_t stream) {
  if (!GemvSupports(a) || !GemvVariantValid(v)) return cudaErrorInvalidValue;
  switch (a.w_dtype) {
    case DType::kBF16:
      return LaunchAs<__nv_bfloat16>(a, v, stream);
    default:
      return LaunchAs<__half>(a, v, stream);
  }
}

cudaError_t LaunchGemv(const GemvArgs& a, cudaStream_t stream) {
  return LaunchGemv(a, GemvDefaultVariant(a.n), stream);
}

}  // namespace tandem::gpu_worker::cuda_backend
