#include "device_utils.cuh"
#include "kv_write.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kThreads = 256;

// One thread per (token, kv head, dim) element; consecutive threads write consecutive dims of
// one cache row, so reads and writes are coalesced.
template <typename T>
__global__ void WriteKvKernel(WriteKvArgs args) {
  const int64_t count = args.num_tokens * args.num_kv_heads * args.head_dim;
  T* k_cache = static_cast<T*>(args.k_cache);
  T* v_cache = static_cast<T*>(args.v_cache);
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < count;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d = idx % args.head_dim;
    const int64_t h = (idx / args.head_dim) % args.num_kv_heads;
    const int64_t t = idx / (args.head_dim * args.num_kv_heads);
    const int32_t slot = args.slots[t];
    if (slot < 0 || slot >= args.capacity) continue;
    const int64_t src = t * args.row_stride + h * args.head_dim + d;
    const int64_t dst = (h * args.capacity + slot) * args.head_dim + d;
    k_cache[dst] = FromFloat<T>(args.k[src]);
    v_cache[dst] = FromFloat<T>(args.v[src]);
  }
}

}  // namespace

cudaError_t LaunchWriteKv(const WriteKvArgs& args, cudaStream_t stream) {
  const int64_t count = args.num_tokens * args.num_kv_heads * args.head_dim;
  if (count <= 0) return cudaSuccess;
  const unsigned blocks = GridStrideBlocks(count, kThreads);
  switch (args.cache_dtype) {
    case DType::kF32:
      WriteKvKernel<float><<<blocks, kThreads, 0, stream>>>(args);
      break;
    case DType::kBF16:
      WriteKvKernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(args);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace tandem::gpu_worker::cuda_backend
