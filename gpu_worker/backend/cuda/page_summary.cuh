// Page summaries for query-aware selection: the elementwise min, max and mean key of each page of
// a window K cache (backend.h's SummarizePagesParams).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker::cuda_backend {

// summaries[g, first_page + i, 0, d] = min over slots [first_slot + i·page_tokens, +page_tokens)
// of k_cache[g, s, d], [.., 1, d] = the max, [.., 2, d] = the mean (an f32 sum in slot order,
// divided by page_tokens, rounded once to dtype: the cpu backend's bits); the stored min and max
// are keys' bits (the running min/max is replaced only by a strictly smaller/larger key, as on
// the cpu backend).
// The caller validates the ranges.
struct SummarizePagesArgs {
  const void* k_cache = nullptr;  // [num_kv_heads, capacity, head_dim] of dtype
  int64_t capacity = 0;
  int64_t first_slot = 0;
  int64_t num_pages = 0;
  int64_t page_tokens = 0;
  void* summaries = nullptr;      // [num_kv_heads, max_pages, 3, head_dim] of dtype (min, max, mean)
  int64_t max_pages = 0;
  int64_t first_page = 0;
  DType dtype = DType::kF32;      // kF32 or kBF16
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
};
cudaError_t LaunchSummarizePages(const SummarizePagesArgs& args, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
