// float8 e4m3fn conversions (tandem/common/f8e4m3.h) against the format's definition.
#include "tandem/common/f8e4m3.h"

#include <cmath>
#include <cstdint>

#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(F8E4M3, KnownCodesDecode) {
  EXPECT_EQ(F8E4M3ToFloat(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(F8E4M3ToFloat(0x80)));
  EXPECT_EQ(F8E4M3ToFloat(0x38), 1.0f);    // exponent 7 (bias), mantissa 0
  EXPECT_EQ(F8E4M3ToFloat(0x7e), 448.0f);  // the largest finite
  EXPECT_EQ(F8E4M3ToFloat(0xfe), -448.0f);
  EXPECT_EQ(F8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(F8E4M3ToFloat(0x08), std::ldexp(1.0f, -6));  // the smallest normal
  EXPECT_EQ(F8E4M3ToFloat(0x3c), 1.5f);
  EXPECT_TRUE(std::isnan(F8E4M3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(F8E4M3ToFloat(0xff)));
}

TEST(F8E4M3, EveryCodeRoundTripsAndValuesAreOrdered) {
  float previous = -1.0f;
  for (int code = 0; code < 0x7f; ++code) {  // the non-negative finite codes, ascending
    const float v = F8E4M3ToFloat(static_cast<f8e4m3_t>(code));
    EXPECT_GT(v, previous) << code;
    previous = v;
    EXPECT_EQ(FloatToF8E4M3(v), code) << v;
    EXPECT_EQ(FloatToF8E4M3(-v), code == 0 ? 0x80 : (code | 0x80)) << -v;
  }
}

TEST(F8E4M3, RoundsToNearestEvenAndSaturates) {
  // Between 1 (0x38) and 1.125 (0x39): below, at and above the midpoint.
  EXPECT_EQ(FloatToF8E4M3(1.06f), 0x38);
  EXPECT_EQ(FloatToF8E4M3(1.0625f), 0x38);  // tie: to the even mantissa (0)
  EXPECT_EQ(FloatToF8E4M3(1.07f), 0x39);
  EXPECT_EQ(FloatToF8E4M3(1.1875f), 0x3a);  // tie between 0x39 and 0x3a: even (0x3a)
  EXPECT_EQ(FloatToF8E4M3(15.5f), 0x58);    // tie into the next binade: 16 (mantissa 0)
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal: tie to 0
  EXPECT_EQ(FloatToF8E4M3(std::ldexp(3.0f, -11)), 0x01);  // 0.75 of it: up
  EXPECT_EQ(FloatToF8E4M3(1e6f), 0x7e);
  EXPECT_EQ(FloatToF8E4M3(-1e6f), 0xfe);
  EXPECT_EQ(FloatToF8E4M3(INFINITY), 0x7e);
  EXPECT_EQ(FloatToF8E4M3(464.0f), 0x7e);  // above 448: saturates rather than becoming NaN
  EXPECT_EQ(FloatToF8E4M3(std::nanf("")), 0x7f);
}

}  // namespace
}  // namespace tandem
