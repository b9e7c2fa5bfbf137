// SentencePiece tokenizer on stories260k (llama2.c's TinyStories model, tokenizer.model only),
// against the ids and text of its golden.json (computed with Hugging Face transformers) and the
// library's own DecodeIds.
#include "sentencepiece_tokenizer.h"

#include <gtest/gtest.h>

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

const std::filesystem::path kModelDir =
    std::filesystem::path(TANDEM_SHARED_DIR) / "models/stories260k";

struct Golden {
  std::vector<int32_t> greedy_ids;
  std::string greedy_text;
  std::string prompt_text;
  std::vector<int32_t> prompt_ids;
};

class Stories260kTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(kModelDir / "tokenizer.model") ||
        !std::filesystem::exists(kModelDir / "golden.json")) {
      GTEST_SKIP() << "stories260k not found under " << kModelDir << "; skipping";
    }
    absl::StatusOr<std::unique_ptr<Tokenizer>> loaded = LoadTokenizer(kModelDir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    tokenizer_ = std::move(*loaded);

    std::ifstream file(kModelDir / "golden.json");
    std::stringstream text;
    text << file.rdbuf();
    const nlohmann::json golden = nlohmann::json::parse(text.str(), nullptr, false);
    ASSERT_FALSE(golden.is_discarded());
    golden_.greedy_ids = golden.at("greedy_ids").get<std::vector<int32_t>>();
    golden_.greedy_text = golden.at("greedy_text").get<std::string>();
    golden_.prompt_text = golden.at("prompt_text_equivalent").get<std::string>();
    golden_.prompt_ids = golden.at("prompt_text_equivalent_ids").get<std::vector<int32_t>>();
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  Golden golden_;
};

TEST_F(Stories260kTokenizerTest, Properties) {
  EXPECT_EQ(tokenizer_->kind(), "sentencepiece");
  EXPECT_EQ(tokenizer_->vocab_size(), 512);  // config.json vocab_size
  EXPECT_EQ(tokenizer_->bos_id(), 1);        // config.json bos_token_id
  EXPECT_EQ(tokenizer_->eos_ids(), std::vector<int32_t>({2}));
  EXPECT_TRUE(tokenizer_->adds_bos());
  EXPECT_TRUE(tokenizer_->strips_leading_space());
  EXPECT_TRUE(tokenizer_->IsSpecial(1));
  EXPECT_TRUE(tokenizer_->IsSpecial(2));
  EXPECT_FALSE(tokenizer_->IsSpecial(403));
  EXPECT_EQ(tokenizer_->TokenBytes(1), "");
  EXPECT_EQ(tokenizer_->TokenBytes(-1), "");
  EXPECT_EQ(tokenizer_->TokenBytes(512), "");
}

TEST_F(Stories260kTokenizerTest, EncodesGoldenPrompt) {
  ASSERT_EQ(golden_.prompt_text, "Once upon a time");
  const absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(golden_.prompt_text, true);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, std::vector<int32_t>({1, 403, 407, 261, 378}));
  EXPECT_EQ(*ids, golden_.prompt_ids);
  const absl::StatusOr<std::vector<int32_t>> no_bos =
      tokenizer_->Encode(golden_.prompt_text, false);
  ASSERT_TRUE(no_bos.ok());
  EXPECT_EQ(*no_bos, std::vector<int32_t>({403, 407, 261, 378}));
}

TEST_F(Stories260kTokenizerTest, DecodesGoldenGreedyIds) {
  EXPECT_EQ(tokenizer_->Decode(golden_.greedy_ids), golden_.greedy_text);
  const auto* sp =
      dynamic_cast<const tokenizer_internal::SentencePieceTokenizer*>(tokenizer_.get());
  ASSERT_NE(sp, nullptr);
  EXPECT_EQ(tokenizer_->Decode(golden_.greedy_ids), sp->LibraryDecode(golden_.greedy_ids));
  // With special tokens kept, BOS shows as its piece and the dummy prefix space stays after it.
  EXPECT_EQ(tokenizer_->Decode({1, 403, 407}, /*skip_special=*/false), "<s> Once upon");
  EXPECT_EQ(tokenizer_->TokenBytes(403), " Once");
  // The greedy text is tokenized canonically, so encoding it gives the greedy ids back.
  const absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(golden_.greedy_text, true);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, golden_.greedy_ids);
}

TEST_F(Stories260kTokenizerTest, StreamDecoderMatchesGoldenText) {
  StreamDecoder from_start(*tokenizer_, /*at_start=*/true);
  std::string text;
  for (const int32_t id : golden_.greedy_ids) text += from_start.Push(id);
  text += from_start.Flush();
  EXPECT_EQ(text, golden_.greedy_text);

  // Continuing after the 5-token prompt: the first generated token keeps its space.
  StreamDecoder continuing(*tokenizer_, /*at_start=*/false);
  std::string continuation;
  for (size_t i = 5; i < golden_.greedy_ids.size(); ++i) {
    continuation += continuing.Push(golden_.greedy_ids[i]);
  }
  continuation += continuing.Flush();
  EXPECT_EQ(continuation, golden_.greedy_text.substr(16));
  EXPECT_EQ(continuation.substr(0, 12), ", there was ");
}

TEST_F(Stories260kTokenizerTest, ByteFallbackRoundTripsAndStreams) {
  // TinyStories' 512 pieces have no CJK, so these characters become <0xNN> byte pieces.
  const std::string text = "Tom saw \xE6\x97\xA5\xE6\x9C\xAC.";  // "Tom saw 日本."
  const absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(text, true);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(tokenizer_->Decode(*ids), text);
  const auto* sp =
      dynamic_cast<const tokenizer_internal::SentencePieceTokenizer*>(tokenizer_.get());
  ASSERT_NE(sp, nullptr);
  EXPECT_EQ(sp->LibraryDecode(*ids), text);
  int byte_pieces = 0;
  for (const int32_t id : *ids)
    byte_pieces += tokenizer_->TokenBytes(id).size() == 1 &&
                   static_cast<uint8_t>(tokenizer_->TokenBytes(id)[0]) >= 0x80;
  EXPECT_EQ(byte_pieces, 6);  // the 6 bytes of 日本

  StreamDecoder stream(*tokenizer_, /*at_start=*/true);
  std::string streamed;
  for (const int32_t id : *ids) {
    const std::string delta = stream.Push(id);
    EXPECT_TRUE(tokenizer_internal::IsValidUtf8(delta)) << "delta after id " << id;
    streamed += delta;
  }
  streamed += stream.Flush();
  EXPECT_EQ(streamed, text);
}

TEST_F(Stories260kTokenizerTest, ParsesSpecialPiecesOnlyWhenAsked) {
  const absl::StatusOr<std::vector<int32_t>> parsed = tokenizer_->Encode("Once</s>", false, true);
  ASSERT_TRUE(parsed.ok());
  ASSERT_FALSE(parsed->empty());
  EXPECT_EQ(parsed->back(), 2);
  EXPECT_EQ(parsed->front(), 403);
  const absl::StatusOr<std::vector<int32_t>> literal = tokenizer_->Encode("Once</s>", false, false);
  ASSERT_TRUE(literal.ok());
  for (const int32_t id : *literal) EXPECT_NE(id, 2);
  EXPECT_EQ(tokenizer_->Decode(*literal), "Once</s>");
}

}  // namespace
}  // namespace tandem::gpu_worker
