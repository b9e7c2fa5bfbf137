#include "device_utils.cuh"
#include "kv_write.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kThreads = 256;

// One thread per (token, kv head, dim) element, grid-stride from `first` by `stride`;
// consecutive threads write consecutive dims of one cache row, so reads and writes are
// coalesced.
template <typename T>
__device__ __forceinline__ void WriteKvElements(const WriteKvArgs& args, int64_t first,
                                                int64_t stride) {
  const int64_t count = args.num_tokens * args.num_kv_heads * args.head_dim;
  T* k_cache = static_cast<T*>(args.k_cache);
  T* v_cache = static_cast<T*>(args.v_cache);
  for (int64_t idx = first; idx < count; idx += stride) {
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

template <typename T>
__global__ void WriteKvKernel(WriteKvArgs args) {
  WriteKvElements<T>(args, blockIdx.x * int64_t{blockDim.x} + threadIdx.x,
                     int64_t{gridDim.x} * blockDim.x);
}

// grid [blocks, count]: blocks along x stride over entry blockIdx.y's elements.
template <typename T>
__global__ void WriteKvBatchKernel(const WriteKvArgs* table) {
  const WriteKvArgs args = table[blockIdx.y];
  WriteKvElements<T>(args, blockIdx.x * int64_t{blockDim.x} + threadIdx.x,
                     int64_t{gridDim.x} * blockDim.x);
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

cudaError_t LaunchWriteKvBatch(const WriteKvArgs* table, int64_t count, int64_t max_elements,
                               DType cache_dtype, cudaStream_t stream) {
  if (count <= 0 || max_elements <= 0) return cudaSuccess;
  if (table == nullptr || count > 65535) return cudaErrorInvalidValue;
  // Up to 1024 blocks per entry (256K elements a pass; larger entries loop).
  const dim3 grid(std::min(GridStrideBlocks(max_elements, kThreads), 1024u),
                  static_cast<unsigned>(count));
  switch (cache_dtype) {
    case DType::kF32:
      WriteKvBatchKernel<float><<<grid, kThreads, 0, stream>>>(table);
      break;
    case DType::kBF16:
      WriteKvBatchKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(table);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace tandem::gpu_worker::cuda_backend
