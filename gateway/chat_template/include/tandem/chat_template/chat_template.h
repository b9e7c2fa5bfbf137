// Chat templates: the subset of Jinja2 that the chat_template of Hugging Face models uses,
// rendered the way transformers' apply_chat_template does: trim_blocks and lstrip_blocks on,
// jinja2.Undefined (falsy, renders as "", iterates as empty; an attribute of it is an error),
// loop controls (break/continue), `{% generation %}` blocks, the globals raise_exception(msg),
// strftime_now(fmt), namespace(), range(), dict(), and tojson as json.dumps(ensure_ascii=False)
// (key order kept). Checked byte for byte against python3-jinja2 on the real templates of
// Llama-3/3.1/3.2, Qwen2.5, Mistral v0.1/v0.2/Nemo, ChatML, Gemma, Phi-3.5 and vLLM's Hermes
// (tests/gateway/chat_template).
//
// Statements: if/elif/else, for (tuple targets, "if" filter, else, loop.*), set (names, tuples,
// namespace attributes, blocks), macro, raw, break/continue, generation. Not supported (a syntax
// error names them): call, filter blocks, include/import/extends, recursive loops, *args.
// Differences from Python that templates do not meet in practice: case mapping covers Latin,
// Greek and Cyrillic only; range() is a list; dict keys are strings; "| items" on a non-mapping
// fails at once rather than when iterated.
//
// Values are JSON (nlohmann::ordered_json keeps the key order of objects, which tojson shows;
// a nlohmann::json argument converts implicitly, with its keys already sorted). Input nested
// deeper than 512 levels is refused.
//
// Thread safety: a parsed Template is immutable; Render and RenderChat may be called from any
// number of threads at once. Copies share the parsed tree.
//
// Errors (nothing throws):
//   Parse: INVALID_ARGUMENT "chat template syntax error at line L, column C: ..." (1-based).
//   Render: INVALID_ARGUMENT with the template's own message for raise_exception(msg) (the text
//   is exactly msg), and "chat template error at line L: ..." for runtime errors (type errors,
//   unknown filters, calls on undefined values, with Python's wording); RESOURCE_EXHAUSTED when
//   a RenderLimits bound is reached. The process is never affected by a bad template or input.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::chat_template {

namespace internal {
struct Program;  // the parsed tree (src/ast.h)
}  // namespace internal

// Bounds of one rendering, so a hostile template or input cannot take unbounded memory or time.
struct RenderLimits {
  int64_t max_output_bytes = 16 << 20;    // rendered text, and any one string value built
  int64_t max_loop_iterations = 1 << 20;  // all loop bodies of one rendering together
  int32_t max_depth = 256;                // nested expressions, statements and macro calls
};

class Template {
 public:
  // Parses Jinja source (e.g. tokenizer_config.json "chat_template"). Sources over 1 MiB are
  // refused.
  static absl::StatusOr<Template> Parse(std::string_view source);

  // Renders with `context` (a JSON object; its keys become the template's variables).
  absl::StatusOr<std::string> Render(const nlohmann::ordered_json& context,
                                     const RenderLimits& limits = {}) const;

 private:
  explicit Template(std::shared_ptr<const internal::Program> program);
  std::shared_ptr<const internal::Program> program_;
};

struct ChatOptions {
  bool add_generation_prompt = true;
  std::string bos_token, eos_token;  // the tokenizer's special tokens, as text
  nlohmann::ordered_json tools;      // OpenAI "tools" array; null = none
  nlohmann::ordered_json extra;      // object merged into the context last (e.g. date_string,
                                     // chat_template_kwargs); null = none
  RenderLimits limits;
};

// OpenAI messages ([{role, content, ...}]) -> prompt text. `content` may be a string, null, or a
// list of parts; a list made only of {type:"text", text} parts is joined with "\n" into one
// string, as vLLM does for string-content templates; other parts (images) are refused
// (INVALID_ARGUMENT). Every other message field (name, tool_calls, tool_call_id) is passed
// through, except that an assistant message's tool_calls[].function.arguments given as a JSON
// string is parsed into its object ("" or absent -> {}), as vLLM does, because the templates
// render it with tojson. The context is {messages, tools (null when none), documents: null,
// add_generation_prompt, bos_token, eos_token} plus `extra`, the names transformers passes.
// INVALID_ARGUMENT when messages is not an array of objects with a string "role".
absl::StatusOr<std::string> RenderChat(const Template& chat_template,
                                       const nlohmann::ordered_json& messages,
                                       const ChatOptions& options);

}  // namespace tandem::chat_template
