// tandem::FormatBytes (people's byte counts) and ParseByteSize (flags), and that they agree.
#include "tandem/common/byte_size.h"

#include <cstdint>
#include <string>

#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(FormatBytesTest, UnitsAndRounding) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1024), "1.0 KiB");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(uint64_t{64} << 20), "64.0 MiB");
  EXPECT_EQ(FormatBytes(uint64_t{64} << 30), "64.0 GiB");
  EXPECT_EQ(FormatBytes((uint64_t{3} << 30) / 2), "1.5 GiB");
  EXPECT_EQ(FormatBytes(uint64_t{2} << 40), "2.0 TiB");
  // Llama-3.1-8B's bf16 weights: 16,060,522,496 bytes.
  EXPECT_EQ(FormatBytes(16060522496), "15.0 GiB");
  // Just under a unit rounds up into it rather than printing "1024.0 MiB".
  EXPECT_EQ(FormatBytes((uint64_t{1} << 30) - 1), "1.0 GiB");
  EXPECT_EQ(FormatBytes((uint64_t{1023} << 20) + (uint64_t{1} << 19)), "1023.5 MiB");
  EXPECT_EQ(FormatBytes(UINT64_MAX), "16.0 EiB");
}

TEST(FormatBytesTest, ParsesBackWithinATenth) {
  for (uint64_t bytes :
       {uint64_t{1} << 10, uint64_t{768} << 20, uint64_t{80} << 30, uint64_t{5} << 40}) {
    const std::string text = FormatBytes(bytes);
    uint64_t parsed = 0;
    std::string error;
    ASSERT_TRUE(ParseByteSize(text, &parsed, &error)) << text << ": " << error;
    EXPECT_EQ(parsed, bytes) << text;
  }
}

}  // namespace
}  // namespace tandem
