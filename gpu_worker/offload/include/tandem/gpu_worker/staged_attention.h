// StagedAttention: the query rows of a pass attend over one staged block of K/V on the device —
// a page uploaded from host memory (KvStreamer), or K/V recomputed from stored layer inputs
// (ExactRecompute) — whose entries are all earlier than every query row, so none is masked, and
// the partial state is merged into the caller's (o, lse) by the exact LSE merge.
//
// Owns what that needs beside the block: slot positions of 0 ([capacity] i32, every entry
// visible) and the partial state ([max_rows, num_q_heads, head_dim] f32 o, [max_rows,
// num_q_heads] f32 lse). Everything is queued on the backend stream.
//
// Not thread-safe; owned by the path that stages the blocks.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker {

class StagedAttention {
 public:
  // Blocks of up to `capacity` entries; up to `max_rows` query rows of `num_q_heads` heads of
  // `head_dim`. INVALID_ARGUMENT for sizes < 1.
  static absl::StatusOr<StagedAttention> Create(Backend& backend, int64_t capacity,
                                                int64_t num_q_heads, int64_t head_dim,
                                                int64_t max_rows);
  // Device bytes Create() allocates for these arguments (the memory estimator's).
  static size_t DeviceBytesFor(int64_t capacity, int64_t num_q_heads, int64_t head_dim,
                               int64_t max_rows);

  StagedAttention(StagedAttention&&) = default;
  StagedAttention& operator=(StagedAttention&&) = default;

  // Attends `base`'s query rows (q, q_pos, q_row_stride, num_tokens, heads, head_dim, scale;
  // its cache fields are ignored) over the first `entries` entries of the block (k, v:
  // [kv_heads, capacity, head_dim] of `dtype`) and merges the result into base.o / base.lse,
  // which hold a partial state already.
  absl::Status AttendAndMerge(const WindowAttentionParams& base, const void* k, const void* v,
                              DType dtype, int64_t entries);
  // The same in two steps, for a caller that frees the block between them (the merge reads
  // only the partial state): Attend into the partial state, then Merge it into base.o / lse.
  absl::Status Attend(const WindowAttentionParams& base, const void* k, const void* v,
                      DType dtype, int64_t entries);
  absl::Status Merge(const WindowAttentionParams& base);

 private:
  StagedAttention(Backend& backend, int64_t capacity, int64_t num_q_heads, int64_t head_dim,
                  int64_t max_rows)
      : backend_(&backend),
        capacity_(capacity),
        num_q_heads_(num_q_heads),
        head_dim_(head_dim),
        max_rows_(max_rows) {}

  Backend* backend_;
  int64_t capacity_, num_q_heads_, head_dim_, max_rows_;
  DeviceBuffer zero_pos_;            // [capacity] i32 zeros
  DeviceBuffer part_o_, part_lse_;   // [max_rows, num_q_heads, head_dim], [max_rows, num_q_heads]
};

}  // namespace tandem::gpu_worker
