#include "utf8.h"

namespace tandem::gpu_worker::tokenizer_internal {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// Length of the sequence that lead byte `b` starts (0 for a byte that cannot start one) and the
// allowed range of its first continuation byte (narrower after E0, ED, F0, F4: no overlongs, no
// surrogates, nothing above U+10FFFF).
struct Lead {
  int len;
  uint8_t lo;
  uint8_t hi;
};

Lead ClassifyLead(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

// Length of the valid prefix of the sequence at src[pos] (>= 1 when the lead byte is valid), and
// whether it is complete. `truncated` is set when the input ended before the sequence did.
int ScanSequence(std::string_view src, size_t pos, bool* complete, bool* truncated) {
  const Lead lead = ClassifyLead(static_cast<uint8_t>(src[pos]));
  *complete = false;
  *truncated = false;
  if (lead.len == 0) return 0;
  for (int k = 1; k < lead.len; ++k) {
    if (pos + k >= src.size()) {
      *truncated = true;
      return k;
    }
    const uint8_t c = static_cast<uint8_t>(src[pos + k]);
    const uint8_t lo = k == 1 ? lead.lo : 0x80;
    const uint8_t hi = k == 1 ? lead.hi : 0xBF;
    if (c < lo || c > hi) return k;
  }
  *complete = true;
  return lead.len;
}

}  // namespace

void AppendUtf8(uint32_t cp, std::string* dst) {
  if (cp < 0x80) {
    dst->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    dst->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    dst->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    dst->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    dst->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    dst->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    dst->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    dst->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    dst->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    dst->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t DecodeUtf8(std::string_view src, size_t pos, uint32_t* cp) {
  bool complete = false;
  bool truncated = false;
  const int len = ScanSequence(src, pos, &complete, &truncated);
  if (!complete) return 0;
  const auto byte = [&](int k) {
    return static_cast<uint32_t>(static_cast<uint8_t>(src[pos + k]));
  };
  switch (len) {
    case 1:
      *cp = byte(0);
      break;
    case 2:
      *cp = ((byte(0) & 0x1F) << 6) | (byte(1) & 0x3F);
      break;
    case 3:
      *cp = ((byte(0) & 0x0F) << 12) | ((byte(1) & 0x3F) << 6) | (byte(2) & 0x3F);
      break;
    default:
      *cp = ((byte(0) & 0x07) << 18) | ((byte(1) & 0x3F) << 12) | ((byte(2) & 0x3F) << 6) |
            (byte(3) & 0x3F);
      break;
  }
  return static_cast<size_t>(len);
}

size_t AppendValidUtf8(std::string_view src, bool final, std::string* dst) {
  size_t pos = 0;
  size_t run_start = 0;  // start of the pending run of well-formed bytes, copied in one go
  while (pos < src.size()) {
    if (static_cast<uint8_t>(src[pos]) < 0x80) {
      ++pos;
      continue;
    }
    bool complete = false;
    bool truncated = false;
    const int len = ScanSequence(src, pos, &complete, &truncated);
    if (complete) {
      pos += len;
      continue;
    }
    dst->append(src.substr(run_start, pos - run_start));
    if (truncated && !final) return pos;
    dst->append(kReplacement);
    pos += len == 0 ? 1 : len;
    run_start = pos;
  }
  dst->append(src.substr(run_start, pos - run_start));
  return pos;
}

std::string ToValidUtf8(std::string_view src) {
  std::string dst;
  dst.reserve(src.size());
  AppendValidUtf8(src, /*final=*/true, &dst);
  return dst;
}

bool IsValidUtf8(std::string_view src) {
  size_t pos = 0;
  while (pos < src.size()) {
    if (static_cast<uint8_t>(src[pos]) < 0x80) {
      ++pos;
      continue;
    }
    bool complete = false;
    bool truncated = false;
    const int len = ScanSequence(src, pos, &complete, &truncated);
    if (!complete) return false;
    pos += len;
  }
  return true;
}

}  // namespace tandem::gpu_worker::tokenizer_internal
