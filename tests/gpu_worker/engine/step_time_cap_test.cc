// StepTimeCap: a step's prompt tokens capped by the measured seconds per prompt token.
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
}

TEST(StepTimeCapTest, CapsToTheTokensThatFitTheTarget) {
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

TEST(StepTimeCapTest, SmallOrEmptyStepsAreNotTimed) {
  StepTimeCap cap(50.0, 64);
  cap.Observe(10, 1.0);   // decode-dominated: fixed costs would read as a huge per-token cost
  cap.Observe(512, 0.0);  // no time measured
  EXPECT_EQ(cap.Cap(512), 512);
}

}  // namespace
}  // namespace tandem::gpu_worker
