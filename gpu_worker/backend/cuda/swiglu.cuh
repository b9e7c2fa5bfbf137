// SwiGLU activation of the Llama MLP.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::gpu_worker::cuda_backend {

// out[t, i] = silu(gate_up[t, i]) · gate_up[t, ffn + i], silu(x) = x / (1 + e^-x).
struct SwiGluArgs {
  const float* gate_up = nullptr;  // [num_tokens, 2·ffn]: gate columns first, then up
  float* out = nullptr;            // [num_tokens, ffn]
  int64_t num_tokens = 0;
  int64_t ffn = 0;
};
cudaError_t LaunchSwiGlu(const SwiGluArgs& args, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
