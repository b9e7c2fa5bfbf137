// Writes the K and V rows of new tokens into a KV cache at given slots.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker::cuda_backend {

// k_cache[h, slots[t], :] = k[t, h, :] converted to cache_dtype (same for v). A slot outside
// [0, capacity) is skipped (the engine validates slots; this only keeps a bad one in bounds).
struct WriteKvArgs {
  const float* k = nullptr;         // [num_tokens, num_kv_heads, head_dim], rows of row_stride
  const float* v = nullptr;         // same layout and stride as k
  int64_t row_stride = 0;           // floats between token t and t+1
  const int32_t* slots = nullptr;   // [num_tokens]
  void* k_cache = nullptr;          // [num_kv_heads, capacity, head_dim] of cache_dtype
  void* v_cache = nullptr;          // [num_kv_heads, capacity, head_dim] of cache_dtype
  DType cache_dtype = DType::kF32;  // kF32 or kBF16
  int64_t num_tokens = 0;
  int64_t num_kv_heads = 0;
  int64_t capacity = 0;
  int64_t head_dim = 0;
};
cudaError_t LaunchWriteKv(const WriteKvArgs& args, cudaStream_t stream);

// LaunchWriteKv for `count` entries in one launch: `table` is a device copy of the entries
// ([count], count <= 65535), which must share cache_dtype and not write the same cache rows;
// max_elements is the largest num_tokens·num_kv_heads·head_dim of an entry.
cudaError_t LaunchWriteKvBatch(const WriteKvArgs* table, int64_t count, int64_t max_elements,
                               DType cache_dtype, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
