#include "device_utils.cuh"
#include "rope.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kThreads = 128;
// Heads per block: a decode row (40 q + k heads of 128 dims) spreads over 10 blocks instead of
// one block looping over every pair.
constexpr int64_t kHeadsPerBlock = 4;

// grid: [num_tokens, ceil(num_heads / kHeadsPerBlock)]; dynamic shared memory: cos and sin
// [2, head_dim / 2]. The block computes token t's angles once (every head uses the same ones),
// then rotates the pairs of its heads.
// NOTE: sincosf without --use_fast_math does full range reduction, so positions up to 2^24 give
// the same angles as the cpu backend's std::sin/std::cos to about 1 ulp.
__global__ void __launch_bounds__(kThreads) RopeKernel(RopeArgs args) {
  extern __shared__ float angles[];
  const int64_t t = blockIdx.x;
  const int64_t half = args.head_dim / 2;
  float* cos_t = angles;
  float* sin_t = angles + half;
  const float pos = static_cast<float>(args.positions[t]);
  const float* inv_freq = args.inv_freq + t * args.inv_freq_row_stride;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    float s;
    float c;
    sincosf(pos * inv_freq[i], &s, &c);
    cos_t[i] = c * args.attention_scaling;
    sin_t[i] = s * args.attention_scaling;
  }
  __syncthreads();
  const int64_t head0 = blockIdx.y * kHeadsPerBlock;
  const int64_t heads = min(kHeadsPerBlock, args.num_heads - head0);
  float* row = args.x + t * args.row_stride + head0 * args.head_dim;
  for (int64_t idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
    const int64_t head = idx / half;
    const int64_t i = idx % half;
    const float c = cos_t[i];
    const float s = sin_t[i];
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
  const dim3 grid(static_cast<unsigned>(args.num_tokens),
                  static_cast<unsigned>((args.num_heads + kHeadsPerBlock - 1) / kHeadsPerBlock));
  const size_t smem = sizeof(float) * static_cast<size_t>(args.head_dim);
  RopeKernel<<<grid, kThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace tandem::gpu_worker::cuda_backend
