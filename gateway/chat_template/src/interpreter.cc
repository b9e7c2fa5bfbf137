#include "interpreter.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "builtins.h"
#include "errors.h"
#include "tandem/common/status_macros.h"

namespace tandem::chat_template::internal {

absl::Status Interpreter::CheckSize(uint64_t bytes) const {
  if (bytes > static_cast<uint64_t>(limits_.max_output_bytes)) {
    return LimitError(absl::StrCat("chat template output exceeds the limit of ",
                                   limits_.max_output_bytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status Interpreter::CountIterations(int64_t n) {
  iterations_ += n;
  if (iterations_ > limits_.max_loop_iterations) {
    return LimitError(absl::StrCat("chat template exceeds the limit of ",
                                   limits_.max_loop_iterations, " loop iterations"));
  }
  return absl::OkStatus();
}

absl::Status Interpreter::Append(absl::string_view text, std::string* out) {
  TANDEM_RETURN_IF_ERROR(CheckSize(out->size() + text.size()));
  out->append(text.data(), text.size());
  return absl::OkStatus();
}

const Value* Interpreter::Lookup(Frame* frame, const std::string& name) {
  for (Frame* f = frame; f != nullptr; f = f->parent) {
    auto it = f->vars.find(name);
    if (it != f->vars.end()) return &it->second;
  }
  return nullptr;
}

absl::StatusOr<std::string> Interpreter::Render(const Program& program, const Value& context) {
  const Dict globals = MakeGlobals();
  for (const auto& [key, value] : globals.entries()) globals_.vars[key] = value;
  if (context.is_dict()) {
    for (const auto& [key, value] : context.dict().entries()) root_.vars[key] = value;
  }
  root_.parent = &globals_;
  std::string out;
  auto flow = Exec(program.body, &root_, &out);
  if (!flow.ok()) return flow.status();
  return out;
}

absl::StatusOr<Interpreter::Flow> Interpreter::Exec(const Body& body, Frame* frame,
                                                    std::string* out) {
  for (const NodePtr& node : body) {
    TANDEM_ASSIGN_OR_RETURN(Flow flow, ExecNode(*node, frame, out));
    if (flow != Flow::kNormal) return flow;
  }
  return Flow::kNormal;
}

absl::StatusOr<Interpreter::Flow> Interpreter::ExecNode(const Node& node, Frame* frame,
                                                        std::string* out) {
  if (++depth_ > limits_.max_depth) {
    return LimitError(absl::StrCat("chat template nests deeper than ", limits_.max_depth,
                                   " levels (line ", node.line, ")"));
  }
  struct DepthGuard {
    int32_t* depth;
    ~DepthGuard() { --*depth; }
  } guard{&depth_};
  switch (node.kind) {
    case Node::Kind::kText:
      TANDEM_RETURN_IF_ERROR(Append(node.text, out));
      return Flow::kNormal;
    case Node::Kind::kOutput: {
      TANDEM_ASSIGN_OR_RETURN(Value value, Eval(*node.expr, frame));
      TANDEM_RETURN_IF_ERROR(Append(ToPyString(value), out));
      return Flow::kNormal;
    }
    case Node::Kind::kIf:
      for (const auto& [condition, body] : node.branches) {
        bool take = true;
        if (condition) {
          TANDEM_ASSIGN_OR_RETURN(Value value, Eval(*condition, frame));
          take = Truthy(value);
        }
        if (take) return Exec(body, frame, out);
      }
      return Flow::kNormal;
    case Node::Kind::kFor:
      return ExecFor(node, frame, out);
    case Node::Kind::kSet:
      TANDEM_RETURN_IF_ERROR(ExecSet(node, frame));
      return Flow::kNormal;
    case Node::Kind::kSetBlock: {
      std::string captured;
      TANDEM_ASSIGN_OR_RETURN(Flow flow, Exec(node.body, frame, &captured));
      (void)flow;
      frame->vars[node.targets[0]] = Value::String(std::move(captured));
      return Flow::kNormal;
    }
    case Node::Kind::kMacro:
      frame->vars[node.name] = MakeMacro(node);
      return Flow::kNormal;
    case Node::Kind::kBreak:
      return Flow::kBreak;
    case Node::Kind::kContinue:
      return Flow::kContinue;
    case Node::Kind::kScope:
      return Exec(node.body, frame, out);
  }
  return Flow::kNormal;
}

absl::Status Interpreter::Assign(const Node& node, const std::vector<std::string>& targets,
                                 const Value& value, Frame* frame) {
  if (targets.size() == 1) {
    frame->vars[targets[0]] = value;
    return absl::OkStatus();
  }
  auto items = Iterate(value);
  if (!items.ok() || value.is_undefined()) {
    return AtLine(node.line, absl::InvalidArgumentError(absl::StrCat("cannot unpack non-iterable ",
                                                                     value.TypeName(), " object")));
  }
  if (items->size() > targets.size()) {
    return AtLine(node.line, absl::InvalidArgumentError(absl::StrCat(
                                 "too many values to unpack (expected ", targets.size(), ")")));
  }
  if (items->size() < targets.size()) {
    return AtLine(node.line, absl::InvalidArgumentError(
                                 absl::StrCat("not enough values to unpack (expected ",
                                              targets.size(), ", got ", items->size(), ")")));
  }
  for (size_t i = 0; i < targets.size(); ++i) frame->vars[targets[i]] = (*items)[i];
  return absl::OkStatus();
}

absl::Status Interpreter::ExecSet(const Node& node, Frame* frame) {
  TANDEM_ASSIGN_OR_RETURN(Value value, Eval(*node.expr, frame));
  if (node.attribute.empty()) return Assign(node, node.targets, value, frame);
  const Value* target = Lookup(frame, node.targets[0]);
  if (target == nullptr || !target->is_namespace()) {
    return AtLine(node.line,
                  absl::InvalidArgumentError("cannot assign attribute on non-namespace object"));
  }
  TANDEM_RETURN_IF_ERROR(AtLine(node.line, CheckNamespaceValue(value)));
  target->namespace_attributes().Set(node.attribute, std::move(value));
  return absl::OkStatus();
}

absl::StatusOr<Interpreter::Flow> Interpreter::ExecFor(const Node& node, Frame* frame,
                                                       std::string* out) {
  TANDEM_ASSIGN_OR_RETURN(Value iterable, Eval(*node.expr, frame));
  auto listed = Iterate(iterable);
  if (!listed.ok()) return AtLine(node.line, listed.status());
  List items = std::move(*listed);
  if (node.condition) {
    // "for x in xs if cond": the filter runs first, so loop.length counts the kept items.
    List kept;
    for (const Value& item : items) {
      TANDEM_RETURN_IF_ERROR(CountIterations(1));
      Frame probe{{}, frame};
      TANDEM_RETURN_IF_ERROR(Assign(node, node.targets, item, &probe));
      TANDEM_ASSIGN_OR_RETURN(Value keep, Eval(*node.condition, &probe));
      if (Truthy(keep)) kept.push_back(item);
    }
    items = std::move(kept);
  }
  const int64_t n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n; ++i) {
    TANDEM_RETURN_IF_ERROR(CountIterations(1));
    Frame iteration{{}, frame};
    const Value& item = items[static_cast<size_t>(i)];
    TANDEM_RETURN_IF_ERROR(Assign(node, node.targets, item, &iteration));
    Dict loop;
    loop.Set("index", Value::Int(i + 1));
    loop.Set("index0", Value::Int(i));
    loop.Set("revindex", Value::Int(n - i));
    loop.Set("revindex0", Value::Int(n - i - 1));
    loop.Set("first", Value::Bool(i == 0));
    loop.Set("last", Value::Bool(i == n - 1));
    loop.Set("length", Value::Int(n));
    loop.Set("depth", Value::Int(1));
    loop.Set("depth0", Value::Int(0));
    loop.Set("previtem", i > 0 ? items[static_cast<size_t>(i - 1)]
                               : Value::Undefined("there is no previous item"));
    loop.Set("nextitem", i + 1 < n ? items[static_cast<size_t>(i + 1)]
                                   : Value::Undefined("there is no next item"));
    loop.Set("cycle", Value::MakeCallable(
                          "loop.cycle", [i](Interpreter&, CallArgs& args) -> absl::StatusOr<Value> {
                            if (args.positional.empty())
                              return absl::InvalidArgumentError("no items for cycling given");
                            return args.positional[static_cast<size_t>(i) % args.positional.size()];
                          }));
    iteration.vars["loop"] = Value::MakeDict(std::move(loop));
    TANDEM_ASSIGN_OR_RETURN(Flow flow, Exec(node.body, &iteration, out));
    if (flow == Flow::kBreak) break;
  }
  if (n == 0 && !node.else_body.empty()) {
    TANDEM_ASSIGN_OR_RETURN(Flow flow, Exec(node.else_body, frame, out));
    return flow;
  }
  return Flow::kNormal;
}

Value Interpreter::MakeMacro(const Node& node) {
  const Node* macro = &node;
  return Value::MakeCallable(
      node.name, [macro](Interpreter& in, CallArgs& args) -> absl::StatusOr<Value> {
        Frame call{{}, &in.root_};
        if (args.positional.size() > macro->params.size()) {
          return absl::InvalidArgumentError(absl::StrCat("macro '", macro->name,
                                                         "' takes not more than ",
                                                         macro->params.size(), " argument(s)"));
        }
        std::vector<bool> given(macro->params.size(), false);
        for (size_t i = 0; i < args.positional.size(); ++i) {
          call.vars[macro->params[i]] = args.positional[i];
          given[i] = true;
        }
        for (const auto& [key, value] : args.keyword) {
          size_t i = 0;
          while (i < macro->params.size() && macro->params[i] != key) ++i;
          if (i == macro->params.size()) {
            return absl::InvalidArgumentError(
                absl::StrCat("macro '", macro->name, "' takes no keyword argument '", key, "'"));
          }
          call.vars[key] = value;
          given[i] = true;
        }
        for (size_t i = 0; i < macro->params.size(); ++i) {
          if (given[i]) continue;
          if (macro->defaults[i]) {
            TANDEM_ASSIGN_OR_RETURN(Value value, in.Eval(*macro->defaults[i], &call));
            call.vars[macro->params[i]] = std::move(value);
          } else {
            call.vars[macro->params[i]] = Value::Undefined(
                absl::StrCat("parameter '", macro->params[i], "' was not provided"));
          }
        }
        std::string out;
        TANDEM_ASSIGN_OR_RETURN(Flow flow, in.Exec(macro->body, &call, &out));
        (void)flow;
        return Value::String(std::move(out));
      });
}

absl::StatusOr<CallArgs> Interpreter::EvalArgs(const Expr& expr, size_t first, Frame* frame) {
  CallArgs args;
  for (size_t i = first; i < expr.children.size(); ++i) {
    TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*expr.children[i], frame));
    args.positional.push_back(std::move(v));
  }
  for (const auto& [key, value_expr] : expr.kwargs) {
    TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*value_expr, frame));
    args.keyword.emplace_back(key, std::move(v));
  }
  return args;
}

absl::StatusOr<Value> Interpreter::EvalCall(const Expr& expr, Frame* frame) {
  TANDEM_ASSIGN_OR_RETURN(Value callee, Eval(*expr.children[0], frame));
  TANDEM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(expr, 1, frame));
  if (callee.is_undefined()) return UndefinedError(callee);
  if (!callee.is_callable()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", callee.TypeName(), "' object is not callable"));
  }
  return callee.callable().fn(*this, args);
}

absl::StatusOr<Value> Interpreter::Eval(const Expr& expr, Frame* frame) {
  if (++depth_ > limits_.max_depth) {
    --depth_;
    return LimitError(absl::StrCat("chat template nests deeper than ", limits_.max_depth,
                                   " levels (line ", expr.line, ")"));
  }
  auto result = EvalInner(expr, frame);
  --depth_;
  if (!result.ok()) return AtLine(expr.line, result.status());
  // A few levels of slack above the input bound for the values the loop object wraps.
  if (result->depth() > kMaxValueDepth + 4) {
    return LimitError(absl::StrCat("chat template builds a value nested deeper than ",
                                   kMaxValueDepth, " levels (line ", expr.line, ")"));
  }
  return result;
}

absl::StatusOr<Value> Interpreter::EvalInner(const Expr& expr, Frame* frame) {
  switch (expr.kind) {
    case Expr::Kind::kLiteral:
      return expr.literal;
    case Expr::Kind::kName: {
      const Value* found = Lookup(frame, expr.name);
      if (found != nullptr) return *found;
      return Value::Undefined(absl::StrCat("'", expr.name, "' is undefined"));
    }
    case Expr::Kind::kList: {
      TANDEM_RETURN_IF_ERROR(CountIterations(static_cast<int64_t>(expr.children.size())));
      List items;
      for (const ExprPtr& child : expr.children) {
        TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*child, frame));
        items.push_back(std::move(v));
      }
      return expr.is_tuple ? Value::MakeTuple(std::move(items)) : Value::MakeList(std::move(items));
    }
    case Expr::Kind::kDict: {
      Dict dict;
      for (size_t i = 0; i + 1 < expr.children.size(); i += 2) {
        TANDEM_ASSIGN_OR_RETURN(Value key, Eval(*expr.children[i], frame));
        TANDEM_ASSIGN_OR_RETURN(Value value, Eval(*expr.children[i + 1], frame));
        if (!key.is_string()) {
          return absl::InvalidArgumentError("dict keys must be strings in chat templates");
        }
        dict.Set(key.str(), std::move(value));
      }
      return Value::MakeDict(std::move(dict));
    }
    case Expr::Kind::kGetAttr: {
      TANDEM_ASSIGN_OR_RETURN(Value obj, Eval(*expr.children[0], frame));
      return GetAttribute(obj, expr.name);
    }
    case Expr::Kind::kGetItem: {
      TANDEM_ASSIGN_OR_RETURN(Value obj, Eval(*expr.children[0], frame));
      TANDEM_ASSIGN_OR_RETURN(Value key, Eval(*expr.children[1], frame));
      return GetItem(obj, key);
    }
    case Expr::Kind::kSlice: {
      TANDEM_ASSIGN_OR_RETURN(Value obj, Eval(*expr.children[0], frame));
      Value bounds[3];
      for (int i = 0; i < 3; ++i) {
        if (expr.children[i + 1]) {
          TANDEM_ASSIGN_OR_RETURN(bounds[i], Eval(*expr.children[i + 1], frame));
        }
      }
      return GetSlice(*this, obj, bounds[0], bounds[1], bounds[2]);
    }
    case Expr::Kind::kCall:
      return EvalCall(expr, frame);
    case Expr::Kind::kFilter: {
      TANDEM_ASSIGN_OR_RETURN(Value subject, Eval(*expr.children[0], frame));
      TANDEM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(expr, 1, frame));
      return ApplyFilter(*this, expr.name, subject, args);
    }
    case Expr::Kind::kTest: {
      TANDEM_ASSIGN_OR_RETURN(Value subject, Eval(*expr.children[0], frame));
      TANDEM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(expr, 1, frame));
      TANDEM_ASSIGN_OR_RETURN(bool result, ApplyTest(*this, expr.name, subject, args));
      return Value::Bool(result != expr.negated);
    }
    case Expr::Kind::kNeg: {
      TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*expr.children[0], frame));
      return Negate(v);
    }
    case Expr::Kind::kPos: {
      TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*expr.children[0], frame));
      if (v.is_undefined()) return UndefinedError(v);
      if (!v.is_number()) {
        return absl::InvalidArgumentError(
            absl::StrCat("bad operand type for unary +: '", v.TypeName(), "'"));
      }
      return v.is_bool() ? Value::Int(v.int_value()) : v;
    }
    case Expr::Kind::kNot: {
      TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*expr.children[0], frame));
      return Value::Bool(!Truthy(v));
    }
    case Expr::Kind::kAnd:
    case Expr::Kind::kOr: {
      // Python: the deciding operand itself is the result.
      TANDEM_ASSIGN_OR_RETURN(Value left, Eval(*expr.children[0], frame));
      bool decided = expr.kind == Expr::Kind::kAnd ? !Truthy(left) : Truthy(left);
      if (decided) return left;
      return Eval(*expr.children[1], frame);
    }
    case Expr::Kind::kBinary: {
      TANDEM_ASSIGN_OR_RETURN(Value a, Eval(*expr.children[0], frame));
      TANDEM_ASSIGN_OR_RETURN(Value b, Eval(*expr.children[1], frame));
      return BinaryOp(*this, expr.name, a, b);
    }
    case Expr::Kind::kCond: {
      TANDEM_ASSIGN_OR_RETURN(Value condition, Eval(*expr.children[0], frame));
      if (Truthy(condition)) return Eval(*expr.children[1], frame);
      if (expr.children[2]) return Eval(*expr.children[2], frame);
      return Value::Undefined(
          "the inline if-expression evaluated to false and no else section was defined");
    }
  }
  return absl::InternalError("unknown expression kind");
}

}  // namespace tandem::chat_template::internal
