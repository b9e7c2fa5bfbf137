// binary16 -> float (tandem/common/f16.h) against the format's definition.
#include "tandem/common/f16.h"

#include <cmath>
#include <cstdint>

#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(F16, KnownCodesDecode) {
  EXPECT_EQ(F16ToFloat(0x0000), 0.0f);
  EXPECT_TRUE(std::signbit(F16ToFloat(0x8000)));
  EXPECT_EQ(F16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(F16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(F16ToFloat(0x3555), 0x1.554p-2f);
  EXPECT_EQ(F16ToFloat(0x7bff), 65504.0f);               // the largest finite
  EXPECT_EQ(F16ToFloat(0x0400), std::ldexp(1.0f, -14));  // the smallest normal
  EXPECT_EQ(F16ToFloat(0x0001), std::ldexp(1.0f, -24));  // the smallest subnormal
  EXPECT_EQ(F16ToFloat(0x83ff), -std::ldexp(1023.0f, -24));
  EXPECT_EQ(F16ToFloat(0x7c00), INFINITY);
  EXPECT_EQ(F16ToFloat(0xfc00), -INFINITY);
  EXPECT_TRUE(std::isnan(F16ToFloat(0x7e00)));
  EXPECT_TRUE(std::isnan(F16ToFloat(0xfc01)));
}

// Every finite code is (-1)^s · m · 2^(e-25) with the implicit bit for e > 0.
TEST(F16, EveryFiniteCodeIsItsDefinition) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint32_t e = (h >> 10) & 0x1f;
    if (e == 31) continue;
    const uint32_t m = h & 0x3ff;
    const float magnitude =
        e == 0 ? std::ldexp(static_cast<float>(m), -24)
               : std::ldexp(static_cast<float>(m + 1024), static_cast<int>(e) - 25);
    const float expected = (h & 0x8000) != 0 ? -magnitude : magnitude;
    ASSERT_EQ(F16ToFloat(static_cast<f16_t>(h)), expected) << h;
    ASSERT_EQ(std::signbit(F16ToFloat(static_cast<f16_t>(h))), (h & 0x8000) != 0) << h;
  }
}

}  // namespace
}  // namespace tandem
