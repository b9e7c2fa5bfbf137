// The decode GEMV (gemv.cuh) launched directly, every variant of kGemvVariants: bf16 and f16
// weights, m = 1 and 2, against a naive f64 reference of its numerics (x rounded to the weight
// dtype). Shapes cover one chunk per column, partial unroll rounds, odd n (a block's last
// columns past n), the down projection's k = 14336 and k past kGemvMaxK. The planning helpers
// (GemvVariantValid, GemvDefaultVariant, GemvPreferred) are host code and run without a GPU.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "convert.cuh"
#include "cuda_test_util.h"
#include "gemv.cuh"
#include "gtest/gtest.h"
#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker::cuda_test {
namespace {

using cuda_backend::GemvArgs;
using cuda_backend::GemvVariant;

TEST(GemvPlanTest, VariantsAndDefaults) {
  for (const GemvVariant& v : cuda_backend::kGemvVariants) {
    EXPECT_TRUE(cuda_backend::GemvVariantValid(v)) << v.warps_per_column << "x" << v.unroll;
  }
  EXPECT_FALSE(cuda_backend::GemvVariantValid({3, 4}));
  EXPECT_FALSE(cuda_backend::GemvVariantValid({1, 2}));
  EXPECT_FALSE(cuda_backend::GemvVariantValid({8, 8}));
  EXPECT_TRUE(cuda_backend::GemvVariantValid(cuda_backend::kGemvNarrowVariant));
  EXPECT_TRUE(cuda_backend::GemvVariantValid(cuda_backend::kGemvWideVariant));
  for (int64_t n : {int64_t{1}, int64_t{4096}, int64_t{6144}, cuda_backend::kGemvNarrowN}) {
    const GemvVariant v = cuda_backend::GemvDefaultVariant(n);
    EXPECT_EQ(v.warps_per_column, cuda_backend::kGemvNarrowVariant.warps_per_column) << n;
    EXPECT_EQ(v.unroll, cuda_backend::kGemvNarrowVariant.unroll) << n;
  }
  for (int64_t n : {cuda_backend::kGemvNarrowN + 1, int64_t{28672}, int64_t{128256}}) {
    const GemvVariant v = cuda_backend::GemvDefaultVariant(n);
    EXPECT_EQ(v.warps_per_column, cuda_backend::kGemvWideVariant.warps_per_column) << n;
    EXPECT_EQ(v.unroll, cuda_backend::kGemvWideVariant.unroll) << n;
  }
}

TEST(GemvPlanTest, SupportsAndPreferred) {
  alignas(16) static float x[16];
  alignas(16) static uint16_t w[16];
  float y[2];
  GemvArgs a{.x = x, .w = w, .w_dtype = DType::kBF16, .y = y, .m = 1, .n = 1, .k = 8};
  EXPECT_TRUE(cuda_backend::GemvSupports(a));
  EXPECT_TRUE(cuda_backend::GemvPreferred(a));
  a.k = 14336;  // the down projection
  EXPECT_TRUE(cuda_backend::GemvPreferred(a));
  a.k = cuda_backend::kGemvMaxK + 8;  // the kernel takes it; MatMul keeps cuBLAS
  EXPECT_TRUE(cuda_backend::GemvSupports(a));
  EXPECT_FALSE(cuda_backend::GemvPreferred(a));
  a.k = 8;
  a.m = 2;  // the kernel takes two rows; MatMul keeps cuBLAS (kGemvPreferredMaxRows)
  EXPECT_TRUE(cuda_backend::GemvSupports(a));
  EXPECT_FALSE(cuda_backend::GemvPreferred(a));
  a.m = 1;
  a.k = 12;  // not a multiple of 8
  EXPECT_FALSE(cuda_backend::GemvSupports(a));
  a.k = 8;
  a.m = 3;
  EXPECT_FALSE(cuda_backend::GemvSupports(a));
  a.m = 1;
  a.w_dtype = DType::kF32;
  EXPECT_FALSE(cuda_backend::GemvSupports(a));
  a.w_dtype = DType::kF16;
  a.x = x + 1;  // 4-byte aligned only
  EXPECT_FALSE(cuda_backend::GemvSupports(a));
  EXPECT_EQ(cuda_backend::LaunchGemv(a, nullptr), cudaErrorInvalidValue);
}

// MatMul's conversion of x (LaunchConvertFromF32): bf16 and f16, counts with and without a tail
// of count % 8, from 16-byte aligned buffers (8 values per thread) and from buffers one float in
// (one per thread); each value must equal the host's round-to-nearest-even, and the slot past
// the count stay unwritten.
class CudaConvertTest : public CudaBackendFixture {};

TEST_F(CudaConvertTest, RoundsEveryValueLikeTheHost) {
  for (const DType dtype : {DType::kBF16, DType::kF16}) {
    for (const int64_t count : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{1000003}}) {
      for (const int64_t offset : {int64_t{0}, int64_t{1}}) {
        std::vector<float> x = RandomFloats(count + offset, -3, 3, 50 + count);
        x[offset] = 1.0f + 1.0f / 256;  // a bf16 tie: rounds to even (1.0)
        DeviceBuffer src = Upload(x);
        DeviceBuffer dst = Upload(std::vector<uint16_t>(count + offset + 1, 0xFFFF));
        ASSERT_TRUE(backend_->Synchronize().ok());
        ASSERT_EQ(
            cuda_backend::LaunchConvertFromF32({.src = src.as<float>() + offset,
                                                .dst = static_cast<uint16_t*>(dst.data()) + offset,
                                                .dst_dtype = dtype,
                                                .count = count},
                                               nullptr),
            cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<uint16_t> got = Download<uint16_t>(dst, count + offset + 1);
        for (int64_t i = 0; i < count; ++i) {
          const float v = x[offset + i];
          const uint16_t want = dtype == DType::kBF16 ? FloatToBf16(v) : FloatToF16(v);
          ASSERT_EQ(got[offset + i], want) << DTypeName(dtype) << " count " << count << " offset "
                                           << offset << " value " << i << " = " << v;
        }
        EXPECT_EQ(got[offset + count], 0xFFFF) << "written past the count";
      }
    }
  }
}

// (dtype, variant index, m, n, k).
using GemvCase = std::tuple<DType, int, int64_t, int64_t, int64_t>;

class CudaGemvTest : public CudaBackendFixture, public ::testing::WithParamInterface<GemvCase> {};

// Tolerance: the reference's f64 sum of |x·w| times 1e-5 (f32 sums of up to 14336 products in a
// different order), plus 1e-6.
TEST_P(CudaGemvTest, MatchesReference) {
  const auto [dtype, variant_index, m, n, k] = GetParam();
  const GemvVariant variant = cuda_backend::kGemvVariants[variant_index];
  const std::vector<float> x = RandomFloats(m * k, -1, 1, 31);
  const std::vector<float> w = RoundTo(RandomFloats(n * k, -1, 1, 32), dtype);
  const std::vector<float> bias = RandomFloats(n, -1, 1, 33);
  const std::vector<float> y0 = RandomFloats(m * n, -1, 1, 34);
  const std::vector<float> xr = RoundTo(x, dtype);
  DeviceBuffer x_buffer = Upload(x);
  DeviceBuffer w_buffer = Upload(EncodeAs(w, dtype));
  DeviceBuffer bias_buffer = Upload(bias);
  for (const bool accumulate : {false, true}) {
    // Plain: y poisoned with NaN (every element must be written); accumulate: y0 + x·wᵀ + bias.
    DeviceBuffer y_buffer = accumulate ? Upload(y0) : Filled(m * n, std::nanf(""));
    const GemvArgs a{.x = x_buffer.as<float>(),
                     .w = w_buffer.data(),
                     .w_dtype = dtype,
                     .bias = accumulate ? bias_buffer.as<float>() : nullptr,
                     .y = y_buffer.as<float>(),
                     .m = m,
                     .n = n,
                     .k = k,
                     .accumulate = accumulate};
    ASSERT_TRUE(backend_->Synchronize().ok());
    ASSERT_EQ(cuda_backend::LaunchGemv(a, variant, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> got = Download<float>(y_buffer, m * n);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double sum = 0.0, magnitude = 0.0;
        for (int64_t l = 0; l < k; ++l) {
          const double p = double{xr[i * k + l]} * w[j * k + l];
          sum += p;
          magnitude += std::abs(p);
        }
        if (accumulate) sum += double{y0[i * n + j]} + bias[j];
        ASSERT_NEAR(got[i * n + j], sum, 1e-5 * magnitude + 1e-6)
            << "row " << i << " column " << j << (accumulate ? " accumulate" : "");
      }
    }
  }
}

std::vector<GemvCase> GemvCases() {
  std::vector<GemvCase> cases;
  constexpr int kVariants = std::size(cuda_backend::kGemvVariants);
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (int v = 0; v < kVariants; ++v) {
      for (int64_t m : {1, 2}) {
        // k = 8: one chunk; 264: a partial round for every unroll; 4104 and 14336: many rounds
        // (14336: the down projection); 16392: past kGemvMaxK. n = 1, 3, 7, 13: blocks of 8, 4
        // 2 or 1 columns, with columns past n.
        for (auto [n, k] : {std::pair<int64_t, int64_t>{1, 8}, {7, 264}, {13, 4104},
                            {3, 14336}, {5, 16392}, {64, 64}}) {
          cases.emplace_back(dtype, v, m, n, k);
        }
      }
    }
  }
  return cases;
}

std::string GemvName(const ::testing::TestParamInfo<GemvCase>& info) {
  const auto [dtype, v, m, n, k] = info.param;
  const GemvVariant variant = cuda_backend::kGemvVariants[v];
  return absl::StrCat(dtype == DType::kBF16 ? "bf16" : "f16", "_w", variant.warps_per_column,
                      "_u", variant.unroll, "_m", m, "_n", n, "_k", k);
}

INSTANTIATE_TEST_SUITE_P(Variants, CudaGemvTest, ::testing::ValuesIn(GemvCases()), GemvName);

}  // namespace
}  // namespace tandem::gpu_worker::cuda_test
