#include "device_utils.cuh"
#include "embed_norm.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kMaxThreads = 512;

// grid: [num_tokens]; threads stride over the hidden dimension (coalesced row copy).
template <typename T>
__global__ void EmbedKernel(EmbedArgs args) {
  const int64_t t = blockIdx.x;
  float* out = args.out + t * args.hidden;
  const int32_t id = args.ids[t];
  if (id < 0 || id >= args.vocab) {
    for (int64_t i = threadIdx.x; i < args.hidden; i += blockDim.x) out[i] = NAN;
    return;
  }
  const T* row = static_cast<const T*>(args.table) + static_cast<int64_t>(id) * args.hidden;
  for (int64_t i = threadIdx.x; i < args.hidden; i += blockDim.x) out[i] = ToFloat(row[i]);
}

// grid: [num_tokens]. Each thread reads and writes the same elements in both passes, so out may
// alias x.
template <typename W>
__global__ void RmsNormKernel(RmsNormArgs args) {
  __shared__ float scratch[kWarpSize];
  const int64_t t = blockIdx.x;
  const float* x = args.x + t * args.hidden;
  float* out = args.out + t * args.hidden;
  const W* weight = static_cast<const W*>(args.weight);
  float sum_sq = 0.0f;
  for (int64_t i = threadIdx.x; i < args.hidden; i += blockDim.x) sum_sq = fmaf(x[i], x[i], sum_sq);
  sum_sq = BlockSum(sum_sq, scratch);
  const float inv_rms = 1.0f / sqrtf(sum_sq / static_cast<float>(args.hidden) + args.eps);
  for (int64_t i = threadIdx.x; i < args.hidden; i += blockDim.x) {
    out[i] = x[i] * inv_rms * ToFloat(weight[i]);
  }
}

}  // namespace

cudaError_t LaunchEmbed(const EmbedArgs& args, cudaStream_t stream) {
  if (args.num_tokens <= 0 || args.hidden <= 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(args.num_tokens);
  const int threads = RowBlockThreads(args.hidden, kMaxThreads);
  switch (args.table_dtype) {
    case DType::kF32:
      EmbedKernel<float><<<blocks, threads, 0, stream>>>(args);
      break;
    case DType::kBF16:
      EmbedKernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(args);
      break;
    case DType::kF16:
      EmbedKernel<__half><<<blocks, threads, 0, stream>>>(args);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchRmsNorm(const RmsNormArgs& args, cudaStream_t stream) {
  if (args.num_tokens <= 0 || args.hidden <= 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(args.num_tokens);
  const int threads = RowBlockThreads(args.hidden, kMaxThreads);
  switch (args.weight_dtype) {
    case DType::kF32:
      RmsNormKernel<float><<<blocks, threads, 0, stream>>>(args);
      break;
    case DType::kBF16:
      RmsNormKernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(args);
      break;
    case DType::kF16:
      RmsNormKernel<__half><<<blocks, threads, 0, stream>>>(args);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace tandem::gpu_worker::cuda_backend
