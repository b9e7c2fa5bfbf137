// Bad model directories give a status with a clear message, never a crash.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "tandem/gpu_worker/tokenizer.h"
#include "tokenizer_test_util.h"

namespace tandem::gpu_worker {
namespace {

const std::filesystem::path kStories =
    std::filesystem::path(TANDEM_SHARED_DIR) / "models/stories260k";

// A minimal valid byte-level tokenizer.json with `model` and `pre_tokenizer` substituted.
std::string TokenizerJson(const std::string& model,
                          const std::string& pre_tokenizer = R"({"type": "ByteLevel"})") {
  return R"({"added_tokens": [], "normalizer": null, "pre_tokenizer": )" + pre_tokenizer +
         R"(, "post_processor": null, "decoder": {"type": "ByteLevel"}, "model": )" + model + "}";
}

constexpr char kGoodModel[] =
    R"({"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]})";

absl::Status LoadStatus(const TempModelDir& dir) { return LoadTokenizer(dir.path()).status(); }

void ExpectError(const absl::Status& status, absl::StatusCode code, const std::string& fragment) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), fragment))
      << "message \"" << status.message() << "\" lacks \"" << fragment << "\"";
}

TEST(TokenizerErrorsTest, GoodMinimalFileLoads) {
  TempModelDir dir;
  dir.Write("tokenizer.json", TokenizerJson(kGoodModel));
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(dir.path());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const absl::StatusOr<std::vector<int32_t>> ids = (*tokenizer)->Encode("ab", false);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, std::vector<int32_t>({2}));
}

TEST(TokenizerErrorsTest, MissingFilesIsNotFoundNamingTheDirectory) {
  TempModelDir dir;
  ExpectError(LoadStatus(dir), absl::StatusCode::kNotFound, dir.path().string());
  ExpectError(LoadTokenizer(dir.path() / "nonexistent").status(), absl::StatusCode::kNotFound,
              "nonexistent");
}

TEST(TokenizerErrorsTest, MalformedTokenizerJson) {
  TempModelDir dir;
  dir.Write("tokenizer.json", "{\"model\": {\"vocab\": ");
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "not valid JSON");

  dir.Write("tokenizer.json", "[1, 2, 3]");
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "not a JSON object");

  dir.Write("tokenizer.json", TokenizerJson(R"({"type": "BPE", "merges": []})"));
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "vocab");

  dir.Write("tokenizer.json", TokenizerJson(R"({"type": "BPE", "vocab": {"a": "zero"}})"));
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "not an integer");

  dir.Write("tokenizer.json", TokenizerJson(R"({"type": "BPE", "vocab": {"a": 99999999}})"));
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "outside");

  dir.Write("tokenizer.json", TokenizerJson(R"({"type": "BPE", "vocab": {"a": 0, "b": 1},
                                               "merges": ["a b"]})"));
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "not in the vocab");

  dir.Write("tokenizer.json", TokenizerJson(R"({"type": "BPE", "vocab": {"a": 0, "ab": 1},
                                               "merges": [["a", "x"]]})"));
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "merge 0");

  dir.Write("tokenizer.json", TokenizerJson(R"({"type": "BPE", "vocab": {"a": 0},
                                               "merges": ["abc"]})"));
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "not two tokens");

  dir.Write("tokenizer.json", TokenizerJson(kGoodModel, R"({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "(\\p{L}+"}, "behavior": "Isolated"},
                {"type": "ByteLevel", "use_regex": false}]})"));
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "does not compile");

  dir.Write("tokenizer.json", TokenizerJson(kGoodModel, R"({"type": "Split"})"));
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "behavior");
}

TEST(TokenizerErrorsTest, UnsupportedFeaturesAreUnimplemented) {
  TempModelDir dir;
  dir.Write("tokenizer.json",
            TokenizerJson(kGoodModel, R"({"type": "Metaspace", "replacement": "\u2581"})"));
  ExpectError(LoadStatus(dir), absl::StatusCode::kUnimplemented, "Metaspace");

  dir.Write("tokenizer.json", TokenizerJson(R"({"type": "BPE", "vocab": {"a": 0},
                                               "merges": [], "byte_fallback": true})"));
  ExpectError(LoadStatus(dir), absl::StatusCode::kUnimplemented, "byte_fallback");

  dir.Write("tokenizer.json", TokenizerJson(R"({"type": "WordPiece", "vocab": {"a": 0}})"));
  ExpectError(LoadStatus(dir), absl::StatusCode::kUnimplemented, "WordPiece");
}

TEST(TokenizerErrorsTest, BadSpecialTokenConfig) {
  TempModelDir dir;
  dir.Write("tokenizer.json", TokenizerJson(kGoodModel));
  dir.Write("config.json", R"({"eos_token_id": 7})");
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "eos_token_id 7");

  dir.Write("config.json", R"({"eos_token_id": "two"})");
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "config.json");

  dir.Write("config.json", "{}");
  dir.Write("tokenizer_config.json", R"({"bos_token": "<s>"})");
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "<s>");

  dir.Write("tokenizer_config.json", "not json");
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "tokenizer_config.json");
}

TEST(TokenizerErrorsTest, CorruptSentencePieceModel) {
  TempModelDir dir;
  dir.Write("tokenizer.model", std::string("\x0a\xff\xff\xff\x0fgarbage", 12));
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "SentencePiece");

  dir.Write("tokenizer.model", "");
  EXPECT_EQ(LoadStatus(dir).code(), absl::StatusCode::kInvalidArgument) << LoadStatus(dir);
}

TEST(TokenizerErrorsTest, TruncatedRealSentencePieceModel) {
  if (!std::filesystem::exists(kStories / "tokenizer.model")) {
    GTEST_SKIP() << "stories260k not found under " << kStories << "; skipping";
  }
  std::ifstream file(kStories / "tokenizer.model", std::ios::binary);
  std::stringstream bytes;
  bytes << file.rdbuf();
  const std::string model = bytes.str();
  TempModelDir dir;
  dir.Write("tokenizer.model", model.substr(0, model.size() / 2));
  ExpectError(LoadStatus(dir), absl::StatusCode::kInvalidArgument, "SentencePiece");
}

TEST(TokenizerErrorsTest, UnsupportedTokenizerJsonFallsBackToSentencePiece) {
  if (!std::filesystem::exists(kStories / "tokenizer.model")) {
    GTEST_SKIP() << "stories260k not found under " << kStories << "; skipping";
  }
  TempModelDir dir;
  std::filesystem::copy_file(kStories / "tokenizer.model", dir.path() / "tokenizer.model");
  // Llama-2's tokenizer.json is a Metaspace BPE with byte_fallback: not run here.
  dir.Write("tokenizer.json", TokenizerJson(R"({"type": "BPE", "vocab": {"a": 0},
                                               "merges": [], "byte_fallback": true})"));
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(dir.path());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  EXPECT_EQ((*tokenizer)->kind(), "sentencepiece");
  // A malformed tokenizer.json is an error even then.
  dir.Write("tokenizer.json", "{");
  EXPECT_EQ(LoadStatus(dir).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::gpu_worker
