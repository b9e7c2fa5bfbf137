// ExactStepClock (exact_step_clock.h) and ExactRateBook::RecordStep (exact_probe.h): the per-path
// times of exact steps from the tier's marks, checked on marks placed by hand, the rates they
// correct computed by hand, and the clock in a real exact pass (tiny random model on the test
// backend, one embedded node): every pass timed, the sums consistent, the book corrected, the
// logits still gpu mode's within 1e-4 (the timing only waits, it changes no arithmetic).
#include "tandem/gpu_worker/exact_step_clock.h"

#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "exact_test_rig.h"
#include "tandem/gpu_worker/exact_probe.h"
#include "tandem/gpu_worker/model_geometry.h"

namespace tandem::gpu_worker {
namespace {

using Clock = ExactStepClock::Clock;

Clock::time_point Ms(double ms) {
  return Clock::time_point(
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(ms)));
}

// Three layers (ms): starts 0, 13, 25; nodes done 10, 23, 34; device done 12, 23.5, 34.
// node busy 10 + 10 + 9 = 29; fetch excess 2 + 0.5 + 0 = 2.5; tail over layers 0-1
// 1 + 1.5 = 2.5, scaled by 3/2: 3.75; span 29 + 2.5 + 3.75 = 35.25.
void MarkStep(ExactStepClock& clock, double offset) {
  const double start[] = {0, 13, 25}, nodes[] = {10, 23, 34}, device[] = {12, 23.5, 34};
  for (int l = 0; l < 3; ++l) {
    clock.Start(l, Ms(offset + start[l]));
    clock.NodesDone(l, Ms(offset + nodes[l]));
    clock.DeviceDone(l, Ms(offset + device[l]));
  }
}

TEST(ExactStepClock, SumsTheLayersOfEachStep) {
  ExactStepClock clock(3);
  MarkStep(clock, 0);
  const ExactStepTimes t = clock.Take();
  EXPECT_EQ(t.steps, 1);
  EXPECT_NEAR(t.node_busy_s, 29e-3, 1e-9);
  EXPECT_NEAR(t.fetch_excess_s, 2.5e-3, 1e-9);
  EXPECT_NEAR(t.tail_s, 3.75e-3, 1e-9);
  EXPECT_NEAR(t.span_s, 35.25e-3, 1e-9);
  EXPECT_EQ(clock.Take().steps, 0);  // taken

  // Two more steps: per step the same; the total keeps all three.
  MarkStep(clock, 100);
  MarkStep(clock, 200);
  const ExactStepTimes two = clock.Take();
  EXPECT_EQ(two.steps, 2);
  EXPECT_NEAR(two.PerStep().span_s, 35.25e-3, 1e-9);
  EXPECT_EQ(clock.total().steps, 3);
}

TEST(ExactStepClock, DropsStepsWithMissingOrAbandonedMarks) {
  ExactStepClock clock(3);
  // No layer 0: nothing counts until a step starts.
  clock.Start(1, Ms(0));
  clock.NodesDone(1, Ms(1));
  clock.DeviceDone(1, Ms(2));
  clock.Start(2, Ms(3));
  clock.NodesDone(2, Ms(4));
  clock.DeviceDone(2, Ms(5));
  EXPECT_EQ(clock.Take().steps, 0);
  // A layer skipped mid-step drops the step.
  clock.Start(0, Ms(10));
  clock.NodesDone(0, Ms(11));
  clock.DeviceDone(0, Ms(12));
  clock.Start(2, Ms(13));
  clock.NodesDone(2, Ms(14));
  clock.DeviceDone(2, Ms(15));
  EXPECT_EQ(clock.Take().steps, 0);
  // Abandoned (a cancelled pass) before its last layer.
  clock.Start(0, Ms(20));
  clock.NodesDone(0, Ms(21));
  clock.Abandon();
  clock.DeviceDone(0, Ms(22));
  EXPECT_EQ(clock.Take().steps, 0);
  // The next whole step counts.
  MarkStep(clock, 50);
  EXPECT_EQ(clock.Take().steps, 1);
}

// By hand, L = 32 layers, node rate 50 GB/s with a 100 us round trip, PCIe 40 GB/s, nodes
// scanning 1.2 GB (24 ms modelled: over kMinRatedScanSecondsPerLayer · L = 16 ms, scan-bound):
//   step 1: busy 30, tail 6, excess 4, span 40 ms. Node rate 1.2 GB / (30 - 32 · 0.1 ms) =
//           44.776 GB/s, overhead 100 us + 6 / 32 ms = 287.5 us (first samples replace).
//           Fetch-bound (4 > 5% of 40): PCIe = 1 GB / 40 ms = 25 GB/s.
//   step 2: busy 30, tail 2, excess 1, span 33 ms. Rate 44.776 again; overhead 100 + 62.5 =
//           162.5 us: EMA 0.8 * 287.5 + 0.2 * 162.5 = 262.5 us. Not fetch-bound: PCIe stays.
TEST(ExactRateBook, RecordStepCorrectsAScanBoundNodeRateAndAFetchBoundPcieRate) {
  ExactPathRates r;
  r.pcie_bytes_per_second = 40e9;
  r.node_bytes_per_second = 50e9;
  r.node_overhead_seconds = 100e-6;
  r.device_attend_bytes_per_second = 2e12;
  r.nodes = 1;
  ExactRateBook book(r);
  const ExactGeometry g{32, 8, 128, 4096, 2, 2};
  const ExactPlan before = PlanExactSplit(book.rates(), g, 1 << 17);

  book.RecordStep({30e-3, 4e-3, 6e-3, 40e-3, 1}, 1e9, 1.2e9, 32);
  EXPECT_NEAR(book.rates().node_bytes_per_second, 1.2e9 / 26.8e-3, 1e-3);
  EXPECT_NEAR(book.rates().node_overhead_seconds, 287.5e-6, 1e-12);
  EXPECT_NEAR(book.rates().pcie_bytes_per_second, 25e9, 1e-3);
  book.RecordStep({30e-3, 1e-3, 2e-3, 33e-3, 1}, 1e9, 1.2e9, 32);
  EXPECT_NEAR(book.rates().node_bytes_per_second, 1.2e9 / 26.8e-3, 1e-3);
  EXPECT_NEAR(book.rates().node_overhead_seconds, 262.5e-6, 1e-12);
  EXPECT_NEAR(book.rates().pcie_bytes_per_second, 25e9, 1e-3);
  EXPECT_EQ(book.step_samples(), 2u);
  EXPECT_EQ(book.node_samples(), 2u);
  EXPECT_EQ(book.pcie_samples(), 1u);
  // PCIe fell 40 -> 25 GB/s, the nodes 50 -> 44.8: less on PCIe.
  EXPECT_LT(PlanExactSplit(book.rates(), g, 1 << 17).fetch_share, before.fetch_share);
  // Nothing to learn from: ignored.
  book.RecordStep({}, 1e9, 1.2e9, 32);
  book.RecordStep({30e-3, 4e-3, 6e-3, 40e-3, 1}, 0, 1.2e9, 32);
  EXPECT_EQ(book.step_samples(), 2u);
  // A fetch-bound step of 32 MB over 32 layers (25 us a layer at 40 GB/s, under
  // kMinRatedFetchSecondsPerLayer): its span is fixed costs, not the link, so PCIe stays.
  book.RecordStep({30e-3, 4e-3, 6e-3, 40e-3, 1}, 32e6, 1.2e9, 32);
  EXPECT_NEAR(book.rates().pcie_bytes_per_second, 25e9, 1e-3);
  EXPECT_EQ(book.pcie_samples(), 1u);
}

// A small session (nodes scanning 12 MB, 0.24 ms modelled: under 16 ms): its nodes' time is
// fixed costs, so the rate stays and the overhead takes the rest, (1 + 0.6 - 0.24) / 32 ms =
// 42.5 us.
TEST(ExactRateBook, RecordStepLeavesTheRateOfASmallSessionToItsOverhead) {
  ExactPathRates r;
  r.pcie_bytes_per_second = 40e9;
  r.node_bytes_per_second = 50e9;
  r.node_overhead_seconds = 100e-6;
  r.device_attend_bytes_per_second = 2e12;
  r.nodes = 1;
  ExactRateBook book(r);
  book.RecordStep({1e-3, 0, 0.6e-3, 2e-3, 1}, 1e6, 1.2e7, 32);
  EXPECT_NEAR(book.rates().node_bytes_per_second, 50e9, 1e-3);
  EXPECT_NEAR(book.rates().node_overhead_seconds, 42.5e-6, 1e-12);
  EXPECT_EQ(book.node_samples(), 0u);
}

TEST(ExactStepClock, TimesRealPassesWithoutChangingTheLogits) {
  absl::StatusOr<ModelConfig> config = GeometryPreset("tiny");
  ASSERT_TRUE(config.ok()) << config.status();
  ASSERT_TRUE(ApplyGeometryOverrides("q_heads=4,kv_heads=4,head_dim=64,dtype=f32", *config).ok());
  std::string why;
  auto rig = testing::MakeExactRig("", *config, 7, &why);
  if (!why.empty()) GTEST_SKIP() << "no backend: " << why;
  ASSERT_TRUE(rig.ok()) << rig.status();
  ExactRateBook book(testing::EvenExactRates());
  auto gpu = testing::MakeExactTestSequence(*rig, AttentionMode::kGpu, "clock-gpu", nullptr, {});
  testing::ExactSplit split{0.5, -1, false};
  split.time_every_steps = 1;
  auto exact =
      testing::MakeExactTestSequence(*rig, AttentionMode::kExact, "clock-exact", &book, split);
  ASSERT_NE(gpu, nullptr);
  ASSERT_NE(exact, nullptr);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 300; ++i) prompt.push_back(1 + (i * 29) % 250);
  std::vector<float> a = testing::StepLogits(*rig, *gpu, prompt);
  std::vector<float> b = testing::StepLogits(*rig, *exact, prompt);
  const auto& tier = static_cast<const ExactTier&>(*exact->offload);
  for (int step = 0; step < 6; ++step) {
    EXPECT_LT(testing::MaxLogitDiff(a, b), 1e-4f) << step;
    const int32_t next = testing::ArgmaxToken(a);
    a = testing::StepLogits(*rig, *gpu, {next});
    b = testing::StepLogits(*rig, *exact, {next});
    exact->MaintainOffloaded();
  }
  EXPECT_LT(testing::MaxLogitDiff(a, b), 1e-4f);
  ASSERT_GT(tier.host_tokens(), 0);
  ASSERT_GT(tier.node_tokens(), 0);
  // Every decode pass timed (the prompt's first pass had nothing offloaded yet).
  const ExactStepTimes t = tier.measured_steps();
  EXPECT_GE(t.steps, 6);
  EXPECT_GT(t.node_busy_s, 0);
  EXPECT_GE(t.fetch_excess_s, 0);
  EXPECT_GE(t.tail_s, 0);
  EXPECT_NEAR(t.span_s, t.node_busy_s + t.fetch_excess_s + t.tail_s, 1e-9);
  EXPECT_GT(book.step_samples(), 0u);
  const ExactStepTimes per = t.PerStep();
  std::printf("per step: node busy %.3f ms, fetch excess %.3f ms, tail %.3f ms, span %.3f ms\n",
              1e3 * per.node_busy_s, 1e3 * per.fetch_excess_s, 1e3 * per.tail_s, 1e3 * per.span_s);
}

}  // namespace
}  // namespace tandem::gpu_worker
