// Rotary position embedding, Hugging Face "rotate_half" convention, in place.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::gpu_worker::cuda_backend {

// For i < head_dim/2 and f = inv_freq[t·inv_freq_row_stride + i] (token t's table),
// c = cos(float(pos)·f)·attention_scaling, s = sin(float(pos)·f)·attention_scaling:
//   x'[i] = x[i]·c - x[i + D/2]·s,   x'[i + D/2] = x[i + D/2]·c + x[i]·s
struct RopeArgs {
  float* x = nullptr;                  // [num_tokens, num_heads, head_dim], rows of row_stride
  int64_t row_stride = 0;              // floats between token t and t+1
  const int32_t* positions = nullptr;  // [num_tokens]
  const float* inv_freq = nullptr;     // [head_dim / 2], or [num_tokens, inv_freq_row_stride]
  int64_t inv_freq_row_stride = 0;     // 0: one table for every token
  float attention_scaling = 1.0f;
  int64_t num_tokens = 0;
  int64_t num_heads = 0;
  int64_t head_dim = 0;  // even
};
cudaError_t LaunchRope(const RopeArgs& args, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
