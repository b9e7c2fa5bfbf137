// 2^x (tandem/common/exp2_approx.h): the scalar form against std::exp2, and the lane form
// against the scalar one, lane by lane, over the clamps, -inf and a dense sweep.
#include "tandem/common/exp2_approx.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

#pragma GCC diagnostic ignored "-Wpsabi"

namespace tandem {
namespace {

using V8 = float __attribute__((vector_size(32)));
using V4 = float __attribute__((vector_size(16)));

constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<float> Inputs() {
  std::vector<float> xs = {-kInf, -1e30f, -200.0f, -126.5f, -126.0f, -125.999f, -64.25f, -1.0f,
                           -0.5f, -1e-7f, 0.0f,   1e-7f,   0.5f,    1.0f,      31.7f,   126.9f,
                           127.0f, 127.5f, 1e30f};
  for (float x = -130.0f; x <= 130.0f; x += 0.0137f) xs.push_back(x);
  while (xs.size() % 8 != 0) xs.push_back(0.25f);
  return xs;
}

TEST(Exp2Approx, MatchesExp2WithinFourUlpAndClamps) {
  for (float x : Inputs()) {
    const float got = Exp2Approx(x);
    if (x < -126.0f) {
      EXPECT_EQ(got, 0.0f) << x;  // masked scores rely on exactly 0
    } else if (x > 127.0f) {
      EXPECT_EQ(got, std::exp2(127.0f)) << x;
    } else {
      const double want = std::exp2(static_cast<double>(x));
      EXPECT_NEAR(got, want, 4 * want * std::numeric_limits<float>::epsilon()) << x;
    }
  }
}

template <typename V>
void ExpectLanesMatchScalar() {
  constexpr size_t kLanes = sizeof(V) / sizeof(float);
  const std::vector<float> xs = Inputs();
  for (size_t i = 0; i < xs.size(); i += kLanes) {
    V v;
    std::memcpy(&v, xs.data() + i, sizeof(v));
    const V got = Exp2ApproxLanes(v);
    for (size_t l = 0; l < kLanes; ++l) {
      // Within one ulp: the two forms may contract their multiply-adds differently.
      const float want = Exp2Approx(xs[i + l]);
      EXPECT_NEAR(got[l], want, want * std::numeric_limits<float>::epsilon()) << xs[i + l];
      if (want == 0.0f) {
        EXPECT_EQ(got[l], 0.0f) << xs[i + l];
      }
    }
  }
}

TEST(Exp2Approx, LanesMatchTheScalarForm) {
  ExpectLanesMatchScalar<V8>();
  ExpectLanesMatchScalar<V4>();
}

TEST(Exp2Approx, NanStaysNan) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(Exp2Approx(nan)));
  const V4 got = Exp2ApproxLanes(V4{nan, 0.0f, nan, 1.0f});
  EXPECT_TRUE(std::isnan(got[0]));
  EXPECT_TRUE(std::isnan(got[2]));
  EXPECT_EQ(got[1], 1.0f);
  EXPECT_EQ(got[3], 2.0f);
}

}  // namespace
}  // namespace tandem
