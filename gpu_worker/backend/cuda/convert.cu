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

__global__ void AddBiasKernel(float* __restrict__ y, const float* __restrict__ bias, int64_t rows,
                              int64_t cols) {
  const int64_t count = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    y[i] += bias[i % cols];
  }
}

}  // namespace

cudaError_t LaunchConvertFromF32(const ConvertArgs& args, cudaStream_t stream) {
  if (args.count <= 0) return cudaSuccess;
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
