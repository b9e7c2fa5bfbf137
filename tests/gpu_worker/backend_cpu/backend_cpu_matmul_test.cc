// MatMul of the cpu backend against backend_reference.h over weight dtypes, m (decode, small,
// prefill-sized), bias and accumulate.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backend_reference.h"
#include "backend_test_util.h"

namespace tandem::gpu_worker {
namespace {

using testing::DeviceArrays;
using testing::MakeCpuBackend;
using testing::RandomFloats;

// Weights of `dtype` from f32 values, as raw bytes.
std::vector<uint8_t> EncodeWeights(const std::vector<float>& w, DType dtype) {
  std::vector<uint8_t> out(w.size() * DTypeBytes(dtype));
  for (size_t i = 0; i < w.size(); ++i) {
    if (dtype == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &w[i], 4);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? FloatToBf16(w[i]) : reference::FloatToF16(w[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

// Checks y = x·wᵀ (+bias) (+y0) within 1e-5 of Σ|terms| per element: f32 summation of k terms
// (blocked by oneDNN) stays far below that; a wrong rounding of x (e.g. bf16 weights without
// rounding x, or rounding x for f32 weights) shows up as ~1e-3 relative.
void RunCase(Backend& backend, DType dtype, int64_t m, int64_t n, int64_t k, bool bias,
             bool accumulate, uint32_t seed) {
  DeviceArrays dev(backend);
  std::mt19937 rng(seed);
  const std::vector<float> x = RandomFloats(rng, m * k, -1.0f, 1.0f);
  const std::vector<float> w = RandomFloats(rng, n * k, -1.0f, 1.0f);
  const std::vector<float> b = RandomFloats(rng, n, -1.0f, 1.0f);
  const std::vector<float> y0 = RandomFloats(rng, m * n, -4.0f, 4.0f);
  const std::vector<uint8_t> w_bytes = EncodeWeights(w, dtype);

  MatMulParams p;
  p.w_dtype = dtype;
  p.m = m;
  p.n = n;
  p.k = k;
  p.accumulate = accumulate;
  std::vector<float> expect = y0;
  MatMulParams ref = p;
  ref.x = x.data();
  ref.w = w_bytes.data();
  ref.bias = bias ? b.data() : nullptr;
  ref.y = expect.data();
  reference::MatMul(ref);

  p.x = dev.Upload(x);
  p.w = dev.Upload(w_bytes);
  p.bias = bias ? dev.Upload(b) : nullptr;
  p.y = dev.Upload(y0);
  TANDEM_ASSERT_OK(backend.MatMul(p));
  const std::vector<float> y = dev.Download(p.y, m * n);
  int failures = 0;
  for (int64_t i = 0; i < m && failures < 5; ++i) {
    for (int64_t j = 0; j < n && failures < 5; ++j) {
      double magnitude =
          (bias ? std::abs(b[j]) : 0.0) + (accumulate ? std::abs(y0[i * n + j]) : 0.0);
      for (int64_t c = 0; c < k; ++c) magnitude += std::abs(x[i * k + c] * w[j * k + c]);
      const double err = std::abs(static_cast<double>(y[i * n + j]) - expect[i * n + j]);
      if (!(err <= 1e-5 * magnitude + 1e-6)) {
        ++failures;
        ADD_FAILURE() << "y[" << i << "," << j << "] = " << y[i * n + j] << ", reference "
                      << expect[i * n + j] << " (error " << err << ")";
      }
    }
  }
}

using MatMulCase = std::tuple<DType, int64_t, bool, bool>;  // dtype, m, bias, accumulate

class MatMulTest : public ::testing::TestWithParam<MatMulCase> {};

TEST_P(MatMulTest, MatchesReference) {
  const auto [dtype, m, bias, accumulate] = GetParam();
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  RunCase(*backend, dtype, m, 96, 80, bias, accumulate, 11);
  RunCase(*backend, dtype, m, 257, 384, bias, accumulate, 12);  // odd n; parallel at m = 300
  // The same shape again: the cached primitive must serve new data.
  RunCase(*backend, dtype, m, 96, 80, bias, accumulate, 13);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MatMulTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values<int64_t>(1, 5, 300), ::testing::Bool(), ::testing::Bool()),
    [](const ::testing::TestParamInfo<MatMulCase>& info) {
      return absl::StrCat(std::string(DTypeName(std::get<0>(info.param))), "_m",
                          std::get<1>(info.param), std::get<2>(info.param) ? "_bias" : "",
                          std::get<3>(info.param) ? "_acc" : "");
    });

TEST(MatMulValidation, BadParamsAreInvalidArgument) {
  auto backend = MakeCpuBackend();
  ASSERT_NE(backend, nullptr);
  DeviceArrays dev(*backend);
  float* x = dev.Allocate<float>(64);
  float* w = dev.Allocate<float>(64);
  float* y = dev.Allocate<float>(64);
  MatMulParams p;
  p.x = x;
  p.w = w;
  p.y = y;
  p.m = 4;
  p.n = 4;
  p.k = 4;
  TANDEM_ASSERT_OK(backend->MatMul(p));
  MatMulParams bad = p;
  bad.w = nullptr;
  TANDEM_EXPECT_INVALID(backend->MatMul(bad));
  bad = p;
  bad.k = 0;
  TANDEM_EXPECT_INVALID(backend->MatMul(bad));
  bad = p;
  bad.m = -3;
  TANDEM_EXPECT_INVALID(backend->MatMul(bad));
  bad = p;
  bad.w_dtype = DType::kI32;
  TANDEM_EXPECT_INVALID(backend->MatMul(bad));
  bad = p;
  bad.y = x + 2;  // overlaps x
  TANDEM_EXPECT_INVALID(backend->MatMul(bad));
}

}  // namespace
}  // namespace tandem::gpu_worker
