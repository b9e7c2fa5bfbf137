#include "device_utils.cuh"
#include "merge_states.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kWarpsPerBlock = 4;

// One warp per row: every lane reads both LSEs before lane 0 overwrites lse_dst, so no other
// thread can see a half-merged row.
__global__ void MergeStatesKernel(MergeStatesArgs args) {
  const int64_t row = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (row >= args.rows) return;
  float* o_a = args.o_dst + row * args.head_dim;
  const float* o_b = args.o_src + row * args.head_dim;
  const float lse_a = args.lse_dst[row];
  const float lse_b = args.lse_src[row];
  float lse_out;
  if (lse_b == -INFINITY) {
    if (lse_a == -INFINITY) {
      for (int64_t d = lane; d < args.head_dim; d += kWarpSize) o_a[d] = 0.0f;
    }
    lse_out = lse_a;
  } else if (lse_a == -INFINITY) {
    for (int64_t d = lane; d < args.head_dim; d += kWarpSize) o_a[d] = o_b[d];
    lse_out = lse_b;
  } else {
    // Max trick: the larger side gets weight 1, the other exp(-|lse_a - lse_b|) <= 1.
    const float m = fmaxf(lse_a, lse_b);
    const float w_a = expf(lse_a - m);
    const float w_b = expf(lse_b - m);
    const float inv = 1.0f / (w_a + w_b);
    const float c_a = w_a * inv;
    const float c_b = w_b * inv;
    for (int64_t d = lane; d < args.head_dim; d += kWarpSize) o_a[d] = c_a * o_a[d] + c_b * o_b[d];
    lse_out = m + logf(w_a + w_b);
  }
  __syncwarp();
  if (lane == 0) args.lse_dst[row] = lse_out;
}

}  // namespace

cudaError_t LaunchMergeStates(const MergeStatesArgs& args, cudaStream_t stream) {
  if (args.rows <= 0 || args.head_dim <= 0) return cudaSuccess;
  const int64_t blocks = (args.rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  MergeStatesKernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * kWarpSize, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace tandem::gpu_worker::cuda_backend
