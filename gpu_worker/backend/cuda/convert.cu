#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

#include "convert.cuh"
#include "device_utils.cuh"
#include "tandem/gpu_worker/random_values.h"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void ConvertKernel(const float* __restrict__ src, T* __restrict__ dst, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = FromFloat<T>(src[i]);
  }
}

// The same over 8 values per thread and step: two 16-byte loads, one 16-byte store (src and dst
// 16-byte aligned); the count % 8 values past the last group one per thread.
template <typename T>
__global__ void ConvertBy8Kernel(const float* __restrict__ src, T* __restrict__ dst,
                                 int64_t count) {
  static_assert(sizeof(T) == 2, "8 values of T fill 16 bytes");
  const int64_t groups = count / 8;
  const int64_t first = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = first; i < groups; i += stride) {
    const float4 lo = reinterpret_cast<const float4*>(src)[2 * i];
    const float4 hi = reinterpret_cast<const float4*>(src)[2 * i + 1];
    union {
      T values[8];
      uint4 bits;
    } out;
    out.values[0] = FromFloat<T>(lo.x), out.values[1] = FromFloat<T>(lo.y);
    out.values[2] = FromFloat<T>(lo.z), out.values[3] = FromFloat<T>(lo.w);
    out.values[4] = FromFloat<T>(hi.x), out.values[5] = FromFloat<T>(hi.y);
    out.values[6] = FromFloat<T>(hi.z), out.values[7] = FromFloat<T>(hi.w);
    reinterpret_cast<uint4*>(dst)[i] = out.bits;
  }
  if (first < count % 8) dst[groups * 8 + first] = FromFloat<T>(src[groups * 8 + first]);
}

__global__ void FillKernel(float* __restrict__ dst, float value, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = value;
  }
}

template <typename T>
__global__ void RandomFillKernel(T* __restrict__ dst, int64_t count, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = FromFloat<T>(RandomSigned(seed, static_cast<uint64_t>(i), scale));
  }
}

__global__ void DequantizeF8Kernel(const uint8_t* __restrict__ codes,
                                   const float* __restrict__ scale, __nv_bfloat16* __restrict__ dst,
                                   int64_t rows, int64_t cols) {
  const int64_t count = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    __nv_fp8_e4m3 code;
    code.__x = codes[i];
    dst[i] = __float2bfloat16_rn(static_cast<float>(code) * scale[i / cols]);
  }
}

// The same, 16 codes per thread (cols a multiple of 16, 16-byte aligned rows): one 16-byte load,
// two 16-byte stores, one row index per 16 codes.
__global__ void DequantizeF8x16Kernel(const uint4* __restrict__ codes,
                                      const float* __restrict__ scale, uint4* __restrict__ dst,
                                      int64_t rows, int64_t cols) {
  const int64_t groups_per_row = cols / 16;
  const int64_t count = rows * groups_per_row;
  for (int64_t g = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; g < count;
       g += int64_t{gridDim.x} * blockDim.x) {
    const float s = scale[g / groups_per_row];
    const uint4 in = codes[g];
    const auto* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&in);
    uint4 out[2];
    auto* o = reinterpret_cast<__nv_bfloat162*>(out);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));
      o[i] = __floats2bfloat162_rn(f.x * s, f.y * s);
    }
    dst[2 * g] = out[0];
    dst[2 * g + 1] = out[1];
  }
}

// One block per row: the row's absmax, then its codes.
__global__ void QuantizeRowsF8Kernel(const float* __restrict__ x, uint8_t* __restrict__ codes,
                                     float* __restrict__ scale, int64_t cols) {
  __shared__ float scratch[kWarpSize];
  const float* row = x + blockIdx.x * cols;
  uint8_t* out = codes + blockIdx.x * cols;
  float amax = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) amax = fmaxf(amax, fabsf(row[c]));
  amax = BlockMax(amax, scratch);
  // A zero row, or one so small that amax / 448 underflows, gets scale 1 (its codes are then 0
  // or the subnormal codes of its values): a finite row never meets a division by 0.
  float s = isinf(amax) ? NAN : amax / 448.0f;
  if (s == 0.0f) s = 1.0f;
  if (threadIdx.x == 0) scale[blockIdx.x] = s;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    out[c] = __nv_cvt_float_to_fp8(row[c] / s, __NV_SATFINITE, __NV_E4M3);
  }
}

__global__ void AddBiasKernel(float* __restrict__ y, const float* __restrict__ bias, int64_t rows,
                              int64_t cols) {
  const int64_t count = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] += bias[i % cols];
  }
}

}  // namespace

cudaError_t LaunchDequantizeF8Rows(const DequantizeF8Args& args, cudaStream_t stream) {
  const int64_t count = args.rows * args.cols;
  if (count <= 0) return cudaSuccess;
  if (args.cols % 16 == 0 && reinterpret_cast<uintptr_t>(args.codes) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(args.dst) % 16 == 0) {
    DequantizeF8x16Kernel<<<GridStrideBlocks(count / 16, kThreads), kThreads, 0, stream>>>(
        reinterpret_cast<const uint4*>(args.codes), args.scale, static_cast<uint4*>(args.dst),
        args.rows, args.cols);
  } else {
    DequantizeF8Kernel<<<GridStrideBlocks(count, kThreads), kThreads, 0, stream>>>(
        args.codes, args.scale, static_cast<__nv_bfloat16*>(args.dst), args.rows, args.cols);
  }
  return cudaGetLastError();
}

cudaError_t LaunchQuantizeRowsF8(const QuantizeRowsF8Args& args, cudaStream_t stream) {
  if (args.rows <= 0 || args.cols <= 0) return cudaSuccess;
  if (args.rows > INT32_MAX) return cudaErrorInvalidValue;
  QuantizeRowsF8Kernel<<<static_cast<unsigned>(args.rows), RowBlockThreads(args.cols, 1024), 0,
                         stream>>>(args.x, args.codes, args.scale, args.cols);
  return cudaGetLastError();
}

cudaError_t LaunchConvertFromF32(const ConvertArgs& args, cudaStream_t stream) {
  if (args.count <= 0) return cudaSuccess;
  // A bandwidth-bound pass (MatMul's x before every prefill GEMM): by 8 where both ends are
  // 16-byte aligned, ~2x the rate of one value per thread.
  if (reinterpret_cast<uintptr_t>(args.src) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(args.dst) % 16 == 0) {
    const unsigned blocks = GridStrideBlocks(std::max<int64_t>(args.count / 8, 1), kThreads);
    switch (args.dst_dtype) {
      case DType::kBF16:
        ConvertBy8Kernel<<<blocks, kThreads, 0, stream>>>(
            args.src, static_cast<__nv_bfloat16*>(args.dst), args.count);
        return cudaGetLastError();
      case DType::kF16:
        ConvertBy8Kernel<<<blocks, kThreads, 0, stream>>>(args.src, static_cast<__half*>(args.dst),
                                                          args.count);
        return cudaGetLastError();
      default:
        return cudaErrorInvalidValue;
    }
  }
  const unsigned blocks = GridStrideBlocks(args.count, kThreads);
  switch (args.dst_dtype) {
    case DType::kBF16:
      ConvertKernel<<<blocks, kThreads, 0, stream>>>(
          args.src, static_cast<__nv_bfloat16*>(args.dst), args.count);
      break;
    case DType::kF16:
      ConvertKernel<<<blocks, kThreads, 0, stream>>>(args.src, static_cast<__half*>(args.dst),
                                                     args.count);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchFill(const FillArgs& args, cudaStream_t stream) {
  if (args.count <= 0) return cudaSuccess;
  FillKernel<<<GridStrideBlocks(args.count, kThreads), kThreads, 0, stream>>>(args.dst, args.value,
                                                                              args.count);
  return cudaGetLastError();
}

cudaError_t LaunchRandomFill(const RandomFillArgs& args, cudaStream_t stream) {
  if (args.count <= 0) return cudaSuccess;
  const unsigned blocks = GridStrideBlocks(args.count, kThreads);
  switch (args.dtype) {
    case DType::kF32:
      RandomFillKernel<<<blocks, kThreads, 0, stream>>>(static_cast<float*>(args.dst), args.count,
                                                        args.seed, args.scale);
      break;
    case DType::kBF16:
      RandomFillKernel<<<blocks, kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(args.dst),
                                                        args.count, args.seed, args.scale);
      break;
    case DType::kF16:
      RandomFillKernel<<<blocks, kThreads, 0, stream>>>(static_cast<__half*>(args.dst), args.count,
                                                        args.seed, args.scale);
      break;
    case DType::kF8E4M3:  // round to nearest even, saturating: FloatToF8E4M3's codes
      RandomFillKernel<<<blocks, kThreads, 0, stream>>>(static_cast<__nv_fp8_e4m3*>(args.dst),
                                                        args.count, args.seed, args.scale);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchAddBias(const AddBiasArgs& args, cudaStream_t stream) {
  if (args.rows <= 0 || args.cols <= 0) return cudaSuccess;
  AddBiasKernel<<<GridStrideBlocks(args.rows * args.cols, kThreads), kThreads, 0, stream>>>(
      args.y, args.bias, args.rows, args.cols);
  return cudaGetLastError();
}

}  // namespace tandem::gpu_worker::cuda_backend
