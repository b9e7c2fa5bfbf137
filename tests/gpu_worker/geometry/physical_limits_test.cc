// The physical-limit probes on the backend under test (small buffers: the rates must be positive
// and finite, the concurrent ones no faster than physics allows), and ComputeLimit against
// hand-computed values.
#include "physical_limits.h"

#include <gtest/gtest.h>

#include <cmath>

#include "geometry_test_util.h"

namespace tandem::bench {
namespace {

bool PositiveFinite(double x) { return std::isfinite(x) && x > 0; }

TEST(PhysicalLimits, DeviceCopyBandwidthIsPositive) {
  TANDEM_GEO_BACKEND_OR_SKIP(backend);
  absl::StatusOr<double> rate = MeasureDeviceCopyBandwidth(*backend, {64 << 20, 3});
  ASSERT_TRUE(rate.ok()) << rate.status();
  EXPECT_TRUE(PositiveFinite(*rate)) << *rate;
  // No memory system moves 100 TB/s: a rate above it means the copy was not timed.
  EXPECT_LT(*rate, 1e14);
  std::printf("%s device copy: %.1f GB/s (read + write)\n", std::string(backend->name()).c_str(),
              *rate / 1e9);
  EXPECT_EQ(backend->bytes_in_use(), 0u) << "the probe frees its buffers";
}

TEST(PhysicalLimits, UploadBandwidthIsPositive) {
  TANDEM_GEO_BACKEND_OR_SKIP(backend);
  absl::StatusOr<UploadRates> r = MeasureUploadBandwidth(*backend, {32 << 20, 3});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(PositiveFinite(r->h2d_bytes_per_s));
  EXPECT_TRUE(PositiveFinite(r->d2h_bytes_per_s));
  EXPECT_TRUE(PositiveFinite(r->h2d_with_d2h_bytes_per_s));
  EXPECT_TRUE(PositiveFinite(r->d2h_with_h2d_bytes_per_s));
  EXPECT_LT(r->h2d_bytes_per_s, 1e14);
  std::printf("%s upload: h2d %.2f GB/s, d2h %.2f GB/s, concurrent h2d %.2f + d2h %.2f GB/s\n",
              std::string(backend->name()).c_str(), r->h2d_bytes_per_s / 1e9,
              r->d2h_bytes_per_s / 1e9, r->h2d_with_d2h_bytes_per_s / 1e9,
              r->d2h_with_h2d_bytes_per_s / 1e9);
}

TEST(PhysicalLimits, CpuScanRateIsPositive) {
  CpuScanOptions o;
  o.kv_bytes = 64 << 20;
  o.reps = 3;
  absl::StatusOr<CpuScanRates> r = MeasureCpuScanRate(2, o);
  ASSERT_TRUE(r.ok()) << r.status();
  // 64 MiB of K + V over 8 heads of 128 bf16 values: 64 MiB / (8 · 2 · 256 B) entries per head.
  EXPECT_EQ(r->entries_per_head, 16384u);
  EXPECT_TRUE(PositiveFinite(r->scan_bytes_per_s));
  EXPECT_TRUE(PositiveFinite(r->read_bytes_per_s));
  EXPECT_LT(r->read_bytes_per_s, 1e14);
  std::printf("cpu scan: %.2f GB/s of KV, plain read %.2f GB/s (2 threads)\n",
              r->scan_bytes_per_s / 1e9, r->read_bytes_per_s / 1e9);
}

TEST(PhysicalLimits, ProbesRejectBadOptions) {
  TANDEM_GEO_BACKEND_OR_SKIP(backend);
  EXPECT_EQ(MeasureDeviceCopyBandwidth(*backend, {0, 3}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MeasureUploadBandwidth(*backend, {1 << 20, 0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  CpuScanOptions o;
  o.kv_bytes = 100;  // less than one entry per head
  EXPECT_EQ(MeasureCpuScanRate(1, o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ComputeLimit, TakesTheLargestTerm) {
  const PhysicalLimits rates{
      .hbm_bytes_per_s = 3e12, .cpu_scan_bytes_per_s = 2e11, .pcie_bytes_per_s = 5e10};
  // 16 GB of weights: 16e9 / 3e12 = 5.333 ms; 1 GB of KV: 1e9 / 2e11 = 5 ms;
  // 0.1 GB over PCIe: 1e8 / 5e10 = 2 ms.
  absl::StatusOr<Limit> l = ComputeLimit(rates, {16e9, 1e9, 1e8});
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_DOUBLE_EQ(l->hbm_seconds, 16e9 / 3e12);
  EXPECT_DOUBLE_EQ(l->cpu_scan_seconds, 5e-3);
  EXPECT_DOUBLE_EQ(l->pcie_seconds, 2e-3);
  EXPECT_DOUBLE_EQ(l->seconds, 16e9 / 3e12);
  EXPECT_EQ(l->bound, LimitTerm::kHbm);
  EXPECT_EQ(LimitTermName(l->bound), "hbm");

  l = ComputeLimit(rates, {16e9, 2e9, 1e8});  // 10 ms of CPU scan
  ASSERT_TRUE(l.ok());
  EXPECT_DOUBLE_EQ(l->seconds, 1e-2);
  EXPECT_EQ(l->bound, LimitTerm::kCpuScan);

  l = ComputeLimit(rates, {1e9, 1e9, 1e9});  // 20 ms over PCIe
  ASSERT_TRUE(l.ok());
  EXPECT_DOUBLE_EQ(l->seconds, 2e-2);
  EXPECT_EQ(l->bound, LimitTerm::kPcie);
  EXPECT_EQ(LimitTermName(l->bound), "pcie");
}

TEST(ComputeLimit, ZeroTrafficNeedsNoRate) {
  // A gpu-only step: no CPU scan and no PCIe traffic, those rates unmeasured (0).
  absl::StatusOr<Limit> l = ComputeLimit({.hbm_bytes_per_s = 2e12}, {4e9, 0, 0});
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_DOUBLE_EQ(l->seconds, 2e-3);
  EXPECT_EQ(l->cpu_scan_seconds, 0.0);
  EXPECT_EQ(l->bound, LimitTerm::kHbm);
}

TEST(ComputeLimit, RejectsBadInputs) {
  const PhysicalLimits rates{1e12, 1e11, 1e10};
  EXPECT_EQ(ComputeLimit(rates, {-1, 0, 0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeLimit(rates, {NAN, 0, 0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeLimit({1e12, 0, 1e10}, {1, 1, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ComputeLimit({1e12, INFINITY, 1e10}, {1, 1, 1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::bench
