// Low-rank page scores (backend.h's PageScore::kLowRank): what SelectPages ranks pages by from
// the keys' int8 coordinates (key_projection.cuh; page_select.cuh then keeps and takes the top
// pages of these scores).
// The caller validates the parameters (param_checks.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker::cuda_backend {

// scores[t, g, p] = max over j < G of (1/σ)·log Σ_{s in page p} exp(σ·scale[g, s]·q̃[t, j]·code[g,
// s]) for pages p < num_pages (rows [p·page_tokens, (p+1)·page_tokens) of head g), with q̃[t, j, r]
// = Σ_d q[t, g·G + j, d]·basis[g, d, r] (f32 in d order) and the logsumexp taken stably (the page's
// max first). -0 is stored as +0.
//
// Numerics of the tensor-core kernel (rank 32, 64 or 128, group <= 8, page_tokens dividing 16
// or a multiple of it, coords 16-byte aligned): each q̃ column is scaled by a power of two to
// integers of at most 22 bits, split into three signed 8-bit limbs and multiplied with the codes
// by int8 mma (exact int32 sums); the sums are converted and combined in f32. So q̃·code is exact
// for q̃ rounded to 2^-22 of the column's largest |q̃_r|, then rounded to f32 twice (about the
// error of an f32 dot product). exp and log are expf / logf; the score is lse·(1/σ). A page of
// more than 16 rows merges the (max, sum) of its 16-row steps. Other shapes take a generic
// kernel (f32 dot products in r order, an online logsumexp, the same 1/σ).
struct LowRankScoreArgs {
  const float* q = nullptr;  // [num_tokens, num_q_heads, head_dim], rows of q_row_stride
  int64_t q_row_stride = 0;
  const float* basis = nullptr;    // [num_kv_heads, head_dim, rank]
  const int8_t* coords = nullptr;  // [num_kv_heads, max_tokens, rank]
  const float* scales = nullptr;   // [num_kv_heads, max_tokens]
  int64_t rank = 0;                // 1..head_dim
  int64_t max_tokens = 0;          // >= num_pages·page_tokens
  int64_t page_tokens = 0;
  float softmax_scale = 0.0f;  // σ > 0
  int64_t num_pages = 0;
  int64_t num_tokens = 0;  // <= 65535
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;  // <= 65535
  int64_t head_dim = 0;
  float* scores = nullptr;  // [num_tokens, num_kv_heads, num_pages]
  int num_sms = 1;          // sizes the grid
};
cudaError_t LaunchLowRankScores(const LowRankScoreArgs& args, cudaStream_t stream);

// Whether LaunchLowRankScores takes the tensor-core kernel for these args (tests, benchmarks).
bool LowRankScoresUseTensorCores(const LowRankScoreArgs& args);

// The largest rank LaunchLowRankScores takes (its generic kernel holds one q̃ row of floats in
// shared memory).
inline constexpr int64_t kLowRankMaxRank = 8192;

}  // namespace tandem::gpu_worker::cuda_backend
