// Byte-level BPE on gutenberg-14m (tokenizer.json, GPT-2 pre-tokenizer, 4096 tokens): hand-derived
// cases from its vocab and merges, round trips of the 12 eval books, and their ids against an
// independent reference implementation.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "tandem/gpu_worker/tokenizer.h"
#include "utf8.h"

namespace tandem::gpu_worker {
namespace {

const std::filesystem::path kSharedDir(TANDEM_SHARED_DIR);
const std::filesystem::path kModelDir = kSharedDir / "models/gutenberg-14m";
const std::filesystem::path kBooksDir = kSharedDir / "data/gutenberg-eval";

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

class Gutenberg14mTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(kModelDir / "tokenizer.json")) {
      GTEST_SKIP() << "gutenberg-14m not found under " << kModelDir << "; skipping";
    }
    absl::StatusOr<std::unique_ptr<Tokenizer>> loaded = LoadTokenizer(kModelDir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    tokenizer_ = std::move(*loaded);
    const nlohmann::json json =
        nlohmann::json::parse(ReadFile(kModelDir / "tokenizer.json"), nullptr, false);
    ASSERT_FALSE(json.is_discarded());
    vocab_ = json.at("model").at("vocab");
  }

  // Id of a vocab entry, read from tokenizer.json by the test itself.
  int32_t Id(const std::string& token) const {
    const auto it = vocab_.find(token);
    EXPECT_NE(it, vocab_.end()) << token;
    return it == vocab_.end() ? -1 : it->get<int32_t>();
  }

  std::vector<int32_t> Encode(const std::string& text, bool parse_special = false) const {
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(text, false, parse_special);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : std::vector<int32_t>();
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  nlohmann::json vocab_;
};

TEST_F(Gutenberg14mTokenizerTest, Properties) {
  EXPECT_EQ(tokenizer_->kind(), "bpe");
  EXPECT_EQ(tokenizer_->vocab_size(), 4096);
  EXPECT_EQ(tokenizer_->bos_id(), 0);  // config.json bos_token_id, tokenizer_config bos_token
  EXPECT_EQ(tokenizer_->eos_ids(), std::vector<int32_t>({0}));
  // Its post-processor is ByteLevel, not a template with BOS: nothing is prepended.
  EXPECT_FALSE(tokenizer_->adds_bos());
  const absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(" the", /*add_bos=*/true);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, std::vector<int32_t>({Id("\xC4\xA0the")}));  // "Ġthe"
  EXPECT_TRUE(tokenizer_->IsSpecial(0));
  EXPECT_TRUE(tokenizer_->IsSpecial(1));  // <|pad|>
  EXPECT_FALSE(tokenizer_->IsSpecial(262));
  EXPECT_FALSE(tokenizer_->strips_leading_space());
}

TEST_F(Gutenberg14mTokenizerTest, HandDerivedCases) {
  const std::string G = "\xC4\xA0";  // "Ġ", the character of byte ' '
  const std::string C = "\xC4\x8A";  // "Ċ", the character of byte '\n'
  // Merges Ġ+t (rank 0), h+e (1), Ġt+he (4) build "Ġthe"; "the" is its own vocab entry.
  EXPECT_EQ(Encode(" the"), std::vector<int32_t>({262}));
  EXPECT_EQ(Id(G + "the"), 262);
  EXPECT_EQ(Encode("the"), std::vector<int32_t>({Id("the")}));
  // "\s+(?!\S)": a whitespace run before a word leaves its last space to the word.
  EXPECT_EQ(Encode(" world\n\n the"), std::vector<int32_t>({Id(G + "world"), Id(C + C), 262}));
  EXPECT_EQ(Encode("  the"), std::vector<int32_t>({Id(G), 262}));
  // ...and a run of newlines before a letter splits off its last newline.
  EXPECT_EQ(Encode(" world\n\nthe"),
            std::vector<int32_t>({Id(G + "world"), Id(C), Id(C), Id("the")}));
  EXPECT_EQ(Encode("\n\n\n"), std::vector<int32_t>({Id(C + C + C)}));
  // Digits: " 1909" is one pre-token; Ġ+1 (rank 232), then Ġ1+9 (1636); no merge joins 0 or 9.
  EXPECT_EQ(Encode(" 1909"), std::vector<int32_t>({Id(G + "19"), Id("0"), Id("9")}));
  // "café": bytes 63 61 66 C3 A9 -> c a f Ã ©; only a+f (rank 2241) merges.
  const std::string cafe = "caf\xC3\xA9";
  EXPECT_EQ(Encode(cafe),
            std::vector<int32_t>({Id("c"), Id("af"), Id("\xC3\x83"), Id("\xC2\xA9")}));
  // With a space: Ġ+c (23), Ġc+a (1406) beat a+f (2241), leaving f alone.
  EXPECT_EQ(Encode(" " + cafe),
            std::vector<int32_t>({Id(G + "ca"), Id("f"), Id("\xC3\x83"), Id("\xC2\xA9")}));
  EXPECT_EQ(tokenizer_->Decode(Encode(cafe)), cafe);
  EXPECT_EQ(tokenizer_->Decode(Encode("A " + cafe + " au lait.\n")), "A " + cafe + " au lait.\n");
  EXPECT_EQ(tokenizer_->TokenBytes(Id(G + "the")), " the");
  EXPECT_EQ(tokenizer_->TokenBytes(Id("\xC3\x83")), "\xC3");  // an incomplete UTF-8 sequence
  EXPECT_TRUE(Encode("").empty());
}

TEST_F(Gutenberg14mTokenizerTest, SpecialTokensParsedOnlyWhenAsked) {
  EXPECT_EQ(Encode("<|endoftext|>", /*parse_special=*/true), std::vector<int32_t>({0}));
  EXPECT_EQ(Encode(" the<|endoftext|> the", true), std::vector<int32_t>({262, 0, 262}));
  const std::vector<int32_t> literal = Encode("<|endoftext|>", /*parse_special=*/false);
  ASSERT_FALSE(literal.empty());
  for (const int32_t id : literal) EXPECT_NE(id, 0);
  EXPECT_EQ(tokenizer_->Decode(literal), "<|endoftext|>");
  EXPECT_EQ(tokenizer_->Decode({262, 0, 262}), " the the");
  EXPECT_EQ(tokenizer_->Decode({262, 0, 262}, /*skip_special=*/false), " the<|endoftext|> the");
  EXPECT_EQ(tokenizer_->TokenBytes(0), "");
}

TEST_F(Gutenberg14mTokenizerTest, StreamDecoderHoldsBackPartialCharacters) {
  const std::string text = "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E ok";  // "日本語 ok"
  const std::vector<int32_t> ids = Encode(text);
  ASSERT_GT(ids.size(), 3u);  // no CJK tokens in this vocab: bytes come one or two at a time
  EXPECT_EQ(tokenizer_->Decode(ids), text);
  StreamDecoder stream(*tokenizer_, /*at_start=*/true);
  std::string streamed;
  int empty_deltas = 0;
  for (const int32_t id : ids) {
    const std::string delta = stream.Push(id);
    EXPECT_TRUE(tokenizer_internal::IsValidUtf8(delta)) << "delta after id " << id;
    empty_deltas += delta.empty();
    streamed += delta;
  }
  EXPECT_EQ(stream.Flush(), "");
  EXPECT_EQ(streamed, text);
  EXPECT_GT(empty_deltas, 0);  // some pushes completed no character

  // An unfinished character at the end comes out of Flush as U+FFFD.
  StreamDecoder cut(*tokenizer_, /*at_start=*/true);
  std::string partial;
  for (const int32_t id : Encode("a\xE6\x97")) partial += cut.Push(id);
  EXPECT_EQ(partial, "a");
  EXPECT_EQ(cut.Flush(), "\xEF\xBF\xBD");
}

// Ids of each book from an independent implementation: a Python script applying GPT-2's regex
// (ASCII form; the books are pure ASCII) and a naive lowest-rank-first merge loop over
// tokenizer.json's merges. hash = fold of h = h * 1000003 + id (mod 2^64) over the ids in order.
struct BookReference {
  const char* name;
  size_t num_tokens;
  uint64_t hash;
};
constexpr BookReference kBooks[] = {
    {"10101.txt", 60953, 10561319046181082068u},  {"10146.txt", 75076, 8600250100426182846u},
    {"10315.txt", 260556, 2894180902652599667u},  {"10321.txt", 106438, 8783870989698257673u},
    {"10533.txt", 146756, 5192627932409544062u},  {"10576.txt", 80976, 11413211368147545277u},
    {"10633.txt", 394423, 3909832948036817196u},  {"10659.txt", 79982, 13978903646328402527u},
    {"10675.txt", 98608, 10925309414829500104u},  {"10717.txt", 96006, 1559963771125873178u},
    {"10840.txt", 167564, 15685294637747158507u}, {"10978.txt", 126812, 3391823517493613667u},
};

TEST_F(Gutenberg14mTokenizerTest, EvalBooksRoundTripAndMatchReference) {
  if (!std::filesystem::exists(kBooksDir)) {
    GTEST_SKIP() << "eval books not found under " << kBooksDir << "; skipping";
  }
  size_t total_bytes = 0;
  double total_seconds = 0;
  for (const BookReference& book : kBooks) {
    SCOPED_TRACE(book.name);
    const std::string text = ReadFile(kBooksDir / book.name);
    ASSERT_FALSE(text.empty());
    const auto start = std::chrono::steady_clock::now();
    const absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(text, true);
    total_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    total_bytes += text.size();
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_GE(ids->size(), 8192u);  // golden.json measures perplexity over the first 8192
    EXPECT_EQ(ids->size(), book.num_tokens);
    uint64_t hash = 0;
    for (const int32_t id : *ids) hash = hash * 1000003u + static_cast<uint64_t>(id);
    EXPECT_EQ(hash, book.hash);
    EXPECT_TRUE(tokenizer_->Decode(*ids) == text) << "round trip differs";
  }
  std::printf("[ info ] encoded %.1f MB of books at %.1f MB/s\n", total_bytes / 1e6,
              total_bytes / 1e6 / total_seconds);
}

}  // namespace
}  // namespace tandem::gpu_worker
