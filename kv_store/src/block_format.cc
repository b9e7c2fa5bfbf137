#include "tandem/kv_store/block_format.h"

#include "absl/strings/str_cat.h"

namespace tandem::kv_store {

const char* KvDTypeName(KvDType t) {
  switch (t) {
    case KvDType::kF32:
      return "f32";
    case KvDType::kBf16:
      return "bf16";
    case KvDType::kInt8:
      return "int8";
  }
  return "unknown";
}

uint64_t BlockFormat::ShardBytes(uint64_t entries, uint64_t selected,
                                 uint64_t selected_growth) const {
  const uint64_t blocks = (entries + block_tokens - 1) / block_tokens;
  const uint64_t selected_buffer =
      (selected * row_bytes() + kSelectedAlignment - 1) / kSelectedAlignment * kSelectedAlignment;
  return blocks * block_bytes() + 2 * selected_growth * selected_buffer;
}

absl::Status BlockFormat::Validate() const {
  if (block_tokens < 16 || block_tokens > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_tokens must be in 16..256, got ", block_tokens));
  }
  if (head_dim < 8 || head_dim > 256 || head_dim % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim must be in 8..256 and a multiple of 8, got ", head_dim));
  }
  // The enum may hold any byte when it arrives from a wire format cast.
  if (dtype != KvDType::kF32 && dtype != KvDType::kBf16 && dtype != KvDType::kInt8) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype must be kF32, kBf16 or kInt8, got ", static_cast<int>(dtype)));
  }
  return absl::OkStatus();
}

}  // namespace tandem::kv_store
