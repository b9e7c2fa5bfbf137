// ExactPlanner (exact_planner.h): the split of exact mode's offloaded KV between PCIe fetch, CPU
// nodes and recompute. Checked against the closed form of two rates, against a brute-force grid
// over every (fetch, recompute) split (the LP's vertex enumeration must be at least as good), on
// the two geometries (Llama-3-8B GQA: recompute does not pay; Llama-2-7B MHA: it can),
// and on the edges: no nodes, no PCIe, node overhead for short contexts, forced shares.
#include "tandem/gpu_worker/exact_planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

namespace tandem::gpu_worker {
namespace {

ExactGeometry Llama3_8b() { return {32, 8, 128, 4096, 2, 2}; }
ExactGeometry Llama2_7b() { return {32, 32, 128, 4096, 2, 2}; }

// The H100 host of BENCHMARKS.md: PCIe ~53 GB/s, two CPU nodes of ~66 GB/s each.
ExactPathRates H100Host() {
  ExactPathRates r;
  r.pcie_bytes_per_second = 53e9;
  r.device_attend_bytes_per_second = 2000e9;
  r.gemm_flops_per_second = 300e12;
  r.node_bytes_per_second = 132e9;
  r.node_overhead_seconds = 100e-6;
  r.nodes = 2;
  return r;
}

double StepOf(const ExactPathRates& r, const ExactGeometry& g, double tokens, double f, double rc) {
  const double k = g.num_layers * tokens * g.kv_row_bytes();
  const double x = g.num_layers * tokens * g.activation_row_bytes();
  const double flops =
      g.num_layers * tokens * 2.0 * g.hidden_size * 2.0 * g.num_kv_heads * g.head_dim;
  const double n = 1 - f - rc;
  const double pcie = (f * k + rc * x) / r.pcie_bytes_per_second;
  const double dev =
      (f + rc) * k / r.device_attend_bytes_per_second + rc * flops / r.gemm_flops_per_second;
  const double nodes =
      n > 0 ? n * k / r.node_bytes_per_second + g.num_layers * r.node_overhead_seconds : 0.0;
  return std::max({pcie, dev, nodes});
}

TEST(ExactPlanner, TwoRatesMeetInClosedForm) {
  ExactPathRates r;
  r.pcie_bytes_per_second = 50e9;
  r.node_bytes_per_second = 100e9;
  r.nodes = 1;
  const ExactGeometry g = Llama3_8b();
  const ExactPlan p = PlanExactSplit(r, g, 1 << 19);
  EXPECT_NEAR(p.fetch_share, 1.0 / 3.0, 1e-9);
  EXPECT_NEAR(p.node_share, 2.0 / 3.0, 1e-9);
  EXPECT_EQ(p.recompute_share, 0.0);
  const double k = 32.0 * (1 << 19) * g.kv_row_bytes();
  EXPECT_NEAR(p.step_seconds, k / 150e9, 1e-9);
  EXPECT_NEAR(p.combined_limit_seconds, k / 150e9, 1e-9);
  EXPECT_NEAR(p.fetch_only_seconds, k / 50e9, 1e-9);
}

// The split follows the rates of the two paths running at once; offload mode's step and the
// combined limit use the rates alone. By hand: together PCIe 40 and nodes 60 GB/s meet at
// f = 40 / (40 + 60) = 0.4, step = 0.4 K / 40e9 = K / 100e9; alone (50 and 100 GB/s) the
// fetch-only step is K / 50e9 and the combined limit K / 150e9. Planning with the rates alone
// (f = 1/3) would leave the nodes last: (2/3) K / 60e9 = K / 90e9, 11% slower than K / 100e9.
TEST(ExactPlanner, SplitsByTheRatesTogetherAndLimitsByTheRatesAlone) {
  ExactPathRates r;
  r.pcie_bytes_per_second = 40e9;
  r.node_bytes_per_second = 60e9;
  r.pcie_alone_bytes_per_second = 50e9;
  r.node_alone_bytes_per_second = 100e9;
  r.nodes = 1;
  const ExactGeometry g = Llama3_8b();
  const int64_t tokens = 1 << 19;
  const double k = 32.0 * tokens * g.kv_row_bytes();
  const ExactPlan p = PlanExactSplit(r, g, tokens);
  EXPECT_NEAR(p.fetch_share, 0.4, 1e-9);
  EXPECT_NEAR(p.node_share, 0.6, 1e-9);
  EXPECT_NEAR(p.step_seconds, k / 100e9, 1e-9);
  EXPECT_NEAR(p.fetch_only_seconds, k / 50e9, 1e-9);
  EXPECT_NEAR(p.combined_limit_seconds, k / 150e9, 1e-9);
  // The split of the rates alone, timed with the rates together.
  ExactPlanOptions alone;
  alone.force_fetch_share = 1.0 / 3.0;
  EXPECT_NEAR(PlanExactSplit(r, g, tokens, alone).step_seconds, k / 90e9, 1e-9);
  // Rates alone unset: taken equal to the rates together (the earlier behaviour).
  ExactPathRates same = r;
  same.pcie_alone_bytes_per_second = 0;
  same.node_alone_bytes_per_second = 0;
  const ExactPlan q = PlanExactSplit(same, g, tokens);
  EXPECT_NEAR(q.fetch_share, 0.4, 1e-9);
  EXPECT_NEAR(q.combined_limit_seconds, k / 100e9, 1e-9);
  EXPECT_NE(FormatExactRates(r).find("alone 50.00"), std::string::npos) << FormatExactRates(r);
}

TEST(ExactPlanner, Llama3At512kMeetsTheCombinedLimitAndRefusesRecompute) {
  const ExactPlan p = PlanExactSplit(H100Host(), Llama3_8b(), 512 * 1024);
  // Fetch : nodes = 53 : 132 up to the small node overhead.
  EXPECT_NEAR(p.fetch_share, 53.0 / 185.0, 0.01);
  EXPECT_LE(p.step_seconds, 1.01 * p.combined_limit_seconds);
  EXPECT_GE(p.fetch_only_seconds / p.step_seconds, 3.0);
  EXPECT_FALSE(p.recompute_pays);
  EXPECT_NE(p.recompute_reason.find("does not pay"), std::string::npos) << p.recompute_reason;
  EXPECT_NE(p.recompute_reason.find("8192 B"), std::string::npos) << p.recompute_reason;
  // 64 GiB of K+V per step over 185 GB/s: about 0.37 s.
  EXPECT_NEAR(p.step_seconds, 32.0 * 512 * 1024 * 4096 / 185e9, 0.01);
}

TEST(ExactPlanner, MhaRecomputePaysWhenTheGemmKeepsUp) {
  ExactPlanOptions o;
  o.allow_recompute = true;
  const ExactPlan p = PlanExactSplit(H100Host(), Llama2_7b(), 64 * 1024, o);
  EXPECT_TRUE(p.recompute_pays) << p.recompute_reason;
  EXPECT_GT(p.recompute_share, 0.0);
  EXPECT_GT(p.recompute_gain, 0.05);
  EXPECT_NEAR(p.fetch_share + p.node_share + p.recompute_share, 1.0, 1e-9);
  // A slow GEMM: recompute stops paying, and the verdict says so.
  ExactPathRates slow = H100Host();
  slow.gemm_flops_per_second = 1e11;
  const ExactPlan q = PlanExactSplit(slow, Llama2_7b(), 64 * 1024, o);
  EXPECT_LT(q.recompute_share, p.recompute_share);
  // Without allow_recompute the verdict is still computed but the plan has no recompute share.
  const ExactPlan plain = PlanExactSplit(H100Host(), Llama2_7b(), 64 * 1024);
  EXPECT_TRUE(plain.recompute_pays);
  EXPECT_EQ(plain.recompute_share, 0.0);
  EXPECT_GT(plain.step_seconds, p.step_seconds);
}

// The vertex enumeration is optimal: no split on a 1/400 grid of (fetch, recompute) is faster.
TEST(ExactPlanner, NoGridSplitBeatsTheLp) {
  const ExactGeometry geometries[] = {Llama3_8b(), Llama2_7b(), {4, 4, 64, 256, 4, 4}};
  ExactPathRates rates[] = {H100Host(), H100Host(), H100Host()};
  rates[1].gemm_flops_per_second = 20e12;
  rates[2].node_bytes_per_second = 10e9;
  rates[2].device_attend_bytes_per_second = 40e9;
  ExactPlanOptions o;
  o.allow_recompute = true;
  for (const ExactGeometry& g : geometries) {
    for (const ExactPathRates& r : rates) {
      for (const double tokens : {300.0, 8192.0, 131072.0}) {
        const ExactPlan p = PlanExactSplit(r, g, static_cast<int64_t>(tokens), o);
        EXPECT_NEAR(p.step_seconds, StepOf(r, g, tokens, p.fetch_share, p.recompute_share), 1e-12);
        double best = 1e30;
        for (int i = 0; i <= 400; ++i) {
          for (int j = 0; i + j <= 400; ++j) {
            best = std::min(best, StepOf(r, g, tokens, i / 400.0, j / 400.0));
          }
        }
        EXPECT_LE(p.step_seconds, best * (1 + 1e-9)) << tokens;
      }
    }
  }
}

TEST(ExactPlanner, EdgesNoNodesNoPcieOverheadAndForcedShares) {
  ExactPathRates none = H100Host();
  none.nodes = 0;
  EXPECT_EQ(PlanExactSplit(none, Llama3_8b(), 100000).fetch_share, 1.0);
  ExactPathRates no_pcie = H100Host();
  no_pcie.pcie_bytes_per_second = 0;
  EXPECT_EQ(PlanExactSplit(no_pcie, Llama3_8b(), 100000).node_share, 1.0);
  // A few entries: the nodes' per-layer round trip costs more than fetching them.
  EXPECT_EQ(PlanExactSplit(H100Host(), Llama3_8b(), 64).fetch_share, 1.0);
  ExactPlanOptions forced;
  forced.force_fetch_share = 0.25;
  const ExactPlan p = PlanExactSplit(H100Host(), Llama3_8b(), 100000, forced);
  EXPECT_EQ(p.fetch_share, 0.25);
  EXPECT_EQ(p.node_share, 0.75);
  EXPECT_FALSE(FormatExactPlan(p).empty());
}

}  // namespace
}  // namespace tandem::gpu_worker
