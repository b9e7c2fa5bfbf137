#include "tandem/gpu_worker/staged_attention.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {

size_t StagedAttention::DeviceBytesFor(int64_t capacity, int64_t num_q_heads, int64_t head_dim,
                                       int64_t max_rows) {
  return capacity * 4 + max_rows * num_q_heads * (head_dim + 1) * 4;
}

absl::StatusOr<StagedAttention> StagedAttention::Create(Backend& backend, int64_t capacity,
                                                        int64_t num_q_heads, int64_t head_dim,
                                                        int64_t max_rows) {
  if (capacity < 1 || num_q_heads < 1 || head_dim < 1 || max_rows < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "staged attention: bad sizes (capacity ", capacity, ", heads ", num_q_heads,
        ", head_dim ", head_dim, ", rows ", max_rows, ")"));
  }
  StagedAttention a(backend, capacity, num_q_heads, head_dim, max_rows);
  TANDEM_ASSIGN_OR_RETURN(a.zero_pos_, backend.Allocate(capacity * 4));
  const std::vector<int32_t> zeros(capacity, 0);
  TANDEM_RETURN_IF_ERROR(backend.CopyToDevice(a.zero_pos_.data(), zeros.data(), capacity * 4));
  TANDEM_ASSIGN_OR_RETURN(a.part_o_, backend.Allocate(max_rows * num_q_heads * head_dim * 4));
  TANDEM_ASSIGN_OR_RETURN(a.part_lse_, backend.Allocate(max_rows * num_q_heads * 4));
  return a;
}

absl::Status StagedAttention::AttendAndMerge(const WindowAttentionParams& base, const void* k,
                                             const void* v, DType dtype, int64_t entries) {
  TANDEM_RETURN_IF_ERROR(Attend(base, k, v, dtype, entries));
  return Merge(base);
}

absl::Status StagedAttention::Attend(const WindowAttentionParams& base, const void* k,
                                     const void* v, DType dtype, int64_t entries) {
  if (base.num_tokens > max_rows_ || base.num_q_heads != num_q_heads_ ||
      base.head_dim != head_dim_ || entries > capacity_ || entries < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "staged attention: ", base.num_tokens, " rows of ", base.num_q_heads, " heads of ",
        base.head_dim, " over ", entries, " entries; planned for ", max_rows_, " rows of ",
        num_q_heads_, " heads of ", head_dim_, " over ", capacity_));
  }
  WindowAttentionParams wa = base;
  wa.k_cache = k;
  wa.v_cache = v;
  wa.cache_dtype = dtype;
  wa.slot_pos = zero_pos_.as<int32_t>();
  wa.num_slots = entries;
  wa.capacity = capacity_;
  wa.o = part_o_.as<float>();
  wa.lse = part_lse_.as<float>();
  wa.maw = nullptr;
  return backend_->WindowAttention(wa);
}

absl::Status StagedAttention::Merge(const WindowAttentionParams& base) {
  return backend_->MergeStates({base.o, base.lse, part_o_.as<float>(), part_lse_.as<float>(),
                                base.num_tokens * base.num_q_heads, base.head_dim});
}

}  // namespace tandem::gpu_worker
