// Query-aware page selection (backend.h's SelectPagesParams): scores every page summary of every
// kv head against the query tokens and keeps the best `select` page ids per (token, kv head).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker::cuda_backend {

// score[t, g, p] = max over j < G of Σ_d max(q[t, g·G+j, d]·min[g, p, d], q[t, g·G+j, d]·max[g, p, d])
// (f32; each lane sums its 16-byte chunk of d in order, then the lanes of a page are summed by a
// butterfly), with -0 stored as +0. pages[t, g, :] = the `select` pages of highest score, ties
// to the lower page id, ascending; when num_pages <= select: 0..num_pages-1, then -1 padding.
// The caller validates the parameters (sizes >= 1, num_pages <= max_pages and < 2^31,
// num_q_heads a multiple of num_kv_heads, num_kv_heads <= 65535).
struct SelectPagesArgs {
  const float* q = nullptr;          // [num_tokens, num_q_heads, head_dim], rows of q_row_stride
  int64_t q_row_stride = 0;
  const void* summaries = nullptr;   // [num_kv_heads, max_pages, 2, head_dim] of dtype (min, max)
  DType dtype = DType::kF32;         // kF32 or kBF16
  int64_t max_pages = 0;
  int64_t num_pages = 0;
  int64_t num_tokens = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t select = 0;
  int32_t* pages = nullptr;          // [num_tokens, num_kv_heads, select]; -1 = padding
  // Device memory of at least SelectPagesScratchBytes(num_tokens, num_kv_heads, num_pages)
  // bytes, 4-byte aligned: the scores [num_tokens, num_kv_heads, num_pages] f32.
  void* scratch = nullptr;
  int num_sms = 1;                   // sizes the scoring grid
};
cudaError_t LaunchSelectPages(const SelectPagesArgs& args, cudaStream_t stream);

// The two steps of LaunchSelectPages for num_pages > select, for benchmarks: the scores into
// scratch, then the top pages of each row from them.
cudaError_t LaunchScorePages(const SelectPagesArgs& args, cudaStream_t stream);
cudaError_t LaunchTopPages(const SelectPagesArgs& args, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
