#include "bpe_tokenizer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "byte_level.h"
#include "tandem/common/status_macros.h"
#include "utf8.h"

namespace tandem::gpu_worker::tokenizer_internal {
namespace {

using nlohmann::json;

// Entries of the per-call pre-token cache before it is emptied; bounds Encode's memory on huge
// texts while keeping the hit rate of natural language (a few thousand distinct words).
constexpr size_t kMaxCachedPreTokens = size_t{1} << 16;

bool IsAsciiSpace(char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

absl::Status CheckNormalizer(const json& normalizer) {
  if (normalizer.is_null()) return absl::OkStatus();
  const auto type = normalizer.find("type");
  if (normalizer.is_object() && type != normalizer.end() && type->is_string()) {
    if (*type == "NFC") return absl::OkStatus();  // not applied: see bpe_tokenizer.h
    if (*type == "Sequence") {
      const auto list = normalizer.find("normalizers");
      if (list != normalizer.end() && list->is_array()) {
        for (const json& entry : *list) TANDEM_RETURN_IF_ERROR(CheckNormalizer(entry));
        return absl::OkStatus();
      }
    }
  }
  return absl::UnimplementedError(absl::StrCat("tokenizer.json normalizer ", normalizer.dump(),
                                               " is not supported (only null or NFC)"));
}

absl::Status CheckDecoder(const json& decoder) {
  if (decoder.is_null()) return absl::OkStatus();
  const auto type = decoder.find("type");
  if (decoder.is_object() && type != decoder.end() && *type == "ByteLevel") {
    return absl::OkStatus();
  }
  return absl::UnimplementedError(absl::StrCat("tokenizer.json decoder ", decoder.dump(),
                                               " is not supported (only ByteLevel)"));
}

const json& Field(const json& object, const char* key) {
  static const json* const kNull = new json(nullptr);
  if (!object.is_object()) return *kNull;
  const auto it = object.find(key);
  return it == object.end() ? *kNull : *it;
}

}  // namespace

absl::Status BpeTokenizer::ParseAddedTokens(const json& added_tokens) {
  if (added_tokens.is_null()) return absl::OkStatus();
  if (!added_tokens.is_array()) {
    return absl::InvalidArgumentError("tokenizer.json \"added_tokens\" is not a list");
  }
  for (const json& entry : added_tokens) {
    const json& id = Field(entry, "id");
    const json& content = Field(entry, "content");
    if (!id.is_number_integer() || !content.is_string()) {
      return absl::InvalidArgumentError(
          "tokenizer.json added_tokens entry without an integer \"id\" and a string \"content\"");
    }
    const int64_t id_value = id.get<int64_t>();
    if (id_value < 0 || id_value > kMaxTokenId) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer.json added token id ", id_value, " is out of range"));
    }
    if (content.get_ref<const std::string&>().empty()) {
      return absl::InvalidArgumentError("tokenizer.json added token with empty content");
    }
    const auto flag = [&](const char* key) {
      const json& value = Field(entry, key);
      return value.is_boolean() && value.get<bool>();
    };
    added_tokens_.push_back({static_cast<int32_t>(id_value), content.get<std::string>(),
                             flag("special"), flag("lstrip"), flag("rstrip")});
  }
  for (size_t i = 0; i < added_tokens_.size(); ++i) {
    added_by_first_byte_[static_cast<uint8_t>(added_tokens_[i].content[0])].push_back(
        static_cast<int32_t>(i));
  }
  for (std::vector<int32_t>& list : added_by_first_byte_) {
    std::stable_sort(list.begin(), list.end(), [&](int32_t a, int32_t b) {
      return added_tokens_[a].content.size() > added_tokens_[b].content.size();
    });
  }
  return absl::OkStatus();
}

int32_t BpeTokenizer::TokenToId(std::string_view text) const {
  for (const AddedToken& token : added_tokens_) {
    if (token.content == text) return token.id;
  }
  return model_.TokenToId(text);
}

absl::StatusOr<int32_t> BpeTokenizer::TemplateFirstToken(const json& post_processor) const {
  const json& type = Field(post_processor, "type");
  if (type == "Sequence") {
    const json& processors = Field(post_processor, "processors");
    if (!processors.is_array()) return -1;
    for (const json& processor : processors) {
      TANDEM_ASSIGN_OR_RETURN(const int32_t id, TemplateFirstToken(processor));
      if (id >= 0) return id;
    }
    return -1;
  }
  if (type != "TemplateProcessing") return -1;
  const json& single = Field(post_processor, "single");
  if (!single.is_array() || single.empty()) return -1;
  const json& name = Field(Field(single[0], "SpecialToken"), "id");
  if (!name.is_string()) return -1;  // the template starts with the text itself
  const std::string& text = name.get_ref<const std::string&>();
  const json& ids = Field(Field(Field(post_processor, "special_tokens"), text.c_str()), "ids");
  if (ids.is_array() && !ids.empty() && ids[0].is_number_integer()) {
    const int64_t id = ids[0].get<int64_t>();
    if (id < 0 || id >= vocab_size_) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.json post_processor token \"", text,
                                                     "\" has id ", id, " outside the vocab"));
    }
    return static_cast<int32_t>(id);
  }
  const int32_t id = TokenToId(text);
  if (id < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.json post_processor token \"", text, "\" is not in the vocab"));
  }
  return id;
}

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::Create(
    const json& tokenizer_json, const SpecialTokenConfig& config) {
  if (!tokenizer_json.is_object()) {
    return absl::InvalidArgumentError("tokenizer.json is not a JSON object");
  }
  TANDEM_RETURN_IF_ERROR(CheckNormalizer(Field(tokenizer_json, "normalizer")));
  TANDEM_RETURN_IF_ERROR(CheckDecoder(Field(tokenizer_json, "decoder")));
  const json& model_json = Field(tokenizer_json, "model");
  TANDEM_ASSIGN_OR_RETURN(BpeModel model, BpeModel::FromJson(model_json));
  TANDEM_ASSIGN_OR_RETURN(PreTokenizer pre_tokenizer,
                          PreTokenizer::FromJson(Field(tokenizer_json, "pre_tokenizer")));
  std::unique_ptr<BpeTokenizer> tokenizer(
      new BpeTokenizer(std::move(model), std::move(pre_tokenizer)));
  TANDEM_RETURN_IF_ERROR(tokenizer->ParseAddedTokens(Field(tokenizer_json, "added_tokens")));

  // Vocabulary: the model's tokens, overlaid by the added tokens.
  const std::vector<std::string>& id_to_token = tokenizer->model_.id_to_token();
  int32_t vocab_size = static_cast<int32_t>(id_to_token.size());
  for (const AddedToken& token : tokenizer->added_tokens_) {
    vocab_size = std::max(vocab_size, token.id + 1);
  }
  tokenizer->vocab_size_ = vocab_size;
  tokenizer->token_bytes_.resize(static_cast<size_t>(vocab_size));
  tokenizer->is_special_.assign(static_cast<size_t>(vocab_size), 0);
  for (size_t id = 0; id < id_to_token.size(); ++id) {
    tokenizer->token_bytes_[id] = ByteLevelDecode(id_to_token[id]);
  }
  for (const AddedToken& token : tokenizer->added_tokens_) {
    if (token.special) {
      tokenizer->token_bytes_[token.id].clear();
      tokenizer->is_special_[token.id] = 1;
      tokenizer->special_text_[token.id] = token.content;
    } else {
      tokenizer->token_bytes_[token.id] = token.content;  // raw text, not byte-level characters
    }
  }

  const BpeTokenizer* self = tokenizer.get();
  TANDEM_ASSIGN_OR_RETURN(
      SpecialTokens special,
      ResolveSpecialTokens(
          config, [self](std::string_view text) { return self->TokenToId(text); }, vocab_size,
          /*model_bos=*/-1, /*model_eos=*/-1));
  TANDEM_ASSIGN_OR_RETURN(const int32_t template_first,
                          tokenizer->TemplateFirstToken(Field(tokenizer_json, "post_processor")));
  tokenizer->bos_id_ = special.bos_id >= 0 ? special.bos_id : template_first;
  tokenizer->eos_ids_ = std::move(special.eos_ids);
  tokenizer->adds_bos_ =
      special.add_bos_token.value_or(template_first >= 0 && template_first == tokenizer->bos_id_);
  return tokenizer;
}

absl::StatusOr<std::vector<int32_t>> BpeTokenizer::Encode(std::string_view text, bool add_bos,
                                                          bool parse_special) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 4 + 1);
  if (add_bos && adds_bos()) ids.push_back(bos_id_);

  PreTokenizer::Scratch pre_scratch = pre_tokenizer_.NewScratch();
  BpeModel::Scratch bpe_scratch;
  std::vector<std::string_view> pieces;
  // Pre-token -> [offset, count) in cached_ids. Keys point into `text` or pre_scratch.
  absl::flat_hash_map<absl::string_view, std::pair<uint32_t, uint32_t>> cache;
  std::vector<int32_t> cached_ids;

  const auto encode_segment = [&](std::string_view segment) -> absl::Status {
    pieces.clear();
    TANDEM_RETURN_IF_ERROR(pre_tokenizer_.Split(segment, pre_scratch, &pieces));
    for (const std::string_view piece : pieces) {
      const absl::string_view key(piece.data(), piece.size());
      const auto it = cache.find(key);
      if (it != cache.end()) {
        const auto [offset, count] = it->second;
        ids.insert(ids.end(), cached_ids.begin() + offset, cached_ids.begin() + offset + count);
        continue;
      }
      const size_t first = ids.size();
      model_.EncodeWord(piece, bpe_scratch, &ids);
      if (cache.size() >= kMaxCachedPreTokens) {
        cache.clear();
        cached_ids.clear();
      }
      cache.emplace(key, std::make_pair(static_cast<uint32_t>(cached_ids.size()),
                                        static_cast<uint32_t>(ids.size() - first)));
      cached_ids.insert(cached_ids.end(), ids.begin() + static_cast<std::ptrdiff_t>(first),
                        ids.end());
    }
    return absl::OkStatus();
  };

  // Cut out added tokens: at each position the longest one that starts there wins.
  size_t segment_start = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const AddedToken* match = nullptr;
    for (const int32_t index : added_by_first_byte_[static_cast<uint8_t>(text[pos])]) {
      const AddedToken& token = added_tokens_[index];
      if (token.special && !parse_special) continue;
      if (text.substr(pos, token.content.size()) == token.content) {
        match = &token;
        break;
      }
    }
    if (match == nullptr) {
      ++pos;
      continue;
    }
    size_t begin = pos;
    size_t end = pos + match->content.size();
    if (match->lstrip) {
      while (begin > segment_start && IsAsciiSpace(text[begin - 1])) --begin;
    }
    if (match->rstrip) {
      while (end < text.size() && IsAsciiSpace(text[end])) ++end;
    }
    TANDEM_RETURN_IF_ERROR(encode_segment(text.substr(segment_start, begin - segment_start)));
    ids.push_back(match->id);
    segment_start = pos = end;
  }
  TANDEM_RETURN_IF_ERROR(encode_segment(text.substr(segment_start)));
  return ids;
}

std::string BpeTokenizer::Decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string bytes;
  for (const int32_t id : ids) {
    if (id < 0 || id >= vocab_size_) continue;
    if (is_special_[id]) {
      if (!skip_special) {
        const auto it = special_text_.find(id);
        if (it != special_text_.end()) bytes.append(it->second);
      }
      continue;
    }
    bytes.append(token_bytes_[id]);
  }
  return ToValidUtf8(bytes);
}

std::string BpeTokenizer::TokenBytes(int32_t id) const {
  if (id < 0 || id >= vocab_size_) return std::string();
  return token_bytes_[id];
}

bool BpeTokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < vocab_size_ && is_special_[id] != 0;
}

}  // namespace tandem::gpu_worker::tokenizer_internal
