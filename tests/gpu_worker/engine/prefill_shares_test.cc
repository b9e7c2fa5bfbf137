// PrefillShares: how a scheduler step divides its prompt tokens (shortest first, aged first, and
// first tokens first: a step that completes a prompt carries no partial chunk of another).
#include "tandem/gpu_worker/prefill_shares.h"

#include <gtest/gtest.h>

#include <vector>

namespace tandem::gpu_worker {
namespace {

constexpr int64_t kAging = 4;

TEST(PrefillSharesTest, ALongPromptAloneTakesTheWholeBudget) {
  const std::vector<PrefillCandidate> c = {{10000, 0, 0}};
  EXPECT_EQ(PrefillShares(c, 512, kAging), (std::vector<int64_t>{512}));
}

TEST(PrefillSharesTest, AShortPromptCompletesInAStepOfItsOwn) {
  // The long prompt came first; the short one completes this step, so the long one waits.
  const std::vector<PrefillCandidate> c = {{10000, 0, 0}, {40, 0, 1}};
  EXPECT_EQ(PrefillShares(c, 512, kAging), (std::vector<int64_t>{0, 40}));
}

TEST(PrefillSharesTest, EveryPromptThatCompletesSharesTheStep) {
  const std::vector<PrefillCandidate> c = {{300, 0, 0}, {40, 0, 1}, {100, 0, 2}, {5000, 0, 3}};
  EXPECT_EQ(PrefillShares(c, 512, kAging), (std::vector<int64_t>{300, 40, 100, 0}));
}

TEST(PrefillSharesTest, TheShortestTakesFirstAndACompletionLeavesTheRestUnused) {
  const std::vector<PrefillCandidate> c = {{5000, 0, 0}, {600, 0, 1}};
  EXPECT_EQ(PrefillShares(c, 512, kAging), (std::vector<int64_t>{0, 512}));
  // 600 completes within 1024: the long prompt's chunk would only delay that first token.
  EXPECT_EQ(PrefillShares(c, 1024, kAging), (std::vector<int64_t>{0, 600}));
}

TEST(PrefillSharesTest, AnAgedPromptGoesFirstAndKeepsItsChunkBesideACompletion) {
  // Passed over kAging times: it takes its chunk first, the short prompt waits for budget.
  const std::vector<PrefillCandidate> c = {{10000, kAging, 0}, {40, 0, 1}};
  EXPECT_EQ(PrefillShares(c, 512, kAging), (std::vector<int64_t>{512, 0}));
  // An aged prompt that does not complete still takes its share after an aged one completed.
  const std::vector<PrefillCandidate> e = {{300, kAging, 0}, {10000, kAging, 1}, {40, 0, 2}};
  EXPECT_EQ(PrefillShares(e, 512, kAging), (std::vector<int64_t>{300, 212, 0}));
  // Aged prompts among themselves: oldest first.
  const std::vector<PrefillCandidate> d = {{900, kAging, 5}, {800, kAging + 3, 2}};
  EXPECT_EQ(PrefillShares(d, 512, kAging), (std::vector<int64_t>{0, 512}));
}

TEST(PrefillSharesTest, TiesGoFirstComeFirstServedAndNoBudgetGivesNothing) {
  const std::vector<PrefillCandidate> c = {{700, 0, 3}, {700, 0, 1}};
  EXPECT_EQ(PrefillShares(c, 512, kAging), (std::vector<int64_t>{0, 512}));
  EXPECT_EQ(PrefillShares(c, 0, kAging), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(PrefillShares(c, -3, kAging), (std::vector<int64_t>{0, 0}));
  EXPECT_TRUE(PrefillShares({}, 512, kAging).empty());
}

}  // namespace
}  // namespace tandem::gpu_worker
