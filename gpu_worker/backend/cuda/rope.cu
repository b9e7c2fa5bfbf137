#include "device_utils.cuh"
#include "rope.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kMaxThreads = 256;

// grid: [num_tokens]; threads stride over the num_heads·head_dim/2 rotation pairs of the token.
// NOTE: sincosf without --use_fast_math does full range reduction, so positions up to 2^24 give
// the same angles as the cpu backend's std::sin/std::cos to about 1 ulp.
__global__ void RopeKernel(RopeArgs args) {
  const int64_t t = blockIdx.x;
  const int64_t half = args.head_dim / 2;
  const float pos = static_cast<float>(args.positions[t]);
  const float* inv_freq = args.inv_freq + t * args.inv_freq_row_stride;
  float* row = args.x + t * args.row_stride;
  for (int64_t idx = threadIdx.x; idx < args.num_heads * half; idx += blockDim.x) {
    const int64_t head = idx / half;
    const int64_t i = idx % half;
    float s;
    float c;
    sincosf(pos * inv_freq[i], &s, &c);
    c *= args.attention_scaling;
    s *= args.attention_scaling;
    float* x = row + head * args.head_dim;
    const float x0 = x[i];
    const float x1 = x[i + half];
    x[i] = x0 * c - x1 * s;
    x[i + half] = x1 * c + x0 * s;
  }
}

}  // namespace

cudaError_t LaunchRope(const RopeArgs& args, cudaStream_t stream) {
  if (args.num_tokens <= 0 || args.num_heads <= 0 || args.head_dim < 2) return cudaSuccess;
  const int threads = RowBlockThreads(args.num_heads * args.head_dim / 2, kMaxThreads);
  RopeKernel<<<static_cast<unsigned>(args.num_tokens), threads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace tandem::gpu_worker::cuda_backend
