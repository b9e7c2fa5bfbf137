// A hand-written Llama-3-style tokenizer.json (Split pre-tokenizer with Llama-3's regex, then
// ByteLevel without regex; ignore_merges; merges in both "a b" and ["a", "b"] forms; a BOS
// template), with every expected id worked out by hand in the comments.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tandem/gpu_worker/tokenizer.h"
#include "tokenizer_test_util.h"

namespace tandem::gpu_worker {
namespace {

// Vocab (byte-level characters: "Ġ" is ' ', "Ċ" is '\n'):
//   0 <|begin_of_text|>  1 <|end|>  2 a  3 b  4 c  5 Ġ  6 1  7 2  8 3  9 4  10 '  11 S  12 s
//   13 Ċ  14 !  15 ab  16 Ġa  17 abc  18 12  19 Ġab  20 cab  21 'Sab  23 aa
// Added tokens: 0 and 1 (special), 22 "<x>" (not special, not in the vocab).
// Merges by rank: 0 a+b, 1 Ġ+a, 2 ab+c, 3 1+2, 4 Ġa+b, 5 a+a.
std::string TinyTokenizerJson(bool ignore_merges, const std::string& post_processor) {
  return R"({
  "version": "1.0",
  "added_tokens": [
    {"id": 0, "content": "<|begin_of_text|>", "single_word": false, "lstrip": false,
     "rstrip": false, "normalized": false, "special": true},
    {"id": 1, "content": "<|end|>", "special": true},
    {"id": 22, "content": "<x>", "special": false}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
  ]},
  "post_processor": )" +
         post_processor + R"(,
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
              "use_regex": true},
  "model": {
    "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
    "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
    "ignore_merges": )" +
         (ignore_merges ? "true" : "false") + R"(,
    "vocab": {"<|begin_of_text|>": 0, "<|end|>": 1, "a": 2, "b": 3, "c": 4, "\u0120": 5,
              "1": 6, "2": 7, "3": 8, "4": 9, "'": 10, "S": 11, "s": 12, "\u010a": 13, "!": 14,
              "ab": 15, "\u0120a": 16, "abc": 17, "12": 18, "\u0120ab": 19, "cab": 20,
              "'Sab": 21, "aa": 23},
    "merges": ["a b", ["\u0120", "a"], "ab c", ["1", "2"], "\u0120a b", ["a", "a"]]
  }
})";
}

constexpr char kTemplate[] = R"({"type": "Sequence", "processors": [
    {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
    {"type": "TemplateProcessing",
     "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}}],
     "pair": [],
     "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [0],
                                              "tokens": ["<|begin_of_text|>"]}}}]})";

std::unique_ptr<Tokenizer> LoadTiny(const TempModelDir& dir, bool ignore_merges,
                                    const std::string& post_processor = kTemplate) {
  dir.Write("tokenizer.json", TinyTokenizerJson(ignore_merges, post_processor));
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(dir.path());
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? std::move(*tokenizer) : nullptr;
}

std::vector<int32_t> Encode(const Tokenizer& tokenizer, const std::string& text,
                            bool add_bos = false, bool parse_special = false) {
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Encode(text, add_bos, parse_special);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : std::vector<int32_t>();
}

using Ids = std::vector<int32_t>;

TEST(TinyBpeTest, MergesWithoutIgnoreMerges) {
  TempModelDir dir;
  const std::unique_ptr<Tokenizer> tok = LoadTiny(dir, /*ignore_merges=*/false);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 24);
  // "abc": a+b (rank 0), then ab+c (rank 2).
  EXPECT_EQ(Encode(*tok, "abc"), Ids({17}));
  // " ab" is one pre-token: a+b (rank 0) beats Ġ+a (rank 1); Ġ+ab is no merge, so "Ġab" (19)
  // is unreachable without ignore_merges.
  EXPECT_EQ(Encode(*tok, " ab"), Ids({5, 15}));
  // "cab": a+b, then c+ab is no merge.
  EXPECT_EQ(Encode(*tok, "cab"), Ids({4, 15}));
  // Equal ranks merge leftmost first: "aaa" -> aa + a.
  EXPECT_EQ(Encode(*tok, "aaa"), Ids({23, 2}));
  // " a": Ġ+a.
  EXPECT_EQ(Encode(*tok, " a"), Ids({16}));
}

TEST(TinyBpeTest, IgnoreMergesTakesWholePreTokensFromVocab) {
  TempModelDir dir;
  const std::unique_ptr<Tokenizer> tok = LoadTiny(dir, /*ignore_merges=*/true);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, " ab"), Ids({19}));
  EXPECT_EQ(Encode(*tok, "cab"), Ids({20}));
  EXPECT_EQ(Encode(*tok, "aaa"), Ids({23, 2}));  // not in the vocab: merged as usual
}

TEST(TinyBpeTest, Llama3PreTokenizer) {
  TempModelDir dir;
  const std::unique_ptr<Tokenizer> tok = LoadTiny(dir, /*ignore_merges=*/true);
  ASSERT_NE(tok, nullptr);
  // (?i:'s) takes "'S" on its own, so "'Sab" is "'S" + "ab" and not the vocab entry 21; a
  // case-sensitive pattern would make "'Sab" one pre-token and give [21].
  EXPECT_EQ(Encode(*tok, "'Sab"), Ids({10, 11, 15}));
  // \p{N}{1,3}: "12341" -> "123" (1+2 then 3) and "41".
  EXPECT_EQ(Encode(*tok, "12341"), Ids({18, 8, 9, 6}));
  // \s*[\r\n]+ keeps the newlines together; [^\r\n\p{L}\p{N}]?\p{L}+ gives " ab" its space.
  EXPECT_EQ(Encode(*tok, "a\n\n ab"), Ids({2, 13, 13, 19}));
  // " !!" is one pre-token: Ġ ! ! (no merges).
  EXPECT_EQ(Encode(*tok, "c !!"), Ids({4, 5, 14, 14}));
  // Characters outside the vocab ("x") are dropped (unk_token is null), so a and b become
  // neighbours and merge.
  EXPECT_EQ(Encode(*tok, "axb"), Ids({15}));
}

TEST(TinyBpeTest, AddedTokensAndBosTemplate) {
  TempModelDir dir;
  const std::unique_ptr<Tokenizer> tok = LoadTiny(dir, /*ignore_merges=*/true);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->bos_id(), 0);  // from the template: no config files here
  EXPECT_TRUE(tok->adds_bos());
  EXPECT_TRUE(tok->eos_ids().empty());
  EXPECT_EQ(Encode(*tok, "abc", /*add_bos=*/true), Ids({0, 17}));
  EXPECT_EQ(Encode(*tok, "<|begin_of_text|>abc<|end|>", false, /*parse_special=*/true),
            Ids({0, 17, 1}));
  for (const int32_t id : Encode(*tok, "<|end|>", false, /*parse_special=*/false)) {
    EXPECT_NE(id, 1);
  }
  // A non-special added token is matched even without parse_special.
  EXPECT_EQ(Encode(*tok, "ab<x>c"), Ids({15, 22, 4}));
  EXPECT_EQ(tok->TokenBytes(22), "<x>");
  EXPECT_FALSE(tok->IsSpecial(22));
  EXPECT_TRUE(tok->IsSpecial(1));
  EXPECT_EQ(tok->Decode({0, 17, 5, 16, 22, 1}), "abc  a<x>");
  EXPECT_EQ(tok->Decode({0, 17, 5, 16, 22, 1}, /*skip_special=*/false),
            "<|begin_of_text|>abc  a<x><|end|>");
  EXPECT_EQ(tok->Decode({17, -1, 24, 1000}), "abc");  // out-of-range ids contribute nothing
}

TEST(TinyBpeTest, ConfigFilesOverrideBosAndEos) {
  TempModelDir dir;
  dir.Write("tokenizer_config.json",
            R"({"add_bos_token": false, "bos_token": "<|begin_of_text|>",
                "eos_token": {"content": "<|end|>", "special": true}})");
  dir.Write("generation_config.json", R"({"bos_token_id": 0, "eos_token_id": [14, 1]})");
  const std::unique_ptr<Tokenizer> tok = LoadTiny(dir, /*ignore_merges=*/true);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->bos_id(), 0);
  EXPECT_FALSE(tok->adds_bos());
  EXPECT_EQ(Encode(*tok, "abc", /*add_bos=*/true), Ids({17}));
  EXPECT_EQ(tok->eos_ids(), Ids({14, 1}));  // generation_config first, then tokenizer_config
}

TEST(TinyBpeTest, NoTemplateMeansNoBos) {
  TempModelDir dir;
  const std::unique_ptr<Tokenizer> tok =
      LoadTiny(dir, /*ignore_merges=*/true, R"({"type": "ByteLevel"})");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->bos_id(), -1);
  EXPECT_FALSE(tok->adds_bos());
  EXPECT_EQ(Encode(*tok, "abc", /*add_bos=*/true), Ids({17}));
}

// Split behaviors, seen through merges that a cut forbids. Vocab a 0, b 1, c 2, ab 3, bc 4;
// merges a+b (rank 0), b+c (rank 1). Uncut, "abc" merges a+b first: [ab, c].
TEST(TinyBpeTest, SplitBehaviors) {
  const auto load = [](const TempModelDir& dir, const std::string& behavior) {
    dir.Write("tokenizer.json", R"({"added_tokens": [], "normalizer": null,
      "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": "b"}, "behavior": ")" +
                                    behavior + R"(", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]},
      "post_processor": null, "decoder": null,
      "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4},
                "merges": ["a b", "b c"]}})");
    absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(dir.path());
    EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
    return tokenizer.ok() ? std::move(*tokenizer) : nullptr;
  };
  TempModelDir dir;
  std::unique_ptr<Tokenizer> tok = load(dir, "Isolated");  // "a" "b" "c"
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "abc"), Ids({0, 1, 2}));
  tok = load(dir, "Removed");  // "a" "c"
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "abc"), Ids({0, 2}));
  tok = load(dir, "MergedWithPrevious");  // "ab" "c"; "bb" -> "b" "b": a match after a match
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "abc"), Ids({3, 2}));
  EXPECT_EQ(Encode(*tok, "abbc"), Ids({3, 1, 2}));
  tok = load(dir, "MergedWithNext");  // "a" "bc"
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(Encode(*tok, "abc"), Ids({0, 4}));
  EXPECT_EQ(Encode(*tok, "abbc"), Ids({0, 1, 4}));
}

}  // namespace
}  // namespace tandem::gpu_worker
