// UTF-8 repair and GPT-2's byte map (private helpers of the tokenizers).
#include "utf8.h"

#include <gtest/gtest.h>

#include <string>

#include "byte_level.h"

namespace tandem::gpu_worker::tokenizer_internal {
namespace {

constexpr char kFffd[] = "\xEF\xBF\xBD";

TEST(Utf8Test, ValidTextIsCopied) {
  const std::string text = "caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80";  // café 日本 😀
  EXPECT_TRUE(IsValidUtf8(text));
  EXPECT_EQ(ToValidUtf8(text), text);
}

TEST(Utf8Test, UnfinishedSequenceIsHeldBackUnlessFinal) {
  std::string out;
  // "a" then the first two of the three bytes of 日 (E6 97 A5).
  EXPECT_EQ(AppendValidUtf8("a\xE6\x97", /*final=*/false, &out), 1u);
  EXPECT_EQ(out, "a");
  out.clear();
  EXPECT_EQ(AppendValidUtf8("a\xE6\x97", /*final=*/true, &out), 3u);
  EXPECT_EQ(out, std::string("a") + kFffd);  // one maximal subpart, one U+FFFD
}

TEST(Utf8Test, InvalidBytesBecomeReplacementCharacters) {
  // Lone continuation byte.
  EXPECT_EQ(ToValidUtf8("a\x80z"), std::string("a") + kFffd + "z");
  // Overlong encoding of '/': C0 is never valid, AF is a lone continuation: two U+FFFD.
  EXPECT_EQ(ToValidUtf8("\xC0\xAF"), std::string(kFffd) + kFffd);
  // Encoded surrogate U+D800: ED must be followed by 80..9F, so ED, A0, 80 are three subparts.
  EXPECT_EQ(ToValidUtf8("\xED\xA0\x80"), std::string(kFffd) + kFffd + kFffd);
  // Truncated 3-byte sequence followed by ASCII: the subpart E6 97 is one U+FFFD.
  EXPECT_EQ(ToValidUtf8("\xE6\x97x"), std::string(kFffd) + "x");
  EXPECT_FALSE(IsValidUtf8("\xF5\x80\x80\x80"));
  // An invalid byte is written at once even when not final: it can never become valid.
  std::string out;
  EXPECT_EQ(AppendValidUtf8("\xFF", /*final=*/false, &out), 1u);
  EXPECT_EQ(out, kFffd);
}

TEST(Utf8Test, Gpt2ByteMap) {
  // GPT-2's bytes_to_unicode: printable bytes map to themselves, the 68 others to U+0100.. in
  // order: 0x00..0x20 -> U+0100..U+0120, 0x7F..0xA0 -> U+0121..U+0142, 0xAD -> U+0143.
  EXPECT_EQ(ByteToCodepoint('a'), static_cast<uint32_t>('a'));
  EXPECT_EQ(ByteToCodepoint(0xE9), 0xE9u);
  EXPECT_EQ(ByteToCodepoint(0x00), 0x100u);
  EXPECT_EQ(ByteToCodepoint('\n'), 0x10Au);  // "Ċ"
  EXPECT_EQ(ByteToCodepoint(' '), 0x120u);   // "Ġ"
  EXPECT_EQ(ByteToCodepoint(0x7F), 0x121u);
  EXPECT_EQ(ByteToCodepoint(0xAD), 0x143u);
  EXPECT_EQ(CodepointToByte(0x120), ' ');
  EXPECT_EQ(CodepointToByte(0x144), -1);
  for (int b = 0; b < 256; ++b) {
    EXPECT_EQ(CodepointToByte(ByteToCodepoint(static_cast<uint8_t>(b))), b);
  }
  std::string mapped;
  ByteLevelEncode(" caf\xC3\xA9\n", &mapped);
  EXPECT_EQ(mapped,
            "\xC4\xA0"
            "caf\xC3\x83\xC2\xA9\xC4\x8A");  // "ĠcafÃ©Ċ"
  EXPECT_EQ(ByteLevelDecode(mapped), " caf\xC3\xA9\n");
  // Characters outside the map (added tokens) are kept.
  EXPECT_EQ(ByteLevelDecode("<|x|> \xE2\x96\x81"), "<|x|> \xE2\x96\x81");
}

}  // namespace
}  // namespace tandem::gpu_worker::tokenizer_internal
