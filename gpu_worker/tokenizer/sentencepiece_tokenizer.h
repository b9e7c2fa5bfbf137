// SentencePiece tokenizer from a tokenizer.model file (Llama-2, TinyLlama, llama2.c models),
// through libsentencepiece.
//
// Special tokens are the model's control pieces (<s>, </s>) and its unknown piece (<unk>). With
// parse_special, those pieces written in the text are cut out first and every other segment is
// encoded on its own (each with its dummy prefix, as Hugging Face's legacy Llama tokenizer does).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "sp_processor.h"
#include "special_tokens.h"
#include "tandem/gpu_worker/tokenizer.h"

namespace tandem::gpu_worker::tokenizer_internal {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // INVALID_ARGUMENT when the file is not a SentencePiece model; NOT_FOUND when it is absent.
  static absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> Load(
      const std::filesystem::path& model_path, const SpecialTokenConfig& config);

  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text, bool add_bos,
                                              bool parse_special) const override;
  std::string Decode(const std::vector<int32_t>& ids, bool skip_special) const override;
  std::string TokenBytes(int32_t id) const override;
  int32_t vocab_size() const override { return vocab_size_; }
  int32_t bos_id() const override { return bos_id_; }
  const std::vector<int32_t>& eos_ids() const override { return eos_ids_; }
  bool IsSpecial(int32_t id) const override;
  std::string_view kind() const override { return "sentencepiece"; }
  bool adds_bos() const override { return adds_bos_ && bos_id_ >= 0; }
  bool strips_leading_space() const override { return strips_leading_space_; }

  // The library's own DecodeIds, for tests that compare Decode with it.
  std::string LibraryDecode(const std::vector<int32_t>& ids) const;

 private:
  SentencePieceTokenizer() = default;

  // Appends the ids of `text` (no special-token parsing) to `ids`.
  absl::Status EncodePlain(std::string_view text, std::vector<int32_t>* ids) const;

  SpProcessor processor_;
  int32_t vocab_size_ = 0;
  std::vector<std::string> token_bytes_;  // [vocab_size], "" for special tokens
  std::vector<std::string> pieces_;       // [vocab_size], the piece texts
  std::vector<uint8_t> is_special_;       // [vocab_size]
  std::vector<int32_t> special_ids_;      // special tokens with a non-empty piece, longest first
  int32_t bos_id_ = -1;
  std::vector<int32_t> eos_ids_;
  bool adds_bos_ = true;
  bool strips_leading_space_ = false;
};

}  // namespace tandem::gpu_worker::tokenizer_internal
