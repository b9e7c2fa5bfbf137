// StepTimeCap: a step's prompt tokens capped by a fixed + per-token model of the step's time.
#include "tandem/gpu_worker/step_time_cap.h"

#include <gtest/gtest.h>

namespace tandem::gpu_worker {
namespace {

TEST(StepTimeCapTest, OffOrUntimedLeavesTheBudget) {
  StepTimeCap off(0.0, 64);
  off.Observe(512, 1.0);
  EXPECT_EQ(off.Cap(512), 512);
  StepTimeCap untimed(50.0, 64);
  EXPECT_EQ(untimed.Cap(512), 512);
  untimed.Observe(0, 0.005);  // a decode step alone says nothing per token
  EXPECT_EQ(untimed.Cap(512), 512);
}

TEST(StepTimeCapTest, WithoutAFixedPartEveryMillisecondIsPerToken) {
  StepTimeCap cap(50.0, 64);
  cap.Observe(512, 0.256);  // 0.5 ms per prompt token: 100 fit in 50 ms
  EXPECT_DOUBLE_EQ(cap.seconds_per_token(), 0.0005);
  EXPECT_EQ(cap.Cap(512), 100);
  EXPECT_EQ(cap.Cap(80), 80);  // a smaller budget stays
  EXPECT_EQ(cap.Cap(-3), -3);  // decode rows took the whole step
  // The prefix grew: 1.5 ms per token now; the average (0.5 newest) is 1 ms: 50 fit, but a
  // step may always feed min_tokens.
  cap.Observe(100, 0.15);
  EXPECT_DOUBLE_EQ(cap.seconds_per_token(), 0.001);
  EXPECT_EQ(cap.Cap(512), 64);
}

// Steps of 5 ms + 40 µs per prompt token (an 8B model on an H200 at a 16K prefix): once decode
// steps have timed the fixed part, a 25 ms cap feeds (25 - 5) / 0.04 = 500 tokens, where a
// per-token-only model would shrink the chunks to what 25 ms of the small steps' inflated
// per-token cost buys.
TEST(StepTimeCapTest, DecodeStepsTimeTheFixedPart) {
  auto step = [](int64_t tokens) { return 0.005 + 4e-5 * static_cast<double>(tokens); };
  StepTimeCap cap(25.0, 64);
  cap.Observe(0, step(0));  // decode rows only
  cap.Observe(2, step(2));  // a 2-token prompt share: no per-token cost known yet, not timed
  EXPECT_DOUBLE_EQ(cap.fixed_seconds(), 0.005);
  cap.Observe(2048, step(2048));
  EXPECT_NEAR(cap.seconds_per_token(), 4e-5, 1e-12);
  EXPECT_EQ(cap.Cap(2048), 500);
  // It stays there as steps of that size follow.
  cap.Observe(500, step(500));
  EXPECT_EQ(cap.Cap(2048), 500);
  // A cap below the fixed part: every step feeds min_tokens.
  StepTimeCap tight(4.0, 64);
  tight.Observe(0, step(0));
  tight.Observe(1024, step(1024));
  EXPECT_EQ(tight.Cap(2048), 64);
}

// A prompt's last chunk under min_tokens at a long prefix (50 tokens at 1 ms each) times the
// fixed part less those tokens, not as 55 ms of it.
TEST(StepTimeCapTest, ASmallSlowPromptStepLeavesTheFixedPart) {
  auto step = [](int64_t tokens) { return 0.005 + 1e-3 * static_cast<double>(tokens); };
  StepTimeCap cap(100.0, 64);
  cap.Observe(0, step(0));
  cap.Observe(90, step(90));
  EXPECT_NEAR(cap.seconds_per_token(), 1e-3, 1e-12);
  cap.Observe(50, step(50));
  EXPECT_NEAR(cap.fixed_seconds(), 0.005, 1e-12);
  EXPECT_EQ(cap.Cap(4096), 95);  // (100 - 5) ms / 1 ms
}

TEST(StepTimeCapTest, AFixedPartNeverTakesAPromptStepWhole) {
  StepTimeCap cap(50.0, 64);
  cap.Observe(0, 0.020);    // a slow decode step (a large batch)
  cap.Observe(128, 0.016);  // a prompt step faster than it: a quarter still counts per token
  EXPECT_DOUBLE_EQ(cap.seconds_per_token(), 0.25 * 0.016 / 128);
  EXPECT_EQ(cap.Cap(4096), 960);  // (50 - 20) ms / 31.25 µs
}

TEST(StepTimeCapTest, UntimedStepsChangeNothing) {
  StepTimeCap cap(50.0, 64);
  cap.Observe(512, 0.0);  // no time measured
  cap.Observe(0, -1.0);
  EXPECT_EQ(cap.fixed_seconds(), 0.0);
  EXPECT_EQ(cap.Cap(512), 512);
}

}  // namespace
}  // namespace tandem::gpu_worker
