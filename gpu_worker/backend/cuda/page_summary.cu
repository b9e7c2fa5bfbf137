#include <cstdint>

#include "device_utils.cuh"
#include "page_summary.cuh"

namespace tandem::gpu_worker::cuda_backend {
namespace {

constexpr int kThreads = 256;

// kVec consecutive elements moved as one load / store (16 bytes when the rows allow it).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// One thread per (kv head, page, chunk of kVec dims): it walks the page's slots, so consecutive
// threads read consecutive chunks of one cache row (coalesced) and write one summary chunk.
template <typename T, int kVec>
__global__ void SummarizePagesKernel(SummarizePagesArgs args) {
  using P = Pack<T, kVec>;
  const int64_t chunks = args.head_dim / kVec;
  const int64_t count = args.num_kv_heads * args.num_pages * chunks;
  const T* cache = static_cast<const T*>(args.k_cache);
  T* summaries = static_cast<T*>(args.summaries);
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < count;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d = (idx % chunks) * kVec;
    const int64_t page = (idx / chunks) % args.num_pages;
    const int64_t g = idx / (chunks * args.num_pages);
    const T* src =
        cache + (g * args.capacity + args.first_slot + page * args.page_tokens) * args.head_dim + d;
    P lo = *reinterpret_cast<const P*>(src);
    P hi = lo;
    float sum[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) sum[i] = ToFloat(lo.v[i]);
    for (int64_t s = 1; s < args.page_tokens; ++s) {
      const P v = *reinterpret_cast<const P*>(src + s * args.head_dim);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        if (ToFloat(v.v[i]) < ToFloat(lo.v[i])) lo.v[i] = v.v[i];
        if (ToFloat(v.v[i]) > ToFloat(hi.v[i])) hi.v[i] = v.v[i];
        sum[i] += ToFloat(v.v[i]);
      }
    }
    P mean;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      // A true division (as the cpu backend's), not a multiply by the reciprocal.
      mean.v[i] = FromFloat<T>(__fdiv_rn(sum[i], static_cast<float>(args.page_tokens)));
    }
    T* dst = summaries + (g * args.max_pages + args.first_page + page) * 3 * args.head_dim + d;
    *reinterpret_cast<P*>(dst) = lo;
    *reinterpret_cast<P*>(dst + args.head_dim) = hi;
    *reinterpret_cast<P*>(dst + 2 * args.head_dim) = mean;
  }
}

template <typename T>
cudaError_t Launch(const SummarizePagesArgs& args, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const bool vectorised = args.head_dim % kVec == 0 &&
                          reinterpret_cast<uintptr_t>(args.k_cache) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(args.summaries) % 16 == 0;
  const int vec = vectorised ? kVec : 1;
  const int64_t count = args.num_kv_heads * args.num_pages * (args.head_dim / vec);
  const unsigned blocks = GridStrideBlocks(count, kThreads);
  if (vectorised) {
    SummarizePagesKernel<T, kVec><<<blocks, kThreads, 0, stream>>>(args);
  } else {
    SummarizePagesKernel<T, 1><<<blocks, kThreads, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchSummarizePages(const SummarizePagesArgs& args, cudaStream_t stream) {
  if (args.num_kv_heads <= 0 || args.num_pages <= 0 || args.head_dim <= 0 ||
      args.page_tokens <= 0) {
    return cudaSuccess;
  }
  switch (args.dtype) {
    case DType::kF32:
      return Launch<float>(args, stream);
    case DType::kBF16:
      return Launch<__nv_bfloat16>(args, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace tandem::gpu_worker::cuda_backend
