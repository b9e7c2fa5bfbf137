// The cuda backend's Rope with a table per token (inv_freq_row_stride > 0, dynamic NTK RoPE)
// against the double-precision reference shared with the cpu backend tests (abs 2e-6 on
// |x| <= 1: the same f32 angles, only sin/cos rounding differs). Skipped without a device.
#include <cmath>
#include <cstdint>
#include <vector>

#include "backend_reference.h"
#include "cuda_test_util.h"
#include "gtest/gtest.h"

namespace tandem::gpu_worker::cuda_test {
namespace {

class CudaRopeRowsTest : public CudaBackendFixture,
                         public ::testing::WithParamInterface<int64_t> {};

TEST_P(CudaRopeRowsTest, TablePerTokenMatchesReference) {
  const int64_t head_dim = GetParam();
  constexpr int64_t kTokens = 5, kHeads = 3;
  const int64_t stride = kHeads * head_dim + 5;
  const int64_t half = head_dim / 2, table_stride = half + 3;
  std::vector<float> x = RandomFloats(kTokens * stride, -1, 1, 17);
  const std::vector<int32_t> positions = {0, 63, 64, 100, 65535};
  std::vector<float> inv_freq(kTokens * table_stride, NAN);  // padding must not be read
  for (int64_t t = 0; t < kTokens; ++t) {
    const double base = 10000.0 * (1 + t);
    for (int64_t i = 0; i < half; ++i) {
      inv_freq[t * table_stride + i] = static_cast<float>(1.0 / std::pow(base, 2.0 * i / head_dim));
    }
  }
  DeviceBuffer x_buffer = Upload(x);
  DeviceBuffer pos_buffer = Upload(positions);
  DeviceBuffer freq_buffer = Upload(inv_freq);
  RopeParams p{.x = x_buffer.as<float>(),
               .row_stride = stride,
               .positions = pos_buffer.as<int32_t>(),
               .inv_freq = freq_buffer.as<float>(),
               .inv_freq_row_stride = table_stride,
               .attention_scaling = 1.125f,
               .num_tokens = kTokens,
               .num_heads = kHeads,
               .head_dim = head_dim};
  ASSERT_TRUE(backend_->Rope(p).ok());
  const std::vector<float> got = Download<float>(x_buffer, x.size());

  std::vector<float> expect = x;
  RopeParams ref = p;
  ref.x = expect.data();
  ref.positions = positions.data();
  ref.inv_freq = inv_freq.data();
  reference::Rope(ref);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], expect[i], 2e-6) << i;

  RopeParams bad = p;
  bad.inv_freq_row_stride = half - 1;
  EXPECT_EQ(backend_->Rope(bad).code(), absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(HeadDims, CudaRopeRowsTest, ::testing::Values(8, 64, 128));

}  // namespace
}  // namespace tandem::gpu_worker::cuda_test
