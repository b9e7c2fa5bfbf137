// float8 e4m3fn conversions (tandem/common/f8e4m3.h) against the format's definition.
#include "tandem/common/f8e4m3.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gtest/gtest.h"

namespace tandem {
namespace {

// The encoding by its definition: |f| rounded to a multiple of the e4m3 spacing at its binade
// (2^(e-3) for normals, 2^-9 for subnormals), ties to even, saturated at 448.
f8e4m3_t ReferenceEncode(float f) {
  if (std::isnan(f)) return 0x7f;
  const f8e4m3_t sign = std::signbit(f) ? 0x80 : 0x00;
  float a = std::fabs(f);
  if (a >= kF8E4M3Max) return sign | 0x7e;
  int e = 0;
  std::frexp(a, &e);  // a = m·2^e, m in [0.5, 1): the binade's exponent is e - 1
  const int step_exp = std::max(e - 1, -6) - 3;
  a = std::ldexp(std::nearbyint(std::ldexp(a, -step_exp)), step_exp);
  if (a >= kF8E4M3Max) return sign | 0x7e;
  if (a == 0.0f) return sign;
  std::frexp(a, &e);
  const int exponent = e - 1 + 7;  // biased
  if (exponent <= 0) return sign | static_cast<f8e4m3_t>(std::ldexp(a, 9));
  return sign |
         static_cast<f8e4m3_t>((exponent << 3) | (static_cast<int>(std::ldexp(a, 4 - e)) - 8));
}

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

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

// The bit-level encoder against the definition: every 251st float (all signs, binades, NaNs and
// infinities) and, around every e4m3 value and midpoint, the floats a few ulps either side (below
// 0: NaN bit patterns). (Run over all 2^32 floats once, it agreed on every one.)
TEST(F8E4M3, EncoderMatchesTheDefinition) {
  int64_t checked = 0;
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 251) {
    const float f = FromBits(static_cast<uint32_t>(bits));
    ASSERT_EQ(FloatToF8E4M3(f), ReferenceEncode(f)) << std::hexfloat << f;
    ++checked;
  }
  for (int code = 0; code < 0x7f; ++code) {
    const float v = F8E4M3ToFloat(static_cast<f8e4m3_t>(code));
    const float next = code + 1 < 0x7f ? F8E4M3ToFloat(static_cast<f8e4m3_t>(code + 1)) : 480.0f;
    for (const float centre : {v, (v + next) / 2}) {
      uint32_t c;
      std::memcpy(&c, &centre, sizeof(c));
      for (uint32_t d = 0; d < 5; ++d) {
        for (const uint32_t b : {c + d, c - d, (c + d) | 0x80000000u, (c - d) | 0x80000000u}) {
          const float f = FromBits(b);
          ASSERT_EQ(FloatToF8E4M3(f), ReferenceEncode(f)) << std::hexfloat << f;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 17000000);
}

}  // namespace
}  // namespace tandem
