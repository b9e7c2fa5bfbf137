#include "device_utils.cuh"
#include "swiglu.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kThreads = 256;

__global__ void SwiGluKernel(SwiGluArgs args) {
  AllowDependentLaunch();  // the down projection's GEMV may start reading its weights
  const int64_t count = args.num_tokens * args.ffn;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < count;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = idx / args.ffn;
    const int64_t i = idx % args.ffn;
    const float* row = args.gate_up + t * 2 * args.ffn;
    const float gate = row[i];
    const float up = row[args.ffn + i];
    args.out[idx] = gate / (1.0f + expf(-gate)) * up;
  }
}

}  // namespace

cudaError_t LaunchSwiGlu(const SwiGluArgs& args, cudaStream_t stream) {
  if (args.num_tokens <= 0 || args.ffn <= 0) return cudaSuccess;
  SwiGluKernel<<<GridStrideBlocks(args.num_tokens * args.ffn, kThreads), kThreads, 0, stream>>>(
      args);
  return cudaGetLastError();
}

}  // namespace tandem::gpu_worker::cuda_backend
