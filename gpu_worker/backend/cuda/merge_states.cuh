// The merge of partial attention states, exactly cpu_attention/merge_state.h's: an empty side
// (lse = -inf) leaves the other unchanged; two empty sides give o = 0, lse = -inf, never NaN.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace tandem::gpu_worker::cuda_backend {

// (o_dst, lse_dst) <- merge((o_dst, lse_dst), (o_src, lse_src)) row by row.
struct MergeStatesArgs {
  float* o_dst = nullptr;          // [rows, head_dim]
  float* lse_dst = nullptr;        // [rows]
  const float* o_src = nullptr;    // [rows, head_dim]
  const float* lse_src = nullptr;  // [rows]
  int64_t rows = 0;
  int64_t head_dim = 0;
};
cudaError_t LaunchMergeStates(const MergeStatesArgs& args, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
