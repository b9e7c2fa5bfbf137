// LoadTokenizer: picks the tokenizer file of a model directory and its special-token settings.
// EncodePrompt: prompt text to ids as the worker does; DescribeToken: one token's bytes and text
// for log-probability candidates.
#include "tandem/gpu_worker/tokenizer.h"

#include <algorithm>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bpe_tokenizer.h"
#include "sentencepiece_tokenizer.h"
#include "special_tokens.h"
#include "utf8.h"
#include "tandem/common/status_macros.h"

namespace tandem::gpu_worker {

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::filesystem::path& model_dir) {
  using tokenizer_internal::BpeTokenizer;
  using tokenizer_internal::SentencePieceTokenizer;
  const std::filesystem::path json_path = model_dir / "tokenizer.json";
  const std::filesystem::path model_path = model_dir / "tokenizer.model";
  std::error_code ec;
  const bool has_json = std::filesystem::exists(json_path, ec);
  const bool has_model = std::filesystem::exists(model_path, ec);
  if (!has_json && !has_model) {
    return absl::NotFoundError(absl::StrCat("model directory ", model_dir.string(),
                                            " has neither tokenizer.json nor tokenizer.model"));
  }
  TANDEM_ASSIGN_OR_RETURN(const tokenizer_internal::SpecialTokenConfig config,
                          tokenizer_internal::ReadSpecialTokenConfig(model_dir));

  if (has_json) {
    absl::StatusOr<nlohmann::json> parsed = tokenizer_internal::ReadJsonFile(json_path);
    if (!parsed.ok()) return parsed.status();  // its message names the file
    absl::StatusOr<std::unique_ptr<BpeTokenizer>> bpe = BpeTokenizer::Create(*parsed, config);
    if (bpe.ok()) return std::unique_ptr<Tokenizer>(std::move(*bpe));
    // A tokenizer.json of a kind this code does not run (e.g. Llama-2's Metaspace BPE) is no
    // obstacle when the SentencePiece model it was converted from is there too.
    if (!(bpe.status().code() == absl::StatusCode::kUnimplemented && has_model)) {
      return absl::Status(bpe.status().code(),
                          absl::StrCat(json_path.string(), ": ", bpe.status().message()));
    }
  }
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<SentencePieceTokenizer> sp,
                          SentencePieceTokenizer::Load(model_path, config));
  return std::unique_ptr<Tokenizer>(std::move(sp));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> ParseTokenizerJson(std::string_view tokenizer_json) {
  if (tokenizer_json.size() > tokenizer_internal::kMaxTokenizerFileBytes) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json is ", tokenizer_json.size(),
                                                   " bytes, more than the limit of ",
                                                   tokenizer_internal::kMaxTokenizerFileBytes));
  }
  nlohmann::json parsed =
      nlohmann::json::parse(tokenizer_json, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return absl::InvalidArgumentError("tokenizer.json is not valid JSON");
  TANDEM_ASSIGN_OR_RETURN(
      std::unique_ptr<tokenizer_internal::BpeTokenizer> bpe,
      tokenizer_internal::BpeTokenizer::Create(parsed, tokenizer_internal::SpecialTokenConfig{}));
  return std::unique_ptr<Tokenizer>(std::move(bpe));
}

absl::StatusOr<std::vector<int32_t>> EncodePrompt(const Tokenizer& tokenizer,
                                                  std::string_view text, bool add_bos) {
  TANDEM_ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                          tokenizer.Encode(text, /*add_bos=*/false, /*parse_special=*/true));
  if (add_bos) AddPromptBos(tokenizer, &ids);
  return ids;
}

void AddPromptBos(const Tokenizer& tokenizer, std::vector<int32_t>* ids) {
  const int32_t bos = tokenizer.bos_id();
  if (tokenizer.adds_bos() && (ids->empty() || ids->front() != bos)) {
    ids->insert(ids->begin(), bos);
  }
}

size_t MaxTokenBytes(const Tokenizer& tokenizer) {
  size_t longest = 1;
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    const size_t bytes = tokenizer.IsSpecial(id)
                             ? tokenizer.Decode({id}, /*skip_special=*/false).size()
                             : tokenizer.TokenBytes(id).size();
    longest = std::max(longest, bytes);
  }
  return longest;
}

absl::Status CheckPromptTextFits(std::string_view text, int64_t room_tokens,
                                 size_t max_token_bytes) {
  const uint64_t bound = static_cast<uint64_t>(std::max<int64_t>(room_tokens, 0)) *
                         max_token_bytes * kPromptBytesSlack;
  if (text.size() <= bound) return absl::OkStatus();
  // SentencePiece collapses whitespace runs: count each run as one byte (one pass, only for a
  // text over the bound).
  uint64_t counted = 0;
  bool in_space = false;
  for (const char c : text) {
    const bool space = c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
    if (!space || !in_space) ++counted;
    in_space = space;
  }
  if (counted <= bound) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the prompt text (", text.size(), " bytes) cannot fit the ", room_tokens,
      " tokens left in the model's context: prompts over ", kPromptBytesSlack,
      " x tokens x ", max_token_bytes, " bytes (this tokenizer's longest token) are refused "
      "before tokenizing"));
}

TokenPiece DescribeToken(const Tokenizer& tokenizer, int32_t id) {
  TokenPiece piece;
  if (id < 0 || id >= tokenizer.vocab_size()) return piece;
  piece.raw = tokenizer.IsSpecial(id) ? tokenizer.Decode({id}, /*skip_special=*/false)
                                      : tokenizer.TokenBytes(id);
  piece.text = tokenizer_internal::ToValidUtf8(piece.raw);
  return piece;
}

}  // namespace tandem::gpu_worker
