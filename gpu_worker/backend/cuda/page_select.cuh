// Query-aware page selection (backend.h's SelectPagesParams): scores every page summary of every
// kv head against the query tokens and keeps the best `select` page ids per (token, kv head).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tandem/gpu_worker/dtype.h"

namespace tandem::gpu_worker::cuda_backend {

// score[t, g, p] = max over j < G of Σ_d max(q[t, g·G+j, d]·lo[g, p, d], q[t, g·G+j, d]·hi[g, p, d])
// (f32; each lane sums its 16-byte chunk of d in order, then the lanes of a page are summed by a
// butterfly), with -0 stored as +0, where lo/hi are the summary rows at `summaries` and
// `summaries + hi_offset` of each page (page_stride elements apart): the min and max rows for
// the bound, the mean row twice for the centroid (max(q·c, q·c) = q·c). Pages named by `keep`
// score +inf. pages[t, g, :] = the `select` pages of highest score, ties to the lower page id,
// ascending; when num_pages <= select: 0..num_pages-1, then -1 padding.
// The caller validates the parameters (sizes >= 1, num_pages <= max_pages and < 2^31,
// num_q_heads a multiple of num_kv_heads, num_kv_heads <= 65535).
struct SelectPagesArgs {
  const float* q = nullptr;          // [num_tokens, num_q_heads, head_dim], rows of q_row_stride
  int64_t q_row_stride = 0;
  const void* summaries = nullptr;   // the lo row of page 0 of kv head 0 (dtype elements)
  int64_t page_stride = 0;           // elements between pages (kv head g starts at g·max_pages·page_stride)
  int64_t hi_offset = 0;             // elements from a page's lo row to its hi row
  DType dtype = DType::kF32;         // kF32 or kBF16
  int64_t max_pages = 0;
  int64_t num_pages = 0;
  int64_t num_tokens = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t select = 0;
  int32_t* pages = nullptr;          // [num_tokens, num_kv_heads, select]; -1 = padding
  const int32_t* keep = nullptr;     // optional [num_tokens, num_kv_heads, keep_per_head]
  int64_t keep_per_head = 0;
  // Device memory of at least SelectPagesScratchBytes(num_tokens, num_kv_heads, num_pages)
  // bytes, 4-byte aligned: the scores [num_tokens, num_kv_heads, num_pages] f32.
  void* scratch = nullptr;
  int num_sms = 1;                   // sizes the scoring grid
};
cudaError_t LaunchSelectPages(const SelectPagesArgs& args, cudaStream_t stream);
// The selection from scores already in args.scratch [num_tokens, num_kv_heads, num_pages] (another
// score's kernel wrote them, e.g. low_rank_score.cuh): the kept pages marked +inf, then the top
// pages as LaunchSelectPages; when num_pages <= select, every page and -1 padding (no score read).
cudaError_t LaunchSelectFromScores(const SelectPagesArgs& args, cudaStream_t stream);

// One entry of a batched selection (SelectPagesBatchPlan): the fields of SelectPagesArgs that
// differ between entries, and where the entry's grid top-k keeps its histograms (in its own
// scratch, after the scores; set by PlanSelectPagesBatch).
struct SelectPagesEntry {
  const float* q = nullptr;          // [num_tokens, num_q_heads, head_dim], rows of q_row_stride
  int64_t q_row_stride = 0;
  const void* summaries = nullptr;   // as SelectPagesArgs (page_stride and hi_offset: the batch's)
  int64_t max_pages = 0;
  int64_t num_pages = 0;             // > select
  int64_t select = 0;
  int32_t* pages = nullptr;          // [num_tokens, num_kv_heads, select]
  const int32_t* keep = nullptr;     // as SelectPagesArgs
  int64_t keep_per_head = 0;
  void* scratch = nullptr;           // SelectPagesScratchBytes(num_tokens, num_kv_heads, num_pages)
  uint32_t* hist = nullptr;                    // [rows, 3, 256] (grid top-k only)
  unsigned long long* chunk_counts = nullptr;  // [rows, chunks] (grid top-k only)
  int64_t chunk_len = 0;
};

// Whether an entry of these args can run in a batch: more pages than `select`, a specialised
// scoring kernel (head_dim 64 or 128, group 1, 2, 4 or 8, 16-byte aligned summaries) and all
// its query tokens in one scoring tile (decode and short chunks). The entries of one batch
// share shape.dtype, num_tokens, num_q_heads, num_kv_heads, head_dim, page_stride and hi_offset.
bool SelectPagesBatchable(const SelectPagesArgs& args);

struct SelectPagesBatchPlan {
  SelectPagesArgs shape;     // the shared fields (its per-entry fields unused)
  int64_t count = 0;
  int64_t longest = 0;       // the most pages of an entry
  int64_t total_pages = 0;   // the pages of all entries
  int64_t chunks = 0;        // top-k blocks per row of the cooperative kernel; 0: one per row
  bool any_keep = false;     // an entry has `keep` (a launch marks the kept pages)
};
// Plans a batch of `count` batchable entries of `shape` and fills their hist / chunk fields;
// the caller then copies entries[0, count) to device memory and passes it to the launch.
cudaError_t PlanSelectPagesBatch(const SelectPagesArgs& shape, SelectPagesEntry* entries,
                                 int64_t count, SelectPagesBatchPlan* plan);
// The same results as LaunchSelectPages of every entry: one scoring launch (grid z = entry)
// and one top-k launch over the device table `entries` [count].
cudaError_t LaunchSelectPagesBatch(const SelectPagesBatchPlan& plan,
                                   const SelectPagesEntry* entries, cudaStream_t stream);

// The two steps of LaunchSelectPages for num_pages > select, for benchmarks: the scores into
// scratch, then the top pages of each row from them.
cudaError_t LaunchScorePages(const SelectPagesArgs& args, cudaStream_t stream);
cudaError_t LaunchTopPages(const SelectPagesArgs& args, cudaStream_t stream);

}  // namespace tandem::gpu_worker::cuda_backend
