#include "byte_level.h"

#include <array>

#include "utf8.h"

namespace tandem::gpu_worker::tokenizer_internal {
namespace {

constexpr uint32_t kNumMappedCodepoints = 256 + 68;  // U+0000..U+0143

bool MapsToItself(int b) { return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174; }

struct Tables {
  std::array<uint32_t, 256> byte_to_cp;
  std::array<int16_t, kNumMappedCodepoints> cp_to_byte;
  std::array<std::string, 256> byte_to_utf8;

  Tables() {
    cp_to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      byte_to_cp[b] = MapsToItself(b) ? static_cast<uint32_t>(b) : next++;
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
      AppendUtf8(byte_to_cp[b], &byte_to_utf8[b]);
    }
  }
};

const Tables& GetTables() {
  static const Tables* const tables = new Tables();
  return *tables;
}

}  // namespace

uint32_t ByteToCodepoint(uint8_t byte) { return GetTables().byte_to_cp[byte]; }

int CodepointToByte(uint32_t cp) {
  return cp < kNumMappedCodepoints ? GetTables().cp_to_byte[cp] : -1;
}

void ByteLevelEncode(std::string_view bytes, std::string* dst) {
  const Tables& tables = GetTables();
  for (const char c : bytes) dst->append(tables.byte_to_utf8[static_cast<uint8_t>(c)]);
}

std::string ByteLevelDecode(std::string_view token) {
  std::string out;
  out.reserve(token.size());
  size_t pos = 0;
  while (pos < token.size()) {
    uint32_t cp = 0;
    const size_t len = DecodeUtf8(token, pos, &cp);
    if (len == 0) {  // ill-formed: keep the byte
      out.push_back(token[pos]);
      ++pos;
      continue;
    }
    const int byte = CodepointToByte(cp);
    if (byte >= 0) {
      out.push_back(static_cast<char>(byte));
    } else {
      out.append(token.substr(pos, len));
    }
    pos += len;
  }
  return out;
}

}  // namespace tandem::gpu_worker::tokenizer_internal
