// The cpu backend's Rope with a table per token (inv_freq_row_stride > 0, as dynamic NTK RoPE
// uses: each sequence's rows get frequencies for its own length) against the double-precision
// reference, and its checks of the stride.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "backend_reference.h"
#include "backend_test_util.h"

namespace tandem::gpu_worker {
namespace {

using testing::DeviceArrays;
using testing::MakeCpuBackend;
using testing::MaxAbsDiff;
using testing::RandomFloats;

TEST(CpuBackendRope, TablePerTokenMatchesReference) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  std::mt19937 rng(5);
  for (const int64_t head_dim : {8, 64, 128}) {
    const int64_t tokens = 5, heads = 2, stride = heads * head_dim;
    const int64_t half = head_dim / 2, table_stride = half + 3;  // padded table rows
    std::vector<float> x = RandomFloats(rng, tokens * stride, -2.0f, 2.0f);
    const std::vector<int32_t> positions = {0, 63, 64, 100, 4095};
    // Token t's base grows with t, as dynamic NTK's does with the sequence length.
    std::vector<float> inv_freq(tokens * table_stride, NAN);  // padding must not be read
    for (int64_t t = 0; t < tokens; ++t) {
      const double base = 10000.0 * (1 + t);
      for (int64_t i = 0; i < half; ++i) {
        inv_freq[t * table_stride + i] =
            static_cast<float>(1.0 / std::pow(base, 2.0 * i / head_dim));
      }
    }
    RopeParams p;
    p.row_stride = stride;
    p.inv_freq_row_stride = table_stride;
    p.attention_scaling = 1.125f;
    p.num_tokens = tokens;
    p.num_heads = heads;
    p.head_dim = head_dim;
    std::vector<float> expect = x;
    RopeParams ref = p;
    ref.x = expect.data();
    ref.positions = positions.data();
    ref.inv_freq = inv_freq.data();
    reference::Rope(ref);

    p.x = dev.Upload(x);
    p.positions = dev.Upload(positions);
    p.inv_freq = dev.Upload(inv_freq);
    TANDEM_ASSERT_OK(backend->Rope(p));
    EXPECT_LE(MaxAbsDiff(dev.Download(p.x, x.size()), expect), 2e-6) << "head_dim " << head_dim;

    RopeParams bad = p;
    bad.inv_freq_row_stride = half - 1;  // rows would overlap
    TANDEM_EXPECT_INVALID(backend->Rope(bad));
  }
}

}  // namespace
}  // namespace tandem::gpu_worker
