// ExactProbe (exact_probe.h): the rates exact mode plans with, on the test backend (cpu in CI; the
// cuda build of the same source runs on the GPU host) with one embedded CPU node. The paths alone
// and at once: the rates together are measured, never above the rates alone, and the planner
// splits by them while its combined limit stays the one of the rates alone.
#include "tandem/gpu_worker/exact_probe.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>

#include "../engine/engine_test_util.h"
#include "tandem/gpu_worker/exact_planner.h"
#include "tandem/gpu_worker/node_pool.h"

namespace tandem::gpu_worker {
namespace {

// Llama-3-8B's attention geometry (the probes size themselves by it; nothing model-sized is
// allocated: the options below keep every probe to a few MiB).
constexpr ExactGeometry kGeometry{32, 8, 128, 4096, 2, 2};

constexpr ExactProbeOptions kSmall{
    .pcie_bytes = 8 << 20, .device_kv_bytes = 2 << 20, .gemm_flops = 1e7, .node_bytes = 16 << 20};

std::unique_ptr<NodePool> OneNode() {
  NodePoolOptions nodes;
  nodes.embedded.pool_bytes = 128ull << 20;
  auto pool = NodePool::Create(nodes);
  return pool.ok() ? std::move(*pool) : nullptr;
}

TEST(ExactProbe, MeasuresThePathsAloneAndTogether) {
  TANDEM_SKIP_WITHOUT_BACKEND();
  std::string why;
  std::unique_ptr<Backend> backend = testing::MakeTestBackend(&why);
  ASSERT_NE(backend, nullptr) << why;
  std::unique_ptr<NodePool> pool = OneNode();
  ASSERT_NE(pool, nullptr);

  auto device = ProbeDeviceRates(*backend, kGeometry, DType::kBF16, kSmall);
  ASSERT_TRUE(device.ok()) << device.status();
  const double pcie_alone = device->pcie_bytes_per_second;
  ASSERT_GT(pcie_alone, 1e6);

  // Without the backend: the nodes alone only, and the rates alone stay unset (= together).
  ExactPathRates nodes_only = *device;
  ASSERT_TRUE(ProbeNodeRates(*pool, kGeometry, DType::kBF16, nodes_only, kSmall).ok());
  EXPECT_EQ(nodes_only.nodes, 1u);
  EXPECT_GT(nodes_only.node_bytes_per_second, 1e6);
  EXPECT_EQ(nodes_only.node_alone_bytes_per_second, 0.0);
  EXPECT_EQ(nodes_only.pcie_alone_bytes_per_second, 0.0);
  EXPECT_EQ(nodes_only.pcie_bytes_per_second, pcie_alone);

  // With it: both paths at once as well.
  ExactPathRates rates = *device;
  ASSERT_TRUE(ProbeNodeRates(*pool, kGeometry, DType::kBF16, rates, kSmall, backend.get()).ok());
  std::printf("probed on %s: %s\n", testing::TestBackendName(), FormatExactRates(rates).c_str());
  EXPECT_EQ(rates.nodes, 1u);
  EXPECT_EQ(rates.pcie_alone_bytes_per_second, pcie_alone);
  EXPECT_GT(rates.node_alone_bytes_per_second, 1e6);
  EXPECT_GT(rates.pcie_bytes_per_second, 1e6);
  EXPECT_GT(rates.node_bytes_per_second, 1e6);
  EXPECT_LE(rates.pcie_bytes_per_second, rates.pcie_alone_bytes_per_second);
  EXPECT_LE(rates.node_bytes_per_second, rates.node_alone_bytes_per_second);

  // The plan splits by the rates together and states the limit of the rates alone.
  const ExactPlan plan = PlanExactSplit(rates, kGeometry, 1 << 19);
  const double k = 32.0 * (1 << 19) * kGeometry.kv_row_bytes();
  const double pcie_path = std::min(rates.pcie_alone(), rates.device_attend_bytes_per_second);
  EXPECT_NEAR(plan.combined_limit_seconds, k / (pcie_path + rates.node_alone()),
              1e-9 * plan.combined_limit_seconds);
  EXPECT_GE(plan.step_seconds, plan.combined_limit_seconds * (1 - 1e-9));

  // The book probes the same way (its rates have both kinds).
  auto book = ExactRateBook::Measure(*backend, *pool, kGeometry, DType::kBF16, kSmall);
  ASSERT_TRUE(book.ok()) << book.status();
  EXPECT_GT((*book)->rates().pcie_alone_bytes_per_second, 0.0);
  EXPECT_GT((*book)->rates().node_alone_bytes_per_second, 0.0);
  // A session's measured node rate (an attend under the real load) replaces the probe's.
  (*book)->RecordNodeRate(3e9);
  EXPECT_EQ((*book)->rates().node_bytes_per_second, 3e9);
}

}  // namespace
}  // namespace tandem::gpu_worker
