// The low-rank keys' basis and coordinates (backend.h's KeyGramParams and ProjectKeysParams):
// the Gram matrix of a head's keys and each key's int8 coordinates in the head's basis.
// The caller validates the parameters (param_checks.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker::cuda_backend {

// gram[g, d, e] = Σ_s k[g, first_slot + s, d]·k[g, first_slot + s, e] over s < count: f32
// products summed in slot order (one 32x32 tile of (d, e) per block).
struct KeyGramArgs {
  const void* k = nullptr;  // [num_kv_heads, capacity, head_dim] of dtype (kF32 or kBF16)
  int64_t capacity = 0;
  int64_t first_slot = 0;
  int64_t count = 0;
  DType dtype = DType::kF32;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  float* gram = nullptr;  // [num_kv_heads, head_dim, head_dim]
};
cudaError_t LaunchKeyGram(const KeyGramArgs& args, cudaStream_t stream);

// For the keys s < count: c_r = Σ_d k[g, first_slot + s, d]·basis[g, d, r] (f32, d order, fused
// multiply-adds), scale = max_r |c_r| / 127, code_r = rint(c_r / scale) (IEEE division, ties to
// even) in [-127, 127]; every code 0 where the scale is 0 or not finite. Written to row
// first_token + s of coords and scales.
struct ProjectKeysArgs {
  const void* k = nullptr;  // [num_kv_heads, capacity, head_dim] of dtype (kF32 or kBF16)
  int64_t capacity = 0;
  int64_t first_slot = 0;
  int64_t count = 0;
  DType dtype = DType::kF32;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  const float* basis = nullptr;  // [num_kv_heads, head_dim, rank]
  int64_t rank = 0;
  int8_t* coords = nullptr;  // [num_kv_heads, max_tokens, rank]
  float* scales = nullptr;   // [num_kv_heads, max_tokens]
  int64_t max_tokens = 0;
  int64_t first_token = 0;
};
cudaError_t LaunchProjectKeys(const ProjectKeysArgs& args, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
