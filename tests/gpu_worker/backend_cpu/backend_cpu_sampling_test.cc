// Sample and TokenLogProbs of the cpu backend against backend_reference.h.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "backend_reference.h"
#include "backend_test_util.h"

namespace tandem::gpu_worker {
namespace {

using testing::DeviceArrays;
using testing::MakeCpuBackend;
using testing::RandomFloats;

int32_t SampleOrFail(Backend& backend, const SampleParams& p) {
  auto id = backend.Sample(p);
  EXPECT_TRUE(id.ok()) << id.status();
  return id.ok() ? *id : -1;
}

TEST(SampleTest, GreedyTakesTheLowestIndexAmongTies) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  const std::vector<float> logits = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f, 3.0f};
  SampleParams p;
  p.logits = dev.Upload(logits);
  p.vocab = static_cast<int64_t>(logits.size());
  for (const float temperature : {0.0f, -1.0f}) {
    p.temperature = temperature;
    p.uniform = 0.9f;
    EXPECT_EQ(SampleOrFail(*backend, p), 1);
  }
}

TEST(SampleTest, TopKOneAndTinyTopPAreArgmax) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  std::mt19937 rng(21);
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<float> logits = RandomFloats(rng, 512, -5.0f, 5.0f);
    int32_t argmax = 0;
    for (int32_t i = 1; i < 512; ++i) {
      if (logits[i] > logits[argmax]) argmax = i;
    }
    SampleParams p;
    p.logits = dev.Upload(logits);
    p.vocab = 512;
    p.temperature = 1.5f;
    p.uniform = std::uniform_real_distribution<float>(0.0f, 0.999f)(rng);
    p.top_k = 1;
    EXPECT_EQ(SampleOrFail(*backend, p), argmax);
    p.top_k = 0;
    p.top_p = 1e-6f;
    EXPECT_EQ(SampleOrFail(*backend, p), argmax);
  }
}

TEST(SampleTest, ChoicesMatchReference) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  std::mt19937 rng(22);
  const int64_t vocab = 300;
  std::vector<float> logits = RandomFloats(rng, vocab, -4.0f, 4.0f);
  logits[17] = logits[18] = logits[200] = 4.5f;         // ties at the top
  logits[5] = -std::numeric_limits<float>::infinity();  // never sampled
  const float* logits_dev = dev.Upload(logits);
  struct Setting {
    float temperature;
    int32_t top_k;
    float top_p;
  };
  const Setting settings[] = {{1.0f, 0, 1.0f},    {0.7f, 0, 1.0f},  {1.0f, 40, 1.0f},
                              {1.0f, 0, 0.9f},    {1.3f, 50, 0.8f}, {0.5f, 3, 0.5f},
                              {2.0f, 500, 0.95f}, {1.0f, 0, 0.0f}};
  int distinct_choices = 0;
  for (const Setting& s : settings) {
    std::vector<int> seen(vocab, 0);
    for (int i = 0; i < 200; ++i) {
      SampleParams p;
      p.logits = logits_dev;
      p.vocab = vocab;
      p.temperature = s.temperature;
      p.top_k = s.top_k;
      p.top_p = s.top_p;
      p.uniform = static_cast<float>(i) / 200.0f + 0.0013f;
      SampleParams ref = p;
      ref.logits = logits.data();
      const int32_t expect = reference::Sample(ref);
      const int32_t got = SampleOrFail(*backend, p);
      EXPECT_EQ(got, expect) << "T=" << s.temperature << " top_k=" << s.top_k
                             << " top_p=" << s.top_p << " u=" << p.uniform;
      EXPECT_NE(got, 5);
      if (got >= 0 && got < vocab) seen[got] = 1;
    }
    for (int x : seen) distinct_choices += x;
  }
  EXPECT_GT(distinct_choices, 50);  // the sweep over uniform really samples
}

TEST(SampleTest, BadParamsAreInvalidArgument) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  const std::vector<float> logits = {1.0f, 2.0f};
  SampleParams p;
  p.logits = dev.Upload(logits);
  p.vocab = 2;
  p.temperature = 1.0f;
  SampleParams bad = p;
  bad.logits = nullptr;
  TANDEM_EXPECT_INVALID(backend->Sample(bad).status());
  bad = p;
  bad.vocab = 0;
  TANDEM_EXPECT_INVALID(backend->Sample(bad).status());
  bad = p;
  bad.uniform = 1.0f;
  TANDEM_EXPECT_INVALID(backend->Sample(bad).status());
  bad = p;
  bad.uniform = -0.1f;
  TANDEM_EXPECT_INVALID(backend->Sample(bad).status());
}

TEST(TokenLogProbsTest, MatchesReference) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  std::mt19937 rng(23);
  const int64_t tokens = 9, vocab = 4096;
  std::vector<float> logits = RandomFloats(rng, tokens * vocab, -20.0f, 20.0f);
  logits[3] = 60.0f;  // one dominant logit in row 0
  std::vector<int32_t> targets(tokens);
  for (int64_t t = 0; t < tokens; ++t) targets[t] = static_cast<int32_t>((t * 977 + 3) % vocab);
  targets[0] = 3;
  std::vector<float> expect(tokens);
  TokenLogProbParams ref;
  ref.logits = logits.data();
  ref.targets = targets.data();
  ref.out = expect.data();
  ref.num_tokens = tokens;
  ref.vocab = vocab;
  reference::TokenLogProbs(ref);
  TokenLogProbParams p = ref;
  p.logits = dev.Upload(logits);
  p.targets = dev.Upload(targets);
  p.out = dev.Allocate<float>(tokens);
  TANDEM_ASSERT_OK(backend->TokenLogProbs(p));
  const std::vector<float> got = dev.Download(p.out, tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    // Log-probabilities down to ~-60: f32 exp and sums give ~1e-6 relative.
    EXPECT_NEAR(got[t], expect[t], 2e-6 * std::abs(expect[t]) + 2e-6) << t;
  }
  TokenLogProbParams bad = p;
  bad.vocab = 0;
  TANDEM_EXPECT_INVALID(backend->TokenLogProbs(bad));
  std::vector<int32_t> bad_targets = targets;
  bad_targets[4] = static_cast<int32_t>(vocab);
  bad = p;
  bad.targets = dev.Upload(bad_targets);
  TANDEM_EXPECT_INVALID(backend->TokenLogProbs(bad));
}

}  // namespace
}  // namespace tandem::gpu_worker
