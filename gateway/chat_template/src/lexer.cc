#include "lexer.h"

#include <cstdlib>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "text_util.h"

namespace tandem::chat_template::internal {

absl::Status SyntaxError(int line, int column, absl::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat("chat template syntax error at line ", line,
                                                 ", column ", column, ": ", message));
}

namespace {

bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
// Names are Python identifiers; any non-ASCII byte counts as part of one (Jinja 3 accepts
// Unicode names such as "é").
bool IsNameStart(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
         static_cast<unsigned char>(c) >= 0x80;
}
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {}

  absl::StatusOr<std::vector<Token>> Run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      size_t tag = FindTag(pos_);
      std::string text = src_.substr(pos_, tag - pos_);
      if (tag == src_.size()) {
        EmitText(std::move(text), pos_);
        Advance(src_.size());
        break;
      }
      char kind = src_[tag + 1];  // '{', '%' or '#'
      char modifier = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
      if (modifier == '-') {
        size_t end = text.size();
        while (end > 0 && IsSpace(text[end - 1])) --end;
        text.resize(end);
      } else if (kind != '{' && modifier != '+') {
        // lstrip_blocks: only spaces before the tag on its line (or on a line begun by a tag).
        size_t line_pos = text.rfind('\n');
        line_pos = line_pos == std::string::npos ? 0 : line_pos + 1;
        if (line_pos > 0 || line_starting) {
          bool blank = line_pos < text.size();
          for (size_t i = line_pos; i < text.size(); ++i) {
            if (!IsSpace(text[i])) blank = false;
          }
          if (blank) text.resize(line_pos);
        }
      }
      EmitText(std::move(text), pos_);
      Advance(tag);
      size_t after = tag + 2 + ((modifier == '-' || modifier == '+') ? 1 : 0);
      if (kind == '#') {
        size_t end = src_.find("#}", after);
        if (end == std::string::npos && after >= src_.size()) {
          Advance(src_.size());  // Jinja drops a "{#" that ends the source
          break;
        }
        if (end == std::string::npos)
          return SyntaxError(line_, column_, "missing end of comment tag");
        bool strip = end > after && src_[end - 1] == '-';
        Advance(end + 2);
        ConsumeTagSuffix(strip, /*trim_newline=*/true);
      } else if (kind == '%' && MatchRawBegin(after)) {
        auto status = LexRaw(after);
        if (!status.ok()) return status;
      } else {
        Token begin{kind == '{' ? Token::Type::kVarBegin : Token::Type::kBlockBegin};
        begin.line = line_;
        begin.column = column_;
        tokens_.push_back(begin);
        Advance(after);
        auto status = LexTag(kind);
        if (!status.ok()) return status;
      }
      line_starting = pos_ > 0 && src_[pos_ - 1] == '\n';
    }
    Token eof{Token::Type::kEof};
    eof.line = line_;
    eof.column = column_;
    tokens_.push_back(eof);
    return std::move(tokens_);
  }

 private:
  // Position of the next "{{", "{%" or "{#" at or after `from`, or src_.size().
  size_t FindTag(size_t from) const {
    size_t p = from;
    while ((p = src_.find('{', p)) != std::string::npos) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) {
        return p;
      }
      ++p;
    }
    return src_.size();
  }

  void Advance(size_t to) {
    for (; pos_ < to; ++pos_) {
      if (src_[pos_] == '\n') {
        ++line_;
        column_ = 1;
      } else if ((static_cast<unsigned char>(src_[pos_]) & 0xC0) != 0x80) {
        ++column_;
      }
    }
  }

  void EmitText(std::string text, size_t at) {
    if (text.empty()) return;
    Token t{Token::Type::kText};
    t.text = std::move(text);
    t.line = line_;
    t.column = column_;
    tokens_.push_back(std::move(t));
  }

  // Whether "{% raw %}" (modifiers allowed) starts at the tag whose body begins at `p`.
  bool MatchRawBegin(size_t p) const { return MatchWordTag(p, "raw", nullptr, nullptr); }

  // "<spaces>word<spaces>[-+]%}" at p: *end = just past "%}", *strip = there was a "-".
  bool MatchWordTag(size_t p, std::string_view word, size_t* end, bool* strip) const {
    while (p < src_.size() && IsSpace(src_[p])) ++p;
    if (src_.compare(p, word.size(), word.data(), word.size()) != 0) return false;
    p += word.size();
    if (p < src_.size() && (IsNameStart(src_[p]) || IsDigit(src_[p]))) return false;
    while (p < src_.size() && IsSpace(src_[p])) ++p;
    bool minus = p < src_.size() && src_[p] == '-';
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) ++p;
    if (src_.compare(p, 2, "%}") != 0) return false;
    if (end != nullptr) *end = p + 2;
    if (strip != nullptr) *strip = minus;
    return true;
  }

  // {% raw %}...{% endraw %}: the content is text; tags in it are not interpreted. As Jinja:
  // "-%}" after raw strips the whitespace that follows, "{%- endraw" the whitespace before it,
  // and after endraw the usual tag-end rules apply.
  absl::Status LexRaw(size_t after) {
    size_t begin_end = 0;
    bool strip_after_begin = false;
    MatchWordTag(after, "raw", &begin_end, &strip_after_begin);
    Advance(begin_end);
    if (strip_after_begin) ConsumeTagSuffix(true, false);
    size_t p = pos_;
    while ((p = src_.find("{%", p)) != std::string::npos) {
      size_t body = p + 2;
      bool strip_before = body < src_.size() && src_[body] == '-';
      if (body < src_.size() && (src_[body] == '-' || src_[body] == '+')) ++body;
      size_t end = 0;
      bool strip_after = false;
      if (MatchWordTag(body, "endraw", &end, &strip_after)) {
        std::string text = src_.substr(pos_, p - pos_);
        if (strip_before) {
          size_t n = text.size();
          while (n > 0 && IsSpace(text[n - 1])) --n;
          text.resize(n);
        }
        EmitText(std::move(text), pos_);
        Advance(end);
        ConsumeTagSuffix(strip_after, /*trim_newline=*/true);
        return absl::OkStatus();
      }
      p += 2;
    }
    return SyntaxError(line_, column_, "missing {% endraw %} for {% raw %}");
  }

  // After a tag's end: "-" strips all following whitespace; else trim_blocks drops one "\n".
  void ConsumeTagSuffix(bool strip, bool trim_newline) {
    if (strip) {
      size_t p = pos_;
      while (p < src_.size() && IsSpace(src_[p])) ++p;
      Advance(p);
    } else if (trim_newline && pos_ < src_.size() && src_[pos_] == '\n') {
      Advance(pos_ + 1);
    }
  }

  absl::Status LexTag(char kind) {
    const std::string end = kind == '{' ? "}}" : "%}";
    int depth = 0;
    while (true) {
      while (pos_ < src_.size() && IsSpace(src_[pos_])) Advance(pos_ + 1);
      if (pos_ >= src_.size()) {
        return SyntaxError(line_, column_,
                           kind == '{' ? "unexpected end of template, expected '}}'"
                                       : "unexpected end of template, expected '%}'");
      }
      if (depth == 0) {
        bool strip = src_.compare(pos_, 1 + end.size(), "-" + end) == 0;
        if (strip || src_.compare(pos_, end.size(), end) == 0) {
          Token t{kind == '{' ? Token::Type::kVarEnd : Token::Type::kBlockEnd};
          t.line = line_;
          t.column = column_;
          tokens_.push_back(t);
          Advance(pos_ + end.size() + (strip ? 1 : 0));
          ConsumeTagSuffix(strip, /*trim_newline=*/kind == '%');
          return absl::OkStatus();
        }
      }
      Token t{Token::Type::kOp};
      t.line = line_;
      t.column = column_;
      char c = src_[pos_];
      if (IsNameStart(c)) {
        size_t p = pos_;
        while (p < src_.size() && (IsNameStart(src_[p]) || IsDigit(src_[p]))) ++p;
        t.type = Token::Type::kName;
        t.text = src_.substr(pos_, p - pos_);
        Advance(p);
      } else if (IsDigit(c)) {
        auto status = LexNumber(&t);
        if (!status.ok()) return status;
      } else if (c == '\'' || c == '"') {
        auto status = LexString(&t);
        if (!status.ok()) return status;
      } else {
        static const char* kTwo[] = {"//", "**", "==", "!=", "<=", ">="};
        std::string op;
        for (const char* two : kTwo) {
          if (src_.compare(pos_, 2, two) == 0) op = two;
        }
        if (op.empty()) {
          if (absl::string_view("+-*/%~<>=()[]{},.:|").find(c) == absl::string_view::npos) {
            return SyntaxError(line_, column_,
                               absl::StrCat("unexpected character '", std::string(1, c), "'"));
          }
          op = std::string(1, c);
        }
        if (op == "(" || op == "[" || op == "{") ++depth;
        if (op == ")" || op == "]" || op == "}") {
          if (depth == 0) return SyntaxError(line_, column_, absl::StrCat("unexpected '", op, "'"));
          --depth;
        }
        t.text = op;
        Advance(pos_ + op.size());
      }
      tokens_.push_back(std::move(t));
    }
  }

  absl::Status LexNumber(Token* t) {
    size_t p = pos_;
    auto digits = [&] {
      while (p < src_.size() && (IsDigit(src_[p]) ||
                                 (src_[p] == '_' && p + 1 < src_.size() && IsDigit(src_[p + 1])))) {
        ++p;
      }
    };
    digits();
    bool is_float = false;
    if (p + 1 < src_.size() && src_[p] == '.' && IsDigit(src_[p + 1])) {
      is_float = true;
      ++p;
      digits();
    }
    if (p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
      size_t q = p + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < src_.size() && IsDigit(src_[q])) {
        is_float = true;
        p = q;
        digits();
      }
    }
    std::string text;
    for (size_t i = pos_; i < p; ++i) {
      if (src_[i] != '_') text.push_back(src_[i]);
    }
    if (is_float) {
      t->type = Token::Type::kFloat;
      t->float_value = std::strtod(text.c_str(), nullptr);
    } else {
      t->type = Token::Type::kInt;
      errno = 0;
      t->int_value = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) return SyntaxError(line_, column_, "integer literal too large");
    }
    t->text = std::move(text);
    Advance(p);
    return absl::OkStatus();
  }

  // A quoted string with Python's escapes (\n \t \r \\ \' \" \xNN \uNNNN \UNNNNNNNN \a \b \f \v,
  // octal); an unknown escape keeps its backslash, as Python does.
  absl::Status LexString(Token* t) {
    char quote = src_[pos_];
    size_t p = pos_ + 1;
    std::string out;
    while (true) {
      if (p >= src_.size()) return SyntaxError(line_, column_, "unterminated string");
      char c = src_[p];
      if (c == quote) break;
      if (c != '\\') {
        out.push_back(c);
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) return SyntaxError(line_, column_, "unterminated string");
      char e = src_[p + 1];
      p += 2;
      switch (e) {
        case 'n':
          out.push_back('\n');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 'a':
          out.push_back('\a');
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'v':
          out.push_back('\v');
          break;
        case '\\':
          out.push_back('\\');
          break;
        case '\'':
          out.push_back('\'');
          break;
        case '"':
          out.push_back('"');
          break;
        case '\n':
          break;  // line continuation
        case 'x':
        case 'u':
        case 'U': {
          size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
          if (p + n > src_.size()) return SyntaxError(line_, column_, "truncated \\x/\\u escape");
          uint32_t cp = 0;
          for (size_t i = 0; i < n; ++i) {
            char h = src_[p + i];
            int v = IsDigit(h)               ? h - '0'
                    : (h >= 'a' && h <= 'f') ? h - 'a' + 10
                    : (h >= 'A' && h <= 'F') ? h - 'A' + 10
                                             : -1;
            if (v < 0) return SyntaxError(line_, column_, "bad \\x/\\u escape");
            cp = cp * 16 + static_cast<uint32_t>(v);
          }
          if (cp > 0x10FFFF) return SyntaxError(line_, column_, "escape out of range");
          p += n;
          AppendCodePoint(cp, &out);
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t cp = static_cast<uint32_t>(e - '0');
            for (int i = 0; i < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++i) {
              cp = cp * 8 + static_cast<uint32_t>(src_[p++] - '0');
            }
            AppendCodePoint(cp, &out);
          } else {
            out.push_back('\\');
            out.push_back(e);
          }
      }
    }
    t->type = Token::Type::kString;
    t->text = std::move(out);
    Advance(p + 1);
    return absl::OkStatus();
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  int column_ = 1;
  std::vector<Token> tokens_;
};

}  // namespace

absl::StatusOr<std::vector<Token>> Tokenize(absl::string_view source) {
  // Newlines normalised to "\n"; one trailing newline dropped (keep_trailing_newline=False).
  std::string normalized;
  normalized.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      normalized.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      normalized.push_back(source[i]);
    }
  }
  if (!normalized.empty() && normalized.back() == '\n') normalized.pop_back();
  return Lexer(std::move(normalized)).Run();
}

}  // namespace tandem::chat_template::internal
