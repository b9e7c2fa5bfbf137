// The parsed template: expression and statement trees. Immutable after parsing, shared by every
// rendering (no per-render state lives here).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "value.h"

namespace tandem::chat_template::internal {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,  // literal
    kName,     // name
    kList,     // children: items (tuples are lists too)
    kDict,     // children: key0, value0, key1, value1, ...
    kGetAttr,  // children[0].name
    kGetItem,  // children[0][children[1]]
    kSlice,    // children[0][children[1]:children[2]:children[3]] (null child = omitted)
    kCall,     // children[0](children[1..], kwargs)
    kFilter,   // children[0] | name(children[1..], kwargs)
    kTest,     // children[0] is [not] name(children[1..], kwargs)
    kNeg,      // -children[0]
    kPos,      // +children[0]
    kNot,      // not children[0]
    kAnd,      // children[0] and children[1]
    kOr,       // children[0] or children[1]
    kBinary,   // children[0] op children[1]; op in + - * / // % ** ~ == != < <= > >= in notin
    kCond,     // children[1] if children[0] else children[2] (null child: undefined)
  };
  Kind kind;
  int line = 1;
  Value literal;
  std::string name;       // kName, kGetAttr, kFilter, kTest; the operator of kBinary
  bool negated = false;   // kTest: "is not"
  bool is_tuple = false;  // kList written as a tuple: (a, b) or a bare a, b
  std::vector<ExprPtr> children;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct Node {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // branches: (condition, body)...; the else branch has a null condition
    kFor,       // for targets in expr [if condition] body [else else_body]
    kSet,       // set targets = expr, or set targets[0].attribute = expr
    kSetBlock,  // set targets[0] %}body{% endset
    kMacro,     // macro name(params = defaults) body
    kBreak,
    kContinue,
    kScope,  // a body rendered in place ({% generation %})
  };
  Kind kind;
  int line = 1;
  std::string text;
  ExprPtr expr;
  ExprPtr condition;
  std::vector<std::pair<ExprPtr, Body>> branches;
  std::vector<std::string> targets;
  std::string attribute;
  Body body;
  Body else_body;
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // per param; null = required
};

struct Program {
  Body body;
};

}  // namespace tandem::chat_template::internal
