// Breaks in a pass (ModelRunner::Step with PassBreaks, issue 29 item 3): a long prefill chunk
// paused between its layers while interludes run other sequences' passes gives the logits of
// the same chunk run alone, and the interludes' passes give what those sequences get alone;
// a pass with attention off the device takes no breaks, nor does a pass inside an interlude; a
// runner without RunnerOptions::pass_breaks refuses breaks. The cpu backend in CI, cuda with
// label gpu.
#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "runner_fixture.h"
#include "tandem/gpu_worker/host_tier.h"
#include "tandem/gpu_worker/model_runner.h"
#include "tandem/gpu_worker/pass_breaks.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker {
namespace {

// The same kernels on the same inputs: only float non-associativity across different batch
// shapes could move a logit, and the shapes are the same.
constexpr float kLogitTolerance = 1e-5f;

// Breaks that run `interlude` at every boundary where `due` says so, counting both.
class ScriptedBreaks final : public PassBreaks {
 public:
  std::function<bool()> due = [] { return true; };
  std::function<void()> interlude = [] {};
  int asked = 0;
  int interludes = 0;
  bool Due() override {
    ++asked;
    return due();
  }
  void Interlude() override {
    ++interludes;
    interlude();
  }
};

class PassBreaksTest : public testing::Stories260kRunnerTest {
 protected:
  void SetUp() override {
    Stories260kRunnerTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    RunnerOptions options;
    options.pass_breaks = true;
    auto runner = ModelRunner::Create(*backend_, *device_model_, options);
    ASSERT_TRUE(runner.ok()) << runner.status();
    breaking_ = std::move(*runner);
  }

  // gpu mode (every entry in the device window), or offload mode: a 32-token window + 4 sinks,
  // the rest in 24-token host pages (its passes attend off the device).
  std::unique_ptr<Sequence> MakeSequence(AttentionMode mode, const std::string& id) {
    auto seq = MakeWindowedSequence(mode, id, /*window=*/32);
    if (seq == nullptr || mode != AttentionMode::kOffload) return seq;
    auto kv = OffloadedKv::Create(*backend_, seq->window.geometry(), 24);
    EXPECT_TRUE(kv.ok()) << kv.status();
    if (kv.ok()) seq->offload = std::make_unique<HostTier>(std::move(*kv));
    return seq;
  }

  static std::vector<int32_t> Tokens(int64_t n, int salt) {
    std::vector<int32_t> ids;
    for (int64_t t = 0; t < n; ++t) {
      ids.push_back(static_cast<int32_t>(1 + (t * 31 + salt * 13) % 500));
    }
    return ids;
  }

  // One Step of `ids` into `seq` on `runner` (with `breaks`); the logits after its last token.
  std::vector<float> StepLogits(ModelRunner& runner, Sequence& seq,
                                const std::vector<int32_t>& ids, PassBreaks* breaks = nullptr) {
    absl::Status s = runner.Step({{&seq, ids.data(), static_cast<int64_t>(ids.size())}}, breaks);
    EXPECT_TRUE(s.ok()) << s;
    std::vector<float> logits(model_->config.vocab_size);
    if (!s.ok()) return {};
    s = backend_->CopyToHost(logits.data(), runner.batch_logits(), logits.size() * 4);
    EXPECT_TRUE(s.ok()) << s;
    return logits;
  }

  static float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
    float diff = a.size() == b.size() && !a.empty() ? 0.0f : INFINITY;
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
      diff = std::max(diff, std::fabs(a[i] - b[i]));
    }
    return diff;
  }

  std::unique_ptr<ModelRunner> breaking_;
};

// A: a 100-token prompt, then a 300-token chunk with breaks at every boundary. B, in the
// interludes: its 20-token prompt in the first, a decode token in each later one. A's chunk
// and each of B's passes match copies fed the same tokens without breaks.
TEST_F(PassBreaksTest, AnInterruptedPassEqualsThePassAloneAndSoDoItsInterludes) {
  auto a = MakeSequence(AttentionMode::kGpu, "a");
  auto a_alone = MakeSequence(AttentionMode::kGpu, "a-alone");
  auto b = MakeSequence(AttentionMode::kGpu, "b");
  auto b_alone = MakeSequence(AttentionMode::kGpu, "b-alone");
  ASSERT_TRUE(a && a_alone && b && b_alone);
  const std::vector<int32_t> prefix = Tokens(100, 1), chunk = Tokens(300, 2);
  StepLogits(*breaking_, *a, prefix);
  StepLogits(*runner_, *a_alone, prefix);

  std::vector<std::vector<int32_t>> b_feeds;
  std::vector<std::vector<float>> b_logits;
  ScriptedBreaks breaks;
  breaks.interlude = [&] {
    EXPECT_TRUE(a->in_pass) << "the paused pass's sequence is not marked";
    EXPECT_FALSE(b->in_pass);
    b_feeds.push_back(b_feeds.empty() ? Tokens(20, 3)
                                      : std::vector<int32_t>{static_cast<int32_t>(7 + b_feeds.size())});
    b_logits.push_back(StepLogits(*breaking_, *b, b_feeds.back()));
  };
  const std::vector<float> interrupted = StepLogits(*breaking_, *a, chunk, &breaks);
  const std::vector<float> alone = StepLogits(*runner_, *a_alone, chunk);

  const int64_t boundaries = model_->config.num_layers - 1;
  EXPECT_EQ(breaks.asked, boundaries);
  EXPECT_EQ(breaks.interludes, boundaries);
  EXPECT_EQ(breaking_->profile().pass_breaks, static_cast<uint64_t>(boundaries));
  EXPECT_LE(MaxAbsDiff(interrupted, alone), kLogitTolerance);
  ASSERT_EQ(b_logits.size(), static_cast<size_t>(boundaries));
  for (size_t i = 0; i < b_feeds.size(); ++i) {
    EXPECT_LE(MaxAbsDiff(b_logits[i], StepLogits(*runner_, *b_alone, b_feeds[i])),
              kLogitTolerance)
        << "interlude " << i;
  }
  EXPECT_FALSE(a->in_pass);
  EXPECT_FALSE(b->in_pass);
  // Both sequences go on from where the pass and the interludes left them.
  EXPECT_EQ(a->window.next_position(), 400);
  EXPECT_EQ(b->window.next_position(), 20 + boundaries - 1);
  const std::vector<int32_t> next = {42};
  EXPECT_LE(MaxAbsDiff(StepLogits(*breaking_, *a, next), StepLogits(*runner_, *a_alone, next)),
            kLogitTolerance);
}

// Breaks where Due says no: asked at each boundary, no interlude, the same logits.
TEST_F(PassBreaksTest, ABreakNotDueChangesNothing) {
  auto a = MakeSequence(AttentionMode::kGpu, "a");
  auto a_alone = MakeSequence(AttentionMode::kGpu, "a-alone");
  ASSERT_TRUE(a && a_alone);
  ScriptedBreaks breaks;
  breaks.due = [] { return false; };
  const std::vector<int32_t> prompt = Tokens(200, 4);
  const std::vector<float> with = StepLogits(*breaking_, *a, prompt, &breaks);
  EXPECT_EQ(breaks.asked, model_->config.num_layers - 1);
  EXPECT_EQ(breaks.interludes, 0);
  EXPECT_LE(MaxAbsDiff(with, StepLogits(*runner_, *a_alone, prompt)), kLogitTolerance);
}

// A sequence with KV in host pages attends off the device in its passes: no breaks for them.
TEST_F(PassBreaksTest, APassThatAttendsOffTheDeviceTakesNoBreaks) {
  auto seq = MakeSequence(AttentionMode::kOffload, "offload");
  ASSERT_TRUE(seq);
  StepLogits(*breaking_, *seq, Tokens(100, 5));
  ASSERT_GT(seq->offload->offloaded_tokens(), 0);
  ScriptedBreaks breaks;
  StepLogits(*breaking_, *seq, Tokens(50, 6), &breaks);
  EXPECT_EQ(breaks.asked, 0);
  EXPECT_EQ(breaks.interludes, 0);
}

// A pass inside an interlude is given breaks of its own: they are never asked.
TEST_F(PassBreaksTest, APassInsideAnInterludeTakesNoBreaks) {
  auto a = MakeSequence(AttentionMode::kGpu, "a");
  auto b = MakeSequence(AttentionMode::kGpu, "b");
  ASSERT_TRUE(a && b);
  ScriptedBreaks inner;
  ScriptedBreaks outer;
  outer.interlude = [&] { StepLogits(*breaking_, *b, Tokens(30, 7), &inner); };
  outer.due = [&] { return outer.interludes == 0; };   // one interlude
  StepLogits(*breaking_, *a, Tokens(64, 8), &outer);
  EXPECT_EQ(outer.interludes, 1);
  EXPECT_EQ(inner.asked, 0);
}

TEST_F(PassBreaksTest, BreaksNeedARunnerMadeForThem) {
  auto a = MakeSequence(AttentionMode::kGpu, "a");
  ASSERT_TRUE(a);
  ScriptedBreaks breaks;
  const std::vector<int32_t> ids = Tokens(8, 9);
  const absl::Status s = runner_->Step({{a.get(), ids.data(), 8}}, &breaks);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("pass_breaks"), std::string::npos) << s;
}

}  // namespace
}  // namespace tandem::gpu_worker
