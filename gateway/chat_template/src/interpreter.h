// Renders a parsed Program. One Interpreter per rendering (it holds the output and the counters
// the RenderLimits bound); the Program is shared and never changed.
//
// Scoping follows Jinja2: {% set %} writes the innermost scope; every for-loop iteration and
// every macro call opens a new scope (so a set inside a loop body is gone after the loop, and is
// not seen by the next iteration), if/elif/else open none. Macros see the template's top-level
// variables and their own arguments.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "ast.h"
#include "tandem/chat_template/chat_template.h"
#include "value.h"

namespace tandem::chat_template::internal {

class Interpreter {
 public:
  explicit Interpreter(const RenderLimits& limits) : limits_(limits) {}

  // `context`: a dict Value; its entries become top-level variables next to the globals
  // (raise_exception, strftime_now, namespace, range, dict).
  absl::StatusOr<std::string> Render(const Program& program, const Value& context);

  // RESOURCE_EXHAUSTED when a string of `bytes` would pass max_output_bytes.
  absl::Status CheckSize(uint64_t bytes) const;
  // Counts `n` loop iterations (or items a filter or range() produces) against the bound.
  absl::Status CountIterations(int64_t n);
  const RenderLimits& limits() const { return limits_; }

 private:
  struct Frame {
    absl::flat_hash_map<std::string, Value> vars;
    Frame* parent = nullptr;
  };
  enum class Flow { kNormal, kBreak, kContinue };

  absl::StatusOr<Flow> Exec(const Body& body, Frame* frame, std::string* out);
  absl::StatusOr<Flow> ExecNode(const Node& node, Frame* frame, std::string* out);
  absl::StatusOr<Flow> ExecFor(const Node& node, Frame* frame, std::string* out);
  absl::Status ExecSet(const Node& node, Frame* frame);
  absl::Status Assign(const Node& node, const std::vector<std::string>& targets, const Value& value,
                      Frame* frame);
  Value MakeMacro(const Node& node);

  absl::StatusOr<Value> Eval(const Expr& expr, Frame* frame);
  absl::StatusOr<Value> EvalInner(const Expr& expr, Frame* frame);
  absl::StatusOr<CallArgs> EvalArgs(const Expr& expr, size_t first, Frame* frame);
  absl::StatusOr<Value> EvalCall(const Expr& expr, Frame* frame);
  absl::Status Append(absl::string_view text, std::string* out);

  static const Value* Lookup(Frame* frame, const std::string& name);

  RenderLimits limits_;
  int64_t iterations_ = 0;
  int32_t depth_ = 0;
  Frame globals_;
  Frame root_;
};

}  // namespace tandem::chat_template::internal
