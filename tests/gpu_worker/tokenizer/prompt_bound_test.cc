// The bound a prompt text is checked against before it is tokenized: MaxTokenBytes really bounds
// the bytes per token on real books (so CheckPromptTextFits never refuses a text that fits), and
// CheckPromptTextFits refuses exactly past kPromptBytesSlack x room x MaxTokenBytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tandem/gpu_worker/tokenizer.h"

namespace tandem::gpu_worker {
namespace {

const std::filesystem::path kSharedDir(TANDEM_SHARED_DIR);

std::string ReadPrefix(const std::filesystem::path& path, size_t bytes) {
  std::ifstream file(path, std::ios::binary);
  std::string text(bytes, '\0');
  file.read(text.data(), static_cast<std::streamsize>(bytes));
  text.resize(static_cast<size_t>(file.gcount()));
  return text;
}

class PromptBoundTest : public ::testing::TestWithParam<const char*> {};

TEST_P(PromptBoundTest, TokensTimesMaxTokenBytesCoverEveryText) {
  const std::filesystem::path model = kSharedDir / "models" / GetParam();
  const std::filesystem::path book = kSharedDir / "data/gutenberg-eval/10101.txt";
  if (!std::filesystem::exists(model) || !std::filesystem::exists(book)) {
    GTEST_SKIP() << model << " or " << book << " not found";
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = LoadTokenizer(model);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const size_t max_bytes = MaxTokenBytes(**tokenizer);
  EXPECT_GE(max_bytes, 2u);
  for (int32_t id = 0; id < (*tokenizer)->vocab_size(); ++id) {
    ASSERT_LE((*tokenizer)->TokenBytes(id).size(), max_bytes) << id;
  }
  // Without whitespace runs, the tokens cover the bytes themselves.
  EXPECT_GE(EncodePrompt(**tokenizer, std::string(3000, 'a'), false)->size() * max_bytes, 3000u);
  for (const std::string& text :
       {ReadPrefix(book, 200000), "a" + std::string(5000, ' ') + "b\n\n\n\t c",
        std::string(5000, 'a'),
        std::string("<|endoftext|><s></s>") + ReadPrefix(book, 2000)}) {
    absl::StatusOr<std::vector<int32_t>> ids = EncodePrompt(**tokenizer, text, false);
    ASSERT_TRUE(ids.ok());
    // The check lets through every text that fits in as many tokens as it has.
    EXPECT_TRUE(CheckPromptTextFits(text, static_cast<int64_t>(ids->size()), max_bytes).ok());
  }
}

// Named by model (scripts/sanitize.sh leaves out the stories260k case: its SentencePiece
// tokenizer cannot load under ASan).
INSTANTIATE_TEST_SUITE_P(Models, PromptBoundTest, ::testing::Values("stories260k", "gutenberg-14m"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string name = info.param;
                           name.erase(std::remove(name.begin(), name.end(), '-'), name.end());
                           return name;
                         });

TEST(CheckPromptTextFits, RefusesExactlyPastTheBound) {
  const size_t bound = 100 * 7 * kPromptBytesSlack;
  EXPECT_TRUE(CheckPromptTextFits(std::string(bound, 'x'), 100, 7).ok());
  const absl::Status over = CheckPromptTextFits(std::string(bound + 1, 'x'), 100, 7);
  EXPECT_EQ(over.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(over.message().find("cannot fit the 100 tokens left"), std::string::npos) << over;
  // Whitespace runs count one byte each (SentencePiece collapses them).
  EXPECT_TRUE(CheckPromptTextFits("a" + std::string(bound * 2, ' ') + "b", 100, 7).ok());
  EXPECT_FALSE(CheckPromptTextFits("x", 0, 7).ok());    // no room at all
  EXPECT_FALSE(CheckPromptTextFits("x", -5, 7).ok());
}

}  // namespace
}  // namespace tandem::gpu_worker
