// Embedding lookup and Llama RMSNorm (f32 math), one thread block per token row.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker::cuda_backend {

// out[t, :] = table[ids[t], :] as f32. An id outside [0, vocab) gives a row of NaN (the engine
// validates ids; this only keeps a bad id from reading out of bounds).
struct EmbedArgs {
  const int32_t* ids = nullptr;  // [num_tokens]
  const void* table = nullptr;   // [vocab, hidden] of table_dtype (kF32, kBF16 or kF16)
  DType table_dtype = DType::kF32;
  float* out = nullptr;  // [num_tokens, hidden]
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  int64_t vocab = 0;
};
cudaError_t LaunchEmbed(const EmbedArgs& args, cudaStream_t stream);

// out[t, :] = x[t, :] * (1 / sqrt(mean(x[t, :]^2) + eps)) * weight[:].
struct RmsNormArgs {
  const float* x = nullptr;      // [num_tokens, hidden]
  const void* weight = nullptr;  // [hidden] of weight_dtype (kF32, kBF16 or kF16)
  DType weight_dtype = DType::kF32;
  float* out = nullptr;  // [num_tokens, hidden]; may alias x
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  float eps = 1e-5f;
  // RmsNormParams' layout: vectors_per_token vectors of hidden per token, tokens token_stride
  // floats apart (> 0 here: the backend fills in the packed stride).
  int64_t vectors_per_token = 1;
  int64_t token_stride = 0;
};
cudaError_t LaunchRmsNorm(const RmsNormArgs& args, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
