// Byte-level BPE tokenizer from a Hugging Face tokenizer.json (GPT-2, Llama-3, Qwen2, SmolLM).
//
// Pipeline of Encode: added tokens are cut out of the text first (leftmost, then longest; special
// ones only when parse_special; lstrip / rstrip absorb ASCII whitespace beside them), each
// remaining segment goes through the pre-tokenizer (pre_tokenizer.h), each pre-token through the
// BPE model (bpe_model.h). Normalizer: null or "NFC"; NFC is NOT applied (no ICU here), which
// matters only for text that is not already in NFC form (rare: what editors and the web produce
// is NFC). Decoder: null or ByteLevel. The post-processor (ByteLevel, TemplateProcessing or a
// Sequence of them) only decides whether BOS is added.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "bpe_model.h"
#include "nlohmann/json.hpp"
#include "pre_tokenizer.h"
#include "special_tokens.h"
#include "tandem/gpu_worker/tokenizer.h"

namespace tandem::gpu_worker::tokenizer_internal {

class BpeTokenizer final : public Tokenizer {
 public:
  // `tokenizer_json`: the parsed tokenizer.json. Errors as documented in tokenizer.h.
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> Create(const nlohmann::json& tokenizer_json,
                                                              const SpecialTokenConfig& config);

  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text, bool add_bos,
                                              bool parse_special) const override;
  std::string Decode(const std::vector<int32_t>& ids, bool skip_special) const override;
  std::string TokenBytes(int32_t id) const override;
  int32_t vocab_size() const override { return vocab_size_; }
  int32_t bos_id() const override { return bos_id_; }
  const std::vector<int32_t>& eos_ids() const override { return eos_ids_; }
  bool IsSpecial(int32_t id) const override;
  std::string_view kind() const override { return "bpe"; }
  bool adds_bos() const override { return adds_bos_ && bos_id_ >= 0; }

 private:
  struct AddedToken {
    int32_t id;
    std::string content;
    bool special;
    bool lstrip;  // absorbs the whitespace before it
    bool rstrip;  // absorbs the whitespace after it
  };

  BpeTokenizer(BpeModel model, PreTokenizer pre_tokenizer)
      : model_(std::move(model)), pre_tokenizer_(std::move(pre_tokenizer)) {}

  absl::Status ParseAddedTokens(const nlohmann::json& added_tokens);
  // Id of a token text: an added token's content, else a vocab entry; -1 when neither.
  int32_t TokenToId(std::string_view text) const;
  // First token of a TemplateProcessing post-processor's `single` template, -1 when none.
  absl::StatusOr<int32_t> TemplateFirstToken(const nlohmann::json& post_processor) const;

  BpeModel model_;
  PreTokenizer pre_tokenizer_;
  std::vector<AddedToken> added_tokens_;
  std::vector<int32_t> added_by_first_byte_[256];  // indices into added_tokens_, longest first
  std::vector<std::string> token_bytes_;           // [vocab_size], "" for special tokens
  std::vector<uint8_t> is_special_;                // [vocab_size]
  absl::flat_hash_map<int32_t, std::string> special_text_;
  int32_t vocab_size_ = 0;
  int32_t bos_id_ = -1;
  std::vector<int32_t> eos_ids_;
  bool adds_bos_ = false;
};

}  // namespace tandem::gpu_worker::tokenizer_internal
