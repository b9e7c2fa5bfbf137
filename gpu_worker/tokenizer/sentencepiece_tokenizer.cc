#include "sentencepiece_tokenizer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/common/status_macros.h"
#include "utf8.h"

namespace tandem::gpu_worker::tokenizer_internal {
namespace {

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";  // "▁" U+2581

// The byte a byte piece "<0xNN>" stands for, -1 when `piece` is not of that form.
int BytePieceValue(std::string_view piece) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return -1;
  int value = 0;
  for (const char c : piece.substr(3, 2)) {
    value *= 16;
    if (c >= '0' && c <= '9') {
      value += c - '0';
    } else if (c >= 'A' && c <= 'F') {
      value += c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      value += c - 'a' + 10;
    } else {
      return -1;
    }
  }
  return value;
}

std::string ReplaceSpaceSymbols(std::string_view piece) {
  std::string out;
  out.reserve(piece.size());
  size_t pos = 0;
  while (pos < piece.size()) {
    if (piece.substr(pos, kSpaceSymbol.size()) == kSpaceSymbol) {
      out.push_back(' ');
      pos += kSpaceSymbol.size();
    } else {
      out.push_back(piece[pos++]);
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::Load(
    const std::filesystem::path& model_path, const SpecialTokenConfig& config) {
  TANDEM_ASSIGN_OR_RETURN(const std::string serialized, ReadFileBytes(model_path));
  std::unique_ptr<SentencePieceTokenizer> tokenizer(new SentencePieceTokenizer());
  const std::string error = tokenizer->processor_.LoadFromSerializedProto(serialized);
  if (!error.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(model_path.string(), " is not a valid SentencePiece model: ", error));
  }
  const int piece_size = tokenizer->processor_.GetPieceSize();
  if (piece_size <= 0 || piece_size > (1 << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat(model_path.string(), " has an invalid vocabulary size ", piece_size));
  }
  tokenizer->vocab_size_ = piece_size;
  tokenizer->token_bytes_.resize(piece_size);
  tokenizer->pieces_.resize(piece_size);
  tokenizer->is_special_.assign(piece_size, 0);
  const SpProcessor& sp = tokenizer->processor_;
  for (int id = 0; id < piece_size; ++id) {
    std::string piece = sp.IdToPiece(id);
    if (sp.IsControl(id) || sp.IsUnknown(id)) {
      tokenizer->is_special_[id] = 1;
      if (!piece.empty()) tokenizer->special_ids_.push_back(id);
    } else if (sp.IsByte(id) && BytePieceValue(piece) >= 0) {
      tokenizer->token_bytes_[id] = std::string(1, static_cast<char>(BytePieceValue(piece)));
    } else {
      tokenizer->token_bytes_[id] = ReplaceSpaceSymbols(piece);
    }
    tokenizer->pieces_[id] = std::move(piece);
  }
  std::stable_sort(tokenizer->special_ids_.begin(), tokenizer->special_ids_.end(),
                   [&](int32_t a, int32_t b) {
                     return tokenizer->pieces_[a].size() > tokenizer->pieces_[b].size();
                   });

  // The dummy prefix shows in the encoding of a plain letter: "▁a" rather than "a".
  std::vector<int> probe;
  if (sp.Encode("a", &probe).empty() && !probe.empty()) {
    tokenizer->strips_leading_space_ = tokenizer->pieces_[probe[0]].starts_with(kSpaceSymbol);
  }

  const SentencePieceTokenizer* self = tokenizer.get();
  TANDEM_ASSIGN_OR_RETURN(SpecialTokens special, ResolveSpecialTokens(
                                                     config,
                                                     [self](std::string_view text) -> int32_t {
                                                       for (int32_t id = 0; id < self->vocab_size_;
                                                            ++id) {
                                                         if (self->pieces_[id] == text) return id;
                                                       }
                                                       return -1;
                                                     },
                                                     piece_size, sp.bos_id(), sp.eos_id()));
  tokenizer->bos_id_ = special.bos_id;
  tokenizer->eos_ids_ = std::move(special.eos_ids);
  tokenizer->adds_bos_ = special.add_bos_token.value_or(true);
  return tokenizer;
}

absl::Status SentencePieceTokenizer::EncodePlain(std::string_view text,
                                                 std::vector<int32_t>* ids) const {
  if (text.empty()) return absl::OkStatus();
  std::vector<int> piece_ids;
  const std::string error = processor_.Encode(text, &piece_ids);
  if (!error.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("SentencePiece cannot encode the text: ", error));
  }
  ids->insert(ids->end(), piece_ids.begin(), piece_ids.end());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> SentencePieceTokenizer::Encode(std::string_view text,
                                                                    bool add_bos,
                                                                    bool parse_special) const {
  std::vector<int32_t> ids;
  if (add_bos && adds_bos()) ids.push_back(bos_id_);
  if (!parse_special || special_ids_.empty()) {
    TANDEM_RETURN_IF_ERROR(EncodePlain(text, &ids));
    return ids;
  }
  size_t segment_start = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    int32_t match = -1;
    for (const int32_t id : special_ids_) {
      if (text.substr(pos, pieces_[id].size()) == pieces_[id]) {
        match = id;
        break;
      }
    }
    if (match < 0) {
      ++pos;
      continue;
    }
    TANDEM_RETURN_IF_ERROR(EncodePlain(text.substr(segment_start, pos - segment_start), &ids));
    ids.push_back(match);
    pos += pieces_[match].size();
    segment_start = pos;
  }
  TANDEM_RETURN_IF_ERROR(EncodePlain(text.substr(segment_start), &ids));
  return ids;
}

std::string SentencePieceTokenizer::Decode(const std::vector<int32_t>& ids,
                                           bool skip_special) const {
  std::string bytes;
  for (const int32_t id : ids) {
    if (id < 0 || id >= vocab_size_) continue;
    if (is_special_[id]) {
      if (!skip_special) bytes.append(pieces_[id]);
      continue;
    }
    bytes.append(token_bytes_[id]);
  }
  std::string_view view = bytes;
  if (strips_leading_space_ && !view.empty() && view.front() == ' ') view.remove_prefix(1);
  return ToValidUtf8(view);
}

std::string SentencePieceTokenizer::TokenBytes(int32_t id) const {
  if (id < 0 || id >= vocab_size_) return std::string();
  return token_bytes_[id];
}

bool SentencePieceTokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < vocab_size_ && is_special_[id] != 0;
}

std::string SentencePieceTokenizer::LibraryDecode(const std::vector<int32_t>& ids) const {
  std::vector<int> valid;
  for (const int32_t id : ids) {
    if (id >= 0 && id < vocab_size_) valid.push_back(id);
  }
  return processor_.DecodeIds(valid);
}

}  // namespace tandem::gpu_worker::tokenizer_internal
