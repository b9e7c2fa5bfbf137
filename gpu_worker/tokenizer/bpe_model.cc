#include "bpe_model.h"

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

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json model: ", message));
}

absl::string_view AbslView(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Heap order: the candidate with the lowest rank, then the leftmost, comes out first.
bool LaterCandidate(int32_t rank_a, int32_t left_a, int32_t rank_b, int32_t left_b) {
  return rank_a != rank_b ? rank_a > rank_b : left_a > left_b;
}

}  // namespace

int32_t BpeModel::TokenToId(std::string_view token) const {
  const auto it = vocab_.find(AbslView(token));
  return it == vocab_.end() ? -1 : it->second;
}

const BpeModel::Merge* BpeModel::FindMerge(int32_t left, int32_t right) const {
  const auto it = merges_.find(PairKey(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

absl::Status BpeModel::ParseVocab(const json& vocab) {
  if (!vocab.is_object()) return Invalid("\"vocab\" is missing or not an object");
  vocab_.reserve(vocab.size());
  int32_t max_id = -1;
  for (const auto& [token, id_json] : vocab.items()) {
    if (!id_json.is_number_integer()) {
      return Invalid(absl::StrCat("vocab id of \"", token, "\" is not an integer"));
    }
    const int64_t id = id_json.get<int64_t>();
    if (id < 0 || id > kMaxTokenId) {
      return Invalid(
          absl::StrCat("vocab id ", id, " of \"", token, "\" is outside [0, ", kMaxTokenId, "]"));
    }
    vocab_[token] = static_cast<int32_t>(id);
    max_id = std::max(max_id, static_cast<int32_t>(id));
  }
  id_to_token_.assign(static_cast<size_t>(max_id) + 1, std::string());
  for (const auto& [token, id] : vocab_) id_to_token_[static_cast<size_t>(id)] = token;
  return absl::OkStatus();
}

absl::Status BpeModel::ParseMerges(const json& merges) {
  if (merges.is_null()) return absl::OkStatus();
  if (!merges.is_array()) return Invalid("\"merges\" is not a list");
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& entry = merges[rank];
    std::string_view left;
    std::string_view right;
    if (entry.is_string()) {  // "a b"
      const std::string_view text = entry.get_ref<const std::string&>();
      const size_t space = text.find(' ');
      if (space == std::string_view::npos || text.find(' ', space + 1) != std::string_view::npos) {
        return Invalid(
            absl::StrCat("merge ", rank, " \"", std::string(text), "\" is not two tokens"));
      }
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else if (entry.is_array() && entry.size() == 2 && entry[0].is_string() &&
               entry[1].is_string()) {  // ["a", "b"]
      left = entry[0].get_ref<const std::string&>();
      right = entry[1].get_ref<const std::string&>();
    } else {
      return Invalid(absl::StrCat("merge ", rank, " is neither \"a b\" nor [\"a\", \"b\"]"));
    }
    const int32_t left_id = TokenToId(left);
    const int32_t right_id = TokenToId(right);
    std::string joined(left);
    joined.append(right);
    const int32_t new_id = TokenToId(joined);
    if (left_id < 0 || right_id < 0 || new_id < 0) {
      return Invalid(absl::StrCat("merge ", rank, " (\"", std::string(left), "\", \"",
                                  std::string(right),
                                  "\") names a token that is not in the vocab"));
    }
    // A repeated pair keeps its first (lowest) rank, as Hugging Face's map insertion order does.
    merges_.try_emplace(PairKey(left_id, right_id), Merge{static_cast<int32_t>(rank), new_id});
  }
  return absl::OkStatus();
}

absl::StatusOr<BpeModel> BpeModel::FromJson(const json& model) {
  if (!model.is_object()) return Invalid("\"model\" is missing or not an object");
  const auto type = model.find("type");
  if (type != model.end() && !(type->is_string() && type->get<std::string>() == "BPE")) {
    return absl::UnimplementedError(
        absl::StrCat("tokenizer.json model type ", type->dump(), " is not supported (only BPE)"));
  }
  const auto string_field = [&](const char* key) -> std::string {
    const auto it = model.find(key);
    return it != model.end() && it->is_string() ? it->get<std::string>() : std::string();
  };
  const auto bool_field = [&](const char* key) {
    const auto it = model.find(key);
    return it != model.end() && it->is_boolean() && it->get<bool>();
  };
  if (bool_field("byte_fallback")) {
    return absl::UnimplementedError("tokenizer.json BPE with byte_fallback=true is not supported");
  }
  if (!string_field("continuing_subword_prefix").empty() ||
      !string_field("end_of_word_suffix").empty()) {
    return absl::UnimplementedError(
        "tokenizer.json BPE with continuing_subword_prefix or end_of_word_suffix is not supported");
  }

  BpeModel bpe;
  bpe.ignore_merges_ = bool_field("ignore_merges");
  bpe.fuse_unk_ = bool_field("fuse_unk");
  const auto vocab = model.find("vocab");
  if (vocab == model.end()) return Invalid("\"vocab\" is missing");
  TANDEM_RETURN_IF_ERROR(bpe.ParseVocab(*vocab));
  const auto merges = model.find("merges");
  if (merges != model.end()) TANDEM_RETURN_IF_ERROR(bpe.ParseMerges(*merges));

  const auto unk = model.find("unk_token");
  if (unk != model.end() && !unk->is_null()) {
    if (!unk->is_string()) return Invalid("\"unk_token\" is neither a string nor null");
    bpe.unk_id_ = bpe.TokenToId(unk->get_ref<const std::string&>());
    if (bpe.unk_id_ < 0) {
      return Invalid(
          absl::StrCat("unk_token \"", unk->get<std::string>(), "\" is not in the vocab"));
    }
  }
  for (int b = 0; b < 256; ++b) {
    std::string character;
    AppendUtf8(ByteToCodepoint(static_cast<uint8_t>(b)), &character);
    bpe.byte_to_id_[b] = bpe.TokenToId(character);
  }
  return bpe;
}

void BpeModel::EncodeWord(std::string_view bytes, Scratch& scratch,
                          std::vector<int32_t>* out) const {
  if (ignore_merges_) {
    scratch.mapped_.clear();
    ByteLevelEncode(bytes, &scratch.mapped_);
    const int32_t id = TokenToId(scratch.mapped_);
    if (id >= 0) {
      out->push_back(id);
      return;
    }
  }

  // One symbol per byte; bytes without a vocab character become unk or vanish.
  std::vector<Scratch::Symbol>& symbols = scratch.symbols_;
  symbols.clear();
  bool previous_unknown = false;
  for (const char c : bytes) {
    int32_t id = byte_to_id_[static_cast<uint8_t>(c)];
    const bool unknown = id < 0;
    if (unknown) {
      id = unk_id_;
      if (id < 0 || (fuse_unk_ && previous_unknown)) continue;
    }
    previous_unknown = unknown;
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, index + 1, true});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  // Min-heap of mergeable adjacent pairs. A popped candidate is stale when its left symbol died
  // or either neighbour changed since it was pushed; the pair's rank, unique per pair, tells.
  std::vector<Scratch::Candidate>& heap = scratch.heap_;
  heap.clear();
  const auto heap_order = [](const Scratch::Candidate& a, const Scratch::Candidate& b) {
    return LaterCandidate(a.rank, a.left, b.rank, b.left);
  };
  const auto push_pair = [&](int32_t left) {
    if (left < 0 || symbols[left].next < 0) return;
    const Merge* merge = FindMerge(symbols[left].id, symbols[symbols[left].next].id);
    if (merge == nullptr) return;
    heap.push_back({merge->rank, left});
    std::push_heap(heap.begin(), heap.end(), heap_order);
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) push_pair(i);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), heap_order);
    const Scratch::Candidate top = heap.back();
    heap.pop_back();
    Scratch::Symbol& left = symbols[top.left];
    if (!left.alive || left.next < 0) continue;
    const int32_t right_index = left.next;
    const Merge* merge = FindMerge(left.id, symbols[right_index].id);
    if (merge == nullptr || merge->rank != top.rank) continue;
    left.id = merge->new_id;
    left.next = symbols[right_index].next;
    if (left.next >= 0) symbols[left.next].prev = top.left;
    symbols[right_index].alive = false;
    push_pair(left.prev);
    push_pair(top.left);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out->push_back(symbols[i].id);
}

}  // namespace tandem::gpu_worker::tokenizer_internal
