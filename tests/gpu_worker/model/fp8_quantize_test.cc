// QuantizeFp8PerRow (fp8_quantize.h) against the plain computation of its contract: per row,
// scale = max |w| / 448, and every code decodes within half an e4m3 ulp of w / scale (and is
// exactly FloatToF8E4M3 of it); the row's largest magnitude gets ±448; zero rows get scale 1;
// NaN or inf is INVALID_ARGUMENT naming the tensor, row and column. f32, bf16 and f16 inputs,
// small (one thread) and large (rows split over threads) matrices.
#include "tandem/gpu_worker/fp8_quantize.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tandem/common/bf16.h"
#include "tandem/common/f16.h"
#include "tandem/common/f8e4m3.h"

namespace tandem::gpu_worker {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// A matrix in one float dtype: its bytes, and its values as floats (exactly: each value is
// representable in the dtype).
struct Matrix {
  DType dtype = DType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<char> bytes;
  std::vector<float> values;

  TensorView View(const std::string& name) const {
    return TensorView{name, dtype, {rows, cols}, bytes.data(), bytes.size()};
  }
  // Sets element (r, c) to the dtype's value nearest `v` (for f16, v must be one: the tests only
  // put 0, ±inf and NaN through this path).
  void Set(int64_t r, int64_t c, float v) {
    const size_t i = static_cast<size_t>(r * cols + c);
    if (dtype == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    } else {
      uint16_t h;
      if (dtype == DType::kBF16) {
        h = FloatToBf16(v);
      } else {
        h = std::isnan(v) ? 0x7e00 : std::isinf(v) ? (v > 0 ? 0x7c00 : 0xfc00) : 0x0000;
      }
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
    values[i] = Decode(i);
  }
  // Flips the sign of element (r, c).
  void Negate(int64_t r, int64_t c) {
    const size_t i = static_cast<size_t>(r * cols + c);
    const size_t top = (i + 1) * DTypeBytes(dtype) - 1;  // little-endian: the sign byte
    bytes[top] = static_cast<char>(bytes[top] ^ 0x80);
    values[i] = Decode(i);
  }
  float Decode(size_t i) const {
    if (dtype == DType::kF32) {
      float v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      return v;
    }
    uint16_t h;
    std::memcpy(&h, bytes.data() + 2 * i, 2);
    return dtype == DType::kBF16 ? Bf16ToFloat(h) : F16ToFloat(h);
  }
};

// Random finite values, each row on its own scale (10^-30 .. 10^30 for f32 and bf16; f16's own
// range, subnormals included, for f16) so that rows' scales differ wildly.
Matrix RandomMatrix(DType dtype, int64_t rows, int64_t cols, uint32_t seed) {
  Matrix m{dtype, rows, cols,
           std::vector<char>(static_cast<size_t>(rows * cols) * DTypeBytes(dtype)),
           std::vector<float>(static_cast<size_t>(rows * cols))};
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> decade(-30, 30);
  std::uniform_int_distribution<int> f16_exponent(0, 30);
  std::uniform_int_distribution<int> f16_bits(0, 0x3ff);
  for (int64_t r = 0; r < rows; ++r) {
    const float row_scale = std::pow(10.0f, static_cast<float>(decade(rng)));
    const int top_exponent = f16_exponent(rng);
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = static_cast<size_t>(r * cols + c);
      if (dtype == DType::kF16) {
        const uint16_t h = static_cast<uint16_t>(
            (rng() & 0x8000u) |
            (static_cast<uint32_t>(std::uniform_int_distribution<int>(0, top_exponent)(rng))
             << 10) |
            static_cast<uint32_t>(f16_bits(rng)));
        std::memcpy(m.bytes.data() + 2 * i, &h, 2);
      } else if (dtype == DType::kBF16) {
        const uint16_t h = FloatToBf16(unit(rng) * row_scale);
        std::memcpy(m.bytes.data() + 2 * i, &h, 2);
      } else {
        const float v = unit(rng) * row_scale;
        std::memcpy(m.bytes.data() + 4 * i, &v, 4);
      }
      m.values[i] = m.Decode(i);
    }
  }
  return m;
}

// Half the spacing of e4m3 values around |x| (|x| <= 448): 2^(e-4) in the binade [2^e, 2^(e+1))
// for e >= -6, 2^-10 among the subnormals.
double HalfUlp(double x) {
  const double a = std::fabs(x);
  const int e = a < 0x1p-6 ? -6 : static_cast<int>(std::floor(std::log2(a)));
  return std::ldexp(1.0, std::max(e, -6) - 4);
}

// The contract, checked element by element against the plain computation.
void ExpectQuantizedPerContract(const Matrix& m, const std::vector<f8e4m3_t>& codes,
                                const std::vector<float>& scales) {
  for (int64_t r = 0; r < m.rows; ++r) {
    float absmax = 0.0f;
    int64_t argmax = 0;
    for (int64_t c = 0; c < m.cols; ++c) {
      const float a = std::fabs(m.values[static_cast<size_t>(r * m.cols + c)]);
      if (a > absmax) {
        absmax = a;
        argmax = c;
      }
    }
    const float expected_scale = absmax / 448.0f > 0.0f ? absmax / 448.0f : 1.0f;
    ASSERT_EQ(scales[static_cast<size_t>(r)], expected_scale) << "row " << r;
    for (int64_t c = 0; c < m.cols; ++c) {
      const size_t i = static_cast<size_t>(r * m.cols + c);
      const float x = m.values[i] / expected_scale;
      ASSERT_EQ(codes[i], FloatToF8E4M3(x)) << "row " << r << " column " << c;
      const double decoded = F8E4M3ToFloat(codes[i]);
      ASSERT_LE(std::fabs(decoded - x), HalfUlp(x)) << "row " << r << " column " << c << " x " << x;
      ASSERT_EQ(std::signbit(decoded), std::signbit(m.values[i])) << "row " << r;
    }
    if (absmax / 448.0f > 0.0f) {
      const size_t i = static_cast<size_t>(r * m.cols + argmax);
      EXPECT_EQ(codes[i], m.values[i] > 0 ? 0x7e : 0xfe) << "row " << r << ": absmax -> ±448";
    }
  }
}

class Fp8QuantizeTest : public ::testing::TestWithParam<DType> {};

TEST_P(Fp8QuantizeTest, EveryCodeIsWithinHalfAnUlpAndTheAbsmaxIs448) {
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{37, 129}, {1024, 4096}}) {
    Matrix m = RandomMatrix(GetParam(), rows, cols, static_cast<uint32_t>(rows));
    // A zero row, a row of one ±value, a row whose max / 448 underflows to 0 (f32 only: those
    // magnitudes are subnormal floats), and a row holding -0 beside small values.
    for (int64_t c = 0; c < cols; ++c) {
      m.Set(1, c, 0.0f);
      if (c != 3) m.Set(2, c, 0.0f);
    }
    m.Negate(2, 3);
    if (GetParam() == DType::kF32) {
      for (int64_t c = 0; c < cols; ++c) m.Set(4, c, c % 2 == 0 ? 1e-44f : -1e-45f);
      m.Set(5, 0, -0.0f);
    }
    std::vector<f8e4m3_t> codes(static_cast<size_t>(rows * cols), 0xaa);
    std::vector<float> scales(static_cast<size_t>(rows), -1.0f);
    ASSERT_TRUE(QuantizeFp8PerRow(m.View("w"), codes.data(), scales.data()).ok());
    ExpectQuantizedPerContract(m, codes, scales);
    EXPECT_EQ(scales[1], 1.0f);  // the zero row
    for (int64_t c = 0; c < cols; ++c)
      EXPECT_EQ(F8E4M3ToFloat(codes[static_cast<size_t>(cols + c)]), 0.0f);
    if (GetParam() == DType::kF32) {
      EXPECT_EQ(scales[4], 1.0f);                             // 1e-44 / 448 is 0 in f32
      EXPECT_EQ(codes[static_cast<size_t>(5 * cols)], 0x80);  // -0 stays -0
    }
  }
}

TEST_P(Fp8QuantizeTest, NonFiniteWeightsAreRefusedByName) {
  const int64_t rows = 600, cols = 4096;  // large enough to be split over threads
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), INFINITY, -INFINITY}) {
    Matrix m = RandomMatrix(GetParam(), rows, cols, 7);
    m.Set(100, 77, bad);
    m.Set(500, 3, bad);  // another thread's rows: the first bad row is the one named
    std::vector<f8e4m3_t> codes(static_cast<size_t>(rows * cols));
    std::vector<float> scales(static_cast<size_t>(rows));
    const absl::Status s =
        QuantizeFp8PerRow(m.View("model.layers.3.mlp.up_proj.weight"), codes.data(), scales.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    const std::string what = std::isnan(bad) ? "NaN" : bad > 0 ? "holds inf" : "holds -inf";
    EXPECT_THAT(std::string(s.message()), AllOf(HasSubstr("\"model.layers.3.mlp.up_proj.weight\""),
                                                HasSubstr(what), HasSubstr("row 100, column 77")));
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, Fp8QuantizeTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

TEST(Fp8Quantize, RefusesWhatIsNotAFloatMatrix) {
  std::vector<char> bytes(64);
  f8e4m3_t codes[64];
  float scales[8];
  const TensorView fp8{"a.weight", DType::kF8E4M3, {8, 8}, bytes.data(), 64};
  const TensorView ints{"b.weight", DType::kI32, {4, 4}, bytes.data(), 64};
  const TensorView vector{"c.weight", DType::kF32, {16}, bytes.data(), 64};
  for (const TensorView* t : {&fp8, &ints, &vector}) {
    const absl::Status s = QuantizeFp8PerRow(*t, codes, scales);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << t->name;
    EXPECT_THAT(std::string(s.message()), HasSubstr("\"" + t->name + "\""));
  }
}

}  // namespace
}  // namespace tandem::gpu_worker
