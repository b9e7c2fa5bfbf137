// Ping-pong micro-batches (ModelRunner, RunnerOptions::micro_batches): a Step whose batch holds
// several hybrid sequences is split into two micro-batches that alternate per layer; each
// sequence's logits must equal what it computes alone, in every mode, for decode tokens and
// prefill chunks mixed in one step, with the rows of the micro-batches reordered against the
// entries. Also: when the runner splits and when it does not.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine_test_util.h"
#include "runner_fixture.h"
#include "tandem/gpu_worker/host_tier.h"
#include "tandem/gpu_worker/model_runner.h"
#include "tandem/gpu_worker/node_tier.h"
#include "tandem/gpu_worker/sequence.h"

namespace tandem::gpu_worker {
namespace {

constexpr float kLogitTolerance = 1e-4f;
constexpr int64_t kPageTokens = 8;

// What a test sequence is: its mode and, for hybrid, how the nodes' entries are chosen.
enum class Kind { kGpu, kHybridMaw, kHybridPages, kOffload };

class MicroBatchTest : public testing::Stories260kRunnerTest {
 protected:
  void SetUp() override {
    Stories260kRunnerTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    RunnerOptions split;
    split.split_min_scan_share = 0;   // split whenever two segments attend off the device
    split.split_min_scan_bytes = 0;
    auto runner = ModelRunner::Create(*backend_, *device_model_, split);
    ASSERT_TRUE(runner.ok()) << runner.status();
    split_runner_ = std::move(*runner);
  }

  // Window 32 + sink 4 (16-token blocks), the rest on the node (beta 0: everything selected,
  // or pages within a 2-page budget) or in 24-token host pages.
  std::unique_ptr<Sequence> MakeSequence(Kind kind, const std::string& id) {
    const ModelConfig& c = model_->config;
    const AttentionMode mode = kind == Kind::kGpu       ? AttentionMode::kGpu
                               : kind == Kind::kOffload ? AttentionMode::kOffload
                                                        : AttentionMode::kHybrid;
    auto seq = MakeWindowedSequence(mode, id, /*window=*/32);
    if (seq == nullptr) return nullptr;
    const WindowGeometry g = seq->window.geometry();
    if (mode == AttentionMode::kOffload) {
      auto kv = OffloadedKv::Create(*backend_, g, 24);
      EXPECT_TRUE(kv.ok()) << kv.status();
      if (kv.ok()) seq->offload = std::make_unique<HostTier>(std::move(*kv));
      return seq;
    }
    if (mode != AttentionMode::kHybrid) return seq;
    RemoteKvOptions ro;
    ro.session_id = id;
    ro.num_layers = c.num_layers;
    ro.num_q_heads = c.num_q_heads;
    ro.num_kv_heads = c.num_kv_heads;
    ro.head_dim = c.head_dim;
    ro.kv_dtype = DType::kF32;
    ro.block_tokens = 16;
    ro.beta = 0.0f;
    std::unique_ptr<PageIndex> pages;
    if (kind == Kind::kHybridPages) {
      ro.selection = SelectionRule::kPages;
      ro.page_tokens = kPageTokens;
      auto index = PageIndex::Create(*backend_, g, kPageTokens, 0);
      EXPECT_TRUE(index.ok()) << index.status();
      if (!index.ok()) return nullptr;
      pages = std::make_unique<PageIndex>(std::move(*index));
    }
    auto remote = RemoteKv::Open(*pool_, ro);
    EXPECT_TRUE(remote.ok()) << remote.status();
    if (!remote.ok()) return nullptr;
    seq->offload = std::make_unique<NodeTier>(std::move(*remote), std::move(pages));
    if (PagePolicy* policy = seq->offload->page_policy()) policy->select_tokens = 2 * kPageTokens;
    return seq;
  }

  static std::vector<int32_t> Tokens(int64_t n, int salt) {
    std::vector<int32_t> ids;
    for (int64_t t = 0; t < n; ++t) ids.push_back(static_cast<int32_t>(1 + (t * 29 + salt * 11) % 500));
    return ids;
  }

  std::vector<float> Row(const ModelRunner& runner, size_t row) {
    const int64_t vocab = model_->config.vocab_size;
    std::vector<float> logits(vocab);
    absl::Status s = backend_->CopyToHost(logits.data(), runner.batch_logits() + row * vocab,
                                          vocab * 4);
    EXPECT_TRUE(s.ok()) << s;
    return logits;
  }

  static float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
    float diff = a.size() == b.size() ? 0.0f : INFINITY;
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) diff = std::max(diff, std::fabs(a[i] - b[i]));
    return diff;
  }

  void ExpectSplitEqualsUnsplit(bool speculate);

  std::unique_ptr<ModelRunner> split_runner_;
};

// Entries in mixed order of modes: two hybrid sequences (MAW at beta 0, and pages within a
// small budget), a gpu and an offload sequence. Every step feeds each a decode token, except
// that one sequence per step (in turn) gets a prefill chunk of 7 tokens instead. Each
// sequence's copy is fed the same tokens alone (one segment per pass, never split); logits
// match at every step, and every step was split.
TEST_F(MicroBatchTest, SplitStepEqualsEachSequenceAlone) {
  const Kind kinds[] = {Kind::kGpu, Kind::kHybridMaw, Kind::kOffload, Kind::kHybridPages};
  constexpr size_t kSeqs = std::size(kinds);
  std::vector<std::unique_ptr<Sequence>> batched, alone;
  for (size_t i = 0; i < kSeqs; ++i) {
    batched.push_back(MakeSequence(kinds[i], "b" + std::to_string(i)));
    alone.push_back(MakeSequence(kinds[i], "a" + std::to_string(i)));
    ASSERT_NE(batched.back(), nullptr);
    ASSERT_NE(alone.back(), nullptr);
    const std::vector<int32_t> prompt = Tokens(60 + 23 * static_cast<int64_t>(i), static_cast<int>(i));
    Step(*batched[i], prompt);
    Step(*alone[i], prompt);
  }
  split_runner_->ResetProfile();
  float worst = 0.0f;
  constexpr int kSteps = 40;
  std::vector<int32_t> next = {5, 17, 29, 41};
  for (int step = 0; step < kSteps; ++step) {
    std::vector<std::vector<int32_t>> feeds(kSeqs);
    std::vector<ModelRunner::BatchEntry> entries;
    for (size_t i = 0; i < kSeqs; ++i) {
      feeds[i] = static_cast<int>(i) == step % static_cast<int>(kSeqs)
                     ? Tokens(7, step)
                     : std::vector<int32_t>{next[i]};
      entries.push_back({batched[i].get(), feeds[i].data(), static_cast<int64_t>(feeds[i].size())});
    }
    ASSERT_TRUE(split_runner_->Step(entries).ok()) << "step " << step;
    for (size_t i = 0; i < kSeqs; ++i) {
      const std::vector<float> single = Step(*alone[i], feeds[i]);
      const float diff = MaxAbsDiff(single, Row(*split_runner_, i));
      worst = std::max(worst, diff);
      ASSERT_LE(diff, kLogitTolerance) << "sequence " << i << " step " << step;
      next[i] = static_cast<int32_t>(std::max_element(single.begin(), single.end()) -
                                     single.begin());
    }
  }
  EXPECT_EQ(split_runner_->profile().passes, static_cast<uint64_t>(kSteps));
  EXPECT_EQ(split_runner_->profile().split_passes, static_cast<uint64_t>(kSteps));
  for (size_t i = 0; i < kSeqs; ++i) {
    if (kinds[i] != Kind::kGpu) {
      EXPECT_GT(batched[i]->offloaded_entries(), 100) << i;
    }
    EXPECT_EQ(batched[i]->degraded_steps, 0u) << i;
  }
  std::printf("split steps vs alone: worst logit difference %.3g over %d steps\n", worst, kSteps);
}

// The split changes the order of work, not the results: the same batch through a split and an
// unsplit runner (micro_batches = 1) gives the same logits. With layer-ahead page selection
// (RunnerOptions::speculate_pages) too: each micro-batch guesses its next layer's pages while
// the other one's nodes attend.
void MicroBatchTest::ExpectSplitEqualsUnsplit(bool speculate) {
  RunnerOptions two;
  two.split_min_scan_share = 0;
  two.split_min_scan_bytes = 0;
  two.speculate_pages = speculate;
  auto split_runner = ModelRunner::Create(*backend_, *device_model_, two);
  ASSERT_TRUE(split_runner.ok()) << split_runner.status();
  const std::string tag = speculate ? "g" : "";
  const Kind kinds[] = {Kind::kHybridMaw, Kind::kGpu, Kind::kHybridPages, Kind::kHybridPages};
  std::vector<std::unique_ptr<Sequence>> split, unsplit;
  for (size_t i = 0; i < std::size(kinds); ++i) {
    split.push_back(MakeSequence(kinds[i], tag + "s" + std::to_string(i)));
    unsplit.push_back(MakeSequence(kinds[i], tag + "u" + std::to_string(i)));
    ASSERT_NE(split.back(), nullptr);
    ASSERT_NE(unsplit.back(), nullptr);
    const std::vector<int32_t> prompt = Tokens(90 + 17 * static_cast<int64_t>(i), 3);
    Step(*split[i], prompt);
    Step(*unsplit[i], prompt);
  }
  RunnerOptions one = two;
  one.micro_batches = 1;
  auto serial = ModelRunner::Create(*backend_, *device_model_, one);
  ASSERT_TRUE(serial.ok()) << serial.status();
  std::vector<int32_t> ids = {7, 8, 9, 10};
  float worst = 0.0f;
  for (int step = 0; step < 20; ++step) {
    std::vector<Sequence*> a, b;
    for (size_t i = 0; i < split.size(); ++i) {
      a.push_back(split[i].get());
      b.push_back(unsplit[i].get());
    }
    ASSERT_TRUE((*split_runner)->Decode(a, ids.data()).ok());
    ASSERT_TRUE((*serial)->Decode(b, ids.data()).ok());
    for (size_t i = 0; i < split.size(); ++i) {
      const std::vector<float> x = Row(**split_runner, i);
      const float diff = MaxAbsDiff(x, Row(**serial, i));
      worst = std::max(worst, diff);
      ASSERT_LE(diff, kLogitTolerance) << "sequence " << i << " step " << step;
      ids[i] = static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
    }
  }
  EXPECT_EQ((*serial)->profile().split_passes, 0u);
  EXPECT_GT((*split_runner)->profile().split_passes, 0u);
  std::printf("split vs unsplit%s: worst logit difference %.3g\n",
              speculate ? " (layer-ahead selection)" : "", worst);
}

TEST_F(MicroBatchTest, SplitEqualsUnsplitPass) { ExpectSplitEqualsUnsplit(false); }
TEST_F(MicroBatchTest, SplitEqualsUnsplitPassWithLayerAheadSelection) {
  ExpectSplitEqualsUnsplit(true);
}

// A batch with one sequence attending off the device is never split (nothing to overlap); gpu
// and offload sequences add no off-device work. By default a tiny model's batch is not split
// (its CPU work does not repay the split), on the cpu backend none is.
TEST_F(MicroBatchTest, SplitsOnlyWhereTwoSegmentsWorkOffTheDevice) {
  auto hybrid = MakeSequence(Kind::kHybridMaw, "h");
  auto other = MakeSequence(Kind::kHybridMaw, "h2");
  auto gpu = MakeSequence(Kind::kGpu, "g");
  auto offload = MakeSequence(Kind::kOffload, "o");
  for (Sequence* s : {hybrid.get(), other.get(), gpu.get(), offload.get()}) {
    ASSERT_NE(s, nullptr);
    Step(*s, Tokens(80, 1));
  }
  const int32_t ids[4] = {3, 4, 5, 6};
  ASSERT_TRUE(split_runner_->Decode({hybrid.get(), gpu.get(), offload.get()}, ids).ok());
  EXPECT_EQ(split_runner_->profile().split_passes, 0u);
  ASSERT_TRUE(split_runner_->Decode({hybrid.get(), other.get(), gpu.get()}, ids).ok());
  EXPECT_EQ(split_runner_->profile().split_passes, 1u);
  ASSERT_TRUE(split_runner_->SetMicroBatches(1).ok());
  ASSERT_TRUE(split_runner_->Decode({hybrid.get(), other.get()}, ids).ok());
  EXPECT_EQ(split_runner_->profile().split_passes, 1u);
  EXPECT_EQ(split_runner_->SetMicroBatches(3).code(), absl::StatusCode::kInvalidArgument);
  // The fixture's runner has the default rule.
  ASSERT_TRUE(runner_->Decode({hybrid.get(), other.get()}, ids).ok());
  EXPECT_EQ(runner_->profile().split_passes, 0u);
}

}  // namespace
}  // namespace tandem::gpu_worker
