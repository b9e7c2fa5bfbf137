// The BPE model of a byte-level tokenizer.json ("model": {"type": "BPE", "vocab", "merges", ...}):
// turns one pre-token into token ids by mapping its bytes to characters (GPT-2's byte map, see
// byte_level.h) and merging adjacent symbols, lowest merge rank first, leftmost first among equal
// ranks, exactly as Hugging Face's `Word::merge_all`.
//
// Understood fields: vocab (token -> id), merges (["a b", ...] or [["a", "b"], ...]; rank =
// index), ignore_merges (a pre-token that is itself in the vocab is one token, as Llama-3 sets),
// unk_token (a token or null; bytes whose character is not in the vocab become it, a run of them
// one unk when fuse_unk, or are dropped when null, as Hugging Face does), dropout (ignored:
// inference is deterministic). byte_fallback = true and non-empty continuing_subword_prefix /
// end_of_word_suffix are UNIMPLEMENTED. Malformed fields, ids outside [0, 2^24), merges naming
// tokens that are not in the vocab (or whose concatenation is not) are INVALID_ARGUMENT.
//
// Thread safety: immutable after FromJson; one Scratch per thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::gpu_worker::tokenizer_internal {

inline constexpr int32_t kMaxTokenId = (1 << 24) - 1;

class BpeModel {
 public:
  // Working memory of EncodeWord, reused across calls.
  class Scratch {
   private:
    friend class BpeModel;
    struct Symbol {
      int32_t id;
      int32_t prev;  // index of the symbol on the left, -1 at the start
      int32_t next;  // index of the symbol on the right, -1 at the end
      bool alive;
    };
    struct Candidate {  // a mergeable pair (symbol `left` and the one after it)
      int32_t rank;
      int32_t left;
    };
    std::vector<Symbol> symbols_;
    std::vector<Candidate> heap_;
    std::string mapped_;
  };

  static absl::StatusOr<BpeModel> FromJson(const nlohmann::json& model);

  // Appends the ids of the pre-token `bytes` (raw bytes) to `out`.
  void EncodeWord(std::string_view bytes, Scratch& scratch, std::vector<int32_t>* out) const;

  // Id of a vocab token (written in byte-level characters, e.g. "Ġthe"), -1 when absent.
  int32_t TokenToId(std::string_view token) const;

  // Token text of every id in [0, max id], "" for ids the vocab skips.
  const std::vector<std::string>& id_to_token() const { return id_to_token_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };

  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) |
           static_cast<uint32_t>(right);
  }
  const Merge* FindMerge(int32_t left, int32_t right) const;
  absl::Status ParseVocab(const nlohmann::json& vocab);
  absl::Status ParseMerges(const nlohmann::json& merges);

  absl::flat_hash_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;
  absl::flat_hash_map<uint64_t, Merge> merges_;
  int32_t byte_to_id_[256];  // id of each byte's character, -1 when not in the vocab
  int32_t unk_id_ = -1;
  bool ignore_merges_ = false;
  bool fuse_unk_ = false;
};

}  // namespace tandem::gpu_worker::tokenizer_internal
