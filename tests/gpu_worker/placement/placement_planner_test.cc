// Placement planner: the cost model against hand computation, PlanBalanced against brute force
// on small instances, the gain over the uniform baseline on HGCA-like skewed costs, capacity,
// Replan's forced moves / threshold / byte limit, and the time it takes.
#include "tandem/gpu_worker/placement_planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cpu_time.h"

namespace tandem::gpu_worker {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

PlacementNode Node(double rate, double overhead = 0, uint64_t capacity = uint64_t{1} << 50,
                   bool accepting = true) {
  PlacementNode n;
  n.scan_bytes_per_second = rate;
  n.attend_overhead_seconds = overhead;
  n.capacity_bytes = capacity;
  n.accepting = accepting;
  return n;
}

PlacementShard Shard(uint32_t layer, uint32_t head, double scan, uint64_t mem = kMiB,
                     int current = -1) {
  PlacementShard s;
  s.layer = layer;
  s.kv_head = head;
  s.scan_bytes = scan;
  s.memory_bytes = mem;
  s.current_node = current;
  return s;
}

// The cost model written out independently of the planner: per layer, per node.
double RefStep(const std::vector<PlacementNode>& nodes, const std::vector<PlacementShard>& shards,
               const std::vector<int>& node_of) {
  uint32_t layers = 0;
  for (const auto& s : shards) layers = std::max(layers, s.layer + 1);
  double known = 0;
  int num_known = 0;
  for (const auto& n : nodes) {
    if (n.scan_bytes_per_second > 0) {
      known += n.scan_bytes_per_second;
      ++num_known;
    }
  }
  std::vector<double> rate;
  for (const auto& n : nodes) {
    rate.push_back(n.scan_bytes_per_second > 0 ? n.scan_bytes_per_second
                   : num_known > 0             ? known / num_known
                                               : 1e10);
  }
  double step = 0;
  for (uint32_t l = 0; l < layers; ++l) {
    double slowest = 0;
    for (size_t n = 0; n < nodes.size(); ++n) {
      double t = 0;
      bool owns = false;
      for (size_t s = 0; s < shards.size(); ++s) {
        if (shards[s].layer != l || node_of[s] != static_cast<int>(n)) continue;
        owns = true;
        t += shards[s].scan_bytes / rate[n];
      }
      if (owns) slowest = std::max(slowest, t + nodes[n].attend_overhead_seconds);
    }
    step += slowest;
  }
  return step;
}

// Every shard on an accepting node, no node over capacity, the plan's bookkeeping right.
void ExpectValid(const std::vector<PlacementNode>& nodes, const std::vector<PlacementShard>& shards,
                 const PlacementPlan& plan) {
  ASSERT_EQ(plan.node_of.size(), shards.size());
  std::vector<uint64_t> used(nodes.size(), 0);
  uint64_t moved = 0;
  int moved_shards = 0;
  bool changed = false;
  for (size_t s = 0; s < shards.size(); ++s) {
    const int n = plan.node_of[s];
    ASSERT_GE(n, 0);
    ASSERT_LT(n, static_cast<int>(nodes.size()));
    EXPECT_TRUE(nodes[n].accepting) << "shard " << s << " on non-accepting node " << n;
    used[n] += shards[s].memory_bytes;
    if (n != shards[s].current_node) {
      changed = true;
      if (shards[s].current_node >= 0) {
        moved += shards[s].memory_bytes;
        ++moved_shards;
      }
    }
  }
  for (size_t n = 0; n < nodes.size(); ++n) {
    EXPECT_LE(used[n], nodes[n].capacity_bytes) << "node " << n << " over capacity";
  }
  EXPECT_EQ(plan.moved_bytes, moved);
  EXPECT_EQ(plan.moved_shards, moved_shards);
  EXPECT_EQ(plan.changed, changed);
  EXPECT_NEAR(plan.step_seconds, RefStep(nodes, shards, plan.node_of),
              1e-9 * plan.step_seconds + 1e-15);
}

// HGCA §3.2.2: per-head selected shares range from < 1% to 30%; log-uniform in [0.5%, 30%].
std::vector<PlacementShard> HgcaShards(uint32_t layers, uint32_t heads, uint32_t seed) {
  constexpr double kContext = 131072, kHeadDim = 128, kBf16 = 2;
  const double full = kContext * kHeadDim * 2 * kBf16;  // K and V of one head
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> log_share(std::log(0.005), std::log(0.30));
  std::vector<PlacementShard> shards;
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t h = 0; h < heads; ++h) {
      shards.push_back(Shard(l, h, std::exp(log_share(rng)) * full, static_cast<uint64_t>(full)));
    }
  }
  return shards;
}

std::vector<PlacementShard> WithCurrent(std::vector<PlacementShard> shards,
                                        const std::vector<int>& node_of) {
  for (size_t s = 0; s < shards.size(); ++s) shards[s].current_node = node_of[s];
  return shards;
}

// A search budget no test instance reaches: the checks of plan quality use it, because the
// default 3 ms of wall-clock time can be cut short by a loaded CI machine or a sanitizer build,
// and the plan would then depend on the load. Idle, their searches end on their own within the
// default budget (well under 1 ms each in Release), so the plans are the default budget's.
PlacementOptions Generous() {
  PlacementOptions o;
  o.time_budget = std::chrono::seconds(2);
  return o;
}

// ---------------------------------------------------------------------------------------------

TEST(StepSecondsTest, HandMadeExample) {
  const std::vector<PlacementNode> nodes = {Node(1e9, 1e-5), Node(2e9, 2e-5)};
  const std::vector<PlacementShard> shards = {Shard(0, 0, 1e6), Shard(0, 1, 2e6), Shard(1, 0, 4e6),
                                              Shard(1, 1, 1e6)};
  // Layer 0: node 0 = 10 µs + 1 ms, node 1 = 20 µs + 1 ms → 1.02 ms.
  // Layer 1: node 1 alone = 20 µs + 5e6 / 2e9 s = 2.52 ms. Step = 3.54 ms.
  EXPECT_NEAR(StepSeconds(nodes, shards, std::vector<int>{0, 1, 1, 1}), 3.54e-3, 1e-12);
  // All on node 0: layer 0 = 10 µs + 3 ms, layer 1 = 10 µs + 5 ms.
  EXPECT_NEAR(StepSeconds(nodes, shards, std::vector<int>{0, 0, 0, 0}), 8.02e-3, 1e-12);
  // Unplaced shards add nothing; layer 1 is empty here.
  EXPECT_NEAR(StepSeconds(nodes, shards, std::vector<int>{0, 1, -1, -1}), 1.02e-3, 1e-12);
  EXPECT_EQ(StepSeconds(nodes, shards, std::vector<int>{0, 1}),
            std::numeric_limits<double>::infinity());
  EXPECT_EQ(StepSeconds(nodes, shards, std::vector<int>{0, 1, 2, 0}),
            std::numeric_limits<double>::infinity());
}

TEST(StepSecondsTest, UnknownRateUsesMeanOfKnown) {
  // Node 1's rate is unknown: the mean of 1e9 and 3e9 = 2e9.
  const std::vector<PlacementNode> nodes = {Node(1e9), Node(0), Node(3e9)};
  const std::vector<PlacementShard> shards = {Shard(0, 0, 4e6)};
  EXPECT_NEAR(StepSeconds(nodes, shards, std::vector<int>{1}), 2e-3, 1e-15);
  // None known: 1e10 bytes/s.
  const std::vector<PlacementNode> unknown = {Node(-1)};
  EXPECT_NEAR(StepSeconds(unknown, shards, std::vector<int>{0}), 4e-4, 1e-15);
}

TEST(PoolRatesByClassTest, NodesOfOneClassGetTheMeanOfTheirKnownRates) {
  std::vector<PlacementNode> nodes = {Node(10e9), Node(20e9), Node(0), Node(50e9), Node(5e9),
                                      Node(0), Node(7e9)};
  const std::vector<int> class_of = {3, 3, 3, 8, -1, 4, 4};
  PoolRatesByClass(nodes, class_of);
  EXPECT_DOUBLE_EQ(nodes[0].scan_bytes_per_second, 15e9);
  EXPECT_DOUBLE_EQ(nodes[1].scan_bytes_per_second, 15e9);
  EXPECT_DOUBLE_EQ(nodes[2].scan_bytes_per_second, 15e9);   // unknown: the class mean
  EXPECT_DOUBLE_EQ(nodes[3].scan_bytes_per_second, 50e9);   // alone in its class
  EXPECT_DOUBLE_EQ(nodes[4].scan_bytes_per_second, 5e9);    // no class: its own
  EXPECT_DOUBLE_EQ(nodes[5].scan_bytes_per_second, 7e9);
  EXPECT_DOUBLE_EQ(nodes[6].scan_bytes_per_second, 7e9);
  std::vector<PlacementNode> unknown = {Node(0), Node(0)};
  PoolRatesByClass(unknown, std::vector<int>{1, 1});
  EXPECT_EQ(unknown[0].scan_bytes_per_second, 0);   // nothing known: stays unknown
  std::vector<PlacementNode> mismatch = {Node(1e9), Node(3e9)};
  PoolRatesByClass(mismatch, std::vector<int>{1});
  EXPECT_EQ(mismatch[0].scan_bytes_per_second, 1e9);   // sizes differ: untouched
  EXPECT_EQ(mismatch[1].scan_bytes_per_second, 3e9);
}

// Equal nodes whose measured rates differ: on pooled rates the plan is the one for equal
// nodes, so it does not depend on which node happened to look fast.
TEST(PoolRatesByClassTest, PlanOnPooledRatesIsThePlanForEqualNodes) {
  const std::vector<PlacementShard> shards = HgcaShards(8, 8, 29);
  std::vector<PlacementNode> skewed = {Node(16e9, 77e-6), Node(8e9, 77e-6), Node(12e9, 77e-6),
                                       Node(12e9, 77e-6)};
  const std::vector<PlacementNode> equal(4, Node(12e9, 77e-6));
  PoolRatesByClass(skewed, std::vector<int>{3, 3, 3, 3});
  for (const PlacementNode& n : skewed) EXPECT_DOUBLE_EQ(n.scan_bytes_per_second, 12e9);
  auto from_pooled = PlanBalanced(skewed, shards, Generous());
  auto from_equal = PlanBalanced(equal, shards, Generous());
  ASSERT_TRUE(from_pooled.ok() && from_equal.ok());
  EXPECT_EQ(from_pooled->node_of, from_equal->node_of);
}

TEST(PlacementValidationTest, BadInputIsInvalidArgument) {
  const std::vector<PlacementNode> nodes = {Node(1e9), Node(1e9)};
  const std::vector<PlacementShard> good = {Shard(0, 0, 1e6), Shard(0, 1, 1e6)};
  ASSERT_TRUE(PlanBalanced(nodes, good).ok());

  std::vector<std::pair<std::vector<PlacementNode>, std::vector<PlacementShard>>> bad;
  auto shards = good;
  shards[1].scan_bytes = std::nan("");
  bad.emplace_back(nodes, shards);
  shards = good;
  shards[1].scan_bytes = -1;
  bad.emplace_back(nodes, shards);
  shards = good;
  shards[0].current_node = 2;
  bad.emplace_back(nodes, shards);
  shards = good;
  shards[0].current_node = -2;
  bad.emplace_back(nodes, shards);
  shards = good;
  shards[1].kv_head = 0;  // duplicate (0, 0)
  bad.emplace_back(nodes, shards);
  auto bad_nodes = nodes;
  bad_nodes[0].attend_overhead_seconds = -1e-6;
  bad.emplace_back(bad_nodes, good);
  bad_nodes = nodes;
  bad_nodes[1].scan_bytes_per_second = std::nan("");
  bad.emplace_back(bad_nodes, good);
  bad_nodes = nodes;
  bad_nodes[0].accepting = bad_nodes[1].accepting = false;
  bad.emplace_back(bad_nodes, good);

  for (size_t i = 0; i < bad.size(); ++i) {
    const auto& [n, s] = bad[i];
    EXPECT_EQ(PlanBalanced(n, s).status().code(), absl::StatusCode::kInvalidArgument) << i;
    EXPECT_EQ(PlanUniform(n, s).status().code(), absl::StatusCode::kInvalidArgument) << i;
    EXPECT_EQ(Replan(n, s).status().code(), absl::StatusCode::kInvalidArgument) << i;
  }
  const std::vector<PlacementNode> too_many(kMaxPlacementNodes + 1, Node(1e9));
  EXPECT_EQ(PlanBalanced(too_many, good).status().code(), absl::StatusCode::kInvalidArgument);
  PlacementOptions negative;
  negative.min_relative_gain = -0.1;
  EXPECT_EQ(Replan(nodes, good, negative).status().code(), absl::StatusCode::kInvalidArgument);
  negative.min_relative_gain = std::nan("");
  EXPECT_EQ(Replan(nodes, good, negative).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PlacementPlannerTest, EmptySessionIsEmptyPlan) {
  const std::vector<PlacementNode> nodes = {Node(1e9)};
  auto plan = PlanBalanced(nodes, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->node_of.empty());
  EXPECT_EQ(plan->step_seconds, 0);
  EXPECT_FALSE(plan->changed);
}

// Brute force over every assignment (accepting nodes only, capacity respected).
struct Optimum {
  double step = std::numeric_limits<double>::infinity();
  std::vector<int> node_of;
};
Optimum BruteForce(const std::vector<PlacementNode>& nodes,
                   const std::vector<PlacementShard>& shards) {
  std::vector<int> accepting;
  for (size_t n = 0; n < nodes.size(); ++n) {
    if (nodes[n].accepting) accepting.push_back(static_cast<int>(n));
  }
  Optimum best;
  std::vector<int> digit(shards.size(), 0), node_of(shards.size());
  while (true) {
    std::vector<uint64_t> used(nodes.size(), 0);
    bool fits = true;
    for (size_t s = 0; s < shards.size(); ++s) {
      node_of[s] = accepting[digit[s]];
      used[node_of[s]] += shards[s].memory_bytes;
      fits = fits && used[node_of[s]] <= nodes[node_of[s]].capacity_bytes;
    }
    if (fits) {
      const double step = RefStep(nodes, shards, node_of);
      if (step < best.step) best = {step, node_of};
    }
    size_t i = 0;
    while (i < digit.size() && ++digit[i] == static_cast<int>(accepting.size())) digit[i++] = 0;
    if (i == digit.size()) break;
  }
  return best;
}

TEST(PlanBalancedTest, NearBruteForceOptimumOnSmallInstances) {
  std::mt19937 rng(20240611);
  std::uniform_real_distribution<double> unit(0, 1);
  int instances = 0, exact = 0, with_capacity = 0, uniform_feasible = 0;
  double worst = 1;
  for (int trial = 0; trial < 400; ++trial) {
    const int num_nodes = 2 + trial % 2;
    const bool heterogeneous = (trial / 2) % 2 == 1;
    const bool tight = (trial / 4) % 2 == 1;
    std::vector<PlacementShard> shards;
    uint64_t total_mem = 0;
    for (uint32_t l = 0; l < 2; ++l) {
      for (uint32_t h = 0; h < 4; ++h) {
        const uint64_t mem = (1 + rng() % 3) * kMiB;
        total_mem += mem;
        shards.push_back(Shard(l, h, std::exp(std::log(1e5) + unit(rng) * std::log(300.0)), mem));
      }
    }
    std::vector<PlacementNode> nodes;
    for (int n = 0; n < num_nodes; ++n) {
      const double rate = heterogeneous ? 1e9 * (1 + 3 * unit(rng)) : 1e9;
      const double overhead = heterogeneous ? 2e-5 * unit(rng) : 1e-5;
      // Tight: capacity 1.15 × an even share, so packing matters and fast nodes cannot take all.
      const uint64_t cap =
          tight ? static_cast<uint64_t>(1.15 * total_mem / num_nodes) : uint64_t{1} << 40;
      nodes.push_back(Node(rate, overhead, cap));
    }
    const Optimum opt = BruteForce(nodes, shards);
    if (!std::isfinite(opt.step)) continue;  // no assignment fits
    ++instances;
    with_capacity += tight;
    auto balanced = PlanBalanced(nodes, shards, Generous());
    ASSERT_TRUE(balanced.ok()) << "trial " << trial << ": " << balanced.status();
    ExpectValid(nodes, shards, *balanced);
    const double ratio = balanced->step_seconds / opt.step;
    worst = std::max(worst, ratio);
    exact += ratio <= 1 + 1e-9;
    EXPECT_LE(ratio, 1.15) << "trial " << trial;
    EXPECT_GE(ratio, 1 - 1e-9) << "trial " << trial << ": better than the brute-force optimum?";
    auto uniform = PlanUniform(nodes, shards);
    if (uniform.ok()) {
      ++uniform_feasible;
      ExpectValid(nodes, shards, *uniform);
      EXPECT_LE(balanced->step_seconds, uniform->step_seconds * (1 + 1e-9)) << "trial " << trial;
    }
  }
  std::printf(
      "[brute force] %d instances (%d with tight capacity, uniform feasible on %d): "
      "%d at the optimum, worst ratio %.4f\n",
      instances, with_capacity, uniform_feasible, exact, worst);
  EXPECT_GE(instances, 300);
  EXPECT_GE(exact, instances * 8 / 10);
}

TEST(PlanBalancedTest, HgcaSkewedCostsBeatUniform) {
  for (int num_nodes : {2, 4}) {
    double total_uniform = 0, total_balanced = 0, worst_gap = 0;
    for (uint32_t seed = 1; seed <= 5; ++seed) {
      const std::vector<PlacementShard> shards = HgcaShards(32, 8, seed);
      std::vector<PlacementNode> nodes(num_nodes, Node(20e9, 20e-6));
      auto uniform = PlanUniform(nodes, shards);
      auto balanced = PlanBalanced(nodes, shards, Generous());
      ASSERT_TRUE(uniform.ok()) << uniform.status();
      ASSERT_TRUE(balanced.ok()) << balanced.status();
      ExpectValid(nodes, shards, *uniform);
      ExpectValid(nodes, shards, *balanced);
      EXPECT_LE(balanced->step_seconds, uniform->step_seconds);
      // Lower bound per layer: max(heaviest shard, even split of the layer) + overhead.
      double bound = 0;
      for (uint32_t l = 0; l < 32; ++l) {
        double sum = 0, heaviest = 0;
        for (uint32_t h = 0; h < 8; ++h) {
          sum += shards[l * 8 + h].scan_bytes / 20e9;
          heaviest = std::max(heaviest, shards[l * 8 + h].scan_bytes / 20e9);
        }
        bound += std::max(heaviest, sum / num_nodes) + 20e-6;
      }
      worst_gap = std::max(worst_gap, balanced->step_seconds / bound);
      total_uniform += uniform->step_seconds;
      total_balanced += balanced->step_seconds;
      if (seed == 1) {
        std::printf(
            "[hgca] %d nodes, seed 1: uniform %.3f ms, balanced %.3f ms (%.1f%% lower), "
            "lower bound %.3f ms, %d search steps\n",
            num_nodes, uniform->step_seconds * 1e3, balanced->step_seconds * 1e3,
            100 * (1 - balanced->step_seconds / uniform->step_seconds), bound * 1e3,
            balanced->search_steps);
      }
    }
    const double gain = 1 - total_balanced / total_uniform;
    std::printf(
        "[hgca] %d nodes, 5 seeds: uniform %.3f ms, balanced %.3f ms, %.1f%% lower; "
        "balanced ≤ %.4f × lower bound\n",
        num_nodes, total_uniform / 5 * 1e3, total_balanced / 5 * 1e3, 100 * gain, worst_gap);
    EXPECT_GE(gain, 0.10) << num_nodes << " nodes";
    EXPECT_LE(worst_gap, 1.02) << num_nodes << " nodes";
  }
}

TEST(PlanBalancedTest, FasterNodeGetsProportionallyMore) {
  // Equal-cost heads; node 0 scans twice as fast, so it should take about 2/3 of the bytes.
  std::vector<PlacementShard> shards;
  for (uint32_t l = 0; l < 32; ++l) {
    for (uint32_t h = 0; h < 8; ++h) shards.push_back(Shard(l, h, 8e6));
  }
  const std::vector<PlacementNode> nodes = {Node(2e10, 1e-6), Node(1e10, 1e-6)};
  auto plan = PlanBalanced(nodes, shards, Generous());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectValid(nodes, shards, *plan);
  int on_fast = 0;
  for (int n : plan->node_of) on_fast += n == 0;
  // Per layer the best split of 8 equal heads over rates 2:1 is 5:3 (max(5/2, 3) = 3 units
  // against 6:2 → 3, 4:4 → 4); both 5:3 and 6:2 give 3 units + overhead.
  const double unit = 8e6 / 1e10;
  EXPECT_NEAR(plan->step_seconds, 32 * (3 * unit + 1e-6), 1e-12);
  EXPECT_GE(on_fast, 5 * 32);
  EXPECT_LE(on_fast, 6 * 32);
  auto uniform = PlanUniform(nodes, shards);
  ASSERT_TRUE(uniform.ok());
  EXPECT_NEAR(uniform->step_seconds, 32 * (4 * unit + 1e-6), 1e-12);
  std::printf("[heterogeneous] fast node holds %d of %zu shards; step %.3f ms vs uniform %.3f ms\n",
              on_fast, shards.size(), plan->step_seconds * 1e3, uniform->step_seconds * 1e3);
}

TEST(PlanBalancedTest, UnknownRateIsTreatedAsTheMean) {
  std::vector<PlacementShard> shards;
  for (uint32_t h = 0; h < 6; ++h) shards.push_back(Shard(0, h, 1e6));
  // Node 2's rate is unknown (mean of 1e9 and 2e9 = 1.5e9).
  const std::vector<PlacementNode> nodes = {Node(1e9), Node(2e9), Node(0)};
  auto plan = PlanBalanced(nodes, shards, Generous());
  ASSERT_TRUE(plan.ok());
  ExpectValid(nodes, shards, *plan);
  EXPECT_NEAR(plan->step_seconds, BruteForce(nodes, shards).step, 1e-12);
}

TEST(CapacityTest, ResourceExhaustedWhenMemoryExceedsCapacity) {
  std::vector<PlacementShard> shards;
  for (uint32_t h = 0; h < 8; ++h) shards.push_back(Shard(0, h, 1e6, 100));
  const std::vector<PlacementNode> nodes = {Node(1e9, 0, 300), Node(1e9, 0, 400),
                                            Node(1e9, 0, 10000, /*accepting=*/false)};
  for (const auto& status : {PlanBalanced(nodes, shards).status(),
                             PlanUniform(nodes, shards).status(), Replan(nodes, shards).status()}) {
    EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
    EXPECT_NE(status.message().find("800"), std::string::npos) << status;
    EXPECT_NE(status.message().find("700"), std::string::npos) << status;
  }
}

TEST(CapacityTest, PackingFailureNamesTheShard) {
  // 3 shards of 60 bytes on two nodes of 100: 180 ≤ 200 bytes in total, but no packing exists.
  std::vector<PlacementShard> shards;
  for (uint32_t h = 0; h < 3; ++h) shards.push_back(Shard(0, h, 1e6, 60));
  const std::vector<PlacementNode> nodes = {Node(1e9, 0, 100), Node(1e9, 0, 100)};
  const absl::Status status = PlanBalanced(nodes, shards).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("60 B"), std::string::npos) << status;
  EXPECT_EQ(PlanUniform(nodes, shards).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(CapacityTest, UniformSkipsAFullNode) {
  // 2 layers × 4 heads on 3 nodes with room for 2, 3 and 3 shards. Uniform order: (0,0)→0,
  // (0,1)→1, (0,2)→2, (0,3)→0, (1,0)→1, (1,1)→2, (1,2)→0 full→1, (1,3)→1 full→2.
  std::vector<PlacementShard> shards;
  for (uint32_t l = 0; l < 2; ++l) {
    for (uint32_t h = 0; h < 4; ++h) shards.push_back(Shard(l, h, 1e6 * (1 + h), 10));
  }
  const std::vector<PlacementNode> nodes = {Node(1e9, 0, 20), Node(1e9, 0, 30), Node(1e9, 0, 30)};
  auto uniform = PlanUniform(nodes, shards);
  ASSERT_TRUE(uniform.ok()) << uniform.status();
  EXPECT_EQ(uniform->node_of, (std::vector<int>{0, 1, 2, 0, 1, 2, 1, 2}));
  ExpectValid(nodes, shards, *uniform);
  auto balanced = PlanBalanced(nodes, shards, Generous());
  ASSERT_TRUE(balanced.ok()) << balanced.status();
  ExpectValid(nodes, shards, *balanced);
  EXPECT_NEAR(balanced->step_seconds, BruteForce(nodes, shards).step, 1e-12);
  // A non-accepting node is never used by either.
  auto draining = nodes;
  draining.push_back(Node(1e12, 0, 1000, /*accepting=*/false));
  auto uniform2 = PlanUniform(draining, shards);
  ASSERT_TRUE(uniform2.ok());
  EXPECT_EQ(uniform2->node_of, uniform->node_of);
}

TEST(CapacityTest, TightMemoryWithAFastNodeSpreadsAcrossLayers) {
  // The fast node would take 2/3 of every layer but may hold only half of all shards: the plan
  // must stay within capacity and still beat uniform; memory binding needs cross-layer moves.
  const std::vector<PlacementShard> shards = HgcaShards(32, 8, 7);
  uint64_t total = 0;
  for (const auto& s : shards) total += s.memory_bytes;
  const std::vector<PlacementNode> nodes = {Node(40e9, 20e-6, total / 2),
                                            Node(20e9, 20e-6, total / 2)};
  auto balanced = PlanBalanced(nodes, shards, Generous());
  auto uniform = PlanUniform(nodes, shards);
  ASSERT_TRUE(balanced.ok()) << balanced.status();
  ASSERT_TRUE(uniform.ok()) << uniform.status();
  ExpectValid(nodes, shards, *balanced);
  ExpectValid(nodes, shards, *uniform);
  std::vector<PlacementNode> loose = nodes;
  for (auto& n : loose) n.capacity_bytes = total;
  auto unconstrained = PlanBalanced(loose, shards, Generous());
  ASSERT_TRUE(unconstrained.ok());
  std::printf(
      "[tight] uniform %.3f ms, balanced (capacity = half each) %.3f ms, unconstrained "
      "%.3f ms, %d search steps\n",
      uniform->step_seconds * 1e3, balanced->step_seconds * 1e3, unconstrained->step_seconds * 1e3,
      balanced->search_steps);
  EXPECT_LT(balanced->step_seconds, uniform->step_seconds);
  EXPECT_GE(balanced->step_seconds, unconstrained->step_seconds * (1 - 1e-9));
}

// ---------------------------------------------------------------------------------------------

TEST(ReplanTest, DrainingNodeIsEmptied) {
  const std::vector<PlacementShard> fresh = HgcaShards(32, 8, 3);
  std::vector<PlacementNode> nodes(4, Node(20e9, 20e-6));
  auto initial = PlanBalanced(nodes, fresh, Generous());
  ASSERT_TRUE(initial.ok());
  const auto shards = WithCurrent(fresh, initial->node_of);
  nodes[2].accepting = false;
  auto plan = Replan(nodes, shards, Generous());
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectValid(nodes, shards, *plan);
  int had = 0;
  for (int n : initial->node_of) had += n == 2;
  ASSERT_GT(had, 0);
  EXPECT_GE(plan->moved_shards, had);
  for (int n : plan->node_of) EXPECT_NE(n, 2);
  // Forced moves only: exactly the drained node's shards move, each to an accepting node.
  PlacementOptions forced = Generous();
  forced.min_relative_gain = std::numeric_limits<double>::infinity();
  auto only = Replan(nodes, shards, forced);
  ASSERT_TRUE(only.ok()) << only.status();
  ExpectValid(nodes, shards, *only);
  EXPECT_EQ(only->moved_shards, had);
  EXPECT_EQ(only->search_steps, 0);
  // Three nodes cannot be faster than four; the result should still be close to a fresh plan.
  auto fresh3 = PlanBalanced(nodes, fresh, Generous());
  ASSERT_TRUE(fresh3.ok());
  std::printf(
      "[replan drain] %d shards forced off node 2, %d moved in all; step %.3f ms → "
      "%.3f ms (fresh plan on 3 nodes %.3f ms)\n",
      had, plan->moved_shards, initial->step_seconds * 1e3, plan->step_seconds * 1e3,
      fresh3->step_seconds * 1e3);
  EXPECT_GE(plan->step_seconds, initial->step_seconds);
  EXPECT_LE(plan->step_seconds, fresh3->step_seconds * 1.10);
}

TEST(ReplanTest, UnplacedShardsArePlacedAndOverfullNodeSheds) {
  const std::vector<PlacementShard> fresh = HgcaShards(4, 8, 5);
  std::vector<PlacementNode> nodes(3, Node(20e9, 20e-6));
  auto plan = Replan(nodes, fresh, Generous());  // nothing placed yet
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectValid(nodes, fresh, *plan);
  EXPECT_EQ(plan->moved_shards, 0);
  EXPECT_TRUE(plan->changed);

  // Node 0's capacity shrinks below what it holds: it must shed shards, and only down to fit.
  auto shards = WithCurrent(fresh, plan->node_of);
  uint64_t on0 = 0;
  for (const auto& s : shards) on0 += s.current_node == 0 ? s.memory_bytes : 0;
  nodes[0].capacity_bytes = on0 - 1;
  auto shed = Replan(nodes, shards, Generous());
  ASSERT_TRUE(shed.ok()) << shed.status();
  ExpectValid(nodes, shards, *shed);
  EXPECT_GE(shed->moved_shards, 1);
}

TEST(ReplanTest, KeepsPlacementWhenGainIsBelowThreshold) {
  const std::vector<PlacementShard> fresh = HgcaShards(32, 8, 11);
  const std::vector<PlacementNode> nodes(4, Node(20e9, 20e-6));
  auto balanced = PlanBalanced(nodes, fresh, Generous());
  ASSERT_TRUE(balanced.ok());
  // Already balanced: nothing to gain.
  auto same = Replan(nodes, WithCurrent(fresh, balanced->node_of), Generous());
  ASSERT_TRUE(same.ok());
  EXPECT_FALSE(same->changed);
  EXPECT_EQ(same->node_of, balanced->node_of);
  EXPECT_EQ(same->moved_bytes, 0u);

  // Perturb: in a few layers put the heaviest head on the node that already has the second.
  std::vector<int> perturbed = balanced->node_of;
  for (uint32_t l = 0; l < 32; l += 8) {
    std::vector<int> idx(8);
    for (int h = 0; h < 8; ++h) idx[h] = l * 8 + h;
    std::sort(idx.begin(), idx.end(),
              [&](int a, int b) { return fresh[a].scan_bytes > fresh[b].scan_bytes; });
    perturbed[idx[0]] = perturbed[idx[1]];
  }
  const auto shards = WithCurrent(fresh, perturbed);
  const double before = StepSeconds(nodes, shards, perturbed);
  PlacementOptions zero = Generous();
  zero.min_relative_gain = 0;
  auto best = Replan(nodes, shards, zero);
  ASSERT_TRUE(best.ok());
  ExpectValid(nodes, shards, *best);
  const double achievable = 1 - best->step_seconds / before;
  ASSERT_GT(achievable, 0.001);
  std::printf("[replan threshold] perturbed step %.3f ms, replanned %.3f ms (%.2f%% gain)\n",
              before * 1e3, best->step_seconds * 1e3, 100 * achievable);

  PlacementOptions never = Generous();
  never.min_relative_gain = std::numeric_limits<double>::infinity();  // forced moves only
  auto forced_only = Replan(nodes, shards, never);
  ASSERT_TRUE(forced_only.ok()) << forced_only.status();
  EXPECT_FALSE(forced_only->changed);

  PlacementOptions high = Generous();
  high.min_relative_gain = achievable + 0.01;
  auto kept = Replan(nodes, shards, high);
  ASSERT_TRUE(kept.ok());
  EXPECT_FALSE(kept->changed);
  EXPECT_EQ(kept->node_of, perturbed);

  PlacementOptions low = Generous();
  low.min_relative_gain = achievable / 2;
  auto taken = Replan(nodes, shards, low);
  ASSERT_TRUE(taken.ok());
  EXPECT_TRUE(taken->changed);
  EXPECT_LE(taken->step_seconds, before * (1 - achievable / 2) * (1 + 1e-9));
}

// Gains below the absolute floor, or too small to repay the copy before the session ends,
// leave the placement as it is; the same gain with a long enough horizon is taken.
TEST(ReplanTest, OptionalMovesMustRepayTheirCopy) {
  const std::vector<PlacementShard> fresh = HgcaShards(32, 8, 19);
  const std::vector<PlacementNode> nodes(4, Node(20e9, 20e-6));
  auto uniform = PlanUniform(nodes, fresh);
  ASSERT_TRUE(uniform.ok());
  const auto shards = WithCurrent(fresh, uniform->node_of);
  PlacementOptions free_moves = Generous();
  free_moves.min_relative_gain = 0;
  auto best = Replan(nodes, shards, free_moves);
  ASSERT_TRUE(best.ok());
  ASSERT_TRUE(best->changed);
  const double gain = uniform->step_seconds - best->step_seconds;
  ASSERT_GT(gain, 0);
  // The gates only decide whether that plan is adopted: it needs copy_of_best seconds of copy.
  const double rate = 1e9;   // bytes per second of copy
  const double copy_of_best = static_cast<double>(best->moved_bytes) / rate;
  std::printf("[replan payback] gain %.3f ms per step, %d shards (%.1f MiB) to move, %.2f s "
              "to copy at 1 GB/s\n",
              gain * 1e3, best->moved_shards, best->moved_bytes / double(kMiB), copy_of_best);

  PlacementOptions floor = free_moves;
  floor.min_gain_seconds = gain * 1.5;   // no plan gains this much
  auto floored = Replan(nodes, shards, floor);
  ASSERT_TRUE(floored.ok());
  EXPECT_FALSE(floored->changed);

  PlacementOptions short_session = free_moves;
  short_session.move_bytes_per_second = rate;
  short_session.remaining_steps = 0.5 * copy_of_best / gain;   // repays half the copy
  auto kept = Replan(nodes, shards, short_session);
  ASSERT_TRUE(kept.ok());
  EXPECT_FALSE(kept->changed);
  EXPECT_EQ(kept->node_of, uniform->node_of);

  PlacementOptions long_session = short_session;
  long_session.remaining_steps = 2 * copy_of_best / gain;      // repays it twice
  auto taken = Replan(nodes, shards, long_session);
  ASSERT_TRUE(taken.ok());
  ExpectValid(nodes, shards, *taken);
  EXPECT_EQ(taken->node_of, best->node_of);

  // Forced moves happen whatever the gates say.
  std::vector<PlacementNode> draining = nodes;
  draining[2].accepting = false;
  auto forced = Replan(draining, shards, short_session);
  ASSERT_TRUE(forced.ok());
  ExpectValid(draining, shards, *forced);
  for (size_t s = 0; s < shards.size(); ++s) {
    if (shards[s].current_node != 2) {
      EXPECT_EQ(forced->node_of[s], shards[s].current_node) << s;
    }
  }

  for (double bad : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    PlacementOptions o = free_moves;
    o.min_gain_seconds = bad;
    EXPECT_EQ(Replan(nodes, shards, o).status().code(), absl::StatusCode::kInvalidArgument);
    o = free_moves;
    o.remaining_steps = bad;
    EXPECT_EQ(Replan(nodes, shards, o).status().code(), absl::StatusCode::kInvalidArgument);
    o = free_moves;
    o.move_bytes_per_second = bad;
    EXPECT_EQ(Replan(nodes, shards, o).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(ReplanTest, MovedBytesRespectLimit) {
  const std::vector<PlacementShard> fresh = HgcaShards(32, 8, 13);
  const std::vector<PlacementNode> nodes(4, Node(20e9, 20e-6));
  auto uniform = PlanUniform(nodes, fresh);
  auto balanced = PlanBalanced(nodes, fresh, Generous());
  ASSERT_TRUE(uniform.ok() && balanced.ok());
  const auto shards = WithCurrent(fresh, uniform->node_of);
  const uint64_t shard_bytes = fresh[0].memory_bytes;

  for (int limit_shards : {0, 3, 16, 64}) {
    PlacementOptions o = Generous();
    o.min_relative_gain = 0.01;
    o.max_moved_bytes = limit_shards * shard_bytes;
    auto plan = Replan(nodes, shards, o);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ExpectValid(nodes, shards, *plan);
    EXPECT_LE(plan->moved_bytes, o.max_moved_bytes) << limit_shards;
    if (limit_shards == 0) {
      EXPECT_FALSE(plan->changed);
    } else {
      EXPECT_LT(plan->step_seconds, uniform->step_seconds) << limit_shards;
    }
    std::printf(
        "[replan limit] ≤ %2d shards moved: %d moved, step %.3f ms (uniform %.3f, "
        "balanced %.3f)\n",
        limit_shards, plan->moved_shards, plan->step_seconds * 1e3, uniform->step_seconds * 1e3,
        balanced->step_seconds * 1e3);
  }
  auto unlimited = Replan(nodes, shards, Generous());
  ASSERT_TRUE(unlimited.ok());
  ExpectValid(nodes, shards, *unlimited);
  EXPECT_LE(unlimited->step_seconds, balanced->step_seconds * 1.02);
  std::printf("[replan limit] unlimited: %d of %zu shards moved, step %.3f ms\n",
              unlimited->moved_shards, shards.size(), unlimited->step_seconds * 1e3);
}

TEST(ReplanTest, Deterministic) {
  const std::vector<PlacementShard> fresh = HgcaShards(32, 8, 17);
  std::vector<PlacementNode> nodes = {Node(20e9, 20e-6), Node(30e9, 10e-6), Node(0, 20e-6),
                                      Node(25e9, 15e-6)};
  auto uniform = PlanUniform(nodes, fresh);
  ASSERT_TRUE(uniform.ok());
  const auto shards = WithCurrent(fresh, uniform->node_of);
  nodes[1].accepting = false;
  PlacementOptions o = Generous();
  o.max_moved_bytes = 40 * fresh[0].memory_bytes;
  auto a = Replan(nodes, shards, o);
  auto b = Replan(nodes, shards, o);
  ASSERT_TRUE(a.ok() && b.ok());
  ExpectValid(nodes, shards, *a);
  EXPECT_EQ(a->node_of, b->node_of);
  EXPECT_EQ(a->step_seconds, b->step_seconds);
  auto c = PlanBalanced(nodes, shards, Generous());
  auto d = PlanBalanced(nodes, shards, Generous());
  ASSERT_TRUE(c.ok() && d.ok());
  EXPECT_EQ(c->node_of, d->node_of);
}

// ---------------------------------------------------------------------------------------------

// Times of `runs` calls of f: the calling thread's CPU time (what the bounds check: the planner
// is single-threaded, and on a loaded 2-core CI machine a call can be descheduled for longer
// than it computes) and the wall time (the search stops at a wall-clock deadline).
struct Timings {
  std::vector<double> cpu_ms, wall_ms;
  double best_cpu_ms() const { return *std::min_element(cpu_ms.begin(), cpu_ms.end()); }
};

template <typename F>
Timings Time(int runs, F f) {
  Timings t;
  for (int i = 0; i < runs; ++i) {
    const auto start = std::chrono::steady_clock::now();
    const double cpu_start = test_timing::ThreadCpuMs();
    f(i);
    t.cpu_ms.push_back(test_timing::ThreadCpuMs() - cpu_start);
    t.wall_ms.push_back(std::chrono::duration<double, std::milli>(
                            std::chrono::steady_clock::now() - start)
                            .count());
  }
  return t;
}

std::string Join(const std::vector<double>& ms) {
  std::string out;
  for (double m : ms) absl::StrAppend(&out, out.empty() ? "" : ", ", absl::StrFormat("%.2f", m));
  return out;
}

// CPU-time bound of one PlanBalanced / Replan call with the default 3 ms search budget: the
// greedy start (which always completes) plus at most the budget's search. 20 ms leaves room for
// a slow CI core; a sanitizer build runs the greedy several times slower.
constexpr double kPlanCpuBoundMs = 20.0 * test_timing::kSanitizerSlowdown;

TEST(PlacementTimingTest, Llama3On16NodesWithinTwentyMs) {
  const std::vector<PlacementShard> shards = HgcaShards(32, 8, 23);  // Llama-3-8B: 256 shards
  std::vector<PlacementNode> nodes;
  for (int n = 0; n < 16; ++n) nodes.push_back(Node(15e9 + 1e9 * (n % 4), 20e-6));
  const PlacementOptions defaults;
  std::vector<absl::StatusOr<PlacementPlan>> plans(3);
  const Timings t = Time(3, [&](int i) { plans[i] = PlanBalanced(nodes, shards, defaults); });
  std::printf(
      "[timing] PlanBalanced 256 shards × 16 nodes, default 3 ms budget: CPU %s ms, wall %s ms\n",
      Join(t.cpu_ms).c_str(), Join(t.wall_ms).c_str());
  // The plan is good whatever the load: never worse than the greedy start alone (zero budget),
  // and, from a call that ended within the budget (its search finished, unhurried: the usual
  // case, 1-2 ms), exactly the plan of an unhurried search (the search is deterministic).
  PlacementOptions greedy_only;
  greedy_only.time_budget = std::chrono::microseconds(0);
  const absl::StatusOr<PlacementPlan> greedy = PlanBalanced(nodes, shards, greedy_only);
  const absl::StatusOr<PlacementPlan> unhurried = PlanBalanced(nodes, shards, Generous());
  ASSERT_TRUE(greedy.ok() && unhurried.ok());
  int within_budget = 0;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(plans[i].ok()) << plans[i].status();
    ExpectValid(nodes, shards, *plans[i]);
    EXPECT_LE(plans[i]->step_seconds, greedy->step_seconds * (1 + 1e-12)) << "run " << i;
    if (t.wall_ms[i] < std::chrono::duration<double, std::milli>(defaults.time_budget).count()) {
      ++within_budget;
      EXPECT_EQ(plans[i]->node_of, unhurried->node_of) << "run " << i;
    }
  }
  std::printf("[timing] %d of 3 runs ended within the budget (checked equal to an unhurried "
              "search); step %.4f ms vs greedy %.4f ms\n",
              within_budget, plans[0]->step_seconds * 1e3, greedy->step_seconds * 1e3);
  EXPECT_LT(t.best_cpu_ms(), kPlanCpuBoundMs);
}

TEST(PlacementTimingTest, ZeroBudgetStillGivesTheGreedyPlan) {
  const std::vector<PlacementShard> shards = HgcaShards(32, 8, 31);
  const std::vector<PlacementNode> nodes(4, Node(20e9, 20e-6));
  PlacementOptions none;
  none.time_budget = std::chrono::microseconds(0);
  auto greedy = PlanBalanced(nodes, shards, none);
  auto searched = PlanBalanced(nodes, shards, Generous());
  ASSERT_TRUE(greedy.ok() && searched.ok());
  ExpectValid(nodes, shards, *greedy);
  EXPECT_EQ(greedy->search_steps, 0);
  EXPECT_GE(greedy->step_seconds, searched->step_seconds * (1 - 1e-9));
  std::printf("[timing] zero budget (greedy only) %.3f ms vs searched %.3f ms\n",
              greedy->step_seconds * 1e3, searched->step_seconds * 1e3);
}

TEST(PlacementTimingTest, EightyLayersOn64Nodes) {
  const std::vector<PlacementShard> fresh = HgcaShards(80, 8, 29);  // 640 shards
  std::vector<PlacementNode> nodes;
  uint64_t total = 0;
  for (const auto& s : fresh) total += s.memory_bytes;
  for (int n = 0; n < 64; ++n) nodes.push_back(Node(15e9 + 1e9 * (n % 5), 20e-6, total / 48));
  absl::StatusOr<PlacementPlan> plan;
  const Timings plan_t = Time(3, [&](int) { plan = PlanBalanced(nodes, fresh); });
  ASSERT_TRUE(plan.ok()) << plan.status();
  ExpectValid(nodes, fresh, *plan);
  const auto shards = WithCurrent(fresh, plan->node_of);
  std::vector<int> held(nodes.size(), 0);
  for (int n : plan->node_of) ++held[n];
  const int drained = static_cast<int>(std::max_element(held.begin(), held.end()) - held.begin());
  nodes[drained].accepting = false;
  absl::StatusOr<PlacementPlan> replan;
  const Timings replan_t = Time(3, [&](int) { replan = Replan(nodes, shards); });
  ASSERT_TRUE(replan.ok()) << replan.status();
  ExpectValid(nodes, shards, *replan);
  EXPECT_GE(replan->moved_shards, held[drained]);
  std::printf(
      "[timing] 640 shards × 64 nodes: PlanBalanced CPU %s ms (wall %s); Replan after draining "
      "a node with %d shards CPU %s ms (wall %s; %d moved)\n",
      Join(plan_t.cpu_ms).c_str(), Join(plan_t.wall_ms).c_str(), held[drained],
      Join(replan_t.cpu_ms).c_str(), Join(replan_t.wall_ms).c_str(), replan->moved_shards);
  EXPECT_LT(plan_t.best_cpu_ms(), kPlanCpuBoundMs);
  EXPECT_LT(replan_t.best_cpu_ms(), kPlanCpuBoundMs);
}

}  // namespace
}  // namespace tandem::gpu_worker
