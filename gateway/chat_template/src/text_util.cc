#include "text_util.h"

namespace tandem::chat_template::internal {

uint32_t DecodeCodePoint(std::string_view s, size_t pos, size_t* len) {
  unsigned char c = static_cast<unsigned char>(s[pos]);
  int n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
  if (n <= 1 || pos + n > s.size()) {
    *len = 1;
    return c;
  }
  uint32_t cp = c & (0x7F >> n);
  for (int i = 1; i < n; ++i) {
    unsigned char cc = static_cast<unsigned char>(s[pos + i]);
    if ((cc >> 6) != 0x2) {
      *len = 1;
      return c;
    }
    cp = (cp << 6) | (cc & 0x3F);
  }
  *len = n;
  return cp;
}

void AppendCodePoint(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::vector<size_t> CodePointOffsets(std::string_view s) {
  std::vector<size_t> offsets;
  offsets.reserve(s.size() + 1);
  size_t pos = 0;
  while (pos < s.size()) {
    offsets.push_back(pos);
    size_t len = 0;
    DecodeCodePoint(s, pos, &len);
    pos += len;
  }
  offsets.push_back(s.size());
  return offsets;
}

int64_t CodePointCount(std::string_view s) {
  int64_t n = 0;
  for (unsigned char c : s) {
    if ((c & 0xC0) != 0x80) ++n;
  }
  return n;
}

bool IsPyWhitespace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

namespace {

struct CodePoints {
  std::vector<uint32_t> cps;
  std::vector<size_t> offsets;  // byte offset of each, plus the end
};

CodePoints Decode(std::string_view s) {
  CodePoints out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t len = 0;
    out.offsets.push_back(pos);
    out.cps.push_back(DecodeCodePoint(s, pos, &len));
    pos += len;
  }
  out.offsets.push_back(s.size());
  return out;
}

}  // namespace

std::string PyStrip(std::string_view s, const std::optional<std::string>& chars, bool left,
                    bool right) {
  CodePoints text = Decode(s);
  std::vector<uint32_t> strip_set;
  if (chars) {
    CodePoints c = Decode(*chars);
    strip_set = c.cps;
  }
  auto strips = [&](uint32_t cp) {
    if (!chars) return IsPyWhitespace(cp);
    for (uint32_t x : strip_set) {
      if (x == cp) return true;
    }
    return false;
  };
  size_t begin = 0, end = text.cps.size();
  if (left) {
    while (begin < end && strips(text.cps[begin])) ++begin;
  }
  if (right) {
    while (end > begin && strips(text.cps[end - 1])) --end;
  }
  return std::string(s.substr(text.offsets[begin], text.offsets[end] - text.offsets[begin]));
}

std::vector<std::string> PySplit(std::string_view s, const std::optional<std::string>& sep,
                                 int64_t maxsplit) {
  std::vector<std::string> parts;
  if (sep) {
    size_t start = 0;
    while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
      size_t hit = s.find(*sep, start);
      if (hit == std::string_view::npos) break;
      parts.emplace_back(s.substr(start, hit - start));
      start = hit + sep->size();
    }
    parts.emplace_back(s.substr(start));
    return parts;
  }
  // Runs of whitespace separate; leading and trailing whitespace give no empty parts.
  CodePoints text = Decode(s);
  size_t i = 0, n = text.cps.size();
  while (true) {
    while (i < n && IsPyWhitespace(text.cps[i])) ++i;
    if (i == n) break;
    if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
      size_t end = n;
      while (end > i && IsPyWhitespace(text.cps[end - 1])) --end;
      parts.emplace_back(s.substr(text.offsets[i], text.offsets[end] - text.offsets[i]));
      break;
    }
    size_t start = i;
    while (i < n && !IsPyWhitespace(text.cps[i])) ++i;
    parts.emplace_back(s.substr(text.offsets[start], text.offsets[i] - text.offsets[start]));
  }
  return parts;
}

size_t PyReplaceSize(std::string_view s, std::string_view old_text, std::string_view new_text,
                     int64_t count) {
  int64_t hits = 0;
  if (old_text.empty()) {
    hits = CodePointCount(s) + 1;
  } else {
    size_t pos = 0;
    while ((pos = s.find(old_text, pos)) != std::string_view::npos) {
      ++hits;
      pos += old_text.size();
    }
  }
  if (count >= 0 && hits > count) hits = count;
  return s.size() + static_cast<size_t>(hits) * new_text.size() -
         static_cast<size_t>(hits) * old_text.size();
}

std::string PyReplace(std::string_view s, std::string_view old_text, std::string_view new_text,
                      int64_t count) {
  std::string out;
  int64_t done = 0;
  if (old_text.empty()) {
    // Python inserts `new` before every code point and at the end.
    std::vector<size_t> offsets = CodePointOffsets(s);
    for (size_t i = 0; i + 1 < offsets.size(); ++i) {
      if (count < 0 || done < count) {
        out += new_text;
        ++done;
      }
      out += s.substr(offsets[i], offsets[i + 1] - offsets[i]);
    }
    if (count < 0 || done < count) out += new_text;
    return out;
  }
  size_t pos = 0;
  while (count < 0 || done < count) {
    size_t hit = s.find(old_text, pos);
    if (hit == std::string_view::npos) break;
    out += s.substr(pos, hit - pos);
    out += new_text;
    pos = hit + old_text.size();
    ++done;
  }
  out += s.substr(pos);
  return out;
}

namespace {

// Simple case pairs of the scripts chat text commonly uses (Latin-1, Latin Extended-A, Greek,
// Cyrillic); other code points have no case here. Python's special cases (final sigma, dotted
// I) are not reproduced.
uint32_t LowerOf(uint32_t cp) {
  if (cp >= 'A' && cp <= 'Z') return cp + 32;
  if (cp < 0xC0) return cp;
  if ((cp >= 0xC0 && cp <= 0xDE && cp != 0xD7)) return cp + 32;
  if (cp == 0x178) return 0xFF;
  if ((cp >= 0x100 && cp <= 0x137) || (cp >= 0x14A && cp <= 0x177)) return cp | 1;
  if ((cp >= 0x139 && cp <= 0x148) || (cp >= 0x179 && cp <= 0x17E)) return (cp & 1) ? cp + 1 : cp;
  if (cp == 0x386) return 0x3AC;
  if (cp >= 0x388 && cp <= 0x38A) return cp + 37;
  if (cp == 0x38C) return 0x3CC;
  if (cp == 0x38E || cp == 0x38F) return cp + 63;
  if ((cp >= 0x391 && cp <= 0x3A1) || (cp >= 0x3A3 && cp <= 0x3AB)) return cp + 32;
  if (cp >= 0x400 && cp <= 0x40F) return cp + 80;
  if (cp >= 0x410 && cp <= 0x42F) return cp + 32;
  if ((cp >= 0x460 && cp <= 0x481) || (cp >= 0x48A && cp <= 0x4BF)) return cp | 1;
  return cp;
}

uint32_t UpperOf(uint32_t cp) {
  if (cp >= 'a' && cp <= 'z') return cp - 32;
  if (cp < 0xB5) return cp;
  if (cp == 0xB5) return 0x39C;
  if (cp >= 0xE0 && cp <= 0xFE && cp != 0xF7) return cp - 32;
  if (cp == 0xFF) return 0x178;
  if ((cp >= 0x100 && cp <= 0x137) || (cp >= 0x14A && cp <= 0x177)) return cp & ~1u;
  if ((cp >= 0x139 && cp <= 0x148) || (cp >= 0x179 && cp <= 0x17E)) return (cp & 1) ? cp : cp - 1;
  if (cp == 0x131) return 'I';
  if (cp == 0x17F) return 'S';
  if (cp == 0x3AC) return 0x386;
  if (cp >= 0x3AD && cp <= 0x3AF) return cp - 37;
  if (cp == 0x3CC) return 0x38C;
  if (cp == 0x3CD || cp == 0x3CE) return cp - 63;
  if (cp == 0x3C2) return 0x3A3;
  if ((cp >= 0x3B1 && cp <= 0x3C1) || (cp >= 0x3C3 && cp <= 0x3CB)) return cp - 32;
  if (cp >= 0x430 && cp <= 0x44F) return cp - 32;
  if (cp >= 0x450 && cp <= 0x45F) return cp - 80;
  if ((cp >= 0x460 && cp <= 0x481) || (cp >= 0x48A && cp <= 0x4BF)) return cp & ~1u;
  return cp;
}

bool IsCased(uint32_t cp) { return LowerOf(cp) != cp || UpperOf(cp) != cp || cp == 0xDF; }

// Title case (first letter of a word): as upper case, except ß -> "Ss".
void AppendTitle(uint32_t cp, std::string* out) {
  if (cp == 0xDF) {
    *out += "Ss";
    return;
  }
  AppendCodePoint(UpperOf(cp), out);
}

void AppendUpper(uint32_t cp, std::string* out) {
  if (cp == 0xDF) {  // ß
    *out += "SS";
    return;
  }
  AppendCodePoint(UpperOf(cp), out);
}

template <typename F>
void ForEachCodePoint(std::string_view s, F f) {
  size_t pos = 0;
  while (pos < s.size()) {
    size_t len = 0;
    uint32_t cp = DecodeCodePoint(s, pos, &len);
    // An invalid byte stays as it is.
    if (len == 1 && cp >= 0x80) {
      f(cp, s.substr(pos, 1), false);
    } else {
      f(cp, s.substr(pos, len), true);
    }
    pos += len;
  }
}

}  // namespace

std::string PyUpper(std::string_view s) {
  std::string out;
  ForEachCodePoint(s, [&](uint32_t cp, std::string_view raw, bool valid) {
    if (valid)
      AppendUpper(cp, &out);
    else
      out += raw;
  });
  return out;
}

std::string PyLower(std::string_view s) {
  std::string out;
  ForEachCodePoint(s, [&](uint32_t cp, std::string_view raw, bool valid) {
    if (valid)
      AppendCodePoint(LowerOf(cp), &out);
    else
      out += raw;
  });
  return out;
}

bool PyIsLower(std::string_view s) {
  bool cased = false, ok = true;
  ForEachCodePoint(s, [&](uint32_t cp, std::string_view, bool valid) {
    if (!valid || !IsCased(cp)) return;
    cased = true;
    if (LowerOf(cp) != cp) ok = false;  // an upper-case letter
  });
  return cased && ok;
}

bool PyIsUpper(std::string_view s) {
  bool cased = false, ok = true;
  ForEachCodePoint(s, [&](uint32_t cp, std::string_view, bool valid) {
    if (!valid || !IsCased(cp)) return;
    cased = true;
    if (UpperOf(cp) != cp || cp == 0xDF) ok = false;  // a lower-case letter
  });
  return cased && ok;
}

std::string PyCapitalize(std::string_view s) {
  std::string out;
  bool first = true;
  ForEachCodePoint(s, [&](uint32_t cp, std::string_view raw, bool valid) {
    if (!valid)
      out += raw;
    else if (first)
      AppendTitle(cp, &out);
    else
      AppendCodePoint(LowerOf(cp), &out);
    first = false;
  });
  return out;
}

std::string PyTitle(std::string_view s) {
  // Python: a cased character is title-cased after an uncased one, lower-cased after a cased one.
  std::string out;
  bool previous_cased = false;
  ForEachCodePoint(s, [&](uint32_t cp, std::string_view raw, bool valid) {
    if (!valid) {
      out += raw;
      previous_cased = false;
      return;
    }
    if (previous_cased)
      AppendCodePoint(LowerOf(cp), &out);
    else
      AppendTitle(cp, &out);
    previous_cased = IsCased(cp);
  });
  return out;
}

std::string JinjaTitle(std::string_view s) {
  // Jinja's do_title: split at runs of [-\s({\[<], then item[0].upper() + item[1:].lower().
  std::string out;
  bool word_start = true;
  ForEachCodePoint(s, [&](uint32_t cp, std::string_view raw, bool valid) {
    bool sep = cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' ||
               (valid && IsPyWhitespace(cp));
    if (sep || !valid) {
      out += raw;
      word_start = sep;
      return;
    }
    if (word_start)
      AppendUpper(cp, &out);
    else
      AppendCodePoint(LowerOf(cp), &out);
    word_start = false;
  });
  return out;
}

}  // namespace tandem::chat_template::internal
