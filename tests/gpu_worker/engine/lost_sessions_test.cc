// LostSessions: a lost session's reason is given once, the oldest entry goes first when full,
// and a client's close forgets it.
#include "tandem/gpu_worker/lost_sessions.h"

#include <string>

#include <gtest/gtest.h>

namespace tandem::gpu_worker {
namespace {

TEST(LostSessionsTest, AReasonIsTakenOnceAndAForgottenIdIsNotLost) {
  LostSessions lost(4);
  lost.Remember("a", "a pass failed");
  lost.Remember("b", "a settle failed");
  EXPECT_EQ(lost.Take("a"), "a pass failed");
  EXPECT_EQ(lost.Take("a"), std::nullopt);
  EXPECT_EQ(lost.Take("c"), std::nullopt);
  EXPECT_TRUE(lost.Forget("b"));
  EXPECT_FALSE(lost.Forget("b"));
  EXPECT_EQ(lost.size(), 0u);
}

TEST(LostSessionsTest, TheOldestGoesFirstWhenFullAndARepeatReplacesItsEntry) {
  LostSessions lost(3);
  lost.Remember("a", "1");
  lost.Remember("b", "2");
  lost.Remember("c", "3");
  lost.Remember("a", "4");   // now the newest
  lost.Remember("d", "5");   // drops b, the oldest
  EXPECT_EQ(lost.size(), 3u);
  EXPECT_EQ(lost.Take("b"), std::nullopt);
  EXPECT_EQ(lost.Take("a"), "4");
  EXPECT_EQ(lost.Take("c"), "3");
  EXPECT_EQ(lost.Take("d"), "5");
}

TEST(LostSessionsTest, ZeroCapacityRemembersNothing) {
  LostSessions lost(0);
  lost.Remember("a", "x");
  EXPECT_EQ(lost.size(), 0u);
  EXPECT_EQ(lost.Take("a"), std::nullopt);
}

}  // namespace
}  // namespace tandem::gpu_worker
