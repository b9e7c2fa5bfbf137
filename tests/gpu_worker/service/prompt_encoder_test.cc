// PromptEncoder: the ids are EncodePrompt's (without BOS), a text that cannot fit is refused
// before it is queued, and the queue is bounded (RESOURCE_EXHAUSTED past it, never blocking).
#include "prompt_encoder.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <future>
#include <string>

#include "tandem/gpu_worker/tokenizer.h"

namespace tandem::gpu_worker {
namespace {

const std::filesystem::path kModel = std::filesystem::path(TANDEM_SHARED_DIR) / "models/stories260k";

class PromptEncoderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(kModel / "tokenizer.model")) {
      GTEST_SKIP() << "stories260k not found under " << kModel;
    }
    absl::StatusOr<std::unique_ptr<Tokenizer>> loaded = LoadTokenizer(kModel);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    tokenizer_ = std::move(*loaded);
  }
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_F(PromptEncoderTest, IdsAreEncodePromptsWithoutBos) {
  PromptEncoder encoder(*tokenizer_, 512);
  const std::string text = "Once upon a time, there was a little girl named Lily.";
  std::promise<absl::StatusOr<std::vector<int32_t>>> got;
  ASSERT_TRUE(encoder.Encode(text, [&](auto ids) { got.set_value(std::move(ids)); }).ok());
  absl::StatusOr<std::vector<int32_t>> ids = got.get_future().get();
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, *EncodePrompt(*tokenizer_, text, /*add_bos=*/false));
  std::vector<int32_t> with_bos = *ids;
  AddPromptBos(*tokenizer_, &with_bos);
  EXPECT_EQ(with_bos, *EncodePrompt(*tokenizer_, text, /*add_bos=*/true));
}

TEST_F(PromptEncoderTest, ATextThatCannotFitIsRefusedBeforeTokenizing) {
  PromptEncoder encoder(*tokenizer_, 512);
  const std::string huge(10 << 20, 'a');   // 10 MB for a 512-token context
  const absl::Status fits = encoder.CheckFits(huge);
  EXPECT_EQ(fits.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(fits.message().find("refused before tokenizing"), std::string::npos) << fits;
  EXPECT_TRUE(encoder.CheckFits("a short prompt").ok());
}

TEST_F(PromptEncoderTest, TheQueueIsBounded) {
  PromptEncoder encoder(*tokenizer_, 512, /*threads=*/1, /*max_queued=*/1);
  std::promise<void> started, release;
  std::shared_future<void> released = release.get_future().share();
  // The only thread is held inside the first job's callback; one more fits in the queue.
  ASSERT_TRUE(encoder.Encode("one", [&](auto) { started.set_value(); released.wait(); }).ok());
  started.get_future().wait();
  std::promise<void> second_done;
  ASSERT_TRUE(encoder.Encode("two", [&](auto) { second_done.set_value(); }).ok());
  const absl::Status third = encoder.Encode("three", [](auto) { FAIL() << "must not run"; });
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  release.set_value();
  second_done.get_future().wait();
}

}  // namespace
}  // namespace tandem::gpu_worker
