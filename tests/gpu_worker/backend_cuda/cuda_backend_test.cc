// The cuda backend's memory functions and its non-attention ops against f64 references
// (cuda_test_util.h). Tolerances are stated per test; every test skips without a CUDA device.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cuda_test_util.h"
#include "gtest/gtest.h"
#include "tandem/common/f8e4m3.h"
#include "tandem/gpu_worker/backend.h"

namespace tandem::gpu_worker::cuda_test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

using CudaMemoryTest = CudaBackendFixture;

TEST_F(CudaMemoryTest, DescribesItself) {
  EXPECT_EQ(backend_->name(), "cuda");
  EXPECT_FALSE(backend_->device_description().empty());
}

TEST_F(CudaMemoryTest, AllocationAccounting) {
  const size_t before = backend_->bytes_in_use();
  {
    absl::StatusOr<DeviceBuffer> a = backend_->Allocate(1000);
    ASSERT_TRUE(a.ok()) << a.status();
    absl::StatusOr<DeviceBuffer> b = backend_->Allocate(3 << 20);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(backend_->bytes_in_use(), before + 1000 + (3 << 20));
    EXPECT_GE(backend_->peak_bytes_in_use(), before + 1000 + (3 << 20));
    EXPECT_EQ(a->bytes(), 1000u);
  }
  EXPECT_EQ(backend_->bytes_in_use(), before);
  EXPECT_GE(backend_->peak_bytes_in_use(), before + 1000 + (3 << 20));
}

TEST_F(CudaMemoryTest, OutOfMemoryIsResourceExhaustedAndRecoverable) {
  absl::StatusOr<DeviceBuffer> huge = backend_->Allocate(size_t{1} << 50);
  EXPECT_TRUE(absl::IsResourceExhausted(huge.status())) << huge.status();
  // The failed cudaMalloc must not poison later calls.
  const std::vector<float> values = RandomFloats(100, -1, 1, 1);
  DeviceBuffer buffer = Upload(values);
  EXPECT_EQ(Download<float>(buffer, values.size()), values);
  EXPECT_TRUE(backend_->Synchronize().ok());
}

TEST_F(CudaMemoryTest, ZeroByteAllocationIsARealBlock) {
  const size_t before = backend_->bytes_in_use();
  absl::StatusOr<DeviceBuffer> empty = backend_->Allocate(0);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_NE(empty->data(), nullptr);
  EXPECT_EQ(empty->bytes(), 0u);
  EXPECT_EQ(backend_->bytes_in_use(), before);
}

// Small copies go through pinned staging memory and return early; more than its 4 MiB of them
// in a row wraps it. Large copies go straight from pageable memory.
TEST_F(CudaMemoryTest, RoundTripsSmallAndLargeCopies) {
  constexpr size_t kChunk = 96 << 10;  // floats: 384 KiB > the staged-copy limit
  const std::vector<float> large = RandomFloats(kChunk, -5, 5, 2);
  DeviceBuffer large_buffer = Upload(large);
  EXPECT_EQ(Download<float>(large_buffer, large.size()), large);

  constexpr size_t kSmall = 30000;  // floats per small copy; 80 copies ≈ 9.6 MB
  constexpr int kCopies = 80;
  absl::StatusOr<DeviceBuffer> all = backend_->Allocate(kSmall * kCopies * sizeof(float));
  ASSERT_TRUE(all.ok()) << all.status();
  std::vector<float> expected;
  for (int c = 0; c < kCopies; ++c) {
    std::vector<float> chunk = RandomFloats(kSmall, -1, 1, 100 + c);
    ASSERT_TRUE(
        backend_->CopyToDevice(all->as<float>() + c * kSmall, chunk.data(), kSmall * sizeof(float))
            .ok());
    expected.insert(expected.end(), chunk.begin(), chunk.end());
    std::fill(chunk.begin(), chunk.end(), kNaN);  // the source may be reused at once
  }
  EXPECT_EQ(Download<float>(*all, expected.size()), expected);
}

TEST_F(CudaMemoryTest, CopyOnDeviceFillAndCopy2D) {
  const std::vector<float> values = RandomFloats(64 * 10, -1, 1, 3);
  DeviceBuffer src = Upload(values);
  DeviceBuffer dst = Filled(values.size(), 0.0f);
  ASSERT_TRUE(backend_->CopyOnDevice(dst.data(), src.data(), values.size() * sizeof(float)).ok());
  EXPECT_EQ(Download<float>(dst, values.size()), values);

  ASSERT_TRUE(backend_->Fill(dst.as<float>() + 5, 2.5f, 100).ok());
  std::vector<float> filled = Download<float>(dst, values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(filled[i], (i >= 5 && i < 105) ? 2.5f : values[i]) << i;
  }

  // Rows 2..7 of a [10, 64] matrix, columns 8..23, into a host matrix of pitch 20 floats.
  std::vector<float> host(6 * 20, -7.0f);
  ASSERT_TRUE(backend_
                  ->CopyToHost2D(host.data(), 20 * sizeof(float), src.as<float>() + 2 * 64 + 8,
                                 64 * sizeof(float), 16 * sizeof(float), 6)
                  .ok());
  for (int r = 0; r < 6; ++r) {
    for (int c = 0; c < 20; ++c) {
      EXPECT_EQ(host[r * 20 + c], c < 16 ? values[(r + 2) * 64 + 8 + c] : -7.0f) << r << "," << c;
    }
  }
  EXPECT_TRUE(absl::IsInvalidArgument(
      backend_->CopyToHost2D(host.data(), 4, src.data(), 64, 16, 2)));  // pitch < row

  // And back: the 6 packed rows into rows 1..6, columns 40..55, of the device matrix (pinned
  // host memory, as a parked cache's); every other element unchanged.
  auto pinned = backend_->AllocateHost(host.size() * sizeof(float));
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  std::copy(host.begin(), host.end(), pinned->as<float>());
  const std::vector<float> before = Download<float>(src, 10 * 64);
  ASSERT_TRUE(backend_
                  ->CopyToDevice2D(src.as<float>() + 1 * 64 + 40, 64 * sizeof(float),
                                   pinned->data(), 20 * sizeof(float), 16 * sizeof(float), 6)
                  .ok());
  const std::vector<float> after = Download<float>(src, 10 * 64);
  for (int r = 0; r < 10; ++r) {
    for (int c = 0; c < 64; ++c) {
      const bool written = r >= 1 && r < 7 && c >= 40 && c < 56;
      EXPECT_EQ(after[r * 64 + c], written ? host[(r - 1) * 20 + c - 40] : before[r * 64 + c])
          << r << "," << c;
    }
  }
  EXPECT_TRUE(absl::IsInvalidArgument(
      backend_->CopyToDevice2D(src.data(), 4, pinned->data(), 64, 16, 2)));  // pitch < row
}

// CopyToHostBatch: strided copies with one wait. Small batches land in the pinned staging behind
// uploads still queued there (the uploads' sources already reused), large ones copy one by one;
// either way each copy equals its CopyToHost2D and leaves the rest of its destination alone.
TEST_F(CudaMemoryTest, CopyToHostBatchEqualsItsCopies) {
  const std::vector<float> values = RandomFloats(64 * 10, -1, 1, 4);
  DeviceBuffer src = Upload(values);
  for (const size_t large_rows : {size_t{0}, size_t{1200}}) {
    // Queued staged uploads first: a fill of row 9 the downloads must see.
    std::vector<float> row9(64, 3.25f);
    ASSERT_TRUE(backend_->CopyToDevice(src.as<float>() + 9 * 64, row9.data(), 64 * 4).ok());
    std::fill(row9.begin(), row9.end(), kNaN);
    std::vector<float> expected = values;
    std::fill(expected.begin() + 9 * 64, expected.end(), 3.25f);
    // Copy a: rows 2..7, columns 8..23, pitch 20; copy b: row 9 packed; copy c (the large
    // case): `large_rows` rows of a big buffer, 384 KiB and more past the staging limit.
    std::vector<float> a(6 * 20, -7.0f), b(64, -7.0f);
    std::vector<float> big_values = RandomFloats(large_rows * 96, -2, 2, 5);
    DeviceBuffer big = Upload(big_values.empty() ? std::vector<float>{0.0f} : big_values);
    std::vector<float> c(big_values.size(), -7.0f);
    std::vector<HostCopy2D> copies = {
        {a.data(), 20 * 4, src.as<float>() + 2 * 64 + 8, 64 * 4, 16 * 4, 6},
        {nullptr, 0, nullptr, 0, 0, 0},   // empty: skipped
        {b.data(), 64 * 4, src.as<float>() + 9 * 64, 64 * 4, 64 * 4, 1},
        {c.data(), 96 * 4, big.data(), 96 * 4, 96 * 4, large_rows},
    };
    ASSERT_TRUE(backend_->CopyToHostBatch(copies.data(), copies.size()).ok());
    for (int r = 0; r < 6; ++r) {
      for (int col = 0; col < 20; ++col) {
        EXPECT_EQ(a[r * 20 + col], col < 16 ? expected[(r + 2) * 64 + 8 + col] : -7.0f)
            << large_rows << ": " << r << "," << col;
      }
    }
    EXPECT_EQ(b, std::vector<float>(64, 3.25f));
    EXPECT_EQ(c, big_values);
  }
  std::vector<float> host(64);
  HostCopy2D bad_pitch{host.data(), 4, src.data(), 64, 16, 2};
  HostCopy2D null_src{host.data(), 64, nullptr, 64, 16, 2};
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->CopyToHostBatch(&bad_pitch, 1)));
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->CopyToHostBatch(&null_src, 1)));
}

// WaitFence returns once the device has done the work issued before the fence: the host waits
// there for most of four 1 GiB fills' device time (they are queued in microseconds).
TEST_F(CudaMemoryTest, AFenceWaitsForTheWorkIssuedBeforeIt) {
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->FenceDevice(Backend::kDeviceFences)));
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->WaitFence(-1)));
  ASSERT_TRUE(backend_->WaitFence(1).ok());   // never set: nothing to wait for
  constexpr size_t kFloats = size_t{1} << 28;   // 1 GiB
  auto big = backend_->Allocate(kFloats * sizeof(float));
  ASSERT_TRUE(big.ok()) << big.status();
  ASSERT_TRUE(backend_->Synchronize().ok());
  ASSERT_TRUE(backend_->MarkDevice(0).ok());
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(backend_->Fill(big->as<float>(), 1.0f, kFloats).ok());
  ASSERT_TRUE(backend_->MarkDevice(1).ok());
  ASSERT_TRUE(backend_->FenceDevice(0).ok());
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(backend_->WaitFence(0).ok());
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto fills = backend_->DeviceSeconds(0, 1);
  ASSERT_TRUE(fills.ok()) << fills.status();
  EXPECT_GE(waited, 0.5 * *fills) << "waited " << waited << " s for " << *fills << " s of fills";
}

// Device marks time the work between them on the device: a large fill takes longer than none.
TEST_F(CudaMemoryTest, DeviceMarksTimeTheWorkBetweenThem) {
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->DeviceSeconds(0, 1).status()));  // never set
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->MarkDevice(Backend::kDeviceMarks)));
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->MarkDevice(-1)));
  constexpr size_t kFloats = size_t{1} << 28;   // 1 GiB
  auto big = backend_->Allocate(kFloats * sizeof(float));
  ASSERT_TRUE(big.ok()) << big.status();
  ASSERT_TRUE(backend_->MarkDevice(0).ok());
  ASSERT_TRUE(backend_->MarkDevice(1).ok());
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(backend_->Fill(big->as<float>(), 1.0f, kFloats).ok());
  ASSERT_TRUE(backend_->MarkDevice(2).ok());
  // DeviceSeconds waits for its marks: no Synchronize here.
  auto none = backend_->DeviceSeconds(0, 1);
  auto fills = backend_->DeviceSeconds(1, 2);
  auto backwards = backend_->DeviceSeconds(2, 1);
  ASSERT_TRUE(none.ok() && fills.ok() && backwards.ok()) << fills.status();
  EXPECT_GE(*none, 0.0);
  EXPECT_LT(*none, 1e-3);
  // 4 GiB written: at least ~0.3 ms on any current GPU, under 10 s on any.
  EXPECT_GT(*fills, 1e-4);
  EXPECT_LT(*fills, 10.0);
  EXPECT_DOUBLE_EQ(*backwards, -*fills);
}

TEST_F(CudaMemoryTest, RejectsBrokenContracts) {
  MatMulParams mm;
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->MatMul(mm)));
  DeviceBuffer x = Filled(64, 1.0f);
  DeviceBuffer y = Filled(64, 1.0f);
  mm = {.x = x.as<float>(),
        .w = x.data(),
        .w_dtype = DType::kI32,
        .y = y.as<float>(),
        .m = 1,
        .n = 8,
        .k = 8};
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->MatMul(mm)));
  mm.w_dtype = DType::kF32;
  mm.k = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->MatMul(mm)));

  WindowAttentionParams wa{.q = x.as<float>(),
                           .q_row_stride = 12,
                           .q_pos = x.as<int32_t>(),
                           .k_cache = y.data(),
                           .v_cache = y.data(),
                           .slot_pos = x.as<int32_t>(),
                           .num_slots = 2,
                           .capacity = 2,
                           .num_tokens = 1,
                           .num_q_heads = 1,
                           .num_kv_heads = 1,
                           .head_dim = 12,
                           .scale = 1.0f,
                           .o = y.as<float>(),
                           .lse = y.as<float>()};
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->WindowAttention(wa)));  // head_dim % 8
  wa.head_dim = 8;
  wa.q_row_stride = 8;
  wa.num_slots = 3;  // > capacity
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->WindowAttention(wa)));
  wa.num_slots = 2;
  wa.num_q_heads = 3;
  wa.num_kv_heads = 2;
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->WindowAttention(wa)));

  EXPECT_TRUE(absl::IsInvalidArgument(
      backend_->Sample({.logits = x.as<float>(), .vocab = 8, .uniform = 1.0f}).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->Sample({.logits = nullptr, .vocab = 8}).status()));
  EXPECT_TRUE(backend_->Synchronize().ok());
}

// ---- Embed / RmsNorm ---------------------------------------------------------------------------

class CudaEmbedTest : public CudaBackendFixture, public ::testing::WithParamInterface<DType> {};

// Exact: the conversion to f32 is exact.
TEST_P(CudaEmbedTest, GathersRowsAsF32) {
  const DType dtype = GetParam();
  constexpr int64_t kVocab = 300, kHidden = 384;
  const std::vector<float> table = RoundTo(RandomFloats(kVocab * kHidden, -2, 2, 4), dtype);
  DeviceBuffer table_buffer = Upload(EncodeAs(table, dtype));
  const std::vector<int32_t> ids = {0, 299, 17, 17, 150};
  DeviceBuffer ids_buffer = Upload(ids);
  DeviceBuffer out = Filled(ids.size() * kHidden, kNaN);
  ASSERT_TRUE(backend_
                  ->Embed({.ids = ids_buffer.as<int32_t>(),
                           .table = table_buffer.data(),
                           .table_dtype = dtype,
                           .out = out.as<float>(),
                           .num_tokens = static_cast<int64_t>(ids.size()),
                           .hidden = kHidden,
                           .vocab = kVocab})
                  .ok());
  const std::vector<float> got = Download<float>(out, ids.size() * kHidden);
  for (size_t t = 0; t < ids.size(); ++t) {
    for (int64_t i = 0; i < kHidden; ++i) {
      ASSERT_EQ(got[t * kHidden + i], table[ids[t] * kHidden + i]) << t << "," << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaEmbedTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16));

class CudaRmsNormTest : public CudaBackendFixture,
                        public ::testing::WithParamInterface<std::tuple<DType, int64_t, bool>> {};

// Relative 1e-5 (f32 sum of squares in a different order than the f64 reference).
TEST_P(CudaRmsNormTest, MatchesReference) {
  const auto [dtype, hidden, in_place] = GetParam();
  constexpr int64_t kTokens = 7;
  constexpr float kEps = 1e-5f;
  const std::vector<float> x = RandomFloats(kTokens * hidden, -3, 3, 5);
  const std::vector<float> weight = RoundTo(RandomFloats(hidden, 0.5f, 1.5f, 6), dtype);
  DeviceBuffer x_buffer = Upload(x);
  DeviceBuffer w_buffer = Upload(EncodeAs(weight, dtype));
  DeviceBuffer out = in_place ? DeviceBuffer() : Filled(x.size(), kNaN);
  float* out_ptr = in_place ? x_buffer.as<float>() : out.as<float>();
  ASSERT_TRUE(backend_
                  ->RmsNorm({.x = x_buffer.as<float>(),
                             .weight = w_buffer.data(),
                             .weight_dtype = dtype,
                             .out = out_ptr,
                             .num_tokens = kTokens,
                             .hidden = hidden,
                             .eps = kEps})
                  .ok());
  const std::vector<float> got = Download<float>(in_place ? x_buffer : out, x.size());
  for (int64_t t = 0; t < kTokens; ++t) {
    double sum_sq = 0.0;
    for (int64_t i = 0; i < hidden; ++i) sum_sq += double{x[t * hidden + i]} * x[t * hidden + i];
    const double inv = 1.0 / std::sqrt(sum_sq / hidden + kEps);
    for (int64_t i = 0; i < hidden; ++i) {
      const double ref = x[t * hidden + i] * inv * weight[i];
      ASSERT_NEAR(got[t * hidden + i], ref, 1e-5 * std::abs(ref) + 1e-6) << t << "," << i;
    }
  }
}

// Qwen3's q/k norms: 32 heads of 128 inside qkv rows of (32 + 2·8)·128 floats (and an odd-width
// case that takes the scalar kernel); the floats past the heads keep their values.
TEST_F(CudaBackendFixture, RmsNormOfEachHeadInAStridedRow) {
  struct Case {
    int64_t heads, head_dim, stride;
  };
  for (const Case& k : {Case{32, 128, 48 * 128}, Case{3, 18, 61}}) {
    constexpr int64_t kTokens = 5;
    constexpr float kEps = 1e-6f;
    const std::vector<float> x = RandomFloats(kTokens * k.stride, -3, 3, 7);
    const std::vector<float> weight =
        RoundTo(RandomFloats(k.head_dim, 0.5f, 1.5f, 8), DType::kBF16);
    DeviceBuffer x_buffer = Upload(x);
    DeviceBuffer w_buffer = Upload(EncodeAs(weight, DType::kBF16));
    ASSERT_TRUE(backend_
                    ->RmsNorm({.x = x_buffer.as<float>(),
                               .weight = w_buffer.data(),
                               .weight_dtype = DType::kBF16,
                               .out = x_buffer.as<float>(),
                               .num_tokens = kTokens,
                               .hidden = k.head_dim,
                               .eps = kEps,
                               .vectors_per_token = k.heads,
                               .token_stride = k.stride})
                    .ok());
    const std::vector<float> got = Download<float>(x_buffer, x.size());
    for (int64_t t = 0; t < kTokens; ++t) {
      for (int64_t h = 0; h < k.heads; ++h) {
        const int64_t o = t * k.stride + h * k.head_dim;
        double sum_sq = 0.0;
        for (int64_t i = 0; i < k.head_dim; ++i) sum_sq += double{x[o + i]} * x[o + i];
        const double inv = 1.0 / std::sqrt(sum_sq / k.head_dim + kEps);
        for (int64_t i = 0; i < k.head_dim; ++i) {
          const double ref = x[o + i] * inv * weight[i];
          ASSERT_NEAR(got[o + i], ref, 1e-5 * std::abs(ref) + 1e-6) << t << "," << h << "," << i;
        }
      }
      for (int64_t i = k.heads * k.head_dim; i < k.stride; ++i) {
        ASSERT_EQ(got[t * k.stride + i], x[t * k.stride + i]) << "untouched " << t << "," << i;
      }
    }
  }
  DeviceBuffer x_buffer = Upload(std::vector<float>(64, 1.0f));
  DeviceBuffer w_buffer = Upload(std::vector<float>(16, 1.0f));
  EXPECT_FALSE(backend_
                   ->RmsNorm({.x = x_buffer.as<float>(),
                              .weight = w_buffer.data(),
                              .out = x_buffer.as<float>(),
                              .num_tokens = 2,
                              .hidden = 16,
                              .vectors_per_token = 2,
                              .token_stride = 31})
                   .ok());
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaRmsNormTest,
    ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                       ::testing::Values(64, 384, 4096, 5000), ::testing::Bool()));

// ---- MatMul ------------------------------------------------------------------------------------

// The FP8 GEMM's operand for x (backend.h): each row quantized to e4m3 with scale absmax/448 (1
// where that is 0), as values (code·scale).
std::vector<double> QuantizedRows(const std::vector<float>& x, int64_t m, int64_t k) {
  std::vector<double> out(x.size());
  for (int64_t r = 0; r < m; ++r) {
    float amax = 0.0f;
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::abs(x[r * k + i]));
    const float scale = amax / 448.0f == 0.0f ? 1.0f : amax / 448.0f;
    for (int64_t i = 0; i < k; ++i) {
      out[r * k + i] = double{F8E4M3ToFloat(FloatToF8E4M3(x[r * k + i] / scale))} * scale;
    }
  }
  return out;
}

// FP8 weights against the product of their exact operands, with the residual add and a bias:
//   the GEMV (m <= 2, or m <= 4 with n <= 16384; k a multiple of 16): f32 x and codes, within
//     bf16 rounding: 2^-8 of Σ|x·w|;
//   the FP8 tensor-core GEMM (the other m on sm_90+, k a multiple of 16, n of 4): x quantized
//     per row like QuantizedRows, f32 sums: 2^-10 of Σ|x_q·w| (Hopper's FP8 MMA keeps fewer
//     accumulator bits between cuBLASLt's f32 promotions); 2500 rows at k = 14336 take two
//     tiles of the FP8 scratch;
//   dequantized bf16 slabs (k = 40, n = 1001, or a GPU before sm_90): 2^-8 of Σ|x·w|.
// Row 2 of the longer cases is all zeros and row 3 holds values so small that absmax/448
// underflows (both take scale 1).
TEST_F(CudaBackendFixture, Fp8MatMulMatchesItsExactOperands) {
  struct Case {
    int64_t m, n, k;
    bool accumulate, bias;
  };
  int major = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  for (const Case& c : {Case{1, 300, 4096, false, false}, Case{1, 77, 48, true, true},
                        Case{2, 300, 256, false, true}, Case{1, 9000, 64, true, true},
                        Case{3, 1000, 28672, true, false}, Case{4, 333, 512, false, true},
                        Case{3, 16400, 64, true, true}, Case{5, 1000, 28672, true, false},
                        Case{8, 336, 512, false, true}, Case{37, 9000, 4096, true, false},
                        Case{2500, 64, 14336, true, true}, Case{1, 50, 40, false, false},
                        Case{6, 1001, 64, true, true}}) {
    const bool gemv = c.k % 16 == 0 && (c.m <= 2 || (c.m <= 4 && c.n <= 16384));
    const bool gemm = !gemv && major >= 9 && c.k % 16 == 0 && c.n % 4 == 0;
    std::mt19937 rng(static_cast<uint32_t>(c.n + c.k));
    std::vector<uint8_t> codes(c.n * c.k);
    for (uint8_t& code : codes) {
      do {
        code = static_cast<uint8_t>(rng());
      } while ((code & 0x7f) == 0x7f);  // not NaN
    }
    std::vector<float> scale(c.n);
    for (float& s : scale) s = 0.001f + 0.01f * static_cast<float>(rng() % 1000) / 1000.0f;
    std::vector<float> x = RandomFloats(c.m * c.k, -1, 1, 7);
    if (c.m > 2) std::fill_n(x.begin() + 2 * c.k, c.k, 0.0f);  // an all-zero row (scale 1)
    if (c.m > 3) {
      for (int64_t i = 0; i < c.k; ++i) x[3 * c.k + i] = (i % 2 ? 1e-44f : -3e-44f);
    }
    const std::vector<double> operand =
        gemm ? QuantizedRows(x, c.m, c.k) : std::vector<double>(x.begin(), x.end());
    const std::vector<float> bias = RandomFloats(c.n, -1, 1, 9);
    const std::vector<float> y0 = RandomFloats(c.m * c.n, -1, 1, 10);
    DeviceBuffer x_buffer = Upload(x);
    DeviceBuffer w_buffer = Upload(codes);
    DeviceBuffer scale_buffer = Upload(scale);
    DeviceBuffer bias_buffer = Upload(bias);
    DeviceBuffer y_buffer = c.accumulate ? Upload(y0) : Filled(y0.size(), kNaN);
    const absl::Status s = backend_->MatMul({.x = x_buffer.as<float>(),
                                             .w = w_buffer.data(),
                                             .w_dtype = DType::kF8E4M3,
                                             .w_scale = scale_buffer.as<float>(),
                                             .bias = c.bias ? bias_buffer.as<float>() : nullptr,
                                             .y = y_buffer.as<float>(),
                                             .m = c.m,
                                             .n = c.n,
                                             .k = c.k,
                                             .accumulate = c.accumulate});
    ASSERT_TRUE(s.ok()) << s;
    const std::vector<float> y = Download<float>(y_buffer, y0.size());
    // Rows sampled (all of them up to 64) so the long case stays quick.
    const int64_t row_step = std::max<int64_t>(1, c.m / 64);
    for (int64_t i = 0; i < c.m; i += row_step) {
      for (int64_t j = 0; j < c.n; ++j) {
        double ref = 0.0, magnitude = 0.0;
        for (int64_t l = 0; l < c.k; ++l) {
          const double prod = operand[i * c.k + l] * F8E4M3ToFloat(codes[j * c.k + l]) * scale[j];
          ref += prod;
          magnitude += std::abs(prod);
        }
        if (c.bias) ref += bias[j];
        if (c.accumulate) ref += y0[i * c.n + j];
        ASSERT_NEAR(y[i * c.n + j], ref, std::ldexp(magnitude, gemm ? -10 : -8) + 1e-5)
            << "m " << c.m << " n " << c.n << " k " << c.k << " at " << i << "," << j;
      }
    }
  }
  // A scale is required with FP8 weights and refused with others.
  DeviceBuffer x_buffer = Upload(std::vector<float>(16, 1.0f));
  DeviceBuffer w_buffer = Upload(std::vector<uint8_t>(16, 0x38));
  DeviceBuffer y_buffer = Filled(1, 0.0f);
  EXPECT_TRUE(absl::IsInvalidArgument(backend_->MatMul({.x = x_buffer.as<float>(),
                                                        .w = w_buffer.data(),
                                                        .w_dtype = DType::kF8E4M3,
                                                        .y = y_buffer.as<float>(),
                                                        .m = 1,
                                                        .n = 1,
                                                        .k = 16})));
}

struct MatMulCase {
  DType dtype;
  int64_t m, n, k;
  bool accumulate;
  bool bias;
};

class CudaMatMulTest : public CudaBackendFixture,
                       public ::testing::WithParamInterface<MatMulCase> {};

// x is rounded to the weight dtype like backend.h says, so the reference sees the same operands;
// only the f32 summation order differs: |y - ref| <= tol·Σ|x·w| with tol = 2e-5 for f32
// (no TF32) and 1e-4 for bf16/f16 (tensor-core f32 accumulation).
TEST_P(CudaMatMulTest, MatchesReference) {
  const MatMulCase c = GetParam();
  const std::vector<float> x = RandomFloats(c.m * c.k, -1, 1, 7);
  const std::vector<float> w = RoundTo(RandomFloats(c.n * c.k, -1, 1, 8), c.dtype);
  const std::vector<float> bias = RandomFloats(c.n, -1, 1, 9);
  const std::vector<float> y0 = RandomFloats(c.m * c.n, -1, 1, 10);
  DeviceBuffer x_buffer = Upload(x);
  DeviceBuffer w_buffer = Upload(EncodeAs(w, c.dtype));
  DeviceBuffer bias_buffer = Upload(bias);
  DeviceBuffer y_buffer = c.accumulate ? Upload(y0) : Filled(y0.size(), kNaN);
  ASSERT_TRUE(backend_
                  ->MatMul({.x = x_buffer.as<float>(),
                            .w = w_buffer.data(),
                            .w_dtype = c.dtype,
                            .bias = c.bias ? bias_buffer.as<float>() : nullptr,
                            .y = y_buffer.as<float>(),
                            .m = c.m,
                            .n = c.n,
                            .k = c.k,
                            .accumulate = c.accumulate})
                  .ok());
  const std::vector<float> y = Download<float>(y_buffer, y0.size());
  const std::vector<float> xr = RoundTo(x, c.dtype);
  const double tol = c.dtype == DType::kF32 ? 2e-5 : 1e-4;
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < c.n; ++j) {
      double ref = 0.0;
      double magnitude = 0.0;
      for (int64_t l = 0; l < c.k; ++l) {
        const double prod = double{xr[i * c.k + l]} * w[j * c.k + l];
        ref += prod;
        magnitude += std::abs(prod);
      }
      if (c.bias) ref += bias[j];
      if (c.accumulate) ref += y0[i * c.n + j];
      ASSERT_NEAR(y[i * c.n + j], ref, tol * magnitude + 1e-6) << i << "," << j;
    }
  }
}

#ifdef TANDEM_TEST_HAVE_CPU_BACKEND
// Both backends on the same inputs: |y_cuda - y_cpu| <= 2·tol·Σ|x·w| (each is within tol of
// the f64 result).
TEST_P(CudaMatMulTest, MatchesCpuBackend) {
  const MatMulCase c = GetParam();
  absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateCpuBackend();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const std::vector<float> x = RandomFloats(c.m * c.k, -1, 1, 23);
  const std::vector<float> w = RoundTo(RandomFloats(c.n * c.k, -1, 1, 24), c.dtype);
  const std::vector<float> bias = RandomFloats(c.n, -1, 1, 25);
  const std::vector<float> y0 = RandomFloats(c.m * c.n, -1, 1, 26);
  std::vector<std::vector<float>> results;
  for (Backend* backend : {backend_.get(), cpu->get()}) {
    DeviceBuffer x_buffer = UploadTo(*backend, x);
    DeviceBuffer w_buffer = UploadTo(*backend, EncodeAs(w, c.dtype));
    DeviceBuffer bias_buffer = UploadTo(*backend, bias);
    DeviceBuffer y_buffer = UploadTo(*backend, y0);
    ASSERT_TRUE(backend
                    ->MatMul({.x = x_buffer.as<float>(),
                              .w = w_buffer.data(),
                              .w_dtype = c.dtype,
                              .bias = c.bias ? bias_buffer.as<float>() : nullptr,
                              .y = y_buffer.as<float>(),
                              .m = c.m,
                              .n = c.n,
                              .k = c.k,
                              .accumulate = c.accumulate})
                    .ok());
    results.push_back(DownloadFrom<float>(*backend, y_buffer, y0.size()));
  }
  const std::vector<float> xr = RoundTo(x, c.dtype);
  const double tol = c.dtype == DType::kF32 ? 2e-5 : 1e-4;
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < c.n; ++j) {
      double magnitude = 0.0;
      for (int64_t l = 0; l < c.k; ++l)
        magnitude += std::abs(double{xr[i * c.k + l]} * w[j * c.k + l]);
      ASSERT_NEAR(results[0][i * c.n + j], results[1][i * c.n + j], 2 * tol * magnitude + 1e-6)
          << i << "," << j;
    }
  }
}
#endif

std::vector<MatMulCase> MatMulCases() {
  std::vector<MatMulCase> cases;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    // m = 1 and 2 with k % 8 == 0 take the decode GEMV (gemv.cuh); k = 4104 leaves a partial
    // round of its unrolled loads; k = 1027 falls back to cuBLAS.
    for (int64_t m : {1, 2, 5, 300}) {
      for (auto [n, k] :
           {std::pair<int64_t, int64_t>{64, 64}, {1000, 384}, {384, 1027}, {130, 4104}}) {
        cases.push_back({dtype, m, n, k, false, false});
        cases.push_back({dtype, m, n, k, true, m != 5});
      }
    }
  }
  return cases;
}

std::string MatMulName(const ::testing::TestParamInfo<MatMulCase>& info) {
  const MatMulCase& c = info.param;
  const std::string_view dtype = DTypeName(c.dtype);
  return absl::StrCat(absl::string_view(dtype.data(), dtype.size()), "_m", c.m, "_n", c.n, "_k",
                      c.k, c.accumulate ? "_acc" : "", c.bias ? "_bias" : "");
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaMatMulTest, ::testing::ValuesIn(MatMulCases()), MatMulName);

// ---- Rope / SwiGlu / WriteKv ------------------------------------------------------------------

class CudaRopeTest : public CudaBackendFixture,
                     public ::testing::WithParamInterface<std::tuple<int64_t, float>> {};

// abs 2e-6 on |x| <= 1: both sides use the same f32 angle; only sin/cos rounding differs.
TEST_P(CudaRopeTest, RotatesHalves) {
  const auto [head_dim, scaling] = GetParam();
  constexpr int64_t kTokens = 6, kHeads = 10;  // the kernel's head blocks: 4 + 4 + 2
  const int64_t stride = kHeads * head_dim + 5;
  std::vector<float> x = RandomFloats(kTokens * stride, -1, 1, 11);
  const std::vector<int32_t> positions = {0, 1, 7, 1000, 32767, 65535};
  std::vector<float> inv_freq(head_dim / 2);
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    inv_freq[i] = static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / head_dim));
  }
  DeviceBuffer x_buffer = Upload(x);
  DeviceBuffer pos_buffer = Upload(positions);
  DeviceBuffer freq_buffer = Upload(inv_freq);
  ASSERT_TRUE(backend_
                  ->Rope({.x = x_buffer.as<float>(),
                          .row_stride = stride,
                          .positions = pos_buffer.as<int32_t>(),
                          .inv_freq = freq_buffer.as<float>(),
                          .attention_scaling = scaling,
                          .num_tokens = kTokens,
                          .num_heads = kHeads,
                          .head_dim = head_dim})
                  .ok());
  const std::vector<float> got = Download<float>(x_buffer, x.size());
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t h = 0; h < kHeads; ++h) {
      const float* in = &x[t * stride + h * head_dim];
      const float* out = &got[t * stride + h * head_dim];
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(positions[t]) * inv_freq[i];
        const double c = std::cos(double{angle}) * scaling;
        const double s = std::sin(double{angle}) * scaling;
        ASSERT_NEAR(out[i], in[i] * c - in[i + half] * s, 2e-6) << t << "," << h << "," << i;
        ASSERT_NEAR(out[i + half], in[i + half] * c + in[i] * s, 2e-6);
      }
    }
    for (int64_t i = kHeads * head_dim; i < stride; ++i) {
      ASSERT_EQ(got[t * stride + i], x[t * stride + i]) << "padding changed";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(HeadDims, CudaRopeTest,
                         ::testing::Combine(::testing::Values(8, 64, 128),
                                            ::testing::Values(1.0f, 1.25f)));

using CudaElementwiseTest = CudaBackendFixture;

// Relative 1e-6 (expf vs exp).
TEST_F(CudaElementwiseTest, SwiGlu) {
  constexpr int64_t kTokens = 5, kFfn = 1000;
  const std::vector<float> gate_up = RandomFloats(kTokens * 2 * kFfn, -8, 8, 12);
  DeviceBuffer in = Upload(gate_up);
  DeviceBuffer out = Filled(kTokens * kFfn, kNaN);
  ASSERT_TRUE(backend_
                  ->SwiGlu({.gate_up = in.as<float>(),
                            .out = out.as<float>(),
                            .num_tokens = kTokens,
                            .ffn = kFfn})
                  .ok());
  const std::vector<float> got = Download<float>(out, kTokens * kFfn);
  for (int64_t t = 0; t < kTokens; ++t) {
    for (int64_t i = 0; i < kFfn; ++i) {
      const double g = gate_up[t * 2 * kFfn + i];
      const double ref = g / (1.0 + std::exp(-g)) * gate_up[t * 2 * kFfn + kFfn + i];
      ASSERT_NEAR(got[t * kFfn + i], ref, 1e-6 * std::abs(ref) + 1e-7) << t << "," << i;
    }
  }
}

class CudaWriteKvTest : public CudaBackendFixture,
                        public ::testing::WithParamInterface<std::tuple<DType, int64_t>> {};

// Exact: the bf16 rounding is round-to-nearest-even on both sides; other slots are untouched.
TEST_P(CudaWriteKvTest, WritesSlots) {
  const auto [dtype, head_dim] = GetParam();
  constexpr int64_t kTokens = 4, kKvHeads = 2, kCapacity = 50;
  const int64_t stride = 3 * kKvHeads * head_dim;  // k and v inside a fused qkv-like row
  const std::vector<float> rows = RandomFloats(kTokens * stride, -2, 2, 13);
  const std::vector<int32_t> slots = {3, 49, 0, 20};
  const std::vector<float> sentinel(kKvHeads * kCapacity * head_dim, 0.5f);
  DeviceBuffer rows_buffer = Upload(rows);
  DeviceBuffer slot_buffer = Upload(slots);
  DeviceBuffer k_cache = Upload(EncodeAs(sentinel, dtype));
  DeviceBuffer v_cache = Upload(EncodeAs(sentinel, dtype));
  const float* k = rows_buffer.as<float>() + kKvHeads * head_dim;
  const float* v = k + kKvHeads * head_dim;
  ASSERT_TRUE(backend_
                  ->WriteKv({.k = k,
                             .v = v,
                             .row_stride = stride,
                             .slots = slot_buffer.as<int32_t>(),
                             .k_cache = k_cache.data(),
                             .v_cache = v_cache.data(),
                             .cache_dtype = dtype,
                             .num_tokens = kTokens,
                             .num_kv_heads = kKvHeads,
                             .capacity = kCapacity,
                             .head_dim = head_dim})
                  .ok());
  const size_t bytes = sentinel.size() * DTypeBytes(dtype);
  for (int which = 0; which < 2; ++which) {
    std::vector<uint8_t> raw = Download<uint8_t>(which == 0 ? k_cache : v_cache, bytes);
    std::vector<float> expected = sentinel;
    for (int64_t t = 0; t < kTokens; ++t) {
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t d = 0; d < head_dim; ++d) {
          expected[(h * kCapacity + slots[t]) * head_dim + d] =
              rows[t * stride + (which + 1) * kKvHeads * head_dim + h * head_dim + d];
        }
      }
    }
    EXPECT_EQ(raw, EncodeAs(expected, dtype)) << (which == 0 ? "k" : "v");
  }
}

INSTANTIATE_TEST_SUITE_P(Caches, CudaWriteKvTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(8, 64, 128)));

// ---- MergeStates / TokenLogProbs / Sample ------------------------------------------------------

class CudaMergeTest : public CudaBackendFixture, public ::testing::WithParamInterface<int64_t> {};

// abs 1e-6 against the f64 merge; exact for the empty-side cases.
TEST_P(CudaMergeTest, MergesWithEmptyGuards) {
  const int64_t head_dim = GetParam();
  constexpr int64_t kRows = 40;
  std::vector<float> o_a = RandomFloats(kRows * head_dim, -1, 1, 14);
  std::vector<float> o_b = RandomFloats(kRows * head_dim, -1, 1, 15);
  std::vector<float> lse_a = RandomFloats(kRows, -5, 5, 16);
  std::vector<float> lse_b = RandomFloats(kRows, -5, 5, 17);
  for (int64_t r = 0; r < kRows; ++r) {  // rows cycle: both, a empty, b empty, both empty
    if (r % 4 == 1 || r % 4 == 3) lse_a[r] = -kInf;
    if (r % 4 == 2 || r % 4 == 3) lse_b[r] = -kInf;
    if (r % 4 == 3) std::fill_n(&o_a[r * head_dim], head_dim, 0.25f);  // must become 0
  }
  DeviceBuffer oa = Upload(o_a), ob = Upload(o_b), la = Upload(lse_a), lb = Upload(lse_b);
  ASSERT_TRUE(backend_
                  ->MergeStates({.o_dst = oa.as<float>(),
                                 .lse_dst = la.as<float>(),
                                 .o_src = ob.as<float>(),
                                 .lse_src = lb.as<float>(),
                                 .rows = kRows,
                                 .head_dim = head_dim})
                  .ok());
  const std::vector<float> o = Download<float>(oa, o_a.size());
  const std::vector<float> lse = Download<float>(la, kRows);
  for (int64_t r = 0; r < kRows; ++r) {
    const double a = lse_a[r], b = lse_b[r];
    double ref_lse;
    double wa = 0.0, wb = 0.0;
    if (r % 4 == 3) {
      ref_lse = -INFINITY;
    } else if (r % 4 == 1) {
      ref_lse = b;
      wb = 1.0;
    } else if (r % 4 == 2) {
      ref_lse = a;
      wa = 1.0;
    } else {
      const double m = std::max(a, b);
      ref_lse = m + std::log(std::exp(a - m) + std::exp(b - m));
      wa = std::exp(a - ref_lse);
      wb = std::exp(b - ref_lse);
    }
    if (std::isinf(ref_lse)) {
      EXPECT_EQ(lse[r], -kInf) << r;
    } else {
      EXPECT_NEAR(lse[r], ref_lse, 1e-6 * std::abs(ref_lse) + 1e-6) << r;
    }
    for (int64_t d = 0; d < head_dim; ++d) {
      const double ref = wa * o_a[r * head_dim + d] + wb * o_b[r * head_dim + d];
      ASSERT_NEAR(o[r * head_dim + d], ref, 1e-6) << r << "," << d;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(HeadDims, CudaMergeTest, ::testing::Values(8, 64, 128));

class CudaLogProbTest : public CudaBackendFixture, public ::testing::WithParamInterface<int64_t> {};

// abs 2e-5 (f32 log-sum-exp of up to 50k terms vs f64).
TEST_P(CudaLogProbTest, MatchesLogSoftmax) {
  const int64_t vocab = GetParam();
  constexpr int64_t kTokens = 5;
  std::vector<float> logits = RandomFloats(kTokens * vocab, -10, 10, 18);
  logits[2 * vocab + 7] = 40.0f;  // one dominant logit
  const std::vector<int32_t> targets = {0, static_cast<int32_t>(vocab - 1), 7, 3, 11};
  DeviceBuffer logit_buffer = Upload(logits);
  DeviceBuffer target_buffer = Upload(targets);
  DeviceBuffer out = Filled(kTokens, kNaN);
  ASSERT_TRUE(backend_
                  ->TokenLogProbs({.logits = logit_buffer.as<float>(),
                                   .targets = target_buffer.as<int32_t>(),
                                   .out = out.as<float>(),
                                   .num_tokens = kTokens,
                                   .vocab = vocab})
                  .ok());
  const std::vector<float> got = Download<float>(out, kTokens);
  for (int64_t t = 0; t < kTokens; ++t) {
    const float* row = &logits[t * vocab];
    const double m = *std::max_element(row, row + vocab);
    double sum = 0.0;
    for (int64_t i = 0; i < vocab; ++i) sum += std::exp(row[i] - m);
    EXPECT_NEAR(got[t], row[targets[t]] - m - std::log(sum), 2e-5) << t;
  }
}

INSTANTIATE_TEST_SUITE_P(Vocabs, CudaLogProbTest, ::testing::Values(512, 4096, 50000));

using CudaSampleTest = CudaBackendFixture;

TEST_F(CudaSampleTest, ArgmaxTakesLowestIndexAmongTies) {
  std::vector<float> logits = RandomFloats(50000, -5, 5, 19);
  logits[40000] = 9.0f;
  logits[31337] = 9.0f;
  logits[45000] = kNaN;
  DeviceBuffer buffer = Upload(logits);
  for (float temperature : {0.0f, -1.0f}) {
    absl::StatusOr<int32_t> id = backend_->Sample({.logits = buffer.as<float>(),
                                                   .vocab = 50000,
                                                   .temperature = temperature,
                                                   .uniform = 0.9f});
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_EQ(*id, 31337);
  }
}

// A +inf logit takes all the mass (the lowest such id); all -inf logits give the argmax, id 0.
TEST_F(CudaSampleTest, InfiniteLogits) {
  std::vector<float> logits = RandomFloats(4096, -5, 5, 22);
  logits[2000] = kInf;
  logits[777] = kInf;
  DeviceBuffer buffer = Upload(logits);
  std::vector<float> all_minus_inf(300, -kInf);
  DeviceBuffer minus_inf = Upload(all_minus_inf);
  for (float u : {0.0f, 0.5f, 0.999f}) {
    absl::StatusOr<int32_t> id = backend_->Sample({.logits = buffer.as<float>(),
                                                   .vocab = 4096,
                                                   .temperature = 1.0f,
                                                   .top_p = 0.9f,
                                                   .uniform = u});
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_EQ(*id, 777);
    id = backend_->Sample(
        {.logits = minus_inf.as<float>(), .vocab = 300, .temperature = 0.7f, .uniform = u});
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_EQ(*id, 0);
  }
}

struct SampleCase {
  int64_t vocab;
  float temperature;
  int32_t top_k;
  float top_p;
};

class CudaSampleDrawTest : public CudaBackendFixture,
                           public ::testing::WithParamInterface<SampleCase> {};

// Same id as the f64 reference for every draw not within 1e-6 of a boundary (those are skipped;
// at least 90% of the draws must count).
TEST_P(CudaSampleDrawTest, MatchesReference) {
  const SampleCase c = GetParam();
  const std::vector<float> logits = RandomFloats(c.vocab, -4, 4, 20 + c.top_k);
  DeviceBuffer buffer = Upload(logits);
  std::mt19937 rng(21);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  int compared = 0;
  constexpr int kDraws = 100;
  for (int i = 0; i < kDraws; ++i) {
    const float u = i == 0 ? 0.0f : std::min(uniform(rng), 0.99999f);
    const SampleReference ref = ReferenceSample(logits, c.temperature, c.top_k, c.top_p, u);
    absl::StatusOr<int32_t> id = backend_->Sample({.logits = buffer.as<float>(),
                                                   .vocab = c.vocab,
                                                   .temperature = c.temperature,
                                                   .top_k = c.top_k,
                                                   .top_p = c.top_p,
                                                   .uniform = u});
    ASSERT_TRUE(id.ok()) << id.status();
    if (!ref.unambiguous) continue;
    ++compared;
    EXPECT_EQ(*id, ref.id) << "uniform " << u;
  }
  EXPECT_GE(compared, kDraws * 9 / 10);
}

#ifdef TANDEM_TEST_HAVE_CPU_BACKEND
// Same id as the cpu backend for every draw the f64 reference calls unambiguous.
TEST_P(CudaSampleDrawTest, MatchesCpuBackend) {
  const SampleCase c = GetParam();
  absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateCpuBackend();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const std::vector<float> logits = RandomFloats(c.vocab, -4, 4, 27 + c.top_k);
  DeviceBuffer cuda_logits = Upload(logits);
  DeviceBuffer cpu_logits = UploadTo(**cpu, logits);
  std::mt19937 rng(28);
  std::uniform_real_distribution<float> uniform(0.0f, 0.99999f);
  for (int i = 0; i < 50; ++i) {
    const float u = uniform(rng);
    const SampleParams params{.vocab = c.vocab,
                              .temperature = c.temperature,
                              .top_k = c.top_k,
                              .top_p = c.top_p,
                              .uniform = u};
    SampleParams on_cuda = params;
    on_cuda.logits = cuda_logits.as<float>();
    SampleParams on_cpu = params;
    on_cpu.logits = cpu_logits.as<float>();
    absl::StatusOr<int32_t> got = backend_->Sample(on_cuda);
    absl::StatusOr<int32_t> want = (*cpu)->Sample(on_cpu);
    ASSERT_TRUE(got.ok() && want.ok()) << got.status() << " " << want.status();
    if (!ReferenceSample(logits, c.temperature, c.top_k, c.top_p, u).unambiguous) continue;
    EXPECT_EQ(*got, *want) << "uniform " << u;
  }
}
#endif

INSTANTIATE_TEST_SUITE_P(
    Settings, CudaSampleDrawTest,
    ::testing::Values(SampleCase{512, 1.0f, 0, 1.0f}, SampleCase{4096, 0.7f, 40, 1.0f},
                      SampleCase{4096, 1.0f, 0, 0.9f}, SampleCase{50000, 1.3f, 100, 0.8f},
                      SampleCase{50000, 0.8f, 1, 1.0f}, SampleCase{128256, 1.0f, 0, 0.95f}));

}  // namespace
}  // namespace tandem::gpu_worker::cuda_test
