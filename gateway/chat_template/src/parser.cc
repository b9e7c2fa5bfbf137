#include "parser.h"

#include <initializer_list>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "lexer.h"
#include "tandem/common/status_macros.h"

namespace tandem::chat_template::internal {
namespace {

// Nesting bound for expressions and blocks, so a hostile template cannot overflow the stack.
constexpr int kMaxNesting = 200;

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  absl::StatusOr<std::unique_ptr<Program>> Run() {
    auto program = std::make_unique<Program>();
    std::string end_tag;
    auto status = ParseBody({}, &program->body, &end_tag);
    if (!status.ok()) return status;
    return program;
  }

 private:
  using T = Token::Type;

  const Token& Peek(size_t ahead = 0) const {
    size_t i = pos_ + ahead;
    return i < tokens_.size() ? tokens_[i] : tokens_.back();
  }
  const Token& Next() {
    const Token& t = Peek();
    if (pos_ < tokens_.size() - 1) ++pos_;
    return t;
  }
  bool IsOp(absl::string_view op, size_t ahead = 0) const {
    return Peek(ahead).type == T::kOp && Peek(ahead).text == op;
  }
  bool IsName(absl::string_view name, size_t ahead = 0) const {
    return Peek(ahead).type == T::kName && Peek(ahead).text == name;
  }
  absl::Status ErrorAt(const Token& t, absl::string_view message) const {
    return SyntaxError(t.line, t.column, message);
  }
  static std::string Describe(const Token& t) {
    switch (t.type) {
      case T::kEof:
        return "end of template";
      case T::kVarEnd:
        return "end of print statement";
      case T::kBlockEnd:
        return "end of statement block";
      case T::kString:
        return "string";
      case T::kInt:
      case T::kFloat:
        return "number";
      default:
        return absl::StrCat("'", t.text, "'");
    }
  }
  absl::Status ExpectOp(absl::string_view op) {
    if (!IsOp(op)) {
      return ErrorAt(Peek(), absl::StrCat("expected '", op, "', got ", Describe(Peek())));
    }
    Next();
    return absl::OkStatus();
  }
  absl::Status ExpectBlockEnd() {
    if (Peek().type != T::kBlockEnd) {
      return ErrorAt(Peek(),
                     absl::StrCat("expected end of statement block, got ", Describe(Peek())));
    }
    Next();
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> ExpectName() {
    if (Peek().type != T::kName) {
      return ErrorAt(Peek(), absl::StrCat("expected a name, got ", Describe(Peek())));
    }
    return Next().text;
  }

  // Parses nodes until a block tag named in `end_tags` (returned in *end_tag, the tag's name
  // consumed, its arguments and %} not) or the end of the template (only when end_tags is empty).
  absl::Status ParseBody(std::initializer_list<absl::string_view> end_tags, Body* body,
                         std::string* end_tag) {
    if (++nesting_ > kMaxNesting) return ErrorAt(Peek(), "blocks nested too deeply");
    while (true) {
      const Token& t = Peek();
      if (t.type == T::kEof) {
        if (end_tags.size() == 0) break;
        std::vector<std::string> names;
        for (auto n : end_tags) names.push_back(absl::StrCat("'", n, "'"));
        return ErrorAt(t, absl::StrCat("unexpected end of template; looking for the tags ",
                                       absl::StrJoin(names, " or ")));
      }
      if (t.type == T::kText) {
        auto node = std::make_unique<Node>();
        node->kind = Node::Kind::kText;
        node->line = t.line;
        node->text = Next().text;
        body->push_back(std::move(node));
        continue;
      }
      if (t.type == T::kVarBegin) {
        Next();
        auto node = std::make_unique<Node>();
        node->kind = Node::Kind::kOutput;
        node->line = t.line;
        auto expr = ParseTuple(/*allow_bare_tuple=*/true);
        if (!expr.ok()) return expr.status();
        node->expr = std::move(*expr);
        if (Peek().type != T::kVarEnd) {
          return ErrorAt(Peek(),
                         absl::StrCat("expected end of print statement, got ", Describe(Peek())));
        }
        Next();
        body->push_back(std::move(node));
        continue;
      }
      if (t.type != T::kBlockBegin) return ErrorAt(t, "unexpected token");
      Next();
      const Token& tag = Peek();
      if (tag.type != T::kName) return ErrorAt(tag, "expected a statement name");
      for (auto n : end_tags) {
        if (tag.text == n) {
          *end_tag = Next().text;
          --nesting_;
          return absl::OkStatus();
        }
      }
      auto status = ParseStatement(body);
      if (!status.ok()) return status;
    }
    --nesting_;
    return absl::OkStatus();
  }

  absl::Status ParseStatement(Body* body) {
    const Token tag = Next();
    auto node = std::make_unique<Node>();
    node->line = tag.line;
    const std::string& name = tag.text;
    absl::Status status;
    if (name == "if") {
      status = ParseIf(node.get());
    } else if (name == "for") {
      status = ParseFor(node.get());
    } else if (name == "set") {
      status = ParseSet(node.get());
    } else if (name == "macro") {
      status = ParseMacro(node.get());
    } else if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) return ErrorAt(tag, absl::StrCat("'", name, "' outside loop"));
      node->kind = name == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      status = ExpectBlockEnd();
    } else if (name == "generation") {
      // transformers' AssistantTracker: the body renders in place.
      node->kind = Node::Kind::kScope;
      status = ExpectBlockEnd();
      std::string end;
      if (status.ok()) status = ParseBody({"endgeneration"}, &node->body, &end);
      if (status.ok()) status = ExpectBlockEnd();
    } else {
      bool is_end = name.rfind("end", 0) == 0 || name == "elif" || name == "else";
      return ErrorAt(tag, is_end ? absl::StrCat("unexpected '", name, "' tag")
                                 : absl::StrCat("unknown tag '", name, "'"));
    }
    if (!status.ok()) return status;
    body->push_back(std::move(node));
    return absl::OkStatus();
  }

  absl::Status ParseIf(Node* node) {
    node->kind = Node::Kind::kIf;
    while (true) {
      // As Jinja: the condition is not itself a conditional expression ("if a if b" is an error).
      auto condition = ParseTuple(false, /*with_condexpr=*/false);
      if (!condition.ok()) return condition.status();
      TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
      Body branch;
      std::string end;
      TANDEM_RETURN_IF_ERROR(ParseBody({"elif", "else", "endif"}, &branch, &end));
      node->branches.emplace_back(std::move(*condition), std::move(branch));
      if (end == "elif") continue;
      if (end == "else") {
        TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
        Body else_branch;
        TANDEM_RETURN_IF_ERROR(ParseBody({"endif"}, &else_branch, &end));
        node->branches.emplace_back(nullptr, std::move(else_branch));
      }
      return ExpectBlockEnd();
    }
  }

  absl::Status ParseTargets(std::vector<std::string>* targets) {
    bool paren = IsOp("(");
    if (paren) Next();
    while (true) {
      auto name = ExpectName();
      if (!name.ok()) return name.status();
      targets->push_back(*name);
      if (!IsOp(",")) break;
      Next();
      if (Peek().type != T::kName) break;  // trailing comma
    }
    if (paren) return ExpectOp(")");
    return absl::OkStatus();
  }

  absl::Status ParseFor(Node* node) {
    node->kind = Node::Kind::kFor;
    TANDEM_RETURN_IF_ERROR(ParseTargets(&node->targets));
    if (!IsName("in"))
      return ErrorAt(Peek(), absl::StrCat("expected 'in', got ", Describe(Peek())));
    Next();
    auto iterable = ParseTuple(false, /*with_condexpr=*/false);
    if (!iterable.ok()) return iterable.status();
    node->expr = std::move(*iterable);
    if (IsName("if")) {
      Next();
      auto condition = ParseExpression();
      if (!condition.ok()) return condition.status();
      node->condition = std::move(*condition);
    }
    if (IsName("recursive")) return ErrorAt(Peek(), "recursive loops are not supported");
    TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
    std::string end;
    ++loop_depth_;
    absl::Status body = ParseBody({"endfor", "else"}, &node->body, &end);
    --loop_depth_;
    TANDEM_RETURN_IF_ERROR(body);
    if (end == "else") {
      TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
      TANDEM_RETURN_IF_ERROR(ParseBody({"endfor"}, &node->else_body, &end));
    }
    return ExpectBlockEnd();
  }

  absl::Status ParseSet(Node* node) {
    if (Peek().type == T::kName && IsOp(".", 1)) {
      node->kind = Node::Kind::kSet;
      node->targets.push_back(Next().text);
      Next();
      auto attribute = ExpectName();
      if (!attribute.ok()) return attribute.status();
      node->attribute = *attribute;
    } else {
      TANDEM_RETURN_IF_ERROR(ParseTargets(&node->targets));
      if (Peek().type == T::kBlockEnd && node->targets.size() == 1) {
        node->kind = Node::Kind::kSetBlock;
        Next();
        std::string end;
        TANDEM_RETURN_IF_ERROR(ParseBody({"endset"}, &node->body, &end));
        return ExpectBlockEnd();
      }
      node->kind = Node::Kind::kSet;
    }
    TANDEM_RETURN_IF_ERROR(ExpectOp("="));
    auto value = ParseTuple(/*allow_bare_tuple=*/true);
    if (!value.ok()) return value.status();
    node->expr = std::move(*value);
    return ExpectBlockEnd();
  }

  absl::Status ParseMacro(Node* node) {
    node->kind = Node::Kind::kMacro;
    auto name = ExpectName();
    if (!name.ok()) return name.status();
    node->name = *name;
    TANDEM_RETURN_IF_ERROR(ExpectOp("("));
    while (!IsOp(")")) {
      if (!node->params.empty()) TANDEM_RETURN_IF_ERROR(ExpectOp(","));
      if (IsOp(")")) break;
      auto param = ExpectName();
      if (!param.ok()) return param.status();
      node->params.push_back(*param);
      if (IsOp("=")) {
        Next();
        auto value = ParseExpression();
        if (!value.ok()) return value.status();
        node->defaults.push_back(std::move(*value));
      } else {
        node->defaults.push_back(nullptr);
      }
    }
    Next();
    TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
    std::string end;
    int outer_loops = loop_depth_;
    loop_depth_ = 0;  // a macro body is not inside the loop it is defined in
    absl::Status body = ParseBody({"endmacro"}, &node->body, &end);
    loop_depth_ = outer_loops;
    TANDEM_RETURN_IF_ERROR(body);
    if (Peek().type == T::kName && Peek().text == node->name) Next();
    return ExpectBlockEnd();
  }

  // ----- expressions -----

  ExprPtr Make(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // expression ("," expression)* -> a list when there is a comma (a tuple in Jinja).
  absl::StatusOr<ExprPtr> ParseTuple(bool allow_bare_tuple, bool with_condexpr = true) {
    int line = Peek().line;
    auto first = with_condexpr ? ParseExpression() : ParseOr();
    if (!first.ok() || !allow_bare_tuple || !IsOp(",")) return first;
    auto list = Make(Expr::Kind::kList, line);
    list->is_tuple = true;
    list->children.push_back(std::move(*first));
    while (IsOp(",")) {
      Next();
      if (Peek().type == T::kVarEnd || Peek().type == T::kBlockEnd) break;
      auto item = ParseExpression();
      if (!item.ok()) return item.status();
      list->children.push_back(std::move(*item));
    }
    return list;
  }

  absl::StatusOr<ExprPtr> ParseExpression() {
    if (++nesting_ > kMaxNesting) return ErrorAt(Peek(), "expression nested too deeply");
    auto result = ParseCondExpr();
    --nesting_;
    return result;
  }

  absl::StatusOr<ExprPtr> ParseCondExpr() {
    auto expr = ParseOr();
    if (!expr.ok()) return expr;
    while (IsName("if")) {
      int line = Next().line;
      auto condition = ParseOr();
      if (!condition.ok()) return condition;
      auto node = Make(Expr::Kind::kCond, line);
      node->children.push_back(std::move(*condition));
      node->children.push_back(std::move(*expr));
      if (IsName("else")) {
        Next();
        auto other = ParseCondExpr();
        if (!other.ok()) return other;
        node->children.push_back(std::move(*other));
      } else {
        node->children.push_back(nullptr);
      }
      expr = std::move(node);
    }
    return expr;
  }

  absl::StatusOr<ExprPtr> ParseOr() {
    auto left = ParseAnd();
    while (left.ok() && IsName("or")) {
      int line = Next().line;
      auto right = ParseAnd();
      if (!right.ok()) return right;
      auto node = Make(Expr::Kind::kOr, line);
      node->children.push_back(std::move(*left));
      node->children.push_back(std::move(*right));
      left = std::move(node);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseAnd() {
    auto left = ParseNot();
    while (left.ok() && IsName("and")) {
      int line = Next().line;
      auto right = ParseNot();
      if (!right.ok()) return right;
      auto node = Make(Expr::Kind::kAnd, line);
      node->children.push_back(std::move(*left));
      node->children.push_back(std::move(*right));
      left = std::move(node);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseNot() {
    if (IsName("not")) {
      int line = Next().line;
      if (++nesting_ > kMaxNesting) return ErrorAt(Peek(), "expression nested too deeply");
      auto operand = ParseNot();
      --nesting_;
      if (!operand.ok()) return operand;
      auto node = Make(Expr::Kind::kNot, line);
      node->children.push_back(std::move(*operand));
      return node;
    }
    return ParseCompare();
  }

  absl::StatusOr<ExprPtr> ParseCompare() {
    auto left = ParseMath1();
    while (left.ok()) {
      std::string op;
      const Token& t = Peek();
      if (t.type == T::kOp && (t.text == "==" || t.text == "!=" || t.text == "<" ||
                               t.text == "<=" || t.text == ">" || t.text == ">=")) {
        op = t.text;
        Next();
      } else if (IsName("in")) {
        op = "in";
        Next();
      } else if (IsName("not") && IsName("in", 1)) {
        op = "notin";
        Next();
        Next();
      } else {
        break;
      }
      auto right = ParseMath1();
      if (!right.ok()) return right;
      auto node = Make(Expr::Kind::kBinary, t.line);
      node->name = op;
      node->children.push_back(std::move(*left));
      node->children.push_back(std::move(*right));
      left = std::move(node);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseBinaryLevel(std::initializer_list<absl::string_view> ops,
                                           absl::StatusOr<ExprPtr> (Parser::*operand)()) {
    auto left = (this->*operand)();
    while (left.ok()) {
      const Token& t = Peek();
      bool match = false;
      for (auto op : ops) match = match || (t.type == T::kOp && t.text == op);
      if (!match) break;
      std::string op = Next().text;
      auto right = (this->*operand)();
      if (!right.ok()) return right;
      auto node = Make(Expr::Kind::kBinary, t.line);
      node->name = op;
      node->children.push_back(std::move(*left));
      node->children.push_back(std::move(*right));
      left = std::move(node);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseMath1() {
    return ParseBinaryLevel({"+", "-"}, &Parser::ParseConcat);
  }
  absl::StatusOr<ExprPtr> ParseConcat() { return ParseBinaryLevel({"~"}, &Parser::ParseMath2); }
  absl::StatusOr<ExprPtr> ParseMath2() {
    return ParseBinaryLevel({"*", "/", "//", "%"}, &Parser::ParsePow);
  }
  absl::StatusOr<ExprPtr> ParsePow() {
    return ParseBinaryLevel({"**"}, &Parser::ParseUnaryFiltered);
  }
  absl::StatusOr<ExprPtr> ParseUnaryFiltered() { return ParseUnary(true); }

  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter) {
    absl::StatusOr<ExprPtr> node;
    if (IsOp("-") || IsOp("+")) {
      const Token& t = Next();
      if (++nesting_ > kMaxNesting) return ErrorAt(Peek(), "expression nested too deeply");
      auto operand = ParseUnary(false);
      --nesting_;
      if (!operand.ok()) return operand;
      auto n = Make(t.text == "-" ? Expr::Kind::kNeg : Expr::Kind::kPos, t.line);
      n->children.push_back(std::move(*operand));
      node = std::move(n);
    } else {
      node = ParsePrimary();
    }
    if (!node.ok()) return node;
    node = ParsePostfix(std::move(*node));
    if (node.ok() && with_filter) node = ParseFilterExpr(std::move(*node));
    return node;
  }

  absl::StatusOr<ExprPtr> ParsePrimary() {
    const Token& t = Peek();
    switch (t.type) {
      case T::kName: {
        Next();
        const std::string& n = t.text;
        if (n == "true" || n == "True") return Literal(Value::Bool(true), t.line);
        if (n == "false" || n == "False") return Literal(Value::Bool(false), t.line);
        if (n == "none" || n == "None") return Literal(Value::None(), t.line);
        auto e = Make(Expr::Kind::kName, t.line);
        e->name = n;
        return e;
      }
      case T::kString: {
        std::string s = Next().text;
        while (Peek().type == T::kString) s += Next().text;  // adjacent literals concatenate
        return Literal(Value::String(std::move(s)), t.line);
      }
      case T::kInt:
        Next();
        return Literal(Value::Int(t.int_value), t.line);
      case T::kFloat:
        Next();
        return Literal(Value::Float(t.float_value), t.line);
      case T::kOp:
        if (t.text == "(") {
          Next();
          if (IsOp(")")) {
            Next();
            auto empty = Make(Expr::Kind::kList, t.line);
            empty->is_tuple = true;
            return empty;
          }
          auto inner = ParseTuple(/*allow_bare_tuple=*/true);
          if (!inner.ok()) return inner;
          TANDEM_RETURN_IF_ERROR(ExpectOp(")"));
          return inner;
        }
        if (t.text == "[") {
          Next();
          auto list = Make(Expr::Kind::kList, t.line);
          while (!IsOp("]")) {
            if (!list->children.empty()) TANDEM_RETURN_IF_ERROR(ExpectOp(","));
            if (IsOp("]")) break;
            auto item = ParseExpression();
            if (!item.ok()) return item;
            list->children.push_back(std::move(*item));
          }
          Next();
          return list;
        }
        if (t.text == "{") {
          Next();
          auto dict = Make(Expr::Kind::kDict, t.line);
          while (!IsOp("}")) {
            if (!dict->children.empty()) TANDEM_RETURN_IF_ERROR(ExpectOp(","));
            if (IsOp("}")) break;
            auto key = ParseExpression();
            if (!key.ok()) return key;
            TANDEM_RETURN_IF_ERROR(ExpectOp(":"));
            auto value = ParseExpression();
            if (!value.ok()) return value;
            dict->children.push_back(std::move(*key));
            dict->children.push_back(std::move(*value));
          }
          Next();
          return dict;
        }
        break;
      default:
        break;
    }
    return ErrorAt(t, absl::StrCat("unexpected ", Describe(t)));
  }

  ExprPtr Literal(Value v, int line) {
    auto e = Make(Expr::Kind::kLiteral, line);
    e->literal = std::move(v);
    return e;
  }

  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr node) {
    while (true) {
      const Token& t = Peek();
      if (IsOp(".")) {
        Next();
        if (Peek().type == T::kInt) {  // x.0 is x[0]
          auto e = Make(Expr::Kind::kGetItem, t.line);
          e->children.push_back(std::move(node));
          e->children.push_back(Literal(Value::Int(Next().int_value), t.line));
          node = std::move(e);
          continue;
        }
        auto attr = ExpectName();
        if (!attr.ok()) return attr.status();
        auto e = Make(Expr::Kind::kGetAttr, t.line);
        e->name = *attr;
        e->children.push_back(std::move(node));
        node = std::move(e);
      } else if (IsOp("[")) {
        Next();
        auto e = ParseSubscript(std::move(node), t.line);
        if (!e.ok()) return e;
        node = std::move(*e);
      } else if (IsOp("(")) {
        auto e = Make(Expr::Kind::kCall, t.line);
        e->children.push_back(std::move(node));
        TANDEM_RETURN_IF_ERROR(ParseCallArgs(e.get()));
        node = std::move(e);
      } else {
        return node;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseSubscript(ExprPtr object, int line) {
    // Either an index or a slice [start:stop:step]; "]" already follows "[" is an error.
    ExprPtr parts[3];
    int part = 0;
    bool is_slice = false;
    while (true) {
      if (IsOp(":")) {
        Next();
        is_slice = true;
        if (++part > 2) return ErrorAt(Peek(), "too many ':' in a slice");
        continue;
      }
      if (IsOp("]")) break;
      if (parts[part]) return ErrorAt(Peek(), absl::StrCat("unexpected ", Describe(Peek())));
      auto e = ParseExpression();
      if (!e.ok()) return e;
      parts[part] = std::move(*e);
    }
    Next();
    if (!is_slice) {
      if (!parts[0]) return ErrorAt(Peek(), "empty subscript");
      auto e = Make(Expr::Kind::kGetItem, line);
      e->children.push_back(std::move(object));
      e->children.push_back(std::move(parts[0]));
      return e;
    }
    auto e = Make(Expr::Kind::kSlice, line);
    e->children.push_back(std::move(object));
    for (auto& p : parts) e->children.push_back(std::move(p));
    return e;
  }

  absl::Status ParseCallArgs(Expr* call) {
    TANDEM_RETURN_IF_ERROR(ExpectOp("("));
    bool first = true;
    while (!IsOp(")")) {
      if (!first) TANDEM_RETURN_IF_ERROR(ExpectOp(","));
      first = false;
      if (IsOp(")")) break;
      if (IsOp("*") || IsOp("**")) return ErrorAt(Peek(), "*args and **kwargs are not supported");
      if (Peek().type == T::kName && IsOp("=", 1)) {
        std::string key = Next().text;
        Next();
        auto value = ParseExpression();
        if (!value.ok()) return value.status();
        call->kwargs.emplace_back(std::move(key), std::move(*value));
        continue;
      }
      if (!call->kwargs.empty()) {
        return ErrorAt(Peek(), "positional argument after keyword argument");
      }
      auto value = ParseExpression();
      if (!value.ok()) return value.status();
      call->children.push_back(std::move(*value));
    }
    Next();
    return absl::OkStatus();
  }

  absl::StatusOr<ExprPtr> ParseFilterExpr(ExprPtr node) {
    while (true) {
      const Token& t = Peek();
      if (IsOp("|")) {
        Next();
        auto name = ParseDottedName();
        if (!name.ok()) return name.status();
        auto e = Make(Expr::Kind::kFilter, t.line);
        e->name = *name;
        e->children.push_back(std::move(node));
        if (IsOp("(")) TANDEM_RETURN_IF_ERROR(ParseCallArgs(e.get()));
        node = std::move(e);
      } else if (IsName("is")) {
        Next();
        auto e = Make(Expr::Kind::kTest, t.line);
        if (IsName("not")) {
          Next();
          e->negated = true;
        }
        auto name = ParseDottedName();
        if (!name.ok()) return name.status();
        e->name = *name;
        e->children.push_back(std::move(node));
        if (IsOp("(")) {
          TANDEM_RETURN_IF_ERROR(ParseCallArgs(e.get()));
        } else if (StartsTestArgument()) {
          // Jinja: "x is divisibleby 3", "x is sameas none": one primary (with postfix) as the
          // argument; "x is defined is ..." is an error, a test after an argument is not.
          if (IsName("is")) return ErrorAt(Peek(), "you cannot chain multiple tests with 'is'");
          auto arg = ParsePrimary();
          if (!arg.ok()) return arg;
          arg = ParsePostfix(std::move(*arg));
          if (!arg.ok()) return arg;
          e->children.push_back(std::move(*arg));
        }
        node = std::move(e);
      } else if (IsOp("(")) {
        auto e = Make(Expr::Kind::kCall, t.line);
        e->children.push_back(std::move(node));
        TANDEM_RETURN_IF_ERROR(ParseCallArgs(e.get()));
        node = std::move(e);
      } else {
        return node;
      }
    }
  }

  // Jinja's rule for a test argument without parentheses: a name (but not else/or/and), a
  // literal, a list or a dict.
  bool StartsTestArgument() const {
    const Token& t = Peek();
    if (t.type == T::kString || t.type == T::kInt || t.type == T::kFloat) return true;
    if (t.type == T::kOp) return t.text == "[" || t.text == "{";
    if (t.type == T::kName) return t.text != "else" && t.text != "or" && t.text != "and";
    return false;
  }

  absl::StatusOr<std::string> ParseDottedName() {
    auto name = ExpectName();
    if (!name.ok()) return name;
    std::string out = *name;
    while (IsOp(".") && Peek(1).type == T::kName) {
      Next();
      out += "." + Next().text;
    }
    return out;
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int nesting_ = 0;
  int loop_depth_ = 0;  // enclosing for-loop bodies (break/continue are allowed inside one)
};

}  // namespace

absl::StatusOr<std::unique_ptr<Program>> ParseProgram(absl::string_view source) {
  auto tokens = Tokenize(source);
  if (!tokens.ok()) return tokens.status();
  return Parser(std::move(*tokens)).Run();
}

}  // namespace tandem::chat_template::internal
