// StreamDecoder: incremental detokenization into valid UTF-8 deltas.
#include <string>

#include "tandem/gpu_worker/tokenizer.h"
#include "utf8.h"

namespace tandem::gpu_worker {

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool at_start, bool skip_special)
    : tokenizer_(tokenizer),
      skip_special_(skip_special),
      strip_next_space_(at_start && tokenizer.strips_leading_space()) {}

std::string StreamDecoder::Push(int32_t id) {
  std::string bytes;
  if (tokenizer_.IsSpecial(id)) {
    if (skip_special_) return std::string();
    bytes = tokenizer_.Decode({id}, /*skip_special=*/false);
  } else {
    bytes = tokenizer_.TokenBytes(id);
  }
  if (bytes.empty()) return std::string();
  if (strip_next_space_) {
    strip_next_space_ = false;
    if (bytes.front() == ' ') bytes.erase(0, 1);
  }
  pending_.append(bytes);
  std::string text;
  const size_t consumed = tokenizer_internal::AppendValidUtf8(pending_, /*final=*/false, &text);
  pending_.erase(0, consumed);
  return text;
}

std::string StreamDecoder::Flush() {
  std::string text = tokenizer_internal::ToValidUtf8(pending_);
  pending_.clear();
  return text;
}

}  // namespace tandem::gpu_worker
